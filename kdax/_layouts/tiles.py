"""Tiles: the stages run on a few chunks at a time, the state carried between (docs/stages.md §5).

A tile is chunks ``[c0, c0 + n)`` of every row, a problem of its own: dense, a dense
layout of its tokens whose initial state is the carry; packed, the tile's slice of the
layout with a state table of ``N + R`` entries (the sequences', then one carry per row)."""

from typing import Callable

import jax
import jax.numpy as jnp

from .._numerics.arrays import vary_like, zeros_after
from .layout import ChunkLayout, make_layout, pack_inputs, unpack


class Tiles:
    """Tiles of ``nt`` chunks over ``layout`` (N sequences): dense inputs tile their tokens
    (full tiles in a loop, then a static tail), packed ones the chunks of the row."""

    def __init__(self, layout: ChunkLayout, N: int, nt: int):
        self.layout, self.N, self.nt, self.dense = layout, N, nt, layout.dense
        self.R, self.NC, self.C = layout.valid.shape
        self.full = layout.T // (nt * self.C) if self.dense else self.NC // nt
        self.tail = self.NC - self.full * nt  # chunks of the last, shorter tile (0: none)

    # -- one tile ---------------------------------------------------------------------

    def layout_of(self, c0, n: int, tail: bool) -> ChunkLayout:
        C = self.C
        if self.dense:
            return make_layout(self.R, self.layout.T - c0 * C if tail else n * C, C)
        L, N = self.layout, self.N
        cut = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, c0, n, 1)  # the tile's chunks
        carry = N + jnp.arange(self.R, dtype=jnp.int32)
        first, last = cut(L.first), cut(L.last)
        first = first.at[:, 0].set(jnp.where(first[:, 0] >= 0, first[:, 0], carry))
        last = last.at[:, -1].set(jnp.where(last[:, -1] >= 0, last[:, -1], carry))
        valid, reset = cut(L.valid), cut(L.reset)  # (shared chunks: the tile's sequence starts travel with it)
        return ChunkLayout(first, last, valid, jnp.zeros((N + self.R,), bool), L.pos, L.T, C, reset=reset)

    def table(self, per_seq, carry):
        """The state table a tile's stage gets: the carry (dense), or the sequences' entries then the carries."""
        return carry if self.dense else jnp.concatenate([per_seq, carry])

    def carry_of(self, tl: ChunkLayout, table):
        """The carry to the next tile: the entry ending at the tile's last chunk (a sequence's own
        final state where one ends there: any finite state serves)."""
        if self.dense:
            return table
        ids = tl.last[:, -1]
        return table[jnp.where(ids >= 0, ids, self.N + jnp.arange(self.R))]

    def collect(self, acc, tl: ChunkLayout, table):
        """``acc [N, ...]`` with the final states of the sequences ending in the tile (varlen)."""
        ids = tl.last
        mask = jnp.zeros((self.N + self.R,), bool).at[jnp.where(ids >= 0, ids, self.N + self.R)].set(True, mode="drop")
        return jnp.where(mask[: self.N].reshape((-1,) + (1,) * (acc.ndim - 1)), table[: self.N], acc)

    # -- all tiles --------------------------------------------------------------------

    def run(self, step: Callable, state):
        """``state = step(c0, n, tail, state)`` for every tile in order."""
        nt = self.nt
        # Inside shard_map the carry must vary like the inputs the steps read.
        state = vary_like(state, self.layout, state)
        state = jax.lax.fori_loop(0, self.full, lambda i, s: step(i * nt, nt, False, s), state)
        return step(self.full * nt, self.tail, True, state) if self.tail else state


def forward_tiled(stages: Callable, layout: ChunkLayout, raw, HV: int, dt, h0, nt: int, clean=None):
    """F1-F5 (``stages(chunked inputs, state table, tile layout)``) on ``nt`` chunks at a time,
    the state carried: on CPU a tile's intermediates stay in cache (the forward 1.4x faster).
    Full-size outputs are written; XLA drops those nothing reads. Returns
    ``(o [B, T, HV, V], final, stage outputs)``."""
    tiles, C = Tiles(layout, h0.shape[0], nt), layout.chunk_size
    if not tiles.dense:
        packed = pack_inputs(layout, raw, HV, dt, clean)

    def tile_stages(c0, n, tail, h_carry):
        tl = tiles.layout_of(c0, n, tail)
        if tiles.dense:  # the tile's tokens, packed
            tokens = lambda x: x[:, c0 * C:] if tail else jax.lax.dynamic_slice_in_dim(x, c0 * C, n * C, 1)
            chunked = pack_inputs(tl, tuple(map(tokens, raw)), HV, dt, clean)
        else:  # the tile's chunks
            chunked = tuple(jax.lax.dynamic_slice_in_dim(x, c0, n, 2) for x in packed)
        oc, fw, table = stages(chunked, tiles.table(h0, h_carry), tl)
        return oc, fw, table, tl

    def step(c0, n, tail, state):
        (h_carry, finals), (o, outs) = state
        oc, fw, table, tl = tile_stages(c0, n, tail, h_carry)
        if tiles.dense:  # o as tokens [B, T, HV, V]
            o = jax.lax.dynamic_update_slice_in_dim(o, unpack(tl, oc), c0 * C, 1)
        else:  # the final states of the sequences that end in this tile; o chunked (unpacked at the end)
            finals = tiles.collect(finals, tl, table)
            o = jax.lax.dynamic_update_slice_in_dim(o, oc, c0, 2)
        outs = tuple(jax.lax.dynamic_update_slice_in_dim(b, x, c0, 2) for b, x in zip(outs, jax.tree.leaves(fw)))
        return (tiles.carry_of(tl, table), finals), (o, outs)

    # Full-size outputs, shaped after one tile, zeros made where they are used.
    oc, fw = jax.eval_shape(lambda: tile_stages(0, nt, False, h0[: tiles.R])[:2])
    shapes, tree = jax.tree.flatten(fw)
    deps = tuple(raw) + (h0,)
    R, Hx, _, _, *rest = oc.shape
    o = zeros_after((R, layout.T, Hx, *rest) if tiles.dense else (R, Hx, tiles.NC, C, *rest), oc.dtype, deps)
    outs = tuple(zeros_after(x.shape[:2] + (tiles.NC,) + x.shape[3:], x.dtype, deps, j + 1)
                 for j, x in enumerate(shapes))
    carry = (h0, None) if tiles.dense else (jnp.zeros((tiles.R,) + h0.shape[1:], h0.dtype), h0)
    (h_last, finals), (o, outs) = tiles.run(step, (carry, (o, outs)))
    # A sequence of length 0 keeps its initial state.
    final = h_last if tiles.dense else jnp.where(layout.empty[:, None, None, None], h0, finals)
    return o if tiles.dense else unpack(layout, o), final, jax.tree.unflatten(tree, outs)
