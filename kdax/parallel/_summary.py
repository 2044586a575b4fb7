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

from .._numerics.affine import apply_map as _apply, scan_prefix as scan_prefix

PrefixMethod = Literal["auto", "gather", "doubling"]

# "auto" gathers the summaries for at most this many devices, above it the doubling scan
# (log2 P rounds of one ppermute each instead of one all-gather of P summaries).
GATHER_MAX_DEVICES = 8


def _first_in_travel(axis_name: str, reverse: bool):
    d, P = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    return d == (P - 1 if reverse else 0)


def exclusive_prefix(
    M: Float[Array, "*batch K K"],
    b: Float[Array, "*batch K V"],
    axis_name: str,
    *,
    reverse: bool = False,
    method: PrefixMethod = "auto",
) -> Float[Array, "*batch K V"]:
    """The value entering each device along ``axis_name``, ``x`` advancing through
    device ``e`` as ``x <- M_e x + b_e`` in index order (``reverse``: from the last
    device down), starting from zero before the first device: on device ``d``,
    ``x_d = b_{d-1} + M_{d-1} b_{d-2} + ...`` (zero on the first device).

    ``method``: ``"gather"`` all-gathers the ``P`` summaries and scans them (one
    collective of ``P`` summaries); ``"doubling"`` is a Hillis-Steele scan with
    ``ceil(log2 P) + 1`` ppermutes of one summary each; ``"auto"`` gathers for
    ``P <= 8``. Composition runs in the summaries' dtype (float32 or float64)."""
    P = jax.lax.axis_size(axis_name)
    if method == "auto":
        method = "gather" if P <= GATHER_MAX_DEVICES else "doubling"
    if method not in ("gather", "doubling"):
        raise ValueError(f"prefix: expected 'auto', 'gather' or 'doubling', got {method!r}.")
    # The first device's entry is zero, so its M never matters: M = 0 there makes every
    # prefix anchored at the first device have M = 0, and composing such a prefix with
    # the zeros a ppermute delivers past the edge of the mesh leaves it unchanged.
    M = jnp.where(_first_in_travel(axis_name, reverse), jnp.zeros_like(M), M)
    if P == 1:
        return jnp.zeros_like(b)
    if method == "gather":
        return _gather_prefix(M, b, axis_name, reverse)
    return _doubling_prefix(M, b, axis_name, reverse)


def _gather_prefix(M, b, axis_name: str, reverse: bool):
    Ms = jax.lax.all_gather(M, axis_name)
    bs = jax.lax.all_gather(b, axis_name)
    entries = scan_prefix(Ms, bs, reverse=reverse)
    return jax.lax.dynamic_index_in_dim(entries, jax.lax.axis_index(axis_name), keepdims=False)


def _doubling_prefix(M, b, axis_name: str, reverse: bool):
    P = jax.lax.axis_size(axis_name)
    step = -1 if reverse else 1

    def shift(x, o):
        # Device d receives from d - o (d + o in reverse); devices with no source get zeros.
        return jax.lax.ppermute(x, axis_name, [(i, i + step * o) for i in range(P) if 0 <= i + step * o < P])

    o = 1
    while o < P:  # inclusive prefix, ceil(log2 P) rounds
        Mp, bp = shift((M, b), o)
        M, b = _apply(M, Mp), _apply(M, bp) + b
        o *= 2
    return shift(b, 1)
