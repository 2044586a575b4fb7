"""Affine summaries of a device's tokens and their exclusive prefix over the devices of
one mesh axis.

Over a span of one sequence the state update is affine, ``h_out = M h_in + b`` with
``M [K, K]`` and ``b [K, V]``; spans compose as ``(M2, b2) ∘ (M1, b1) = (M2 M1, M2 b1 + b2)``.
A span in which a sequence starts has ``M = 0`` there, so resets need no bookkeeping. The
backward runs the same scan in the other direction with ``(M^T, c)``.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._numerics.affine import apply_map as _apply, drop as _drop, scan_prefix as scan_prefix

PrefixMethod = Literal["auto", "gather", "doubling"]

# "auto" gathers the summaries for at most this many devices, above it the doubling scan
# (log2 P rounds of one ppermute each instead of one all-gather of P summaries).
GATHER_MAX_DEVICES = 8


def exclusive_prefix(
    M: Float[Array, "*batch K K"],
    b: Float[Array, "*batch K V"],
    axis_name: str,
    *,
    reverse: bool = False,
    method: PrefixMethod = "auto",
    live=None,
) -> Float[Array, "*batch K V"]:
    """The value entering each device along ``axis_name``, ``x`` advancing through
    device ``e`` as ``x <- M_e x + b_e`` in index order (``reverse``: from the last
    device down), starting from zero before the first device: on device ``d``,
    ``x_d = b_{d-1} + M_{d-1} b_{d-2} + ...`` (zero on the first device).

    ``method``: ``"gather"`` all-gathers the ``P`` summaries and scans them (one
    collective of ``P`` summaries); ``"doubling"`` is a Hillis-Steele scan with
    ``ceil(log2 P) + 1`` ppermutes of one summary each; ``"auto"`` gathers for
    ``P <= 8``. Composition runs in the summaries' dtype (float32 or float64).

    ``live [P, *batch]`` (bool, broadcastable; the same on every device, e.g. from the
    global ``cu_seqlens``; default all True): False for a device that no sequence runs
    through (one starts there, so its ``M`` is zero). The value entering such a device is
    dropped (a select), not multiplied by zero, so a sequence whose state or cotangent
    overflowed (huge finite inputs: inf) reaches no sequence past it (0 * inf is NaN)."""
    P = jax.lax.axis_size(axis_name)
    if method == "auto":
        method = "gather" if P <= GATHER_MAX_DEVICES else "doubling"
    if method not in ("gather", "doubling"):
        raise ValueError(f"prefix: expected 'auto', 'gather' or 'doubling', got {method!r}.")
    # In travel order (reversed with ``reverse``); the first device's entry is zero, so its
    # M never matters: not live there makes every prefix anchored at it not live.
    lives = jnp.broadcast_to(True if live is None else live, (P,) + M.shape[:-2])
    lives = (lives[::-1] if reverse else lives).at[0].set(False)
    t = P - 1 - jax.lax.axis_index(axis_name) if reverse else jax.lax.axis_index(axis_name)
    if P == 1:
        return jnp.zeros_like(b)
    M = _drop(lives[t], M)  # (zero by construction there, up to what an overflow made of it)
    if method == "gather":
        return _gather_prefix(M, b, lives, axis_name, reverse)
    return _doubling_prefix(M, b, lives, t, axis_name, reverse)


def _gather_prefix(M, b, lives, axis_name: str, reverse: bool):
    Ms, bs = (jax.lax.all_gather(x, axis_name) for x in (M, b))
    entries = scan_prefix(Ms, bs, reverse=reverse, live=lives[::-1] if reverse else lives)
    return jax.lax.dynamic_index_in_dim(entries, jax.lax.axis_index(axis_name), keepdims=False)


def _doubling_prefix(M, b, lives, t, axis_name: str, reverse: bool):
    P = jax.lax.axis_size(axis_name)
    step = -1 if reverse else 1
    pos = jnp.arange(P).reshape((P,) + (1,) * (lives.ndim - 1))

    def shift(x, o):
        # Device d receives from d - o (d + o in reverse); devices with no source get zeros.
        return jax.lax.ppermute(x, axis_name, [(i, i + step * o) for i in range(P) if 0 <= i + step * o < P])

    # (M, b) summarise the devices at travel positions t - o + 1 .. t, live if all of them are
    # (computed here from the flags every device holds: no collective).
    window = lambda lo, hi: jnp.all(jnp.where((pos >= lo) & (pos <= hi), lives, True), axis=0)
    o = 1
    while o < P:  # inclusive prefix, ceil(log2 P) rounds
        Mp, bp = shift((M, b), o)
        live = window(t - o + 1, t)
        M, b = _apply(M, _drop(live, Mp)), _apply(M, _drop(live, bp)) + b
        o *= 2
    return shift(b, 1)
