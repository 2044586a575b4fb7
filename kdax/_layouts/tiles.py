"""Tiles: the stages run on a few chunks at a time, the state carried between (docs/stages.md §5).

A tile is chunks ``[c0, c0 + n)`` of every row, a problem of its own: dense, a dense
layout of its tokens whose initial state is the carry; packed, the tile's slice of the
layout with a state table of one entry a chunk, then a carry a row (``R n + R``; a table of
all N sequences through every tile made 128 in 4096 tokens 4.7x slower), or with shared
chunks ``N + R`` (N = 1, the zero state) and the tile's tokens packed, as dense ones."""

from typing import Callable

import jax
import jax.numpy as jnp

from .._numerics.arrays import vary_like, zeros_after
from .layout import ChunkLayout, make_layout, pack_inputs, unpack


class Tiles:
    """Tiles of ``nt`` chunks over ``layout`` (N sequences): dense inputs and shared chunks
    (token t at t) tile their tokens (full tiles in a loop, then a static tail), other
    packed ones the chunks of the row."""

    def __init__(self, layout: ChunkLayout, N: int, nt: int):
        self.layout, self.N, self.nt, self.dense = layout, N, nt, layout.dense
        self.R, self.NC, self.C = layout.valid.shape
        # (shared chunks packed whole before the loop took the forward 1.1-1.2x: 16 sequences, main job's shape)
        self.by_tokens = self.dense or layout.pos is None
        self.full = layout.T // (nt * self.C) if self.by_tokens else self.NC // nt
        self.tail = self.NC - self.full * nt  # chunks of the last, shorter tile (0: none)
        self.per_chunk = not self.dense and layout.reset is None  # (unshared: one sequence a chunk)

    # -- one tile ---------------------------------------------------------------------

    def _cut(self, x, c0, n: int):
        """The tile's chunks of ``x [R, NC, ...]``."""
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, c0, n, 1)

    def layout_of(self, c0, n: int, tail: bool) -> ChunkLayout:
        C, L, R = self.C, self.layout, self.R
        if self.dense:
            return make_layout(R, L.T - c0 * C if tail else n * C, C)
        first, last = self._cut(L.first, c0, n), self._cut(L.last, c0, n)
        size = R * n + R if self.per_chunk else self.N + R
        carry = size - R + jnp.arange(R, dtype=jnp.int32)
        if self.per_chunk:  # the entry of chunk (r, j) is r n + j
            slot = jnp.arange(R * n, dtype=jnp.int32).reshape(R, n)
            first, last = jnp.where(first >= 0, slot, -1), jnp.where(last >= 0, slot, -1)
        first = first.at[:, 0].set(jnp.where(first[:, 0] >= 0, first[:, 0], carry))
        last = last.at[:, -1].set(jnp.where(last[:, -1] >= 0, last[:, -1], carry))
        valid, reset = self._cut(L.valid, c0, n), self._cut(L.reset, c0, n)  # (shared chunks: the tile's sequence starts travel with it)
        return ChunkLayout(first, last, valid, jnp.zeros((size,), bool), L.pos, L.T, C, reset=reset)

    def table(self, per_seq, carry, c0, n: int):
        """The state table a tile's stage gets: the carry (dense), or the entries of
        ``per_seq`` (per chunk of the tile: the sequence starting there) then the carries."""
        if self.dense:
            return carry
        if self.per_chunk:
            per_seq = per_seq[jnp.maximum(self._cut(self.layout.first, c0, n), 0).reshape(-1)]
        return jnp.concatenate([per_seq, carry])

    def collect(self, acc, table, c0, n: int):
        """``acc [N, ...]`` with the final states of the sequences ending in the tile (varlen), in place."""
        ids = self._cut(self.layout.last, c0, n).reshape(-1)
        at = jnp.arange(ids.shape[0]) if self.per_chunk else jnp.maximum(ids, 0)
        return acc.at[jnp.where(ids >= 0, ids, self.N)].set(table[at], mode="drop")

    # -- all tiles --------------------------------------------------------------------

    def run(self, step: Callable, state):
        """``state = step(c0, n, tail, state)`` for every tile in order."""
        nt = self.nt
        # Inside shard_map the carry must vary like the inputs the steps read.
        state = vary_like(state, self.layout, state)
        state = jax.lax.fori_loop(0, self.full, lambda i, s: step(i * nt, nt, False, s), state)
        return step(self.full * nt, self.tail, True, state) if self.tail else state


def forward_tiled(stages: Callable, layout: ChunkLayout, raw, HV: int, dt, h0, nt: int, clean=None, by_tile=None):
    """F1-F5 (``stages(chunked inputs, state table, tile layout)``) on ``nt`` chunks at a time,
    the state carried: on CPU a tile's intermediates stay in cache (the forward 1.4x faster).
    Full-size outputs are written; XLA drops those nothing reads. ``by_tile``: ``(start(a tile's
    outputs), update(acc, tile's outputs, first chunk, chunks))``, what packed input keeps
    tile by tile for its final states, returned as ``final`` (shared chunks:
    ``tile_finals``), or None: the final states from the state tables.
    Returns ``(o [B, T, HV, V], final, stage outputs)``."""
    tiles, C = Tiles(layout, h0.shape[0], nt), layout.chunk_size
    if not tiles.by_tokens:
        packed = pack_inputs(layout, raw, HV, dt, clean)
    # bfloat16 inputs enter the loop as their bits: XLA:CPU carried them in as float32 copies
    # made whole before it (the main job's shape: 41 MiB more temporaries, 1.07x the time)
    as_bits = tuple(x if x.dtype != jnp.bfloat16 else jax.lax.bitcast_convert_type(x, jnp.uint16) for x in raw)

    def tile_stages(c0, n, tail, h_carry):
        tl = tiles.layout_of(c0, n, tail)
        if tiles.by_tokens:  # the tile's tokens, packed
            cut = lambda b: b[:, c0 * C:] if tail else jax.lax.dynamic_slice_in_dim(b, c0 * C, n * C, 1)
            tokens = lambda x, b: cut(b) if b.dtype == x.dtype else jax.lax.bitcast_convert_type(cut(b), x.dtype)
            chunked = pack_inputs(tl, tuple(map(tokens, raw, as_bits)), HV, dt, clean)
        else:  # the tile's chunks
            chunked = tuple(jax.lax.dynamic_slice_in_dim(x, c0, n, 2) for x in packed)
        oc, fw, table = stages(chunked, tiles.table(h0, h_carry, c0, n), tl)
        return oc, fw, table, tl

    def step(c0, n, tail, state):
        (h_carry, finals), (o, outs) = state
        oc, fw, table, tl = tile_stages(c0, n, tail, h_carry)
        if tiles.dense:  # o as tokens [B, T, HV, V]
            o = jax.lax.dynamic_update_slice_in_dim(o, unpack(tl, oc), c0 * C, 1)
        else:  # the final states of the sequences that end in this tile; o chunked (unpacked at the end)
            finals = tiles.collect(finals, table, c0, n) if by_tile is None else by_tile[1](finals, fw, c0, n)
            o = jax.lax.dynamic_update_slice_in_dim(o, oc, c0, 2)
        outs = tuple(jax.lax.dynamic_update_slice_in_dim(b, x, c0, 2) for b, x in zip(outs, jax.tree.leaves(fw)))
        # The carry: the entry ending at the tile's last chunk (where a sequence ends there, its
        # final state: any finite state serves).
        return (table if tiles.dense else table[tl.last[:, -1]], finals), (o, outs)

    # Full-size outputs, shaped after one tile, zeros made where they are used.
    oc, fw = jax.eval_shape(lambda: tile_stages(0, nt, False, h0[: tiles.R])[:2])
    shapes, tree = jax.tree.flatten(fw)
    deps = tuple(raw) + (h0,)
    R, Hx, _, _, *rest = oc.shape
    o = zeros_after((R, layout.T, Hx, *rest) if tiles.dense else (R, Hx, tiles.NC, C, *rest), oc.dtype, deps)
    outs = tuple(zeros_after(x.shape[:2] + (tiles.NC,) + x.shape[3:], x.dtype, deps, j + 1)
                 for j, x in enumerate(shapes))
    carry = (h0, None) if tiles.dense else (jnp.zeros((tiles.R,) + h0.shape[1:], h0.dtype),
                                            h0 if by_tile is None else by_tile[0](fw))
    (h_last, finals), (o, outs) = tiles.run(step, (carry, (o, outs)))
    # A sequence of length 0 keeps its initial state.
    if not tiles.dense and by_tile is None:
        finals = jnp.where(layout.empty[:, None, None, None], h0, finals)
    final = h_last if tiles.dense else finals
    return o if tiles.dense else unpack(layout, o), final, jax.tree.unflatten(tree, outs)
