"""Batch and head sharding: on inputs sharded over Explicit mesh axes, ``chunk_kda`` and
``fused_recurrent_kda`` run per shard in ``jax.shard_map`` (any pipeline, the Pallas ones
included), with no collective: rows and heads are independent."""

import contextlib
import functools
import inspect
from typing import Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

from .._config import KDAOptions, resolve_deprecated
from .._validate import validate
from ._chunk import sp_chunk_kda
from ._interpret import check_interpret_in_shard_map, interprets


def spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def explicit_spec(t):
    """``(mesh, spec)`` of the Explicit sharding of an array of type ``t`` (``jax.typeof``),
    or None (unsharded, an Auto mesh, or inside shard_map over every axis it is sharded on)."""
    sh = getattr(t, "sharding", None)
    mesh = getattr(sh, "mesh", None)
    spec = getattr(sh, "spec", None)
    if mesh is None or spec is None or not any(spec_axes(e) for e in spec):
        return None
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    if not any(a in explicit for e in spec for a in spec_axes(e)):
        return None
    return mesh, tuple(spec) + (None,) * (t.ndim - len(spec))


def sharding_of(q, k, v, g, beta) -> Optional[tuple]:
    """``(mesh, spec)`` of the Explicit mesh axes that shard the token inputs (those of v,
    then q, k, g, beta; ``spec`` over ``[B, T, H, ...]``), or None when none is sharded so:
    the call is a plain one. A sharded token axis is refused (sequence parallelism has its
    own entry)."""
    found = [s for x in (v, q, k, g, beta) if (s := explicit_spec(jax.typeof(x))) is not None]
    if not found:
        return None
    for _, s in found:
        if spec_axes(s[1]):
            raise ValueError(
                f"q, k, v, g, beta: the token axis is sharded over {s[1]!r}; sequence parallelism "
                "needs seq_axis_name inside jax.shard_map, or kdax.parallel.chunk_kda on global arrays."
            )
    return found[0]


def per_shard(fn: Callable, sharding: tuple, q, k, v, g, beta, *, initial_state=None, A_log=None, dt_bias=None,
              cu_seqlens=None, state_v_first: bool = False, check_vma: bool = True, **options) -> tuple:
    """``fn(q, k, v, g, beta, **options)`` in ``jax.shard_map`` over ``sharding``
    (``sharding_of``'s ``(mesh, spec)``: the mesh axes sharding the batch and head axes;
    ``check_vma``: shard_map's, False for an interpret-mode Pallas pipeline, see
    ``interprets``). Outputs keep the inputs' sharding: o like v, the final state over the
    batch (dense) and heads, the chunks' start states likewise."""
    mesh, spec = sharding
    b, h = spec[0], spec[2]
    dense = cu_seqlens is None
    tok4, tok3 = P(b, None, h, None), P(b, None, h)
    qk4, pick = tok4, _qk_heads(mesh, h, q.shape[2], v.shape[2])
    if pick is not None:  # q, k replicated over the head axes, each shard slicing its head
        qk4 = P(b, None, None, None)
    state = P(b if dense else None, h, None, None)
    arrays = dict(initial_state=(initial_state, state), A_log=(A_log, P(h)), dt_bias=(dt_bias, P(h)),
                  cu_seqlens=(cu_seqlens, P()))
    arrays = {n: xs for n, xs in arrays.items() if xs[0] is not None}
    put = lambda x, s: jax.sharding.reshard(x, jax.NamedSharding(mesh, s))
    ins = tuple(put(x, s) for x, s in zip((q, k, v, g, beta), (qk4, qk4, tok4, tok4, tok3)))
    kw = {n: put(x, s) for n, (x, s) in arrays.items()}

    def local(q, k, v, g, beta, kw):
        if pick is not None:
            q, k = pick(q), pick(k)
        return fn(q, k, v, g, beta, state_v_first=state_v_first, **kw, **options)

    out_specs = (tok4, state if options.get("output_final_state", False) else None)
    if options.get("return_intermediate_states", False):  # (each chunk's start state: [B, NC, HV, ...])
        out_specs += (P(b if dense else None, None, h, None, None),)
    per_shard = jax.shard_map(local, mesh=mesh, in_specs=(qk4, qk4, tok4, tok4, tok3, {n: s for n, (_, s) in arrays.items()}),
                              out_specs=out_specs, check_vma=check_vma)
    # Compiled, in the inputs' mesh: called eagerly, shard_map runs op by op, where JAX
    # implements no custom_vjp (chunk_kda's VJP inside: "custom_vjp symbolic_zeros support
    # with shard_map is not implemented").
    with _concrete_mesh(q):
        return jax.jit(per_shard)(*ins, kw)


def _concrete_mesh(x):
    """The context in which ``per_shard``'s jit runs: the mesh of ``x``'s sharding set
    (``jax.set_mesh``) when ``x`` is a concrete array (an eager call); else nothing
    (inside a trace, where the caller's mesh context, if any, holds)."""
    concrete = getattr(getattr(x, "sharding", None), "mesh", None)
    if isinstance(concrete, jax.sharding.Mesh) and not isinstance(x, jax.core.Tracer):
        return jax.set_mesh(concrete)
    return contextlib.nullcontext()


def _qk_heads(mesh, h, H: int, HV: int) -> Optional[Callable]:
    """With the value heads sharded over the mesh axes ``h`` in ``P`` blocks: None when the
    q/k heads shard the same way (``H % P == 0``: block p of the value heads reads block p
    of the q/k heads); else, when every block's value heads read one q/k head (H < P, the
    group size ``HV // H`` a multiple of the block ``HV // P``), the function that slices
    that head out of replicated ``q``/``k`` on each shard; otherwise an error."""
    axes = spec_axes(h)
    if not axes:
        return None
    Pn = 1
    for a in axes:
        Pn *= mesh.shape[a]
    if H % Pn == 0:
        return None
    group, block = HV // H, HV // Pn
    if HV % Pn or group % block:
        raise ValueError(
            f"q, k, v: the value heads (HV={HV}) are sharded {Pn} ways over mesh axes {axes!r}, and the q/k heads "
            f"(H={H}) can neither be sharded the same way (H a multiple of {Pn}) nor sliced per shard (each shard's "
            f"{HV}/{Pn} value heads reading a single q/k head); shard the heads over a mesh axis whose size "
            f"divides H, or replicate them."
        )

    def pick(x):
        head = jax.lax.axis_index(axes) * block // group
        return jax.lax.dynamic_slice_in_dim(x, head, 1, axis=2)

    return pick


# chunk_kda's FLA-only arguments (docs/fla_arguments.md) and their defaults.
_FLA_ONLY = dict(return_intermediate_states=False, cu_seqlens_cpu=None, cp_context=None, use_graph=False,
                 max_num_seqs=None)


def without_fla_only(kw: dict, where: str) -> dict:
    """``kw`` less FLA's arguments that have no meaning in sequence parallel (``where``), each
    at its default; another value is refused, naming it (an array too: not compared)."""
    for name, default in _FLA_ONLY.items():
        x = kw.pop(name, default)
        if (x is not None) if default is None else (x is not default and x != default):
            raise ValueError(f"{name}: not supported {where} (FLA-only argument; leave it at {default!r}).")
    return kw


def route(fn: Callable, arguments: dict) -> Optional[tuple]:
    """What ``kdax.chunk_kda`` / ``kdax.fused_recurrent_kda`` (``fn``) return when their
    call is not a plain single-device one, or None. ``arguments``: the call's arguments
    by name (``locals()`` on entry). ``seq_axis_name`` set: sequence parallel inside
    shard_map (chunk_kda only); inputs sharded over Explicit mesh axes: per shard."""
    kw = dict(arguments)
    q, k, v, g, beta = (kw.pop(n) for n in ("q", "k", "v", "g", "beta"))
    seq_axis_name = kw.pop("seq_axis_name", None)
    if seq_axis_name is not None:
        if kw.get("transpose_state_layout") is not None:
            kw = resolve_deprecated(kw)
        kw.pop("transpose_state_layout", None)
        kw = without_fla_only(kw, "with seq_axis_name")
        return sp_chunk_kda(q, k, v, g, beta, seq_axis_name=seq_axis_name, **kw)
    pipeline, chunked = kw.pop("pipeline", None), fn.__name__ == "chunk_kda"
    if pipeline is not None:
        check_interpret_in_shard_map(pipeline, q, k, v, g, beta)
        fn = functools.partial(fn, pipeline=pipeline)
    # Decided from the token inputs alone: a plain call hands nothing else on.
    sharding = sharding_of(q, k, v, g, beta)
    if sharding is None:
        return _gathered(fn, (q, k, v, g, beta), kw)
    # The caller's global shapes checked first (per shard, the messages gave the shard's).
    opts = {n: x for n, x in kw.items() if n in KDAOptions.names() and n != "state_v_first"}
    v_first = kw.get("state_v_first", False) if kw.get("transpose_state_layout") is None else kw["transpose_state_layout"]
    validate(q, k, v, g, beta, KDAOptions(**opts, state_v_first=v_first), chunked=chunked)
    return per_shard(fn, sharding, q, k, v, g, beta, check_vma=pipeline is None or not interprets(pipeline), **kw)


def _gathered(fn: Callable, tokens: tuple, kw: dict) -> Optional[tuple]:
    """``fn`` on the token inputs ``tokens`` (sharded over no Explicit mesh axis) with
    ``kw``'s arrays that are so sharded (A_log and dt_bias over heads, initial_state over
    rows or heads: a model's parameters and states) gathered first, as the layer gathers
    FSDP-sharded parameters beside an unsharded x; None when none is (a plain call).
    Without it JAX refuses the mix ("All operands should have the same sharding")."""
    sharded = {n: s for n in ("initial_state", "A_log", "dt_bias", "cu_seqlens")
               if isinstance(kw.get(n), jax.Array) and (s := explicit_spec(jax.typeof(kw[n]))) is not None}
    if not sharded:
        return None
    for n, (mesh, _) in sharded.items():
        kw[n] = jax.sharding.reshard(kw[n], jax.NamedSharding(mesh, P()))
    return fn(*tokens, **kw)


def routed(fn: Callable) -> Callable:
    """Decorator of ``kdax.chunk_kda`` / ``kdax.fused_recurrent_kda``: a call that is not a
    plain single-device one (``route``) is routed before ``fn``'s body runs."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        out = route(fn, bound.arguments)
        return fn(*args, **kwargs) if out is None else out

    return call
