"""Pallas implementations of every stage (TPU Mosaic and GPU Triton targets)."""

from ._common import PallasTarget as PallasTarget, default_target as default_target, resolve_interpret as resolve_interpret
from ._gate import PallasGate as PallasGate, PallasGateBackward as PallasGateBackward
from ._intra import PallasIntra as PallasIntra, PallasIntraBackward as PallasIntraBackward
from ._output import PallasDAv as PallasDAv, PallasOutput as PallasOutput
from ._recompute import PallasRecompute as PallasRecompute
from ._state import PallasDhu as PallasDhu, PallasState as PallasState
from ._wy import PallasWY as PallasWY, PallasWYDqkg as PallasWYDqkg
from ._tuning import TUNINGS as TUNINGS, Tuning as Tuning, get_tuning as get_tuning, stage_tuning as stage_tuning
