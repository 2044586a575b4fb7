"""Small array helpers shared by the reference stages."""

from typing import Optional

import jax
import jax.numpy as jnp


def mT(x):
    """Transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def tri_mask(n: int, strict: bool):
    """``[n, n]`` mask of j <= i (j < i when strict), i the row."""
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    return j < i if strict else j <= i


def rowsum(x):
    """Sum over the last axis as a matvec: XLA:CPU runs large multiply-reduce fusions an
    order of magnitude slower than a dot."""
    return x @ jnp.ones((x.shape[-1],), x.dtype)


def last_row(G):
    """``G[..., -1:, :]``, taken outside the chunk-group loops (``over_chunks``): XLA:CPU
    runs a loop-body fusion that slices and broadcasts its own input several times slower
    than one that reads the slice as a separate operand."""
    return G[..., -1:, :]


def over_chunks(fn, group: Optional[int], *xs):
    """``fn`` over the flattened chunk axes ``[R, HV, NC]`` of ``xs``, about ``group``
    chunks at a time (``lax.map``; None: all at once). Every ``x`` has those three leading
    axes, and so has every output of ``fn``; ``fn`` must work on any leading axes. On CPU,
    cache-sized groups keep ``fn``'s temporaries out of main memory."""
    lead = xs[0].shape[:3]
    n = lead[0] * lead[1] * lead[2]
    if group is None or n <= group:
        return fn(*xs)
    # A divisor of n keeps the split a free reshape (lax.map's batch_size transposes).
    g = next(d for d in range(group, 0, -1) if n % d == 0)
    if 2 * g < group:
        g = group
    m = n // g * g
    flat = tuple(x.reshape(n, *x.shape[3:]) for x in xs)
    out = jax.lax.map(lambda a: fn(*a), tuple(x[:m].reshape(n // g, g, *x.shape[1:]) for x in flat))
    out = jax.tree.map(lambda o: o.reshape(m, *o.shape[2:]), out)
    if m < n:
        rest = fn(*(x[m:] for x in flat))
        out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, rest)
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
