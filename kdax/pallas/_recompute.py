"""Pallas B0: recompute w, u, qg, kg, h, v_new with the Pallas F3 and F4 kernels."""

from jaxtyping import Array, Float

from .._layout import ChunkLayout
from .._typing import typecheck
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
        q: Float[Array, "R HV NC C K"],
        k: Float[Array, "R HV NC C K"],
        v: Float[Array, "R HV NC C V"],
        beta: Float[Array, "R HV NC C"],
        G: Float[Array, "R HV NC C K"],
        Akk: Float[Array, "R HV NC C C"],
        h0: Float[Array, "N HV K V"],
        layout: ChunkLayout,
    ) -> tuple[WYOut, StateOut]:
        kw = dict(target=self.target, interpret=self.interpret)
        return recompute_with(PallasWY(**kw), PallasState(**kw), q, k, v, beta, G, Akk, h0, layout)
