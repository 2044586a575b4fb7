"""Affine maps of the recurrent state and their prefix scan, shared by sequence
parallelism across devices (``kdax.parallel``) and the segment-split recurrences of one
device (``kdax.stages.SegmentedState``).

Over a span of one sequence the state update is affine, ``h_out = M h_in + b`` with
``M [K, K]`` and ``b [K, V]``; spans compose as ``(M2, b2) ∘ (M1, b1) = (M2 M1, M2 b1 + b2)``.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .arrays import vary_like


def apply_map(M, x):
    """``M x`` per (row, head): ``[..., K, K] @ [..., K, V]`` at full precision."""
    return jnp.matmul(M, x, precision=jax.lax.Precision.HIGHEST)


def scan_prefix(
    Ms: Float[Array, "P *batch K K"],
    bs: Float[Array, "P *batch K V"],
    *,
    reverse: bool = False,
    live=None,
) -> Float[Array, "P *batch K V"]:
    """The exclusive prefix of summaries stacked on the leading axis (spans in order, or
    from the last down with ``reverse``): ``x`` advancing through span ``e`` as
    ``x <- M_e x + b_e`` from zero, the value entering each span. Composition at full
    precision in the summaries' dtype. Used across devices (``exclusive_prefix``) and
    across the segments of one device's chunk recurrence (``kdax.stages.SegmentedState``).

    ``live [P, *batch]`` (bool, optional): False where a span's ``M`` is zero because no
    sequence runs through it: ``x`` is dropped there, not multiplied by zero (an earlier
    sequence's inf state made the next one's entry NaN)."""
    if live is None:
        live = jnp.ones(Ms.shape[:-2], bool)
    if reverse:
        Ms, bs, live = Ms[::-1], bs[::-1], live[::-1]

    def step(x, mb):
        Me, be, le = mb
        return apply_map(Me, drop(le, x)) + be, x  # emits the value entering this span

    _, entries = jax.lax.scan(step, vary_like(jnp.zeros_like(bs[0]), Ms, bs), (Ms, bs, live))
    return entries[::-1] if reverse else entries


def drop(live, x):
    """``x [*batch, K, V]`` where ``live [*batch]``, else zero (a select: inf and NaN go too)."""
    return jnp.where(live[..., None, None], x, jnp.zeros((), x.dtype))
