"""The oracle: KDA token by token (``lax.scan``), FLA's argument order and semantics."""

from typing import Optional

import jax
import jax.numpy as jnp

from .._annotations import ArrayIn, Beta, Float, Gate, QK, State, Values, typecheck


def compute_dtype(*xs):
    """float64 if any input is float64, else float32 (bf16/fp16 accumulate in float32)."""
    return jnp.float64 if any(x is not None and x.dtype == jnp.float64 for x in xs) else jnp.float32


HIGHEST = jax.lax.Precision.HIGHEST


def expand_heads(x, hv: int):
    """``[B, T, H, ...] -> [B, T, HV, ...]``: value head i reads q/k head i // (HV // H)."""
    return jnp.repeat(x, hv // x.shape[2], axis=2) if x.shape[2] != hv else x


def recurrent_step(S, q_t, k_t, v_t, g_t, b_t, scale):
    """One step of the recurrence on ``S [..., K, V]``; returns the new state and output.
    ``b_t`` is ``[...]`` (one beta per head) or ``[..., V]`` (head-wise beta)."""
    S = S * jnp.exp(g_t)[..., :, None]
    # HIGHEST: float32 products on GPUs default to TF32 (10-bit mantissa)
    pred = jnp.einsum("...k,...kv->...v", k_t, S, precision=HIGHEST)
    if b_t.ndim == v_t.ndim:  # head-wise beta [..., V] (FLA's): one write strength per value column
        S = S + k_t[..., :, None] * (b_t * (v_t - pred))[..., None, :]
    else:
        S = S + (b_t[..., None] * k_t)[..., :, None] * (v_t - pred)[..., None, :]
    o_t = scale * jnp.einsum("...k,...kv->...v", q_t, S, precision=HIGHEST)
    return S, o_t


@typecheck
def naive_recurrent_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "B HV K V"]]]:
    """Reference recurrence: ``S_t = Diag(exp(g_t)) S_{t-1}; S_t += beta_t k_t (v_t -
    S_t^T k_t)^T; o_t = scale S_t^T q_t``. q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g ``[B, T, HV, K]``; beta ``[B, T, HV]``; state ``[B, HV, K, V]``. Exact in float64."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    q, k = expand_heads(q, HV).astype(dt), expand_heads(k, HV).astype(dt)
    S0 = jnp.zeros((B, HV, K, V), dt) if initial_state is None else initial_state.astype(dt)
    xs = tuple(jnp.moveaxis(x.astype(dt), 1, 0) for x in (q, k, v, g, beta))

    def step(S, x):
        return recurrent_step(S, *x, scale)

    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), (S if output_final_state else None)
