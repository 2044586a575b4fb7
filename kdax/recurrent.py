"""Fused recurrent KDA: the token-by-token path for inference, decoding and varlen."""

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from ._config import KDAOptions
from ._config import state_v_first_of
from ._numerics.arrays import vary_like
from ._annotations import ALogIn, ArrayIn, Beta, CuSeqlensIn, Float, Gate, QK, Scalar, State, Values, typecheck
from ._validate import Dims, _value_of, checked_domain, validate
from .parallel._shard import routed
from .ref import beta_activation, compute_dtype, expand_heads, kda_gate, l2norm


# FLA's head-wise beta: one write strength per value column.
BetaHeadwise = Float[ArrayIn, "B T HV V"]


def activate_inputs(q, k, g, beta, dt, *, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
                    dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """Apply the in-kernel activations in the compute dtype (plain jnp, autodiff-able)."""
    q, k, g, beta = (x.astype(dt) for x in (q, k, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, None if A_log is None else A_log.astype(dt),
                     None if dt_bias is None else dt_bias.astype(dt), lower_bound)
    beta = beta_activation(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return q, k, g, beta


def _fused_step(S, q_t, k_t, v_t, g_t, b_t, scale):
    """``kdax.ref.recurrent_step`` (the same state and output) reading ``S [..., K, V]`` once for
    both products and once more to write the new state, where the readable step stored the
    decayed state and read it three times: with ``e = exp(g_t)``, ``k^T (e S) = (e k)^T S``,
    and ``q^T S'`` for ``S' = e S + k u^T`` is ``(e q)^T S + (q . k) u`` (a decode step's state
    update 2x less memory traffic). ``b_t`` ``[...]`` or head-wise ``[..., V]``."""
    e = jnp.exp(g_t)
    kq = jnp.stack([e * k_t, e * q_t], axis=-2)  # [..., 2, K]
    pred, oS = jnp.moveaxis(jnp.einsum("...ik,...kv->...iv", kq, S, precision="highest"), -2, 0)
    u = (b_t if b_t.ndim == v_t.ndim else b_t[..., None]) * (v_t - pred)
    S = S * e[..., :, None] + k_t[..., :, None] * u[..., None, :]
    qk = jnp.sum(q_t * k_t, axis=-1, keepdims=True)
    return S, scale * (oS + qk * u)


def _varlen_scan(xs, h0, cu_seqlens, scale, branches: Optional[bool] = None):
    """One sequence-resetting scan over packed tokens (B == 1). ``h0``: ``[N, HV, K, V]``.
    ``branches``: load and store the states in branches (None: on CPU; see below)."""
    T = xs[0].shape[0]
    N = h0.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_seqlens, t, side="right") - 1, 0, N - 1)
    is_first = t == cu_seqlens[seq]
    is_last = t == cu_seqlens[seq + 1] - 1

    # On CPU a sequence's first token loads its state and its last stores it in branches:
    # selects over the whole state at every token took 4.7x the time for 8 sequences in 1024
    # tokens. Elsewhere selects: a GPU's branch reads its predicate on the host, every token.
    branches = jax.default_backend() == "cpu" if branches is None else branches
    if branches:
        load = lambda first, s, S: jax.lax.cond(first, lambda S: h0[s].astype(S.dtype), lambda S: S, S)
        store = lambda last, s, S, final: jax.lax.cond(last, lambda f: f.at[s].set(S), lambda f: f, final)
    else:
        load = lambda first, s, S: jnp.where(first, h0[s], S)
        store = lambda last, s, S, final: final.at[s].set(jnp.where(last, S, final[s]))

    def step(carry, x):
        S, final = carry
        (q_t, k_t, v_t, g_t, b_t), s, first, last = x
        S, o_t = _fused_step(load(first, s, S), q_t, k_t, v_t, g_t, b_t, scale)
        return (S, store(last, s, S, final)), o_t

    # Sequences of length 0 are never visited, so their final state stays h0.
    (_, final), o = jax.lax.scan(step, vary_like((h0[0], h0), xs, h0), ((xs, seq, is_first, is_last)))
    return o, final


@typecheck
@routed  # sharded over an Explicit mesh: per shard, decided before the body
def fused_recurrent_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Union[Beta, BetaHeadwise],
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, "_"]] = None,
    scale: Optional[Scalar] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[Scalar] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[CuSeqlensIn] = None,
    *,
    transpose_state_layout: Optional[bool] = None,
    check_inputs: bool = True,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "N HV _S1 _S2"]]]:
    """KDA token by token (a ``lax.scan``); differentiable by JAX autodiff and jit-safe.
    FLA's ``fused_recurrent_kda`` arguments, order and layouts (the arguments after
    ``beta`` may be given positionally in FLA's order).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` (log decay, or raw gate
    input with ``use_gate_in_kernel``); beta ``[B, T, HV]``, or ``[B, T, HV, V]`` (FLA's
    head-wise beta: ``S += k (beta * (v - S^T k))^T``, one strength per value column); initial/final state
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), N = B or the number of
    packed sequences with ``cu_seqlens`` ``[N + 1]`` (B must be 1; its values are data, so
    new values do not recompile). Returns ``o [B, T, HV, V]`` in v's dtype and the final
    state (float32, or float64 for float64 inputs) when ``output_final_state``. The
    options are ``chunk_kda``'s (``kdax.KDAOptions``) without ``safe_gate``, ``chunk_size``
    and ``disable_recompute``; ``transpose_state_layout`` is FLA's deprecated alias of
    ``state_v_first``; ``check_inputs`` as ``chunk_kda``'s (g's and beta's domain checked
    eagerly before any kernel, under ``jit`` inside the compiled program unless False).
    Called eagerly, the checks run on the caller's values, then one compiled program
    cached by shapes, dtypes and options.
    """
    options = KDAOptions(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first_of(state_v_first, transpose_state_layout), check_inputs=check_inputs,
    )
    # Every check runs here, on the caller's values, before any kernel: check_domain reads
    # concrete g and beta, check_cu_seqlens concrete offsets (a compiled program would see
    # neither).
    dims, options = validate(q, k, v, g, beta, options, chunked=False)
    g, beta = checked_domain(g, beta, options)  # (traced values: inside the program; concrete: done)
    arrays = (q, k, v, g, beta, initial_state, options.A_log, dt_bias, options.cu_seqlens)
    static = _Static(dims, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                     None if lower_bound is None else float(lower_bound), use_beta_sigmoid_in_kernel,
                     allow_neg_eigval, output_final_state, options.state_v_first)
    # Called eagerly: one compiled program, cached by shapes, dtypes and options, as
    # chunk_kda's eager calls are (kdax._runner.vjp.apply). Op by op, the scan's body was
    # retraced and recompiled at every call: 0.07-0.17 s a call against 0.1-2 ms jitted.
    # Under a transformation (jit, vmap, ...), traced into the caller's program as is.
    run = _compiled_recurrent if concrete_call(arrays) else _recurrent
    return run(*arrays, static)


def concrete_call(*trees) -> bool:
    """Whether a call with these arguments runs eagerly: no array in ``trees`` is traced,
    or each traced one is an eager ``jax.grad``/``jax.jvp`` tracer over a concrete value
    (a compiled call is then differentiated as one program; under ``jit`` or ``vmap`` a
    tracer has no concrete value)."""
    return all(_value_of(x) is not None for x in jax.tree.leaves(trees))


class _Static(NamedTuple):
    """The validated options that change what is traced: the compiled program's static
    argument. (A tuple, not a ``KDAConfig``: building and hashing an ``eqx.Module`` cost
    ~0.05 ms a call, half of a jitted decode step at B=8, H=4, K=V=64 on the CPU.)"""

    dims: Dims
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    lower_bound: Optional[float]
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    output_final_state: bool
    state_v_first: bool


def _recurrent(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, static: _Static):
    """``fused_recurrent_kda``'s computation on validated inputs (``A_log`` ``[HV]`` or
    None, ``cu_seqlens`` int32 or None) with the options ``static``."""
    dims = static.dims
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q, k, g, b = activate_inputs(
        q, k, g, beta, dt, use_qk_l2norm_in_kernel=static.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=static.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=static.lower_bound, use_beta_sigmoid_in_kernel=static.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=static.allow_neg_eigval,
    )
    q, k = expand_heads(q, dims.HV), expand_heads(k, dims.HV)
    if initial_state is None:
        h0 = jnp.zeros((dims.N, dims.HV, dims.K, dims.V), dt)
    else:
        h0 = jnp.asarray(initial_state).astype(dt)  # (a numpy array cannot be indexed by a tracer)
        if static.state_v_first:
            h0 = jnp.swapaxes(h0, -1, -2)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v.astype(dt), g, b))
    if cu_seqlens is None:
        final, o = jax.lax.scan(lambda S, x: _fused_step(S, *x, dims.scale), vary_like(h0, xs, h0), xs)
    else:
        xs = tuple(x[:, 0] for x in xs)
        o, final = _varlen_scan(xs, h0, jnp.asarray(cu_seqlens, jnp.int32), dims.scale)
        o = o[:, None]
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    if not static.output_final_state:
        return o, None
    return o, (jnp.swapaxes(final, -1, -2) if static.state_v_first else final)


# jax.jit, not eqx.filter_jit: every argument is an array or None, and filter_jit's
# partitioning of them cost ~0.03 ms more a call.
_compiled_recurrent = jax.jit(_recurrent, static_argnums=9)
