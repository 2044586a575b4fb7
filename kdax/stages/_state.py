"""Inter-chunk state family: F4 (forward recurrence over chunks) and B2 (dhu, reverse).

Both scan over the chunk axis. Sequence boundaries come from the layout: chunk c of row r
starts sequence ``layout.first[r, c]`` (state reset to its initial state) and/or ends
sequence ``layout.last[r, c]`` (its final state is written / its ``dht`` enters), -1 for
neither.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp

from .._layout import ChunkLayout
from .._typing import ChunkK, ChunkV, SeqState, typecheck
from ._ops import full_precision, mT, vary_like, zeros_after
from ._types import DhuOut, StateOut


def _at(c):
    """Chunk ``c`` of ``[R, HV, NC, ...]`` (or column ``c`` of ``[R, NC]``), read in place:
    scanning a chunk-major copy costs more than the loop itself on CPU."""
    return lambda x: jax.lax.dynamic_index_in_dim(x, c, 2 if x.ndim > 2 else 1, keepdims=False)


def _put(x, c, y):
    return jax.lax.dynamic_update_index_in_dim(x, y, c, 2)


def _select(ids, table, other):
    """Per row r: ``table[ids[r]]`` where ``ids[r] >= 0``, else ``other[r]``."""
    return jnp.where((ids >= 0)[:, None, None, None], table[jnp.maximum(ids, 0)], other)


def _scatter(table, ids, rows):
    """``table[ids[r]] = rows[r]`` for rows with ``ids[r] >= 0``."""
    return table.at[jnp.where(ids >= 0, ids, table.shape[0])].set(rows, mode="drop")


def _enter(layout: ChunkLayout, c, at_c: int, ids, table, other):
    """``_select`` at chunk ``c``; a dense layout (row r is sequence r, entered at chunk
    ``at_c``) reads ``table`` whole instead of gathering by id, which would gather
    across devices when rows are sharded."""
    if layout.dense:
        return jnp.where(c == at_c, table, other)
    return _select(ids, table, other)


def _leave(layout: ChunkLayout, c, at_c: int, table, ids, rows):
    """``_scatter`` at chunk ``c``; dense: the whole table at chunk ``at_c``."""
    if layout.dense:
        return jnp.where(c == at_c, rows, table)
    return _scatter(table, ids, rows)


class AbstractState(eqx.Module):
    """F4: ``v_new = u - w h``; ``h <- e^Γ h + kg^T v_new`` chunk by chunk."""

    @abc.abstractmethod
    def __call__(
        self,
        w: ChunkK,
        u: ChunkV,
        kg: ChunkK,
        G: ChunkK,
        h0: SeqState,
        layout: ChunkLayout,
    ) -> StateOut:
        raise NotImplementedError


class ReferenceState(AbstractState):
    """F4 as a loop over chunks; unrolled for at most ``unroll`` chunks (a forward tile),
    which writes ``h`` and ``v_new`` once by stacking instead of into zero-filled buffers
    chunk by chunk (the tiled CPU forward 5% faster)."""

    unroll: int = eqx.field(static=True, default=8)

    @full_precision
    @typecheck
    def __call__(
        self,
        w: ChunkK,
        u: ChunkV,
        kg: ChunkK,
        G: ChunkK,
        h0: SeqState,
        layout: ChunkLayout,
    ) -> StateOut:
        R, HV, NC, _, K = w.shape
        V = u.shape[-1]
        if NC == 0:  # T = 0: every sequence is empty and keeps its initial state
            return StateOut(jnp.zeros((R, HV, 0, K, V), h0.dtype), u, h0)
        decay = jnp.exp(G[..., -1, :])

        def chunk(c, h, final):
            at = _at(c)
            h = _enter(layout, c, 0, at(layout.first), h0, h)
            v_new = at(u) - at(w) @ h
            h_next = at(decay)[..., None] * h + mT(at(kg)) @ v_new
            return h, v_new, h_next, _leave(layout, c, NC - 1, final, at(layout.last), h_next)

        h = jnp.zeros((R, HV, K, V), h0.dtype)
        if NC <= self.unroll:
            hs, v_news, final = [], [], h0
            for c in range(NC):
                h_start, v_new, h, final = chunk(c, h, final)
                hs.append(h_start)
                v_news.append(v_new)
            return StateOut(jnp.stack(hs, 2), jnp.stack(v_news, 2), final)

        def step(c, carry):
            h, final, hs, v_news = carry
            h_start, v_new, h, final = chunk(c, h, final)
            return h, final, _put(hs, c, h_start), _put(v_news, c, v_new)

        deps = (w, u, kg, G, h0)
        hs = zeros_after((R, HV, NC, K, V), h0.dtype, deps)
        init = vary_like((h, h0, hs, zeros_after(u.shape, u.dtype, deps, 1)), deps)
        _, final, h, v_new = jax.lax.fori_loop(0, NC, step, init)
        return StateOut(h, v_new, final)


class AbstractDhu(eqx.Module):
    """B2: reverse over chunks. ``dv_new = dv_intra + kg dh``; the gradient of the state at
    a chunk's start is ``e^Γ dh + scale qg^T do - w^T dv_new`` where ``dh`` is that at the
    chunk's end (``dht`` of the sequence at its last chunk)."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        kg: ChunkK,
        w: ChunkK,
        G: ChunkK,
        do: ChunkV,
        dv_intra: ChunkV,
        dht: SeqState,
        layout: ChunkLayout,
    ) -> DhuOut:
        raise NotImplementedError


class ReferenceDhu(AbstractDhu):
    """B2 as a reverse loop over chunks."""

    @full_precision
    @typecheck
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        kg: ChunkK,
        w: ChunkK,
        G: ChunkK,
        do: ChunkV,
        dv_intra: ChunkV,
        dht: SeqState,
        layout: ChunkLayout,
    ) -> DhuOut:
        R, HV, NC, _, K = qg.shape
        V = do.shape[-1]
        decay = jnp.exp(G[..., -1, :])

        def step(i, carry):
            dh_c, dh0, dhs, dv_news = carry
            c = NC - 1 - i
            at = _at(c)
            dh_end = _enter(layout, c, NC - 1, at(layout.last), dht, dh_c)
            dv_new = at(dv_intra) + at(kg) @ dh_end
            dh_start = at(decay)[..., None] * dh_end + scale * mT(at(qg)) @ at(do) - mT(at(w)) @ dv_new
            dh0 = _leave(layout, c, 0, dh0, at(layout.first), dh_start)
            return dh_start, dh0, _put(dhs, c, dh_end), _put(dv_news, c, dv_new)

        # A sequence of length 0 has no chunk: its dh0 is its dht.
        dh0 = jnp.where(layout.empty[:, None, None, None], dht, 0.0)
        if NC == 0:
            return DhuOut(jnp.zeros((R, HV, 0, K, V), dht.dtype), dh0, dv_intra)
        deps = (qg, kg, w, G, do, dv_intra, dht)
        dhs = zeros_after((R, HV, NC, K, V), dht.dtype, deps)
        init = vary_like((jnp.zeros((R, HV, K, V), dht.dtype), dh0, dhs, zeros_after(do.shape, do.dtype, deps, 1)), deps)
        _, dh0, dh, dv_new = jax.lax.fori_loop(0, NC, step, init)
        return DhuOut(dh, dh0, dv_new)
