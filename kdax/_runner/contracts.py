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
from .._numerics import precision as _precision
from ..ref import compute_dtype
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
    Activated,
    ChunkGrads,
    DhuOut,
    IntraOut,
    RawGrads,
    StateOut,
    WYOut,
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


class Maybe(NamedTuple):
    """An output that may be None (else must match ``spec``)."""

    spec: Any


def _sds(x, shape=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else tuple(shape), x.dtype)


def expected_output(name: str, kw: dict, config, policy: str = "highest") -> Any:
    """The container, shapes and dtypes stage ``name`` must return for arguments ``kw``
    under precision ``policy`` (the intermediates of ``kdax._numerics.precision.STORED`` in their
    storage dtype, every gradient in its argument's dtype)."""
    sds = _sds

    def s(x, shape=None, stored=False):
        out = sds(x, shape)
        return jax.ShapeDtypeStruct(out.shape, _precision.storage(out.dtype, policy)) if stored else out

    def grad_of(x, like):  # a gradient of stored x: the compute dtype (like's)
        return sds(like, x.shape)

    def computed(x, shape, stored=False):  # in the compute dtype of x (which may be stored in bf16)
        return s(jax.ShapeDtypeStruct(tuple(shape), compute_dtype(x)), stored=stored)

    if name == "gate":
        q = kw["q"]
        rstd = s(q, q.shape[:-1] + (1,)) if config.use_qk_l2norm_in_kernel else None
        return Activated(s(q), s(kw["k"]), s(kw["beta"]), s(kw["g"]), rstd, rstd, Maybe(s(kw["g"])))
    if name == "intra":
        q = kw["q"]
        mat = s(q, q.shape[:-1] + (q.shape[-2],), stored=True)
        return IntraOut(mat, mat)
    if name == "wy":
        return WYOut(s(kw["k"], stored=True), s(kw["v"], stored=True), s(kw["q"], stored=True), s(kw["k"], stored=True))
    if name == "state":
        w, u, h0 = kw["w"], kw["u"], kw["h0"]
        return StateOut(s(h0, w.shape[:3] + (w.shape[-1], u.shape[-1]), stored=True), s(h0, u.shape, stored=True),
                        s(h0))
    if name == "output":
        return computed(kw["qg"], kw["v_new"].shape)
    if name == "recompute":
        q, v, h0 = kw["q"], kw["v"], kw["h0"]
        return (WYOut(s(kw["k"], stored=True), s(v, stored=True), s(q, stored=True), s(kw["k"], stored=True)),
                StateOut(s(q, q.shape[:3] + (q.shape[-1], v.shape[-1]), stored=True), s(v, stored=True), s(h0)))
    if name == "dav":
        return (grad_of(kw["Aqk"], kw["do"]), s(kw["do"]))
    if name == "dhu":
        qg, do = kw["qg"], kw["do"]
        return DhuOut(computed(qg, qg.shape[:3] + (qg.shape[-1], do.shape[-1]), stored=True), s(kw["dht"]),
                      s(kw["dv_intra"]))
    if name == "wy_dqkg":
        return ChunkGrads(s(kw["q"]), s(kw["k"]), s(kw["v"]), s(kw["beta"]), s(kw["G"]), grad_of(kw["Akk"], kw["q"]))
    if name == "intra_bwd":
        g = kw["grads"]
        return ChunkGrads(s(kw["q"]), s(kw["k"]), s(g.dv), s(kw["beta"]), s(kw["G"]), Maybe(s(kw["dAqk"])))
    if name == "gate_bwd":
        gate = config.use_gate_in_kernel
        A_log, dt_bias = kw["A_log"], kw["dt_bias"]
        return RawGrads(
            s(kw["dq"]), s(kw["dk"]), s(kw["dG"]), s(kw["dbeta"]),
            s(A_log) if gate and A_log is not None else None,
            s(dt_bias) if gate and dt_bias is not None else None,
        )
    raise KeyError(name)


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
