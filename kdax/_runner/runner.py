"""The stage runner: every stage call of a pipeline goes through ``run_stage``, which
checks the field's family, gives the stage the arguments its declaration accepts
(``stage_arguments``), calls it under its named scope with the precision policy, falls
back to the reference stage on ``UnsupportedCase`` (``call_stage``), casts what it
stores, and checks its output against the family's ``output_spec``. An active
``recording()`` (the one ContextVar: ``plan``, ``stage_inputs``, ``kdax.testing``) notes
what ran on what."""

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any, ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._config import KDAOptions
from .._errors import StageContractError, UnsupportedCase
from .._layouts import resets as _resets
from .._numerics import precision as _precision
from .._annotations import QK, Beta, ChunkK, Gate, Values, typecheck
from ..stages import AbstractState, AbstractWY
from .._stage_protocol.capabilities import negotiated, told
from .._stage_protocol.output_specs import Maybe, Specs
from .contracts import STAGES, check_family
from .routes import RESET_FIELDS, reference_is_exact, routed, warn_once


@dataclasses.dataclass
class Recording:
    """What ``run_stage`` noted: per field the first call's arguments (``inputs``) and
    ``(stage, what ran, reason)`` (``ran``), the forward's ``layout``, ``derived``
    (reasons, swapped fields) when the backward was derived. ``quiet``: no fallback warnings."""

    quiet: bool = False
    inputs: dict = dataclasses.field(default_factory=dict)
    ran: dict = dataclasses.field(default_factory=dict)
    layout: Optional[str] = None
    derived: Optional[tuple] = None


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("kdax_recordings", default=())


@contextlib.contextmanager
def recording(quiet: bool = False):
    """Record the stage calls made inside the block."""
    rec = Recording(quiet)
    token = _ACTIVE.set(_ACTIVE.get() + (rec,))
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


active_recordings = _ACTIVE.get  # () -> the active ``Recording``s, innermost last


def run_stage(pipeline, name: str, **kwargs):
    """Run ``pipeline``'s stage ``name`` on keyword arguments (module docstring); returns its output."""
    stage = getattr(pipeline, name, None)
    check_family(name, stage)
    given, needs_reset, guard = stage_arguments(pipeline, name, stage, kwargs)
    for rec in _ACTIVE.get():
        rec.inputs.setdefault(name, given)
    # The policy goes to stages that declare ``precision``; a user's stage keeps the caller's.
    policy = "highest" if pipeline.precision == "auto" else pipeline.precision  # unresolved: safe
    with jax.named_scope(f"kdax_{name}"):
        ran, reason, out = call_stage(pipeline, name, stage, given, kwargs, needs_reset, guard, policy)
        if name in _STORING:  # the policy's storage dtype, cast once here (kdax._numerics.precision)
            out = _precision.store_outputs(out, policy)
    for rec in _ACTIVE.get():
        rec.ran.setdefault(name, (stage, ran, reason))
    want = STAGES[name].family.output_spec(jax.eval_shape(lambda a: a, given), given.get("config"), Specs(policy))
    _check_output(name, ran, out, want)
    return out


def stage_arguments(pipeline, name: str, stage, kwargs: dict) -> tuple:
    """``(the arguments the stage gets, needs_reset, guard)``: what its declaration accepts,
    ``reset`` only if its math is checked (``needs_reset``: the layout needs one it does not
    take), and the inputs masked where the pipeline makes the reset exact (``guard``)."""
    takes_reset = routed(pipeline, name).reset  # (reset only to a stage whose math is checked)
    kwargs = negotiated(stage, kwargs)
    needs_reset = kwargs.get("reset") is not None and not takes_reset and name in RESET_FIELDS  # (F5's is optional)
    kwargs = kwargs if takes_reset else {n: x for n, x in kwargs.items() if n != "reset"}
    guard = kwargs.get("reset") is not None and not pipeline.trust_declarations and _resets.guards(stage)
    return (_resets.guard_inputs(name, kwargs) if guard else kwargs), needs_reset, guard


def call_stage(pipeline, name: str, stage, given: dict, full: dict, needs_reset: bool, guard: bool,
               policy: str) -> tuple:
    """``(the stage that ran, the fallback's reason or None, its output)``: ``stage`` on
    ``given``, or on ``UnsupportedCase`` with ``fallback`` the family's reference stage on
    ``full`` (one ``FallbackWarning`` per field, implementation and reason)."""
    try:
        if needs_reset:
            raise UnsupportedCase("packed sequences sharing chunks (cu_seqlens) need a stage that accepts "
                                  "`reset` (docs/stages.md, capabilities)")
        given = dict(given, **told(stage, policy))
        _check_arguments(name, stage, given)
        out = stage(**given)
        return stage, None, (_resets.guard_outputs(name, out, given["reset"]) if guard else out)
    except UnsupportedCase as e:
        if not pipeline.fallback or not reference_is_exact(name, stage):  # (the stage named: its text may not)
            why = ("does not fall back (fallback=False)" if not pipeline.fallback else
                   f"cannot fall back to {STAGES[name].reference.__qualname__}: the stage declares other math than "
                   f"KDA's (`math`/`transposes`), which the reference stage does not compute")
            raise UnsupportedCase(f"KDAPipeline.{name} ({type(stage).__qualname__}) cannot run this case ({e}), and "
                                  f"the pipeline {why}.") from e
        ran, reason = STAGES[name].reference(), str(e) or type(e).__name__
        if not any(r.quiet for r in _ACTIVE.get()):
            warn_once(f"KDAPipeline.{name} ({STAGES[name].step}): {type(stage).__qualname__} cannot run this case "
                      f"({reason}); running {type(ran).__qualname__} instead.")
        return ran, reason, ran(**negotiated(ran, full), precision=policy)


# -- the contract checked at each call: arguments by keyword, the output's shapes and dtypes


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__call__)


def _check_arguments(name: str, stage: Any, kwargs: dict) -> None:
    """The pipeline calls stages by keyword: ``stage.__call__`` must take these names."""
    try:
        _signature(type(stage)).bind(stage, **kwargs)
    except TypeError as e:
        fam = STAGES[name].family
        params = [p.replace(annotation=inspect.Parameter.empty) for p in _signature(fam).parameters.values()]
        raise StageContractError(
            f"KDAPipeline.{name} ({type(stage).__qualname__}): its __call__ does not take the arguments the pipeline "
            f"passes by keyword ({e}). Expected signature: {fam.__name__}.__call__{inspect.Signature(params)}."
        ) from None


def _check_output(name: str, stage: Any, out: Any, want: Any) -> None:
    """``StageContractError`` naming the field, the class and the first part of ``out`` unlike
    ``want`` (the family's ``output_spec``)."""

    def fail(path: str, got, expected: str):
        said = (f"{tuple(got.shape)} {jnp.dtype(got.dtype).name}" if hasattr(got, "shape") and hasattr(got, "dtype")
                else "None" if got is None else type(got).__name__)
        raise StageContractError(
            f"KDAPipeline.{name} ({type(stage).__qualname__}) returned {path + ' ' if path else ''}{said}, expected "
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
            array = hasattr(got, "shape") and hasattr(got, "dtype")
            if not array or tuple(got.shape) != tuple(w.shape) or jnp.dtype(got.dtype) != w.dtype:
                fail(path, got, f"{'' if array else 'an array '}{tuple(w.shape)} {w.dtype.name}")
        elif isinstance(w, tuple):
            if not isinstance(got, tuple) or len(got) != len(w):
                fail(path, got, f"a tuple of {len(w)}")
            for i, (a, b) in enumerate(zip(got, w)):
                walk(f"{path}[{i}]", a, b)
        elif isinstance(w, eqx.Module):
            if not isinstance(got, type(w)):
                fail(path, got, f"{'an' if type(w).__name__[0] in 'AEIOU' else 'a'} {type(w).__name__}")
            for f in w.__dataclass_fields__:
                walk(f"{path}.{f}" if path else f, getattr(got, f), getattr(w, f))

    walk("", out, want)


# The stages whose outputs hold intermediates of kdax._numerics.precision.STORED.
_STORING = frozenset({"intra", "wy", "state", "recompute", "dhu"})


class PipelineWY(AbstractWY):
    """F3 as ``pipeline`` runs it: what B0 recomputes with. ``G_lo``: the forward's, for a B0
    that calls F3 without it, so B0 still recomputes exactly the forward's F3."""

    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe", "tokens", "half_stored"})
    pipeline: eqx.Module
    G_lo: Optional[ChunkK] = None

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        if G_lo is None and self.G_lo is not None and self.G_lo.shape == G.shape:
            G_lo = self.G_lo
        return run_stage(self.pipeline, "wy", q=q, k=k, v=v, beta=beta, G=G, Akk=Akk, G_lo=G_lo, reset=reset)


class PipelineState(AbstractState):
    """F4 as ``pipeline`` runs it: what B0 recomputes with."""

    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe", "half_stored", "zero_h0"})
    pipeline: eqx.Module

    def __call__(self, w, u, kg, G, h0, layout, reset=None, zero_h0=False):
        zero = {"zero_h0": True} if zero_h0 else {}
        return run_stage(self.pipeline, "state", w=w, u=u, kg=kg, G=G, h0=h0, layout=layout, reset=reset, **zero)


def record_layout(name: str) -> None:
    """Tell the active recordings which layout the forward took (the first: not a backward's rerun)."""
    for rec in _ACTIVE.get():
        if rec.layout is None:
            rec.layout = name


@typecheck
def stage_inputs(pipeline, q: QK, k: QK, v: Values, g: Gate, beta: Beta, **options) -> dict:
    """The positional arguments (in the family's ``__call__`` order) each stage of ``pipeline``
    receives in one eager forward and backward of ``chunk_kda`` (untiled; loss
    ``sum(o * w)``, ``w`` fixed random): ``getattr(pipeline, name)(*args)`` runs one stage
    alone, as ``kdax.bench --stages`` does. B0's keyword-only ``wy``/``state`` are left out."""
    pipeline = pipeline.untiled()  # whole-input arguments, not a tile's
    w = jax.random.normal(jax.random.key(1), v.shape, jnp.float32)
    with recording() as rec:
        opts = KDAOptions.from_kwargs(**options)
        loss = lambda *a: jnp.sum(pipeline.apply(*a, opts)[0].astype(jnp.float32) * w)
        jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    # (a parameter the stage does not take, G_lo, is not in kw: kdax._numerics.hilo)
    return {name: tuple(kw[p.name] for p in _signature(STAGES[name].family).parameters.values()
                        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name in kw) for name, kw in rec.inputs.items()}
