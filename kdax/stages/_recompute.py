"""B0: recompute the forward intermediates the backward needs (w, u, qg, kg, h, v_new)."""

import abc

import equinox as eqx

from .. import _precision
from .._layout import ChunkLayout
from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkV, SeqState, typecheck
from ._ops import full_precision
from ._state import AbstractState, ReferenceState
from ._types import StateOut, WYOut
from ._wy import AbstractWY, ReferenceWY


class AbstractRecompute(eqx.Module):
    """B0: from the saved activated inputs, ``Akk`` and the initial states, rebuild what
    ``disable_recompute=True`` would have cached."""

    @abc.abstractmethod
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
        raise NotImplementedError


def recompute_with(wy: AbstractWY, state: AbstractState, q, k, v, beta, G, Akk, h0, layout):
    # F3 and F4 under their own stages' precision policy (kdax._precision).
    with _precision.stage_scope(_precision.current_policy(), "wy"):
        out = wy(q, k, v, beta, G, Akk)
    with _precision.stage_scope(_precision.current_policy(), "state"):
        return out, state(out.w, out.u, out.kg, G, h0, layout)


class ReferenceRecompute(AbstractRecompute):
    """B0 by re-running the reference F3 and F4."""

    @full_precision
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
        return recompute_with(ReferenceWY(), ReferenceState(), q, k, v, beta, G, Akk, h0, layout)
