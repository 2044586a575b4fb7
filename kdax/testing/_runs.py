"""Running a pipeline or one of its stages for the checks: the pipeline a case runs in,
the arguments each stage got in a recorded forward and backward, one stage called on
them, and ``chunk_kda``'s outputs and gradients through a pipeline."""

import dataclasses
import functools
import warnings
from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._config import KDAOptions
from .._numerics import precision as _precision
from .._runner import routes as _routes
from .._stage_protocol.capabilities import capabilities, negotiated
from .._runner.runner import recording, run_stage
from ..pipeline import KDAPipeline
from ..stages import KDA, AbstractGate, ReferenceGate
from ._cases import Case, _weights


@functools.cache
def _compile_options() -> dict:
    """The checks compile many small programs, each run once or twice: on CPU, XLA's
    backend at optimisation level 0 and (where this XLA has the option) its older fusion
    emitters compile them in about a third of the time (a reference pipeline's gradient
    at the checks' shapes: 1.9 s -> 0.6 s; tests/conftest.py sets the same for the suite).
    Floating-point semantics are unchanged at every level (no fast-math), and both sides
    of every comparison are compiled alike."""
    if jax.default_backend() != "cpu":
        return {}
    opts = {"xla_backend_optimization_level": 0}
    try:  # (an option this XLA does not know is an error: probe it once)
        jax.jit(lambda x: x + 1, compiler_options=dict(opts, xla_cpu_use_fusion_emitters=False)).lower(1.0).compile()
        opts["xla_cpu_use_fusion_emitters"] = False
    except Exception:
        pass
    return opts


def _jit(fun):
    """``eqx.filter_jit`` with the checks' compiler options (``_compile_options``)."""
    return eqx.filter_jit(fun, compiler_options=_compile_options())


def _base(base: Optional[KDAPipeline]) -> KDAPipeline:
    """The pipeline the arguments come from (the reference one by default), untiled."""
    return (KDAPipeline.reference() if base is None else base).untiled()


def _pipe_for(base: KDAPipeline, case: Case) -> KDAPipeline:
    """``base`` as ``case`` runs it: its layout (shared chunks or not), untiled, F1 without
    the floor where the case asks, the precision policy resolved for the case's dtype."""
    p = dataclasses.replace(base, share_chunks=case.share, tile=None)
    if not case.floor:
        p = eqx.tree_at(lambda p: p.gate, p, _UnflooredGate())
    policy = base.precision if getattr(case, "precision", None) is None else case.precision
    return p.with_precision(_precision.resolve(policy, case.dtype))


class _UnflooredGate(AbstractGate):
    """KDA's F1 without the log decay floor at sequence starts (``Case.floor``): G runs on
    through a chunk's earlier sequence, which the other stages' resets must cut exactly."""

    math: ClassVar[Optional[str]] = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


# The reference pipeline's recorded arguments by case: every check_stage without a base
# records the same ones, and recording is a jitted forward and backward.
_RECORDED: dict = {}


def _record(pipe: KDAPipeline, case: Case, cache: bool, key=None, backward: bool = True):
    """The keyword arguments each stage of ``pipe`` got in one forward and backward
    (``loss = sum(o w) + sum(ht wh)``, fixed random weights), jitted; and what ran:
    ``(kwargs by field, layout, derived, error or None)``. ``backward=False``: the
    forward alone (the forward stages' arguments, in less than half the compile time).
    ``cache``: keep them, by ``key`` (default: the case), for later reports (``pipe`` the
    reference pipeline as the case runs it)."""
    key = (case,) if key is None else key
    if cache and key in _RECORDED:
        return _RECORDED[key]
    if cache and not backward and key + ("forward",) in _RECORDED:
        return _RECORDED[key + ("forward",)]
    (q, k, v, g, beta), kw = case.inputs()
    arrays = {n: x for n, x in kw.items() if n in ("initial_state", "A_log", "dt_bias")}
    static = {n: x for n, x in kw.items() if n not in arrays}
    meta = {}

    def run(x, arrays):
        with recording(quiet=True) as rec:
            opts = KDAOptions.from_kwargs(**static, **arrays)

            def loss(x):
                o, ht = pipe.apply(*x, opts)
                return (jnp.sum(o.astype(jnp.float32) * _weights(o.shape, jnp.float32, 1))
                        + jnp.sum(ht.astype(jnp.float32) * _weights(ht.shape, jnp.float32, 2)))

            err = None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if _routes.mismatches(pipe):  # derived backward: no backward stage runs
                        pipe.apply(*x, opts)
                    elif not backward:  # (the forward rule of the custom VJP, traced here, not inside it)
                        jax.vjp(loss, x)
                    else:
                        jax.grad(loss)(x)
            except Exception as e:  # the stage under test may break the run: keep what was recorded
                err = e
        meta.update(layout=rec.layout, derived=rec.derived, error=err)
        return rec.inputs

    inputs = _jit(run)((q, k, v, g, beta), arrays)
    out = (inputs, meta.get("layout"), meta.get("derived"), meta.get("error"))
    if cache:
        _RECORDED[key if backward else key + ("forward",)] = out
    return out


def _with_stage(base: KDAPipeline, field: str, stage) -> KDAPipeline:
    """``base`` with ``stage`` at ``field``, without fallback (a stage's ``UnsupportedCase``
    reaches the check)."""
    return eqx.tree_at(lambda p: getattr(p, field), dataclasses.replace(base, fallback=False), stage)


def _for_stage(stage, kwargs: dict) -> dict:
    """``kwargs`` (what the reference pipeline passed) as the stage runner negotiates them
    for ``stage``: ``G_lo`` only if accepted, ``reset`` only if accepted (a stage that
    does not accept it is not run on shared chunks)."""
    kwargs = negotiated(stage, dict(kwargs))
    if "reset" in kwargs and not capabilities(type(stage)).reset:
        kwargs = {n: x for n, x in kwargs.items() if n != "reset"}
    return kwargs


def _run(pipe, field, kwargs):
    """The stage at ``field`` of ``pipe`` called by the stage runner on ``kwargs``."""
    # (the stage as it declares itself: reset passed by its declaration, whatever its
    # math, and none of the pipeline's reset masks, which would hide a false one)
    with recording(quiet=True), _routes.as_declared():
        return run_stage(pipe, field, **kwargs)


@functools.cache
def _jit_run_compiled():
    # (built on first use: the compiler options ask which backend runs, and importing
    # kdax must not start one)
    return _jit(_run)


def _jit_run(pipe, field, kwargs):
    return _jit_run_compiled()(pipe, field, kwargs)


def _pipeline_outputs(P: KDAPipeline, case: Case, grads: bool):
    """``(o, ht, grads or None, meta)`` of ``chunk_kda`` with pipeline ``P`` on ``case``'s
    inputs (loss ``sum(o w) + sum(ht wh)``), jitted; ``meta``: layout, derived, which
    implementation ran each field."""
    (q, k, v, g, beta), kw = case.inputs()
    arrays = {n: x for n, x in kw.items() if n in ("initial_state", "A_log", "dt_bias")}
    static = {n: x for n, x in kw.items() if n not in arrays}
    meta = {}

    def run(P, x, arrays):
        with recording(quiet=True) as rec, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opts = KDAOptions.from_kwargs(**static, **arrays)

            def loss(x, arrays):
                o, ht = P.apply(*x, KDAOptions.from_kwargs(**static, **arrays))
                val = (jnp.sum(o.astype(jnp.float64 if o.dtype == jnp.float64 else jnp.float32)
                               * _weights(o.shape, jnp.float64 if o.dtype == jnp.float64 else jnp.float32, 1))
                       + jnp.sum(ht * _weights(ht.shape, ht.dtype, 2)))
                return val, (o, ht)

            if grads:
                d, (o, ht) = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, arrays)
            else:
                o, ht = P.apply(*x, opts)
                d = None
        meta.update(layout=rec.layout, derived=rec.derived, ran={n: type(r[1]) for n, r in rec.ran.items()})
        return o, ht, d

    o, ht, d = _jit(run)(P, (q, k, v, g, beta), arrays)
    return o, ht, d, meta
