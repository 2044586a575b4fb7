"""Running a pipeline or one of its stages for the checks: the pipeline a case runs in,
the arguments each stage got in a recorded forward and backward, one stage called on
them, and ``chunk_kda``'s outputs and gradients through a pipeline."""

import collections
import concurrent.futures
import dataclasses
import functools
import warnings
from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._config import KDAOptions
from .._numerics import precision as _precision
from .._platform import near_the_mapping_limit
from .._runner import routes as _routes
from .._stage_protocol.capabilities import capabilities, negotiated
from .._runner.contracts import STAGES
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
    # (an option this XLA does not know is an error: probe each once). The parallel
    # codegen's split of a module into parts costs more than it saves at these sizes:
    # one part, a third less CPU time per compile, and no more wall time.
    for name, value in (("xla_cpu_use_fusion_emitters", False), ("xla_cpu_parallel_codegen_split_count", 1)):
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(opts, **{name: value})).lower(1.0).compile()
            opts[name] = value
        except Exception:
            pass
    return opts


def _jit(fun):
    """``eqx.filter_jit`` with the checks' compiler options (``_compile_options``)."""
    return eqx.filter_jit(fun, compiler_options=_compile_options())


# Compiled programs by what they were traced from (``_program_key``), as futures: a program
# is lowered on the calling thread (tracing reads its context) and compiled on one of two
# worker threads (XLA releases the GIL), so that a check can ask for its programs ahead
# (``_ahead``) and trace the next while the last compiles.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_KEEP = 512  # (futures kept, the least recently used dropped; JAX keeps the programs: release_compiled_programs)


@functools.cache
def _workers() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kdax-testing-compile")


def _program_key(program, args) -> tuple:
    """What a jitted program's trace depends on: the static leaves of ``args`` (the
    pipeline's stages and settings, the options, flags) and the shapes and dtypes of the
    arrays, as ``jax.jit``'s cache keys it."""
    leaves, tree = jax.tree.flatten(args)
    return (id(program), tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) if eqx.is_array(x) else x
                                 for x in leaves))


def _compiled(program, *args) -> concurrent.futures.Future:
    """The future of ``program`` (an ``eqx.filter_jit`` function) compiled for ``args``:
    lowered now, on this thread, compiled by a worker, once per ``_program_key``."""
    key = _program_key(program, args)
    got = _COMPILED.get(key)
    if got is None:
        lowered = program.lower(*args)
        got = _COMPILED[key] = _workers().submit(lowered.compile)
        if len(_COMPILED) > _KEEP:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return got


def release_compiled_programs() -> None:
    """Drop every compiled program, the checks' (``_COMPILED``) and JAX's
    (``jax.clear_caches()``): JAX keeps each program the checks compile (a check's are for
    the stage it checks) until its caches are cleared; XLA:CPU maps each one's code."""
    _COMPILED.clear()
    jax.clear_caches()


def release_near_the_mapping_limit() -> None:
    """``release_compiled_programs`` once the process nears the kernel's limit on memory
    mappings (``kdax._platform.near_the_mapping_limit``): about 120 mappings a check of the
    reference F4 under a class of its own, and a process that checked stages in a loop died
    in a compile. Dropped programs only cost a later call its compile."""
    if near_the_mapping_limit():
        release_compiled_programs()


def _call(program, *args):
    """``program(*args)``, compiled by ``_compiled`` (once per program key)."""
    return _compiled(program, *args).result()(*args)


def _ahead(program, *args) -> None:
    """Start compiling ``program`` for ``args`` (``_compiled``): a check that will call it
    asks ahead. A trace that fails here is left to the call, which raises it where the
    check reports it."""
    try:
        _compiled(program, *args)
    except Exception:
        pass


def trusting(pipe: KDAPipeline) -> KDAPipeline:
    """``pipe`` taking every route its stages' declarations select, whatever their math,
    and none of the pipeline's reset masks, which would hide a false declaration
    (``KDAPipeline.trust_declarations``): how a declaration is checked."""
    return dataclasses.replace(pipe, trust_declarations=True)


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

# A call's keyword arguments that are arrays the programs take as arguments; the others
# (cu_seqlens too: the layout is made from its values) are static.
_ARRAYS = ("initial_state", "A_log", "dt_bias")


class _Options:
    """A call's static keyword options (``cu_seqlens`` as the concrete array the call
    gets), equal and hashed by value: a static argument of the checks' jitted programs, so
    that cases of the same options and shapes (a case and its other seed, the float64 twin
    of a float32 case) share one compiled program."""

    def __init__(self, kw: dict):
        self.kw = kw
        self._key = tuple(sorted((n, tuple(np.asarray(x).tolist()) if hasattr(x, "shape") else x)
                                 for n, x in kw.items()))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Options) and self._key == other._key


def _call_of(case) -> tuple:
    """``(inputs (q, k, v, g, beta), array options, static options)`` of ``case``'s call."""
    x, kw = case.inputs()
    return x, {n: a for n, a in kw.items() if n in _ARRAYS}, _Options({n: a for n, a in kw.items() if n not in _ARRAYS})


class _Enough(BaseException):
    """Ends a recording once the wanted stage's arguments are noted (a BaseException: no
    ``except Exception`` on the way takes it for the stage's own error)."""


class _UpTo(dict):
    """A recording's ``inputs`` that ends the run (``_Enough``) when ``field``'s arguments
    are noted: the rest of the forward and backward is never traced nor compiled."""

    def __init__(self, field: str):
        super().__init__()
        self.field = field

    def setdefault(self, name, value):
        new = name not in self
        got = super().setdefault(name, value)
        if new and name == self.field:
            raise _Enough
        return got


def _recording_run(pipe, x, arrays, options: _Options, field: Optional[str], backward: bool):
    """What ``_record`` compiles: ``(kwargs by field, layout, derived, error, stopped)``."""
    stopped, err = False, None
    with recording(quiet=True) as rec:
        if field is not None:
            rec.inputs = _UpTo(field)
        opts = KDAOptions.from_kwargs(**options.kw, **arrays)

        def loss(x):
            o, ht = pipe.apply(*x, opts)
            return (jnp.sum(o.astype(jnp.float32) * _weights(o.shape, jnp.float32, 1))
                    + jnp.sum(ht.astype(jnp.float32) * _weights(ht.shape, jnp.float32, 2)))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if _routes.mismatches(pipe):  # derived backward: no backward stage runs
                    pipe.apply(*x, opts)
                elif not backward:  # (the forward rule of the custom VJP, traced here, not inside it)
                    jax.vjp(loss, x)
                else:
                    jax.grad(loss)(x)
        except _Enough:
            stopped = True
        except Exception as e:  # the stage under test may break the run: keep what was recorded
            err = e
    return dict(rec.inputs), rec.layout, rec.derived, err, stopped


@functools.cache
def _recording_program():
    # (one jitted function for every recording: equal options and shapes share a program;
    # built on first use, as _run_program)
    return _jit(_recording_run)


def _recording_args(pipe: KDAPipeline, case: Case, backward: bool, field: Optional[str]) -> tuple:
    return (pipe, *_call_of(case), field, backward)


def _record_ahead(pipe: KDAPipeline, case: Case, cache: bool, key=None, backward: bool = True,
                  field: Optional[str] = None) -> None:
    """Start compiling what ``_record`` with these arguments will run (``_ahead``), unless
    it has been recorded already."""
    if not (cache and _recorded(key or (case,), field) is not None):
        _ahead(_recording_program(), *_recording_args(pipe, case, backward, field))


def _recorded(key, field: Optional[str]):
    """A kept recording (``_RECORDED``) that has ``field``'s arguments, or None."""
    forward_field = field is not None and STAGES[field].forward
    for out, whole in _RECORDED.get(key, ()):
        # (a run that was not ended early noted every stage that runs: a field not there
        # does not run; a forward-only run, every forward stage)
        if field in out[0] or whole == "all" or (whole == "forward" and forward_field):
            return out
    return None


def _record(pipe: KDAPipeline, case: Case, cache: bool, key=None, backward: bool = True,
            field: Optional[str] = None):
    """The keyword arguments each stage of ``pipe`` got in one forward and backward
    (``loss = sum(o w) + sum(ht wh)``, fixed random weights), jitted; and what ran:
    ``(kwargs by field, layout, derived, error or None)``. ``backward=False``: the
    forward alone. ``field``: the run ends once that stage's arguments are noted (the
    stages after it are neither traced nor compiled; the others' arguments are those
    noted before it). ``cache``: keep them, by ``key`` (default: the case), for later
    reports (``pipe`` the reference pipeline as the case runs it)."""
    key = (case,) if key is None else key
    if cache and _recorded(key, field) is not None:
        return _recorded(key, field)
    inputs, layout, derived, err, stopped = _call(_recording_program(), *_recording_args(pipe, case, backward, field))
    out = (inputs, layout, derived, err)
    if cache:
        whole = None if stopped else ("all" if backward else "forward")
        _RECORDED.setdefault(key, []).append((out, whole))
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
    with recording(quiet=True):
        return run_stage(trusting(pipe), field, **kwargs)


@functools.cache
def _run_program():
    # (built on first use: the compiler options ask which backend runs, and importing
    # kdax must not start one)
    return _jit(_run)


def _for_reference(reference, stage, kwargs: dict) -> dict:
    """``kwargs`` for ``reference`` beside ``stage`` run on ``_for_stage(stage, kwargs)``: without
    ``dh_start`` where ``stage`` does not take it (the pipeline then runs B2 once more on it)."""
    if not capabilities(type(stage)).dh_start:
        kwargs = {n: x for n, x in kwargs.items() if n != "dh_start"}
    return _for_stage(reference, kwargs)


def _jit_run(pipe, field, kwargs):
    """``_run`` jitted (compiled once per program key, ``_compiled``)."""
    return _call(_run_program(), pipe, field, kwargs)


def _run_ahead(pipe, field, kwargs) -> None:
    """Start compiling what ``_jit_run`` with these arguments will run."""
    _ahead(_run_program(), pipe, field, kwargs)


def _outputs_run(P: KDAPipeline, x, arrays, options: _Options, grads: bool):
    """What ``_pipeline_outputs`` compiles."""
    with recording(quiet=True) as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def loss(x, arrays):
            o, ht = P.apply(*x, KDAOptions.from_kwargs(**options.kw, **arrays))
            wt = jnp.float64 if o.dtype == jnp.float64 else jnp.float32
            val = jnp.sum(o.astype(wt) * _weights(o.shape, wt, 1)) + jnp.sum(ht * _weights(ht.shape, ht.dtype, 2))
            return val, (o, ht)

        if grads:
            d, (o, ht) = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, arrays)
        else:
            o, ht = P.apply(*x, KDAOptions.from_kwargs(**options.kw, **arrays))
            d = None
    meta = dict(layout=rec.layout, derived=rec.derived, ran={n: type(r[1]) for n, r in rec.ran.items()})
    return o, ht, d, meta


@functools.cache
def _outputs_program():
    return _jit(_outputs_run)


def _pipeline_outputs(P: KDAPipeline, case: Case, grads: bool):
    """``(o, ht, grads or None, meta)`` of ``chunk_kda`` with pipeline ``P`` on ``case``'s
    inputs (loss ``sum(o w) + sum(ht wh)``), jitted; ``meta``: layout, derived, which
    implementation ran each field."""
    return _call(_outputs_program(), P, *_call_of(case), grads)


def _outputs_ahead(P: KDAPipeline, case: Case, grads: bool) -> None:
    """Start compiling what ``_pipeline_outputs`` with these arguments will run."""
    _ahead(_outputs_program(), P, *_call_of(case), grads)
