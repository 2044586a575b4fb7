"""``G`` as an unevaluated sum ``G + G_lo``, for float32 compute.

A float32 ``G`` (the chunk-local cumsum of log decays, up to ``C |floor|`` = 16384 in
magnitude at C = 128, the float32 floor being -128) carries an absolute error of about ``eps |G|``, and so does every
difference ``G_i - G_j`` formed from it: a relative error of ``eps |G|`` in each decay,
``|G| / 2``-fold the recurrence's, growing with C. F1 therefore rounds each token's log
decay to a grid, ``g = g_hi + g_lo`` with ``g_hi`` a multiple of ``2^-m``, ``m`` chosen so
that every partial sum of ``g_hi`` is a float32 integer multiple of ``2^-m`` (exact in
any summation order), and ``|g_lo| <= 2^-(m+1)``, whose cumsum is small and so accurate
to ~1e-9. It returns ``G = fl(G_hi + G_lo_sum)`` (the single G every stage has always
seen, now correctly rounded) and the remainder ``G_lo = G_hi + G_lo_sum - G``, so
``G + G_lo`` is the exact cumsum to ~1e-9. A stage that takes ``G_lo`` forms each exponent
as ``(G_i - G_j) + (G_lo_i - G_lo_j)``: a rounding relative to the difference itself, as
in the recurrence. float64 keeps one G (``G_lo`` is
None): its error, ``1e-16 |G|``, is far below every tolerance.
"""

import math
from typing import Optional

import jax
import jax.numpy as jnp

from ..ref import log_decay_floor


def grid_bits(dtype, C: int) -> Optional[int]:
    """``m``: multiples of ``2^-m`` of magnitude up to ``C |floor|`` (every partial sum of a
    chunk's clamped log decays, all of one sign) are exact in ``dtype``; None for float64
    (no split)."""
    if jnp.dtype(dtype) == jnp.float64:
        return None
    digits = jnp.finfo(dtype).nmant + 1  # float32: 24
    return digits - math.ceil(math.log2(C * abs(log_decay_floor(dtype))))


def split_log_decay(g, C: int, round_even=jnp.round):
    """``(g_hi, g_lo)`` with ``g_hi + g_lo == g`` exactly, ``g_hi`` on the grid of
    ``grid_bits`` and ``|g_lo| <= 2^-(m+1)``; ``g`` the clamped per-token log decay.
    ``round_even``: rounding to the nearest integer, ties to even (a kernel passes its
    own where ``jnp.round`` does not lower)."""
    m = grid_bits(g.dtype, C)
    step = 2.0**m  # a power of two: the scaling and the rounding are exact
    hi = round_even(g * step) / step
    return hi, g - hi


def exponent(x, y, x_lo=None, y_lo=None):
    """The exponent of the decay ``exp(x - y)`` (``x = G_i``, ``y = G_j``, i >= j, or an
    anchor between them): ``x - y``, or with the low parts ``(x - y) + (x_lo - y_lo)``
    clamped at 0 (a rounding of the low parts must not give a positive exponent).

    The clamp only removes a rounding, so its derivative is taken as 1 (``nonpositive``):
    code that JAX differentiates (``kdax._layouts.shared_states``' VJPs, the XLA-autodiff
    baseline) gets the decay's true derivative ``exp(x - y)`` with respect to ``x`` and
    ``y``, as the hand-written backward stages use it. With ``jnp.minimum``'s own
    derivative a difference that rounds to 0 (tiny log decays after larger ones) would
    lose half its gradient, one that rounds above 0 all of it."""
    if x_lo is None:
        return x - y
    return nonpositive((x - y) + (x_lo - y_lo))


@jax.custom_jvp
def nonpositive(d):
    """``min(d, 0)`` whose derivative is 1 everywhere (``exponent``). NaN stays NaN."""
    return jnp.minimum(d, 0.0)


@nonpositive.defjvp
def _nonpositive_jvp(primals, tangents):
    (d,), (t,) = primals, tangents
    return nonpositive(d), t
