"""Pallas B0: recompute w, u, qg, kg, h, v_new with the pipeline's F3 and F4 (by default
the Pallas F3 and F4 kernels of this stage's target)."""

from typing import ClassVar, Union

from .._layouts.tokens import Tokens
from .._stage_protocol.final import final
from .._annotations import ChunkV
from ..stages import AbstractRecompute, recompute_with
from ._common import PallasTarget, tuned
from ._state import PallasState
from ._wy import PallasWY


@final
class PallasRecompute(AbstractRecompute, PallasTarget):
    """B0 by re-running the given F3 and F4; called directly without them, ``PallasWY``
    and ``PallasState`` of this target. Passes a ``Tokens`` view of ``v`` on to F3
    (``tokens``), and ``G_lo`` and the reset table (shared chunks) on to F3 and F4, and
    ``zero_h0`` (no initial states given) on to F4."""

    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tokens", "half_stored", "zero_h0"})

    @tuned
    def __call__(
        self, q, k, v: Union[ChunkV, Tokens], beta, G, Akk, h0, layout, G_lo=None, reset=None, *, wy=None, state=None,
        zero_h0: bool = False, precision: str = "highest"
    ):
        kw = dict(target=self.target, interpret=self.interpret)
        wy = PallasWY(**kw) if wy is None else wy
        state = PallasState(**kw) if state is None else state
        return recompute_with(wy, state, q, k, v, beta, G, Akk, h0, layout, G_lo, reset, zero_h0, precision)
