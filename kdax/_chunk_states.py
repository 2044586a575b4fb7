"""``chunk_kda(..., return_intermediate_states=True)``: FLA's ``h``, the state at the start
of every chunk, beside ``o`` and the final state. Forward only, as FLA's (which asserts
inference mode): the serving path that caches states at chunk boundaries (prefix caching),
and the layer's ``return_intermediate_states``."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from ._config import KDAOptions
from ._numerics import isolation as _isolation
from ._platform import behind_barriers, traced
from ._runner.forward import initial_states
from ._runner.vjp import bad_inputs
from ._validate import domain_flag, final_out, prepare_options
from .ref import compute_dtype


@jax.custom_jvp
def _forward_only(x):
    return x


@_forward_only.defjvp
def _refuse_derivative(primals, tangents):
    raise ValueError(
        "return_intermediate_states: forward only (FLA's asserts inference mode); differentiate chunk_kda "
        "without it (the six-stage backward), and call it again with it for the states.")


def chunk_start_states(pipeline, q, k, v, g, beta, options: KDAOptions):
    """``(o [B, T, HV, V], final state or None, h)``: ``chunk_kda``'s outputs (non-finite
    inputs kept in their sequence, as there) and the state entering each chunk, float32
    (float64 for float64 inputs), ``[N, HV, V, K]``-style under ``state_v_first``:

    - dense: ``h [B, NC, HV, K, V]``, NC = ceil(T / chunk_size); ``h[:, 0]`` is the initial state;
    - packed (``cu_seqlens``): FLA's flat ``[1, NT, HV, K, V]``, each sequence's
      ceil(len / chunk_size) chunks in order, where JAX needs a static NT: kdax's bound on
      the chunks of any packing of T tokens, the rows after the last sequence's zero.

    A chunk whose start state met a non-finite input of its sequence is NaN, as the
    final state is. Differentiating raises (``_forward_only``)."""
    guard = lambda x: _forward_only(x) if isinstance(x, jax.core.Tracer) else x  # (only a tracer has tangents)
    q, k, v, g, beta = map(guard, (q, k, v, g, beta))
    options = dataclasses.replace(options, **{n: guard(getattr(options, n))
                                              for n in ("scale", "initial_state", "A_log", "dt_bias")})
    config, args, opts = prepare_options(q, k, v, g, beta, options, flagged=True)
    q, k, v, h0, cu = args[0], args[1], args[2], args[5], args[8]
    B, T, _, K = q.shape
    HV, V, C = v.shape[2], v.shape[-1], config.chunk_size
    if 0 in (B, T, K, V):  # (chunk_kda's answer: zero outputs, the states passed through)
        N = B if cu is None else cu.shape[0] - 1
        final = initial_states(h0, (N, HV, K, V), compute_dtype(*args[:6]))
        o, h = jnp.zeros(v.shape, q.dtype), jnp.zeros((B, -(-T // C), HV, K, V), final.dtype)
    else:
        domain = domain_flag(args[3], args[4], opts)
        args = (*behind_barriers(args[:8]), args[8])  # (arrays a jitted caller captured: not folded by XLA)
        pipeline = dataclasses.replace(pipeline.resolved(*args[:6]), share_chunks=False)
        o, final, h = (_states if traced((args, domain)) else _compiled_states)(pipeline, config, args, domain)
    return o, final_out(final, config, opts.state_v_first), jnp.swapaxes(h, -1, -2) if opts.state_v_first else h


def _states(pipeline, config, args, domain):
    bad, cu = bad_inputs(config, args[:8], args[8], domain), args[8]
    o, final, res = pipeline.run_forward(config, *args, clean=True)
    o, final = _isolation.poison_outputs(bad, o, final)
    h = res.read("h").astype(compute_dtype(*args[:6]))  # [B or 1, NC, HV, K, V]
    C = config.chunk_size
    return o, final, _dense_marks(h, bad.after, C) if cu is None else _packed_marks(h, bad.after, cu, C)


_compiled_states = eqx.filter_jit(_states)


def _nan_where(bad, h):
    """``h [R, NC, HV, K, V]`` NaN at the chunks and heads of ``bad [R, NC, HV]``."""
    return jnp.where(bad[..., None, None], jnp.asarray(jnp.nan, h.dtype), h)


def _dense_marks(h, after, C: int):
    """Chunk c > 0 starts after token ``c * C - 1``: NaN where that token is at or after
    its row's first token that made the state non-finite (``Bad.after [B, T, HV]``)."""
    NC = h.shape[1]
    ends = after[:, C - 1::C][:, : NC - 1]
    return _nan_where(jnp.concatenate([jnp.zeros_like(after[:, :1]), ends], axis=1), h)


def _packed_marks(h, after, cu, C: int):
    """FLA's flat chunk order: sequence s owns chunks ``first[s] ..`` (``count[s]`` of
    them); chunk j > 0 of s starts after token ``cu[s] + j * C - 1``. Rows past the last
    sequence's chunks are zero."""
    cu = jnp.asarray(cu, jnp.int32)
    count = (cu[1:] - cu[:-1] + C - 1) // C
    ends = jnp.cumsum(count)
    c = jnp.arange(h.shape[1], dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(ends, c, side="right"), 0, count.shape[0] - 1)
    j = c - (ends[s] - count[s])
    T = after.shape[1]
    prev = after[0, jnp.clip(cu[s] + j * C - 1, 0, max(T - 1, 0))]  # [NC, HV]
    live = c < ends[-1]
    h = jnp.where(live[None, :, None, None, None], h, jnp.zeros((), h.dtype))
    return _nan_where((live & (j > 0))[None, :, None] & prev[None], h)
