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
        self.layout, self.N, self.nt = layout, N, nt
        self.R, self.NC, self.C = layout.valid.shape
        self.dense = layout.dense
        self.full = layout.T // (nt * self.C) if self.dense else self.NC // nt
        self.tail = self.NC - self.full * nt  # chunks of the last, shorter tile (0: none)

    # -- one tile ---------------------------------------------------------------------

    def layout_of(self, c0, n: int, tail: bool) -> ChunkLayout:
        C = self.C
        if self.dense:
            return make_layout(self.R, self.layout.T - c0 * C if tail else n * C, C)
        L, N = self.layout, self.N
        carry = N + jnp.arange(self.R, dtype=jnp.int32)
        first = jax.lax.dynamic_slice_in_dim(L.first, c0, n, 1)
        last = jax.lax.dynamic_slice_in_dim(L.last, c0, n, 1)
        first = first.at[:, 0].set(jnp.where(first[:, 0] >= 0, first[:, 0], carry))
        last = last.at[:, -1].set(jnp.where(last[:, -1] >= 0, last[:, -1], carry))
        valid = jax.lax.dynamic_slice_in_dim(L.valid, c0, n, 1)
        # Shared chunks (make_shared_layout): the tile's sequence starts travel with it.
        reset = None if L.reset is None else jax.lax.dynamic_slice_in_dim(L.reset, c0, n, 1)
        return ChunkLayout(first, last, valid, jnp.zeros((N + self.R,), bool), L.pos, L.T, C, reset=reset)

    def tokens(self, x, c0, n: int, tail: bool):
        """Dense only: the tile's tokens of ``x [B, T, ...]``."""
        if tail:
            return x[:, c0 * self.C:]
        return jax.lax.dynamic_slice_in_dim(x, c0 * self.C, n * self.C, 1)

    @staticmethod
    def chunks(x, c0, n: int):
        """The tile's chunks of ``x [R, HV, NC, ...]``."""
        return jax.lax.dynamic_slice_in_dim(x, c0, n, 2)

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

    def put(self, buf, tl: ChunkLayout, x, c0):
        """Write a tile's chunked ``x`` into ``buf``: dense, as tokens ``[B, T, Hx, ...]``; varlen,
        chunked (``finish`` unpacks it)."""
        if self.dense:
            return jax.lax.dynamic_update_slice_in_dim(buf, unpack(tl, x), c0 * self.C, 1)
        return jax.lax.dynamic_update_slice_in_dim(buf, x, c0, 2)

    def buffer_shape(self, chunked_shape):
        """The shape ``put`` writes into, for a tile's chunked shape ``[R, Hx, n, C, ...]``."""
        R, Hx, _, C, *rest = chunked_shape
        return (R, self.layout.T, Hx, *rest) if self.dense else (R, Hx, self.NC, C, *rest)

    def finish(self, buf):
        return buf if self.dense else unpack(self.layout, buf)

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
    tiles = Tiles(layout, h0.shape[0], nt)
    if not tiles.dense:
        packed = pack_inputs(layout, raw, HV, dt, clean)

    def tile_stages(c0, n, tail, h_carry):
        tl = tiles.layout_of(c0, n, tail)
        if tiles.dense:
            chunked = pack_inputs(tl, tuple(tiles.tokens(x, c0, n, tail) for x in raw), HV, dt, clean)
        else:
            chunked = tuple(tiles.chunks(x, c0, n) for x in packed)
        oc, fw, table = stages(chunked, tiles.table(h0, h_carry), tl)
        return oc, fw, table, tl

    def step(c0, n, tail, state):
        (h_carry, finals), (o, outs) = state
        oc, fw, table, tl = tile_stages(c0, n, tail, h_carry)
        if not tiles.dense:  # the final states of the sequences that end in this tile
            finals = tiles.collect(finals, tl, table)
        o = tiles.put(o, tl, oc, c0)
        outs = tuple(jax.lax.dynamic_update_slice_in_dim(b, x, c0, 2) for b, x in zip(outs, jax.tree.leaves(fw)))
        return (tiles.carry_of(tl, table), finals), (o, outs)

    # Full-size outputs, shaped after one tile, zeros made where they are used.
    oc, fw = jax.eval_shape(lambda: tile_stages(0, nt, False, h0[: tiles.R])[:2])
    shapes, tree = jax.tree.flatten(fw)
    deps = tuple(raw) + (h0,)
    o = zeros_after(tiles.buffer_shape(oc.shape), oc.dtype, deps)
    outs = tuple(zeros_after(x.shape[:2] + (tiles.NC,) + x.shape[3:], x.dtype, deps, j + 1)
                 for j, x in enumerate(shapes))
    carry = (h0, None) if tiles.dense else (jnp.zeros((tiles.R,) + h0.shape[1:], h0.dtype), h0)
    (h_last, finals), (o, outs) = tiles.run(step, (carry, (o, outs)))
    # A sequence of length 0 keeps its initial state.
    final = h_last if tiles.dense else jnp.where(layout.empty[:, None, None, None], h0, finals)
    return tiles.finish(o), final, jax.tree.unflatten(tree, outs)
