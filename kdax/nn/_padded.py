"""Padded rows (``attention_mask``) run as one packed row with static shapes, and back."""

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from .._annotations import ArrayIn
from ._cache import KDACache


def pack_padded(x: Float[Array, "B T D"], attention_mask: Shaped[ArrayIn, "B T"], rows: Optional[KDACache]):
    """``(xs [1, B*T, D], cu [B + 2], rows, order)``: the tokens of row 0, row 1, ..., then
    all padding as one trailing dummy sequence (its cache row zeros), so shapes never depend
    on the mask; ``order`` is what ``unpack_padded`` needs."""
    B, T, D = x.shape
    m = jnp.asarray(attention_mask).astype(bool).reshape(B * T)
    flat = jnp.arange(B * T, dtype=jnp.int32)
    perm = jnp.argsort(jnp.where(m, flat, flat + B * T))
    lens = jnp.sum(jnp.asarray(attention_mask).astype(bool), axis=1, dtype=jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32),
                          jnp.full((1,), B * T, jnp.int32)])
    xs = jnp.where(m[perm, None], x.reshape(B * T, D)[perm], jnp.zeros((), x.dtype))[None]
    if rows is not None:
        rows = KDACache(*(None if a is None else jnp.concatenate([a, jnp.zeros_like(a[:1])])
                          for a in rows._fields()))
    return xs, cu, rows, (perm, m)


def unpack_padded(ys: Float[Array, "1 BT D"], new_rows: KDACache, order: tuple[Int[Array, " BT"], Bool[Array, " BT"]],
                  B: int, T: int) -> tuple[Float[Array, "B T D"], KDACache]:
    """``pack_padded``'s inverse on the layer's output: ``y [B, T, D]`` with exact zeros at
    padding, and the cache rows of the B real sequences (the dummy's dropped)."""
    perm, m = order
    D = ys.shape[-1]
    y = jnp.zeros((B * T, D), ys.dtype).at[perm].set(ys[0])
    y = jnp.where(m[:, None], y, jnp.zeros((), y.dtype)).reshape(B, T, D)
    return y, KDACache(*(None if a is None else a[:B] for a in new_rows._fields()))
