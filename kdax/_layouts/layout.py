"""The chunked layout ``[R, HV, NC, C, D]`` every stage works in (docs/stages.md §1).

Dense ``[B, T, ...]``: R = B rows of ceil(T / C) chunks, zero-padded at the end. Packed
varlen (B == 1): one row, each sequence from a chunk boundary, NC the static bound
``(T + N (C - 1)) // C``. Padding tokens are zeros with ``valid`` False. Shared chunks
(``make_shared_layout``): token t at t, NC = ceil(T / C), ``reset`` at each sequence's
first token (exact resets: ``kdax._layouts.resets``; docs/DESIGN.md §7)."""

from typing import Optional

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class ChunkLayout(eqx.Module):
    """Where tokens and sequences sit. ``first``/``last [R, NC]``: the sequence (state table
    entry) starting / ending in each chunk, or -1; ``valid [R, NC, C]``: real tokens;
    ``empty [N]``: length-0 sequences; ``pos [T]`` (varlen): each token's position in the
    packed row (None: t at t); ``dense``: row r holds sequence r alone, so stages may ignore
    ``first``/``last``; ``reset [R, NC, C]`` (shared layout, else None): each sequence's
    first token, the row one stream with a one-entry zero state table."""

    first: Int[Array, "R NC"]
    last: Int[Array, "R NC"]
    valid: Bool[Array, "R NC C"]
    empty: Bool[Array, " N"]
    pos: Optional[Int[Array, " T"]]
    T: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    dense: bool = eqx.field(static=True, default=False)
    reset: Optional[Bool[Array, "R NC C"]] = None

    @property
    def num_chunks(self) -> int:
        return self.valid.shape[1]


def make_layout(B: int, T: int, chunk_size: int, cu_seqlens=None) -> ChunkLayout:
    C = chunk_size
    if cu_seqlens is None:
        nc = -(-T // C)
        c = jnp.arange(nc)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        first = jnp.where(c[None] == 0, rows, -1).astype(jnp.int32)
        last = jnp.where(c[None] == nc - 1, rows, -1).astype(jnp.int32)
        valid = jnp.broadcast_to((jnp.arange(nc * C) < T).reshape(1, nc, C), (B, nc, C))
        return ChunkLayout(first, last, valid, jnp.full((B,), T == 0), None, T, C, dense=True)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    N = cu.shape[0] - 1
    nc = (T + N * (C - 1)) // C
    lens = cu[1:] - cu[:-1]
    nchunks = (lens + C - 1) // C
    cstart = jnp.cumsum(nchunks) - nchunks
    ids = jnp.arange(N, dtype=jnp.int32)
    # Index nc is out of range: mode="drop" skips sequences of length 0.
    first = jnp.full((nc,), -1, jnp.int32).at[jnp.where(lens > 0, cstart, nc)].set(ids, mode="drop")
    last = jnp.full((nc,), -1, jnp.int32).at[jnp.where(lens > 0, cstart + nchunks - 1, nc)].set(ids, mode="drop")
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, N - 1)
    pos = (cstart[seq] * C + t - cu[seq]).astype(jnp.int32)
    valid = jnp.zeros((nc * C,), bool).at[pos].set(True).reshape(1, nc, C)
    return ChunkLayout(first[None], last[None], valid, lens == 0, pos, T, C)


def make_shared_layout(T: int, chunk_size: int, cu_seqlens) -> ChunkLayout:
    """Packed varlen input with sequences sharing chunks: one row of T tokens, NC = ceil(T / C),
    ``reset`` at the first token of every non-empty sequence, a one-entry zero state table
    entered at each chunk a sequence starts on and left before it."""
    C = chunk_size
    base = make_layout(1, T, C)
    nc = base.num_chunks
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    # Index nc * C is out of range: mode="drop" skips empty sequences.
    at = jnp.where(lens > 0, starts, nc * C)
    reset = jnp.zeros((nc * C,), bool).at[at].set(True, mode="drop").reshape(1, nc, C)
    c = jnp.arange(nc)
    starts_chunk = reset[0, :, 0] | (c == 0)
    ends_chunk = jnp.concatenate([starts_chunk[1:], jnp.ones((min(nc, 1),), bool)])
    first = jnp.where(starts_chunk, 0, -1).astype(jnp.int32)[None]
    last = jnp.where(ends_chunk, 0, -1).astype(jnp.int32)[None]
    return ChunkLayout(first, last, base.valid, base.empty, None, T, C, reset=reset)


def pack(layout: ChunkLayout, x, dtype=None):
    """``[B, T, Hx, *D] -> [R, Hx, NC, C, *D]`` (zeros at padding)."""
    if dtype is not None:
        x = x.astype(dtype)
    C, nc = layout.chunk_size, layout.num_chunks
    if layout.pos is None:
        x = jnp.pad(x, [(0, 0), (0, nc * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    else:
        x = jnp.zeros((1, nc * C) + x.shape[2:], x.dtype).at[:, layout.pos].set(x)
    return jnp.moveaxis(to_chunks(x, C), 3, 1)


def to_chunks(x, C: int):
    """``[B, NC * C, ...] -> [B, NC, C, ...]`` (a reshape)."""
    return x.reshape(x.shape[0], x.shape[1] // C, C, *x.shape[2:])


def unpack(layout: ChunkLayout, y):
    """``[R, Hx, NC, C, *D] -> [B, T, Hx, *D]`` (padding dropped)."""
    y = jnp.moveaxis(y, 1, 3)
    y = y.reshape(y.shape[0], -1, *y.shape[3:])
    return y[:, : layout.T] if layout.pos is None else y[:, layout.pos]


def expand_group(x, hv: int):
    """``[R, H, ...] -> [R, HV, ...]``: value head i reads q/k head i // (HV // H)."""
    return x if x.shape[1] == hv else jnp.repeat(x, hv // x.shape[1], axis=1)


def reduce_group(dx, h: int):
    """Adjoint of ``expand_group``: sum the gradients of each group of value heads."""
    return dx if dx.shape[1] == h else dx.reshape(dx.shape[0], h, dx.shape[1] // h, *dx.shape[2:]).sum(axis=2)


def pack_inputs(layout: ChunkLayout, raw, HV: int, dt, clean=None):
    """``(q, k, v, g, beta)`` in the chunked layout, in the compute dtype, q and k
    expanded to the HV value heads; ``clean(raw) -> raw`` first if given (elementwise,
    so that it fuses into the packing instead of copying the inputs)."""
    q, k, v, g, beta = raw if clean is None else clean(raw)
    return (expand_group(pack(layout, q, dt), HV), expand_group(pack(layout, k, dt), HV), pack(layout, v, dt),
            pack(layout, g, dt), pack(layout, beta[..., None], dt)[..., 0])
