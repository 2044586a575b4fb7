"""Small array helpers shared by the reference stages."""

import jax.numpy as jnp


def mT(x):
    """Transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def tri_mask(n: int, strict: bool):
    """``[n, n]`` mask of j <= i (j < i when strict), i the row."""
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    return j < i if strict else j <= i
