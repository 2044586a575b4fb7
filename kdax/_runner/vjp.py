"""``chunk_kda``'s derivative: an ``eqx.filter_custom_vjp`` whose forward is the pipeline's
(untiled) and whose backward is the six-stage backward, or, where the backward stages do
not transpose the forward stages (``kdax._runner.routes``), ``jax.vjp`` through the
forward stages. Stage arrays: ``kdax._runner.stage_grads``; non-finite values:
``kdax._numerics.isolation``."""

import equinox as eqx
import jax
import jax.numpy as jnp

from . import output_vjp as _output_vjp
from . import routes as _routes
from .._config import KDAConfig, KDAOptions
from .._errors import reverse_mode_only
from .._layouts import tokens as _tokens
from .._numerics import isolation as _isolation
from .._numerics.arrays import varying_axes
from .._platform import behind_barriers, traced
from .._stage_protocol.capabilities import capabilities
from .._validate import domain_flag, final_out, prepare_options
from ..ref import compute_dtype
from .forward import initial_states
from .runner import active_recordings
from .stage_grads import check_perturbed, pipeline_gradients


@eqx.filter_custom_vjp
def differentiable(diff, config: KDAConfig, cu_seqlens, domain):
    """``(o, final)`` of ``diff = ((q, k, v, g, beta, h0, A_log, dt_bias), pipeline)``;
    ``config``, ``cu_seqlens`` and ``domain`` (``domain_flag``) are not differentiated."""
    inputs, pipeline = diff
    bad = bad_inputs(config, inputs, cu_seqlens, domain)
    o, final, _ = pipeline.run_forward(config, *inputs, cu_seqlens, clean=True, entries=True)
    return _isolation.poison_outputs(bad, o, final)


def bad_inputs(config: KDAConfig, inputs, cu_seqlens, domain):
    # Non-finite inputs (and packed initial states, which may enter shared chunks) read as
    # zero, their sequence's outputs NaN; the domain check rides on the same masks.
    entering = None if cu_seqlens is None else inputs[5]
    return _isolation.Bad(inputs[:5], cu_seqlens, config.use_gate_in_kernel, config.use_beta_sigmoid_in_kernel,
                          entering=entering, flag=domain)


def _concrete(*trees) -> bool:
    """Whether a rule runs eagerly: no array traced (``kdax._platform.traced``), no stage call being recorded."""
    return not active_recordings() and not traced(trees)


def _compiled_when_eager(fn):
    """``fn`` run as one compiled program where it runs eagerly (``_concrete`` arguments; an
    eager ``jax.grad`` reaches the rules with concrete arrays, and op by op a rule took 13 s
    a call at T=512), as is where traced."""
    compiled = eqx.filter_jit(fn)
    return lambda *args: (compiled if _concrete(*args) else fn)(*args)


@differentiable.def_fwd
def _vjp_fwd(perturbed, diff, config: KDAConfig, cu_seqlens, domain):
    if not _concrete(diff, cu_seqlens, domain):  # (traced: no wrapper frame, for derived_vjp's stacklevel)
        return _fwd(perturbed, diff, config, cu_seqlens, domain)
    if _routes.backward_route(diff[1]).derived:
        _routes.warn_derived(diff[1])  # (once, here: a cached trace would not say it)
    return _compiled_fwd(perturbed, diff, config, cu_seqlens, domain)


def _fwd(perturbed, diff, config: KDAConfig, cu_seqlens, domain):
    inputs, pipeline = diff
    bad = bad_inputs(config, inputs, cu_seqlens, domain)
    if _routes.backward_route(pipeline).derived:
        run = lambda inputs_, pipe: pipe.run_forward(config, *inputs_, cu_seqlens, clean=True, entries=True)[:2]
        (o, final), vjp, swapped = _routes.derived_vjp(pipeline, run, inputs)
        for rec in active_recordings():
            rec.derived = (_routes.mismatches(pipeline), swapped)
        res = _routes.DerivedResiduals.of(vjp, swapped, o, final, inputs[0].shape[2])
        return _isolation.poison_outputs(bad, o, final), (res, bad.where)
    got = check_perturbed(pipeline, perturbed[1])
    # Untiled: XLA shares F3/F4 with B0 (tiled was ~15% slower). A differentiated F1 array
    # keeps states from entering shared chunks (their decay is KDA's gate outside F1).
    o, final, res = pipeline.untiled().run_forward(config, *inputs, cu_seqlens, clean=True,
                                                   entries="gate" not in got)
    if not config.disable_recompute:
        # Keep what FLA keeps (inputs, G, Aqk, Akk, l2norm statistics, h0); B0 rebuilds the rest.
        res = eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda x: x is None)
    return _isolation.poison_outputs(bad, o, final), (res, bad.where)


_compiled_fwd = eqx.filter_jit(_fwd)


@differentiable.def_bwd
@_compiled_when_eager
def _vjp_bwd(residuals, cotangents, perturbed, diff, config: KDAConfig, cu_seqlens, domain):
    del domain  # (read by the forward's masks, which the residuals keep)
    res, where = residuals
    inputs, pipeline = diff
    do, dht = cotangents
    do, dht = behind_barriers((do, dht if config.output_final_state else None), always=True)  # (constant: captured w)
    if isinstance(res, _routes.DerivedResiduals):  # the derived backward (kdax._runner.routes)
        out, d_pipe = _routes.derived_gradients(res, where, do, dht, cu_seqlens)
        return out, _routes.pipeline_cotangent(perturbed[1], d_pipe, res.swapped)
    if do is None:  # only the final state carries a loss
        do = jnp.zeros(res.o_shape(), res.h0.dtype)
    # A non-finite cotangent stays in its sequence (kdax._numerics.isolation); a B3/B5 that
    # writes the call's gradients puts the NaN in itself (final_in_stages).
    route = _routes.backward_route(pipeline)
    do, poison = _isolation.clean_cotangents(do, dht, cu_seqlens, res.num_qk_heads)
    final = None if route.output_vjp or not final_in_stages(pipeline, res) else _tokens.FinalGrads(
        poison.masks(where, res.layout.chunk_size), res.in_dtypes[:5])
    clean = (*_isolation.cleaner_of(config)(inputs[:5]), *inputs[5:])
    bwd = _routes.gate_vjp_pipeline(pipeline, res, clean) if route.gate_vjp else pipeline
    if route.output_vjp:  # F5's transpose by jax.vjp; B0, B2-B5 hand-written
        grads, parts = _output_vjp.backward(bwd, res, do, dht)
    else:
        grads, parts = bwd.backward_with_parts(res, do, dht, final)
    if final is None:
        grads = _isolation.poison_inputs(where, poison(grads))
    else:  # (q's to beta's: final already, in the inputs' dtypes)
        grads = poison.states(grads)
    out = (grads.q, grads.k, grads.v, grads.g, grads.beta, grads.initial_state, grads.A_log, grads.dt_bias)
    d_inputs = tuple(None if d is None or x is None else summed_like(x, jax.typeof(p), d)
                     for x, p, d in zip(out, inputs, res.in_dtypes))
    return d_inputs, pipeline_gradients(pipeline, perturbed[1], parts, res, clean)


def summed_like(ct, primal, dtype=None):
    """``ct`` summed over the ``jax.shard_map`` axes it varies over and ``primal`` (an array
    or its type) does not: an input replicated beside tokens sharded over them, e.g. A_log."""
    extra = tuple(sorted(varying_axes(jax.typeof(ct)) - varying_axes(primal)))  # (types: the values stay here)
    return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype if dtype is None else dtype)


def final_in_stages(pipeline, res) -> bool:
    """Whether B3 or B5 write the gradients of q to beta as the call's results
    (``FinalGrads``): they declare ``final_grads``, the views fit and H == HV."""
    writes = any(capabilities(type(getattr(pipeline, n))).final_grads for n in ("wy_dqkg", "gate_bwd"))
    return writes and _tokens.views_fit(res.layout) and res.num_qk_heads == res.v.shape[1]


def apply(pipeline, q, k, v, g, beta, options: KDAOptions):
    """The single-device call behind ``chunk_kda``: validation, then ``differentiable``.
    Returns ``(o, final state or None)`` in ``chunk_kda``'s layouts."""
    config, args, opts = prepare_options(q, k, v, g, beta, options, flagged=True)
    domain = domain_flag(args[3], args[4], opts)  # (g and beta as given: checked eagerly where concrete)
    (q, k, v, g, beta, h0, A_log, dt_bias), cu = behind_barriers(args[:8]), args[8]
    pipeline = pipeline.resolved(q, k, v, g, beta, h0)
    B, T, _, K = q.shape
    if 0 in (B, T, K, v.shape[-1]):
        # Nothing to do: o is zero, every state (and its gradient) passes through.
        N = v.shape[0] if cu is None else cu.shape[0] - 1
        final = initial_states(h0, (N, v.shape[2], K, v.shape[-1]), compute_dtype(q, k, v, g, beta, h0))
        return jnp.zeros(v.shape, q.dtype), final_out(final, config, opts.state_v_first)
    # Eager: one compiled program (op by op: 8 s a call at T = 2048, against 0.05 s); traced,
    # as is (a nested jit made the jitted training step 8-14% slower); never while recording.
    diff = ((q, k, v, g, beta, h0, A_log, dt_bias), pipeline)
    o, final = _differentiable(diff, config, cu, domain)
    return o, final_out(final, config, opts.state_v_first)


_differentiable = reverse_mode_only(_compiled_when_eager(differentiable))
