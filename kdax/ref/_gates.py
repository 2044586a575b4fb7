"""Input activations as plain, differentiable jnp (the oracles for the gate stage), and
the per-token log decay the chunked stages see (``activated_gate``: F1's, and the shared
layout's for the states entering its chunks).

Shapes: ``g_raw`` ``[..., HV, K]`` (any leading dims), ``A_log`` ``[HV]``, ``dt_bias``
``[HV * K]``; ``x`` of ``l2norm`` ``[..., D]``.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._annotations import ALogIn, Array, ArrayIn, Float, Scalar, typecheck
from .._config import KDAConfig

L2NORM_EPS = 1e-6

# The floor on a token's log decay in the chunked pipelines, per compute dtype: exp(floor)
# underflows to exactly zero (float32: e^-128 < 1.4e-45, the smallest subnormal;
# float64: e^-1024 < 4.9e-324), and so does every exponent that crosses a floored token,
# so a gate at or below the floor (-inf included) forgets its channel exactly, as the
# recurrence's exp(g) = 0 does, whatever the state held. The floor keeps the chunk cumsum
# G finite (|G| <= C |floor|; -inf would give inf - inf = NaN), and float32's hi/lo split
# of G (kdax._numerics.hilo) keeps the differences after a floored token exact.
LOG_DECAY_FLOOR = {"float32": -128.0, "float64": -1024.0}


def log_decay_floor(dtype) -> float:
    """The floor on a token's log decay for G computed in ``dtype`` (float32 or float64)."""
    return LOG_DECAY_FLOOR["float64" if jnp.dtype(dtype) == jnp.float64 else "float32"]


def clamp_log_decay(g):
    """``max(g, floor)``: any gate in [-inf, 0] gives a finite log decay (NaN stays NaN).
    A token at or below the floor resets its channel exactly: exp(floor) is 0 in the dtype."""
    return jnp.maximum(g, jnp.asarray(log_decay_floor(g.dtype), g.dtype))


def _per_head(A_log, x):
    """``exp(A_log)`` ``[..., HV, 1]`` at x's rank (explicit: a user's program may make
    implicit rank promotion an error)."""
    return jax.lax.broadcast_to_rank(jnp.exp(A_log.reshape(-1).astype(x.dtype))[:, None], x.ndim)


def _with_bias(g_raw, dt_bias):
    if dt_bias is None:
        return g_raw
    hv, kd = g_raw.shape[-2:]
    return g_raw + jax.lax.broadcast_to_rank(dt_bias.reshape(hv, kd).astype(g_raw.dtype), g_raw.ndim)


def softplus_gate(g_raw, A_log, dt_bias=None):
    """``g = -exp(A_log[h]) * softplus(g_raw + dt_bias)``."""
    x = _with_bias(g_raw, dt_bias)
    # A_log [HV], or any shape holding HV values (FLA's [1, 1, HV, 1])
    return -_per_head(A_log, x) * jax.nn.softplus(x)


def lower_bound_gate(g_raw, lower_bound: float, A_log=None, dt_bias=None):
    """``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))`` (no ``exp(A_log)``
    factor when ``A_log`` is None)."""
    x = _with_bias(g_raw, dt_bias)
    if lower_bound == -jnp.inf:  # forget everything, whatever the input (-inf * sigmoid can be NaN)
        return jnp.full_like(x, -jnp.inf)
    if A_log is not None:
        x = _per_head(A_log, x) * x
    return lower_bound * jax.nn.sigmoid(x)


@typecheck
def kda_gate(
    g_raw: Float[ArrayIn, "*batch HV K"],
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, " _"]] = None,
    lower_bound: Optional[Scalar] = None,
) -> Float[Array, "*batch HV K"]:
    """The in-kernel gate: lower-bound form whenever ``lower_bound`` is set, else softplus
    (``A_log`` ``[HV]`` or ``[1, 1, HV, 1]``, ``dt_bias`` ``[HV * K]``)."""
    HV, K = g_raw.shape[-2:]
    if dt_bias is not None and tuple(dt_bias.shape) != (HV * K,):
        raise ValueError(f"dt_bias: expected shape [HV * K] = ({HV * K},) for g_raw [..., {HV}, {K}], "
                         f"got {tuple(dt_bias.shape)}.")
    if lower_bound is not None:
        return lower_bound_gate(g_raw, lower_bound, A_log, dt_bias)
    if A_log is None:
        raise ValueError("A_log: required by the softplus gate (lower_bound is None).")
    return softplus_gate(g_raw, A_log, dt_bias)


# -- FLA's gate functions (fla.ops.kda.gate), by their names ---------------------------


@typecheck
def fused_kda_gate(
    g: Float[ArrayIn, "*batch HV K"],
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, " _"]] = None,
    lower_bound: Optional[Scalar] = None,
    output_dtype: Optional[DTypeLike] = None,
) -> Float[Array, "*batch HV K"]:
    """FLA's ``fused_kda_gate``: ``kda_gate`` computed in float32 (float64 for float64 ``g``)
    whatever the inputs' dtypes, returned in ``output_dtype`` (None: that dtype, as FLA's
    default float32; a bf16 gate would round the log decays to 3 significant digits).
    ``A_log`` None needs ``lower_bound``, as in FLA."""
    dt = jnp.dtype(jnp.float64 if g.dtype == jnp.float64 else jnp.float32)
    up = lambda x: None if x is None else jnp.asarray(x).astype(dt)
    return kda_gate(up(g), up(A_log), up(dt_bias), lower_bound).astype(dt if output_dtype is None else output_dtype)


def naive_kda_gate(g: Float[ArrayIn, "*batch HV K"], A_log: ALogIn, dt_bias: Optional[Float[ArrayIn, " _"]] = None,
                   output_dtype: Optional[DTypeLike] = None) -> Float[Array, "*batch HV K"]:
    """FLA's ``naive_kda_gate``: ``-exp(A_log[h]) * softplus(g + dt_bias)`` (``fused_kda_gate``)."""
    return fused_kda_gate(g, A_log, dt_bias, None, output_dtype)


def naive_kda_lowerbound_gate(g: Float[ArrayIn, "*batch HV K"], A_log: Optional[ALogIn] = None,
                              dt_bias: Optional[Float[ArrayIn, " _"]] = None, lower_bound: Scalar = -5.0,
                              output_dtype: Optional[DTypeLike] = None) -> Float[Array, "*batch HV K"]:
    """FLA's ``naive_kda_lowerbound_gate``: ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias))``
    (without the ``exp(A_log)`` factor when ``A_log`` is None; ``fused_kda_gate``)."""
    return fused_kda_gate(g, A_log, dt_bias, lower_bound, output_dtype)


def l2norm(x, eps: float = L2NORM_EPS):
    """``x / sqrt(sum(x**2, -1) + eps)``."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def beta_activation(beta, use_sigmoid: bool, allow_neg_eigval: bool):
    """``sigmoid(beta)`` (times 2 with ``allow_neg_eigval``) when ``use_sigmoid``; otherwise
    beta is taken as given (already in (0, 1), or (0, 2) with ``allow_neg_eigval``)."""
    if not use_sigmoid:
        return beta
    b = jax.nn.sigmoid(beta)
    return 2.0 * b if allow_neg_eigval else b


# -- the chunked stages' per-token log decay ------------------------------------------

_HeadsLast = lambda x: jnp.moveaxis(x, 1, -2)  # [R, HV, NC, C, K] -> [R, NC, C, HV, K]
_HeadsBack = lambda x: jnp.moveaxis(x, -2, 1)


# The log decay of a token that starts a sequence inside a shared chunk. The other stages
# mask every term across a sequence start to exact zeros, so the value only has to keep G
# non-increasing; a small one (not the floor's) keeps G small, so float64's single G
# keeps its low bits in the sequences after it.
RESET_LOG_DECAY = {"float32": -20.0, "float64": -60.0}


def reset_log_decay(dtype) -> float:
    return RESET_LOG_DECAY["float64" if jnp.dtype(dtype) == jnp.float64 else "float32"]


def activated_gate(config: KDAConfig, g, A_log, dt_bias, valid, reset=None):
    """The per-token log decay in the chunked layout, what F1 of KDA's math computes: raw
    ``g`` ``[R, HV, NC, C, K]`` or the in-kernel gate of it (``A_log``, ``dt_bias``,
    ``config``'s options), clamped at the dtype's floor (``clamp_log_decay``), zero where
    ``valid`` ``[R, NC, C]`` is False; ``reset_log_decay`` at ``reset`` ``[R, NC, C]``
    tokens (a sequence start inside a shared chunk: ``kdax._layouts.layout.make_shared_layout``)."""
    if config.use_gate_in_kernel:
        g = _HeadsBack(kda_gate(_HeadsLast(g), A_log, dt_bias, config.lower_bound))
    g = clamp_log_decay(g)
    if reset is not None:
        # A NaN or inf gate stays (it then reaches G from its own row on, as any).
        floor = jnp.where(jnp.isfinite(g), jnp.asarray(reset_log_decay(g.dtype), g.dtype), g)
        g = jnp.where(reset[:, None, :, :, None], floor, g)
    return jnp.where(valid[:, None, :, :, None], g, 0.0)
