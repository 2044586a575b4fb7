"""Stage interfaces (``Abstract*``) and their pure-JAX reference implementations."""

from ._gate import (
    AbstractGate as AbstractGate,
    AbstractGateBackward as AbstractGateBackward,
    ReferenceGate as ReferenceGate,
    ReferenceGateBackward as ReferenceGateBackward,
)
from ._intra import (
    AbstractIntra as AbstractIntra,
    AbstractIntraBackward as AbstractIntraBackward,
    ReferenceIntra as ReferenceIntra,
    ReferenceIntraBackward as ReferenceIntraBackward,
)
from ._output import (
    AbstractDAv as AbstractDAv,
    AbstractOutput as AbstractOutput,
    ReferenceDAv as ReferenceDAv,
    ReferenceOutput as ReferenceOutput,
)
from ._recompute import AbstractRecompute as AbstractRecompute, ReferenceRecompute as ReferenceRecompute
from ._state import (
    AbstractDhu as AbstractDhu,
    AbstractState as AbstractState,
    ReferenceDhu as ReferenceDhu,
    ReferenceState as ReferenceState,
)
from ._types import (
    Activated as Activated,
    ChunkGrads as ChunkGrads,
    DhuOut as DhuOut,
    ForwardCache as ForwardCache,
    IntraOut as IntraOut,
    RawGrads as RawGrads,
    StateOut as StateOut,
    WYOut as WYOut,
)
from ._wy import (
    AbstractWY as AbstractWY,
    AbstractWYDqkg as AbstractWYDqkg,
    ReferenceWY as ReferenceWY,
    ReferenceWYDqkg as ReferenceWYDqkg,
)
