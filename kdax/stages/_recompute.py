"""B0: recompute the forward intermediates the backward needs (w, u, qg, kg, h, v_new)."""

import abc
from typing import ClassVar, Optional

from .._errors import UnsupportedCase
from .._layouts.layout import ChunkLayout
from .._numerics import precision as _precision
from .._stage_protocol.capabilities import capabilities, negotiated, told
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Specs
from .._annotations import ChunkK, ChunkMat, ChunkScalar, ChunkV, ChunkValid, SeqState
from ._state import AbstractState, ReferenceState
from ._types import AbstractStage, StateOut, WYOut
from ._wy import AbstractWY, ReferenceWY


class AbstractRecompute(AbstractStage):
    """B0: from the saved activated inputs, ``Akk`` and the initial states, rebuild what
    ``disable_recompute=True`` would have cached: F3 then F4 again.

    Arguments (chunked layout ``[R, HV, NC, C, ...]``, compute dtype): ``q``, ``k``
    ``[R, HV, NC, C, K]`` activated (after any in-kernel l2norm); ``v`` ``[.., V]``;
    ``beta`` ``[R, HV, NC, C]`` activated; ``G`` ``[.., K]`` the chunk-local cumulative log
    decay (natural log); ``Akk`` ``[.., C, C]`` = ``(I + L)^-1``; ``h0`` ``[N, HV, K, V]``
    the initial state of each sequence; ``layout`` the chunked layout; ``G_lo`` G's low
    part or None (``kdax._numerics.hilo``; optional parameter, to pass on to ``wy``); ``reset``
    ``[R, NC, C]`` or None (shared chunks: to pass on to ``wy`` and ``state``; a stage
    not declaring it in ``accepts`` cannot run shared chunks and the pipeline falls back).

    ``wy``, ``state`` (keyword): the F3 and F4 stages the forward ran; a ``KDAPipeline``
    always passes its own (routed through its fallback and contract checks), so that the
    backward differentiates exactly the forward that ran. An implementation must return
    what ``wy`` then ``state`` return (a fused kernel may stand in for them only when it
    computes the same thing). None (a direct call): the implementation's own default F3/F4.

    Returns ``(WYOut, StateOut)`` as F3 and F4 do.
    """

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
        G_lo: Optional[ChunkK] = None,
        reset: Optional[ChunkValid] = None,
        *,
        wy: Optional[AbstractWY] = None,
        state: Optional[AbstractState] = None,
    ) -> tuple[WYOut, StateOut]:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> tuple:
        """What B0 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        q, k, v, h0 = kw["q"], kw["k"], kw["v"], kw["h0"]
        wy = WYOut(s.like(k, stored=True), s.like(v, stored=True), s.like(q, stored=True), s.like(k, stored=True))
        return wy, StateOut(s.like(q, q.shape[:3] + (q.shape[-1], v.shape[-1]), stored=True), s.like(v, stored=True),
                            s.like(h0))


def _with_reset(stage, kwargs: dict, reset) -> dict:
    """``kwargs`` plus ``reset`` when there is one (a stage must then take it)."""
    if reset is None:
        return kwargs
    if not capabilities(type(stage)).reset:
        raise UnsupportedCase(f"{type(stage).__qualname__} does not take `reset` (packed sequences sharing chunks)")
    return dict(kwargs, reset=reset)


def recompute_with(wy: AbstractWY, state: AbstractState, q, k, v, beta, G, Akk, h0, layout, G_lo=None, reset=None,
                   zero_h0: bool = False, precision: str = "highest"):
    # F3 and F4 told the policy (kdax._numerics.precision), their outputs stored as the
    # forward's are (the stage runner's cast), so B0 rebuilds them exactly.
    kw = negotiated(wy, dict(q=q, k=k, v=v, beta=beta, G=G, Akk=Akk, G_lo=G_lo))
    out = _precision.store_outputs(wy(**_with_reset(wy, kw, reset), **told(wy, precision)), precision)
    zero = {"zero_h0": True} if zero_h0 else {}  # (h0 zeros: kdax._stage_protocol.capabilities)
    kw = negotiated(state, dict(w=out.w, u=out.u, kg=out.kg, G=G, h0=h0, layout=layout, **zero))
    return out, _precision.store_outputs(state(**_with_reset(state, kw, reset), **told(state, precision)), precision)


@final
class ReferenceRecompute(AbstractRecompute):
    """B0 by re-running the given F3 and F4 (``ReferenceWY``, ``ReferenceState`` when none
    are given)."""

    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

    def __call__(
        self, q, k, v, beta, G, Akk, h0, layout, G_lo=None, reset=None, *, wy=None, state=None,
        precision: str = "highest"
    ):
        wy = ReferenceWY() if wy is None else wy
        state = ReferenceState() if state is None else state
        return recompute_with(wy, state, q, k, v, beta, G, Akk, h0, layout, G_lo, reset, precision=precision)
