"""Pallas B0: recompute w, u, qg, kg, h, v_new with the Pallas F3 and F4 kernels."""


from .._layout import ChunkLayout
from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkV, SeqState, typecheck
from ..stages._recompute import AbstractRecompute, recompute_with
from ..stages._types import StateOut, WYOut
from ._common import PallasTarget
from ._state import PallasState
from ._wy import PallasWY


class PallasRecompute(AbstractRecompute, PallasTarget):
    """B0 by re-running ``PallasWY`` and ``PallasState`` (dense layout; varlen raises
    ``NotImplementedError`` from the state kernel)."""

    @typecheck
    def __call__(
        self,
        q: ChunkK,
        k: ChunkK,
        v: ChunkV,
        beta: ChunkScalar,
        G: ChunkK,
        Akk: ChunkMat,
        h0: SeqState,
        layout: ChunkLayout,
    ) -> tuple[WYOut, StateOut]:
        kw = dict(target=self.target, interpret=self.interpret)
        return recompute_with(PallasWY(**kw), PallasState(**kw), q, k, v, beta, G, Akk, h0, layout)
