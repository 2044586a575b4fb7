"""Exact sequence resets inside shared chunks (``_layouts.layout.make_shared_layout``).

A chunk of the shared layout may hold the end of one sequence and the starts of others.
F1 gives each sequence's first token (``reset``) the log decay floor, so G stays
non-increasing through the chunk and every difference ``G_i - G_j`` within one sequence is
its own; the decay between two sequences is then about exp(floor), tiny but not zero. The
stages that take ``reset`` make it exactly zero: with ``seg`` the index of each token's
sequence within its chunk (0: the one that continues from the chunk's start), they mask
in the exponent, or select,

- pair terms ``e^(G_i - G_j)`` (F2, B4) where ``seg_i != seg_j``;
- the state at the chunk's start reaching token i, ``e^(G_i)`` (``qg``, ``w``: F3, B3),
  where ``seg_i != 0``;
- token j writing the state at the chunk's end, ``e^(Γ - G_j)`` (``kg``: F3, B3), where
  ``seg_j`` is not the chunk's last sequence;
- the state's decay through the chunk, ``e^Γ`` (F4, B2, B3), where a sequence starts
  after the chunk's first token (the state is replaced, not decayed).

Each sequence then equals running it alone to rounding, whatever its neighbours hold (a
finite value: a product with an exact zero is zero; ``kdax._numerics.isolation`` keeps non-finite
inputs out of shared chunks).
"""

import jax.numpy as jnp


def segments(reset):
    """``reset [R, NC, C]`` -> ``[R, NC, C]`` int32: each token's sequence within its
    chunk, 0 for the one that continues from the chunk's start (a sequence starting at
    the chunk's first token is also 0: the state it meets there is already zero)."""
    after_first = reset & (jnp.arange(reset.shape[-1]) > 0)
    return jnp.cumsum(after_first.astype(jnp.int32), axis=-1)


def per_head(x, HV: int):
    """``[R, NC, ...]`` -> ``[R, HV, NC, ...]`` (a broadcast, for ``over_chunks``)."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], HV) + x.shape[1:])


def same_segment(seg):
    """``seg [..., C]`` -> ``[..., C, C]``: row i and column j in one sequence."""
    return seg[..., :, None] == seg[..., None, :]


def from_start(seg):
    """``seg [..., C]`` -> ``[..., C, 1]``: the chunk's start state reaches the token."""
    return (seg == 0)[..., None]


def to_end(seg):
    """``seg [..., C]`` -> ``[..., C, 1]``: the token writes the chunk's end state."""
    return (seg == seg[..., -1:])[..., None]


def state_passes(reset):
    """``reset [R, NC, C]`` -> ``[R, 1, NC, 1]`` bool: the state at the chunk's start
    reaches its end (no sequence starts after its first token)."""
    return ~jnp.any(reset[..., 1:], axis=-1)[:, None, :, None]


def mask_exponent(keep, x):
    """``x`` where ``keep``, else -inf (its exponential an exact zero)."""
    return x if keep is None else jnp.where(keep, x, -jnp.inf)
