"""Stage interfaces (``Abstract*``) and their pure-JAX reference implementations
(contracts: docs/stages.md)."""

from ._gate import AbstractGate as AbstractGate
from ._gate import AbstractGateBackward as AbstractGateBackward
from ._gate import ReferenceGate as ReferenceGate
from ._gate import GateVjpBackward as GateVjpBackward
from ._gate import ReferenceGateBackward as ReferenceGateBackward
from ._intra import AbstractIntra as AbstractIntra
from ._intra import AbstractIntraBackward as AbstractIntraBackward
from ._intra import ReferenceIntra as ReferenceIntra
from ._intra import ReferenceIntraBackward as ReferenceIntraBackward
from ._output import AbstractDAv as AbstractDAv
from ._output import AbstractOutput as AbstractOutput
from ._output import ReferenceDAv as ReferenceDAv
from ._output import ReferenceOutput as ReferenceOutput
from ._recompute import AbstractRecompute as AbstractRecompute
from ._recompute import ReferenceRecompute as ReferenceRecompute
from ._recompute import recompute_with as recompute_with
from ._segments import SegmentedDhu as SegmentedDhu
from ._segments import SegmentedState as SegmentedState
from ._segments import segmented as segmented
from ._state import AbstractDhu as AbstractDhu
from ._state import AbstractState as AbstractState
from ._state import ReferenceDhu as ReferenceDhu
from ._state import ReferenceState as ReferenceState
from ._types import Activated as Activated
from ._types import ChunkGrads as ChunkGrads
from ._types import DhuOut as DhuOut
from ._types import ForwardCache as ForwardCache
from ._types import IntraOut as IntraOut
from ._types import KDA as KDA
from ._types import RawGrads as RawGrads
from ._types import StateOut as StateOut
from ._types import WYOut as WYOut
from ._wy import AbstractWY as AbstractWY
from ._wy import AbstractWYDqkg as AbstractWYDqkg
from ._wy import ReferenceWY as ReferenceWY
from ._wy import ReferenceWYDqkg as ReferenceWYDqkg
from ..ref import activated_gate as activated_gate  # (F1's log decay: kdax.ref)
