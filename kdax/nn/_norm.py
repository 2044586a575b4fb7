"""The gated RMSNorm of Kimi Linear / FLA (``FusedRMSNormGated`` with a sigmoid gate)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._numerics.arrays import at_least_float32, ranked


def gated_rms_norm(
    x: Float[Array, "*batch D"], gate: Float[Array, "*batch D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "*batch D"]:
    """``x / sqrt(mean(x**2) + eps) * weight * sigmoid(gate)`` over the last axis, in at
    least float32; returned in x's dtype."""
    dt = at_least_float32(x.dtype, gate.dtype, weight.dtype)
    xf = x.astype(dt)
    r = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (r * ranked(weight.astype(dt), r) * jax.nn.sigmoid(gate.astype(dt))).astype(x.dtype)
