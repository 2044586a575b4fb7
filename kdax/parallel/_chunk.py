"""Sequence-parallel ``chunk_kda`` inside ``jax.shard_map``: the token axis split over a
mesh axis, exact.

Forward, on each device: (1) a local pass with a zero entry state for the sequence that
enters from the previous device gives ``b``, the exit state of the sequence that leaves to
the next device; the state stage run once more from the identity (zero ``u``) gives its
``M``; (2) the exclusive prefix of ``(M, b)`` over devices gives the true entry state;
(3) the local pass from it: as it is affine in the entry, the pass of (1) plus the state
and output stages run from the entry alone with ``u = 0`` (F1-F3 run once), in the
forward alone and in a training step alike (so that the two agree bit for bit). Backward
(hand-written, an ``eqx.filter_custom_vjp``): B0 once; B1-B2 with only this device's own ``dht``
give ``c``, the gradient reaching the entering sequence's start; the reverse prefix of
``(M^T, c)`` gives the gradient arriving at this device's exit; the local backward
(B1-B5) with it.

Custom stages: each shortcut above rests on what a stage's declared math guarantees, and
is taken only then. Splitting a sequence between devices at all needs an F4 of KDA's math
(its state map affine in the entry state, and a span's exit the next span's entry): any
other F4 is refused by name (``check_state_splits``), since an F4 that reads its entry
state otherwise (clips it, say) computes something else for each split. The training
step's "pass from zero plus the part from the entry" needs F5 of KDA's math too (linear
in ``h`` and ``v_new``); otherwise the local pass runs again from the true entry. When the backward stages are not the transposes of the forward
stages (``kdax._runner.routes``), the backward is derived by ``jax.vjp`` through this
sequence-parallel forward, collectives included, as ``chunk_kda`` does on one device.
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._layouts.layout import pack, unpack
from .._numerics import isolation as _isolation
from .._numerics.arrays import varying_axes
from .._platform import in_eager_shard_map
from .._runner import routes as _routes
from .._runner.stage_grads import check_perturbed, pipeline_gradients
from .._runner.vjp import summed_like
from .._validate import checked_cu_seqlens
from ..pipeline import default_pipeline
from ..ref import compute_dtype
from ._interpret import check_interpret_in_shard_map
from ._summary import PrefixMethod, exclusive_prefix


class _Static(eqx.Module):
    """What the custom VJP does not differentiate (hashable)."""

    pipeline: object
    axis: str = eqx.field(static=True)
    prefix: str = eqx.field(static=True)
    options: tuple = eqx.field(static=True)


class _Spans(eqx.Module):
    """Where this device's tokens sit among the sequences, per sequence ``[N]`` (dense:
    one sequence per row, ``[B]``): ``enters`` (the sequence runs into this device from
    the previous one), ``leaves`` (it runs on into the next), ``owns`` (it ends here,
    so its final state and ``dht`` are this device's); ``cu`` the local offsets (None
    when dense)."""

    enters: jax.Array
    leaves: jax.Array
    owns: jax.Array
    cu: Optional[jax.Array]


def _spans(axis: str, B: int, Tl: int, cu) -> _Spans:
    d = jax.lax.axis_index(axis)
    P = jax.lax.axis_size(axis)
    if cu is None:
        rows = jnp.ones((B,), bool)
        return _Spans(rows & (d > 0), rows & (d < P - 1), rows & (d == P - 1), None)
    s, e = d * Tl, (d + 1) * Tl
    start, end = cu[:-1], cu[1:]
    owner = jnp.clip((end - 1) // Tl, 0, P - 1)  # an empty sequence: any device it is empty on
    return _Spans((start < s) & (end > s), (start < e) & (end > e), owner == d, jnp.clip(cu - s, 0, Tl).astype(jnp.int32))


def _rows(mask, x):
    """``x [N, ...]`` where ``mask [N]``, else 0."""
    return jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _pick(spans: _Spans, mask, x):
    """The summary rows from per-sequence ``x [N, ...]``: dense, every row; packed, the
    one sequence where ``mask`` (a sum of at most one term), as ``[1, ...]``."""
    x = _rows(mask, x)
    return x if spans.cu is None else jnp.sum(x, axis=0, keepdims=True)


def _through(axis: str, B: int, Tl: int, cu):
    """Per device ``[P, B, 1]`` (dense) or ``[P, 1, 1]`` (packed), from the global offsets
    every device holds: a sequence runs through device e (it enters and leaves), else the
    summary's ``M`` is zero there (``exclusive_prefix``'s ``live``)."""
    P = jax.lax.axis_size(axis)
    e = jnp.arange(P)
    if cu is None:
        return jnp.broadcast_to(((e > 0) & (e < P - 1))[:, None, None], (P, B, 1))
    start, end = cu[:-1], cu[1:]
    x = (start[None] < (e * Tl)[:, None]) & (end[None] > ((e + 1) * Tl)[:, None])  # [P, N]
    return jnp.any(x, axis=1)[:, None, None]


def _spread(spans: _Spans, mask, x, N: int):
    """Adjoint of ``_pick``: summary rows back to ``[N, ...]``, zero where not ``mask``."""
    return _rows(mask, x if spans.cu is None else jnp.broadcast_to(x, (N,) + x.shape[1:]))


def _forward_local(static: _Static, q, k, v, g, beta, h0, A_log, dt_bias, cu):
    """The one place this module runs the pipeline's forward: ``(o, final, residuals)``."""
    opts = dict(static.options)
    return static.pipeline.forward(
        q, k, v, g, beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
        output_final_state=True, **opts,
    )


def _backward_local(static: _Static, res, do, dht):
    """The one place this module runs the pipeline's backward: ``(KDAGrads, parts)``."""
    return static.pipeline.backward_with_parts(res, do, dht)


def _resolved(static: _Static, res):
    """The pipeline with its precision policy resolved, as ``backward`` resolves it."""
    return static.pipeline.resolved(*res.in_dtypes[:6])


def _with_cache(static: _Static, res):
    """``res`` with its forward cache, B0 run once here when it was dropped (both local
    backward passes then skip it)."""
    if res.cache is not None:
        return res
    cache = _resolved(static, res).recomputed(res)  # (B0 as the one-device backward calls it)
    return eqx.tree_at(lambda r: r.cache, res, cache, is_leaf=lambda x: x is None)


def _entry_gradient(static: _Static, res, do, dht):
    """The gradient reaching the entry states ``[N, HV, K, V]`` from ``do`` and ``dht``:
    B1 and B2 of the backward alone, on ``res``'s cache."""
    pipe, c, L = _resolved(static, res), res.cache, res.layout
    dt = res.h0.dtype
    doc = pack(L, do, dt)
    _, dv_intra = pipe.run_stage("dav", v_new=c.v_new, Aqk=res.Aqk, do=doc)
    return pipe.run_stage("dhu", scale=res.config.scale, qg=c.qg, kg=c.kg, w=c.w, G=res.act.G, do=doc,
                       dv_intra=dv_intra, dht=dht.astype(dt), layout=L).dh0


def _state_stage(static: _Static, res, h0):
    """F4 of the pipeline on the cached ``w, kg, G`` of ``res`` with ``u = 0`` and entry
    states ``h0 [N, HV, K, K]``: the final states are the linear parts ``M``."""
    c = res.cache
    u = jnp.zeros(c.w.shape, c.w.dtype)
    return static.pipeline.run_stage("state", w=c.w, u=u, kg=c.kg, G=c.G, h0=h0, layout=res.layout).final


def _from_entry(static: _Static, res0, o0, fin0, h_add):
    """The local pass from entry states ``h0 + h_add`` given the one from ``h0``
    (``o0, fin0, res0``, its cache kept): F4 from ``h_add`` with ``u = 0`` and F5 on that
    part, added. Returns ``(o, final, residuals of the pass from h0 + h_add)``."""
    c, L = res0.cache, res0.layout
    pipe = static.pipeline
    st = pipe.run_stage("state", w=c.w, u=jnp.zeros(c.u.shape, c.u.dtype), kg=c.kg, G=c.G, h0=h_add, layout=L)
    oc = pipe.run_stage("output", scale=res0.config.scale, qg=c.qg, h=st.h, Aqk=c.Aqk, v_new=st.v_new)
    o = (o0.astype(oc.dtype) + unpack(L, oc)).astype(o0.dtype)
    cache = eqx.tree_at(lambda c: (c.h, c.v_new), c, (c.h + st.h, c.v_new + st.v_new))
    res = eqx.tree_at(lambda r: (r.h0, r.cache), res0, (res0.h0 + h_add, cache))
    return o, fin0 + st.final, res


def _forward(static: _Static, q, k, v, g, beta, h0, A_log, dt_bias, cu):
    B, Tl = q.shape[:2]
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    dt = compute_dtype(q, k, v, g, beta, h0)
    N = B if cu is None else cu.shape[0] - 1
    sp = _spans(static.axis, B, Tl, cu)
    h0 = jnp.zeros((N, HV, K, V), dt) if h0 is None else h0.astype(dt)
    # (1) the summary: b from a zero entry, M from the identity
    o0, fin0, res0 = _forward_local(static, q, k, v, g, beta, _rows(~sp.enters, h0), A_log, dt_bias, sp.cu)
    eye = _rows(sp.enters, jnp.broadcast_to(jnp.eye(K, dtype=dt), (N, HV, K, K)))
    M = _pick(sp, sp.leaves, _state_stage(static, res0, eye))
    b = _pick(sp, sp.leaves, fin0)
    # (2) the true entry state, (3) the local pass from it.
    entry = exclusive_prefix(M, b, static.axis, method=static.prefix, live=_through(static.axis, B, Tl, cu))
    h_add = _rows(sp.enters, _spread(sp, sp.enters, entry, N))
    if _routes.is_kda(static.pipeline.output):
        # Affine in the entry: the pass from zero plus F4 and F5 from the entry alone
        # (u = 0), F1-F3 once (the training step 1.3-1.5x faster at T = 8192 on 8 devices).
        # The forward alone takes the same route, so that it equals the training step's
        # forward bit for bit (a second whole pass kept the forward's per-device peak 1.5x
        # lower at T = 8192, for other rounding).
        o, fin, res = _from_entry(static, res0, o0, fin0, h_add)
    else:
        # F5 of other math (its output need not be linear in the entry): a second whole
        # pass from the true entry.
        o, fin, res = _forward_local(static, q, k, v, g, beta, res0.h0 + h_add, A_log, dt_bias, sp.cu)
    final = jax.lax.psum(_rows(sp.owns, fin), static.axis)
    return o, final, res, M, sp


class _Call(eqx.Module):
    """The static part of a call (mesh axis, prefix method, options)."""

    axis: str = eqx.field(static=True)
    prefix: str = eqx.field(static=True)
    options: tuple = eqx.field(static=True)

    def static(self, pipeline) -> _Static:
        return _Static(pipeline, self.axis, self.prefix, self.options)


@eqx.filter_custom_vjp
def _sp_kda(diff, call: _Call, cu):
    """``(o, final)`` of ``diff = ((q, k, v, g, beta, h0, A_log, dt_bias), pipeline)``:
    any pipeline, its arrays traced or not, differentiated as ``kdax._runner.stage_grads`` says."""
    inputs, pipeline = diff
    bad, inputs = _isolated(call, inputs, cu)
    # (Whole, as the training step's forward: the two equal bit for bit.)
    o, final, *_ = _forward(call.static(pipeline.untiled()), *inputs, cu)
    return _isolation.poison_outputs(bad, o, final)


def _isolated(call: _Call, inputs, cu):
    """``(Bad, inputs with non-finite elements read as zero)``: non-finite inputs stay in
    their own sequence across devices too (``kdax._numerics.isolation``)."""
    opts = dict(call.options)
    Tl = inputs[0].shape[1]
    local_cu = None if cu is None else jnp.clip(cu - jax.lax.axis_index(call.axis) * Tl, 0, Tl)
    gate, sigmoid = bool(opts.get("use_gate_in_kernel", False)), bool(opts.get("use_beta_sigmoid_in_kernel", False))
    bad = _isolation.Bad(inputs[:5], local_cu, gate, sigmoid, axis=call.axis)
    return bad, (*_isolation.cleaner(gate, sigmoid)(inputs[:5]), *inputs[5:])


def _derived_fwd(call: _Call, pipeline, inputs, cu, bad):
    """The forward of a pipeline whose backward stages do not transpose its forward
    stages, and its VJP by ``jax.vjp`` through the sequence-parallel forward (as
    ``kdax._runner.vjp`` does on one device)."""
    def run(inputs_, pipe):
        o_, final_, *_ = _forward(call.static(pipe), *inputs_, cu)
        return o_, final_

    (o, final), vjp, swapped = _routes.derived_vjp(pipeline, run, inputs)
    sp = _spans(call.axis, inputs[0].shape[0], inputs[0].shape[1], cu)
    res = _routes.DerivedResiduals.of(vjp, swapped, o, final, inputs[0].shape[2])
    return _isolation.poison_outputs(bad, o, final), (res, None, sp, bad.where)


def _derived_bwd(res, sp: _Spans, where, primals, perturbed, do, dfinal, axis: str):
    """The derived backward on this device (``kdax._runner.routes.derived_gradients``).
    Under ``check_vma``, JAX's transpose of the forward has summed the cotangents of the
    replicated inputs (h0, A_log, dt_bias, the pipeline's arrays) over the devices
    already, so dh0's NaN for bad cotangents is marked alike on every device (marked per
    device, the copies were summed again: P times dh0); without it, shard_map's transpose
    sums each device's part."""
    out, d_pipe = _routes.derived_gradients(res, where, do, dfinal, sp.cu, axis)
    d_inputs = tuple(None if x is None or p is None else summed_like(x, p) for x, p in zip(out, primals))
    d_pipe = jax.tree.map(lambda x: x if x is None else summed_like(x, x), d_pipe)
    return d_inputs, _routes.pipeline_cotangent(perturbed, d_pipe, res.swapped)


@_sp_kda.def_fwd
def _sp_fwd(perturbed, diff, call: _Call, cu):
    inputs, pipeline = diff
    if _routes.backward_route(pipeline, one_device=False).derived:
        bad, inputs = _isolated(call, inputs, cu)
        return _derived_fwd(call, pipeline, inputs, cu, bad)
    check_perturbed(pipeline, perturbed[1], where="kdax.parallel's sequence-parallel chunk_kda")
    bad, inputs = _isolated(call, inputs, cu)
    # A training step runs the forward whole, as chunk_kda's own VJP does.
    static = call.static(pipeline.untiled())
    o, final, res, M, sp = _forward(static, *inputs, cu)
    if not dict(static.options).get("disable_recompute", False):
        res = eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda x: x is None)
    return _isolation.poison_outputs(bad, o, final), (res, M, sp, bad.where)


@_sp_kda.def_bwd
def _sp_bwd(residuals, cotangents, perturbed, diff, call: _Call, cu):
    res, M, sp, where = residuals
    primals, pipeline = diff
    do, dfinal = cotangents
    if isinstance(res, _routes.DerivedResiduals):
        return _derived_bwd(res, sp, where, primals, perturbed[1], do, dfinal, call.axis)
    static = call.static(pipeline.untiled())
    if do is None:
        do = jnp.zeros(primals[2].shape, res.h0.dtype)
    dfinal = jnp.zeros_like(res.h0) if dfinal is None else dfinal.astype(res.h0.dtype)
    # Non-finite cotangents: zero here, NaN in the gradients of their sequence up to them,
    # on the earlier devices too (kdax._numerics.isolation).
    do, poison = _isolation.clean_cotangents(do, dfinal, sp.cu, res.num_qk_heads, static.axis)
    dfinal = _isolation.finite_or_zero(dfinal)
    # Under shard_map's check_vma=False (q then varies over nothing), the transpose hands
    # each device 1/P of a replicated output's cotangent and sums the replicated inputs'
    # cotangents over the devices itself.
    checked = static.axis in varying_axes(primals[0])
    if not checked:
        dfinal = jax.lax.psum(dfinal, static.axis)
    N = res.h0.shape[0]
    own = _rows(sp.owns, dfinal)
    res = _with_cache(static, res)
    clean = _isolated(call, primals, cu)[1]
    if _routes.backward_route(static.pipeline, one_device=False).gate_vjp:  # (B5 as F1's VJP; B0-B4 hand-written)
        static = eqx.tree_at(lambda s: s.pipeline, static, _routes.gate_vjp_pipeline(static.pipeline, res, clean))
    # c: the gradient reaching the entering sequence's start from this device's own do/dht
    c = _pick(sp, sp.enters, _entry_gradient(static, res, do, own))
    # the gradient arriving at this device's exit from the devices after it
    d_exit = exclusive_prefix(jnp.swapaxes(M, -1, -2), c, static.axis, reverse=True, method=static.prefix,
                              live=_through(static.axis, *primals[0].shape[:2], cu))
    grads, parts = _backward_local(static, res, do, own + _spread(sp, sp.leaves, d_exit, N))
    grads = _isolation.poison_inputs(where, poison(grads))
    dh0 = _rows(~sp.enters, grads.initial_state)
    dh0 = jax.lax.psum(dh0, static.axis) if checked else dh0
    out = (grads.q, grads.k, grads.v, grads.g, grads.beta, dh0, grads.A_log, grads.dt_bias)
    d_inputs = tuple(None if x is None or p is None else summed_like(x, p) for x, p in zip(out, primals))
    # Stage arrays: the stage's VJP on this device's tokens. The pipeline is replicated:
    # under check_vma the VJP's own transpose of the implicit broadcast sums over the
    # devices; without it, shard_map's transpose does.
    return d_inputs, pipeline_gradients(pipeline.untiled(), perturbed[1], parts, res, clean)


def check_state_splits(pipeline) -> None:
    """Sequence parallel cuts each sequence's chunk recurrence at the device boundaries and
    joins the pieces by affine summaries: exact for an F4 of KDA's math alone. Any other
    F4 is a ``ValueError`` naming it and what to declare."""
    if not _routes.is_kda(pipeline.state):
        raise ValueError(
            f"pipeline: sequence parallel (seq_axis_name) splits each sequence's state recurrence between devices "
            f"and joins the pieces by affine summaries, exact only for an F4 whose state map is affine in its entry "
            f"state and whose pieces compose (KDA's); F4 `state` ({type(pipeline.state).__qualname__}) declares "
            f"math {pipeline.state.math!r}. If it computes KDA's state recurrence (a wrapper, another "
            f"implementation), declare math = kdax.stages.KDA on its class; otherwise run it on one device.")


def check_axis(axis):
    if not isinstance(axis, str):
        raise ValueError(f"seq_axis_name: expected the name of a mesh axis (a str), got {axis!r}.")
    try:
        jax.lax.axis_index(axis)
    except NameError as e:
        mesh = jax.sharding.get_abstract_mesh()
        names = tuple(getattr(mesh, "axis_names", ()) or ())
        raise ValueError(
            f"seq_axis_name: {axis!r} is not a mesh axis in scope (call chunk_kda inside "
            f"jax.shard_map over a mesh with that axis; axes in scope: {names})."
        ) from e


# Compiled when called in an eager jax.shard_map (kdax._platform.in_eager_shard_map).
_sp_kda_jit = eqx.filter_jit(_sp_kda)


def sp_chunk_kda(
    q, k, v, g, beta, *, seq_axis_name: str, pipeline=None, prefix: PrefixMethod = "auto",
    initial_state=None, output_final_state: bool = False, cu_seqlens=None,
    state_v_first: bool = False, A_log=None, dt_bias=None, **options,
):
    """``chunk_kda`` on this device's shard of the token axis (see
    ``kdax.chunk_kda(..., seq_axis_name=...)``)."""
    check_axis(seq_axis_name)
    P = jax.lax.axis_size(seq_axis_name)
    Tl = q.shape[1]
    cu = None
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, got {tuple(cu.shape)}.")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens: packed variable-length input needs B == 1 (q.shape[0]), got B={q.shape[0]}.")
        if not isinstance(cu_seqlens, jax.core.Tracer):
            c = np.asarray(cu_seqlens)
            if c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] != P * Tl:
                raise ValueError(
                    f"cu_seqlens: with seq_axis_name, the global offsets: non-decreasing from 0 to "
                    f"{P} devices x local T {Tl} = {P * Tl}, got {c.tolist()}."
                )
        else:
            # The global offsets, checked inside the compiled program (end: devices x local T).
            cu = checked_cu_seqlens(cu, P * Tl)
    h0 = initial_state
    if h0 is not None:
        h0 = jnp.asarray(h0)
        if state_v_first:
            h0 = jnp.swapaxes(h0, -1, -2)
    pipeline = default_pipeline() if pipeline is None else pipeline
    check_state_splits(pipeline)
    check_interpret_in_shard_map(pipeline, q, k, v, g, beta)
    call = _Call(seq_axis_name, prefix, tuple(sorted(options.items())))
    asarr = lambda x: None if x is None else jnp.asarray(x)
    inputs = (*map(asarr, (q, k, v, g, beta)), h0, asarr(A_log), asarr(dt_bias))
    o, final = (_sp_kda_jit if in_eager_shard_map(inputs) else _sp_kda)((inputs, pipeline), call, cu)
    if not output_final_state:
        return o, None
    return o, (jnp.swapaxes(final, -1, -2) if state_v_first else final)
