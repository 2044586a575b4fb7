"""What the pipeline checks at each stage boundary: the family of every field, the
arguments a stage takes (by keyword), and the container, shapes and dtypes it returns.

All of it runs when the pipeline is traced (shapes and dtypes are static), never per
element at run time.
"""

import functools
import inspect
from typing import Any, NamedTuple

import equinox as eqx
import jax

from .._errors import StageContractError
from .._stage_protocol.output_specs import Maybe, Specs
from ..stages import (
    ReferenceDAv,
    ReferenceDhu,
    ReferenceGate,
    ReferenceGateBackward,
    ReferenceIntra,
    ReferenceIntraBackward,
    ReferenceOutput,
    ReferenceRecompute,
    ReferenceState,
    ReferenceWY,
    ReferenceWYDqkg,
    AbstractDAv,
    AbstractDhu,
    AbstractGate,
    AbstractGateBackward,
    AbstractIntra,
    AbstractIntraBackward,
    AbstractOutput,
    AbstractRecompute,
    AbstractState,
    AbstractWY,
    AbstractWYDqkg,
)


class StageInfo(NamedTuple):
    step: str  # F1..F5, B0..B5
    family: type  # the abstract class
    forward: bool  # a forward stage (F1-F5): subject to tiles
    reference: type  # the reference implementation (the fallback)


STAGES = {
    "gate": StageInfo("F1", AbstractGate, True, ReferenceGate),
    "intra": StageInfo("F2", AbstractIntra, True, ReferenceIntra),
    "wy": StageInfo("F3", AbstractWY, True, ReferenceWY),
    "state": StageInfo("F4", AbstractState, True, ReferenceState),
    "output": StageInfo("F5", AbstractOutput, True, ReferenceOutput),
    "recompute": StageInfo("B0", AbstractRecompute, False, ReferenceRecompute),
    "dav": StageInfo("B1", AbstractDAv, False, ReferenceDAv),
    "dhu": StageInfo("B2", AbstractDhu, False, ReferenceDhu),
    "wy_dqkg": StageInfo("B3", AbstractWYDqkg, False, ReferenceWYDqkg),
    "intra_bwd": StageInfo("B4", AbstractIntraBackward, False, ReferenceIntraBackward),
    "gate_bwd": StageInfo("B5", AbstractGateBackward, False, ReferenceGateBackward),
}


def check_family(name: str, stage: Any) -> None:
    """``stage`` implements the abstract class of field ``name``."""
    want = STAGES[name].family
    if not isinstance(stage, want):
        raise TypeError(
            f"KDAPipeline.{name}: expected an implementation of {want.__name__} "
            f"({STAGES[name].step}), got {type(stage).__module__}.{type(stage).__qualname__}."
        )


def check_families(pipeline) -> None:
    """Every stage field of ``pipeline`` implements its family's abstract class."""
    for name in STAGES:
        check_family(name, getattr(pipeline, name))


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__call__)


def expected_signature(name: str) -> str:
    fam = STAGES[name].family
    params = [p.replace(annotation=inspect.Parameter.empty, default=p.default) for p in _signature(fam).parameters.values()]
    return f"{fam.__name__}.__call__{inspect.Signature(params)}"


def check_arguments(name: str, stage: Any, kwargs: dict) -> None:
    """The pipeline calls stages by keyword: ``stage.__call__`` must take these names."""
    try:
        _signature(type(stage)).bind(stage, **kwargs)
    except TypeError as e:
        raise StageContractError(
            f"KDAPipeline.{name} ({type(stage).__qualname__}): its __call__ does not take the arguments "
            f"the pipeline passes by keyword ({e}). Expected signature: {expected_signature(name)}."
        ) from None


def expected_output(name: str, kw: dict, config, policy: str = "highest") -> Any:
    """The container, shapes and dtypes stage ``name`` must return for arguments ``kw``
    under precision ``policy``: its family's ``output_spec``, given the arguments' shapes
    and dtypes."""
    return STAGES[name].family.output_spec(jax.eval_shape(lambda args: args, kw), config, Specs(policy))


def _describe(x) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{tuple(x.shape)} {jax.numpy.dtype(x.dtype).name}"
    return type(x).__name__


def check_output(name: str, stage: Any, out: Any, want: Any) -> None:
    """``out`` matches ``want`` (from ``expected_output``); else a ``StageContractError``
    naming the field, the implementation class and the first mismatching part."""

    def fail(path: str, got, expected: str):
        where = f"{path} " if path else ""
        raise StageContractError(
            f"KDAPipeline.{name} ({type(stage).__qualname__}) returned {where}{_describe(got)}, expected "
            f"{expected} ({STAGES[name].family.__name__}'s contract)."
        )

    def walk(path: str, got, w):
        if isinstance(w, Maybe):
            if got is not None:
                walk(path, got, w.spec)
        elif w is None:
            if got is not None:
                fail(path, got, "None")
        elif isinstance(w, jax.ShapeDtypeStruct):
            if not (hasattr(got, "shape") and hasattr(got, "dtype")):
                fail(path, got, f"an array {tuple(w.shape)} {w.dtype.name}")
            if tuple(got.shape) != tuple(w.shape) or jax.numpy.dtype(got.dtype) != w.dtype:
                fail(path, got, f"{tuple(w.shape)} {w.dtype.name}")
        elif isinstance(w, tuple):
            if not isinstance(got, tuple) or len(got) != len(w):
                fail(path, got, f"a tuple of {len(w)}")
            for i, (a, b) in enumerate(zip(got, w)):
                walk(f"{path}[{i}]", a, b)
        elif isinstance(w, eqx.Module):
            if not isinstance(got, type(w)):
                fail(path, got, f"a {type(w).__name__}")
            for f in w.__dataclass_fields__:
                walk(f"{path}.{f}" if path else f, getattr(got, f), getattr(w, f))

    walk("", out, want)
