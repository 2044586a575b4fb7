"""The eleven stage fields (``STAGES``: step, family, reference stage) and the family check."""

import difflib
from typing import Any, NamedTuple

from .. import stages as S


class StageInfo(NamedTuple):
    step: str  # F1..F5, B0..B5
    family: type  # the abstract class
    forward: bool  # a forward stage (F1-F5): subject to tiles
    reference: type  # the reference implementation (the fallback)


STAGES = {
    "gate": StageInfo("F1", S.AbstractGate, True, S.ReferenceGate),
    "intra": StageInfo("F2", S.AbstractIntra, True, S.ReferenceIntra),
    "wy": StageInfo("F3", S.AbstractWY, True, S.ReferenceWY),
    "state": StageInfo("F4", S.AbstractState, True, S.ReferenceState),
    "output": StageInfo("F5", S.AbstractOutput, True, S.ReferenceOutput),
    "recompute": StageInfo("B0", S.AbstractRecompute, False, S.ReferenceRecompute),
    "dav": StageInfo("B1", S.AbstractDAv, False, S.ReferenceDAv),
    "dhu": StageInfo("B2", S.AbstractDhu, False, S.ReferenceDhu),
    "wy_dqkg": StageInfo("B3", S.AbstractWYDqkg, False, S.ReferenceWYDqkg),
    "intra_bwd": StageInfo("B4", S.AbstractIntraBackward, False, S.ReferenceIntraBackward),
    "gate_bwd": StageInfo("B5", S.AbstractGateBackward, False, S.ReferenceGateBackward),
}


def check_family(name: str, stage: Any) -> None:
    """``stage`` implements the abstract class of field ``name``, a stage's name."""
    if name not in STAGES:
        near = difflib.get_close_matches(str(name), list(STAGES), n=1)
        raise ValueError(f"name: expected a stage's name, one of {', '.join(STAGES)}; got {name!r}"
                         + (f" (did you mean {near[0]!r}?)." if near else "."))
    want = STAGES[name].family
    if not isinstance(stage, want):
        raise TypeError(f"KDAPipeline.{name}: expected an implementation of {want.__name__} ({STAGES[name].step}), "
                        f"got {type(stage).__module__}.{type(stage).__qualname__}.")


def check_families(pipeline) -> None:
    """Every stage field of ``pipeline`` implements its family's abstract class."""
    for name in STAGES:
        check_family(name, getattr(pipeline, name))
