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


def over_chunks(fn, group: Optional[int], *xs):
    """``fn`` over the flattened chunk axes ``[R, HV, NC]`` of ``xs``, ``group`` chunks at a
    time (``lax.map``; None: all at once). Every ``x`` has those three leading axes, and so
    has every output of ``fn``; ``fn`` must work on any leading axes. On CPU,
    cache-sized groups keep ``fn``'s temporaries out of main memory."""
    lead = xs[0].shape[:3]
    n = lead[0] * lead[1] * lead[2]
    if group is None or n == 0:
        return fn(*xs)
    flat = tuple(x.reshape(n, *x.shape[3:]) for x in xs)
    out = jax.lax.map(lambda a: fn(*a), flat, batch_size=min(group, n))
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
