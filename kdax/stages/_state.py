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
from ._ops import mT
from ._types import DhuOut, StateOut


def _chunk_major(*xs):
    return tuple(jnp.moveaxis(x, 2, 0) for x in xs)


def _from_chunk_major(x):
    return jnp.moveaxis(x, 0, 2)


def _select(ids, table, other):
    """Per row r: ``table[ids[r]]`` where ``ids[r] >= 0``, else ``other[r]``."""
    return jnp.where((ids >= 0)[:, None, None, None], table[jnp.maximum(ids, 0)], other)


def _scatter(table, ids, rows):
    """``table[ids[r]] = rows[r]`` for rows with ``ids[r] >= 0``."""
    return table.at[jnp.where(ids >= 0, ids, table.shape[0])].set(rows, mode="drop")


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
    """F4 as a ``lax.scan`` over chunks."""

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
        R, HV, _, _, K = w.shape
        V = u.shape[-1]

        def step(carry, x):
            h, final = carry
            w_c, u_c, kg_c, gam, f, l = x
            h = _select(f, h0, h)
            v_new = u_c - w_c @ h
            h_next = jnp.exp(gam)[..., None] * h + mT(kg_c) @ v_new
            return (h_next, _scatter(final, l, h_next)), (h, v_new)

        xs = _chunk_major(w, u, kg, G[..., -1, :]) + (layout.first.T, layout.last.T)
        init = (jnp.zeros((R, HV, K, V), h0.dtype), h0)
        (_, final), (h, v_new) = jax.lax.scan(step, init, xs)
        return StateOut(_from_chunk_major(h), _from_chunk_major(v_new), final)


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
    """B2 as a reverse ``lax.scan`` over chunks."""

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
        R, HV, _, _, K = qg.shape
        V = do.shape[-1]

        def step(carry, x):
            dh_c, dh0 = carry
            qg_c, kg_c, w_c, gam, do_c, dv_c, f, l = x
            dh_end = _select(l, dht, dh_c)
            dv_new = dv_c + kg_c @ dh_end
            dh_start = jnp.exp(gam)[..., None] * dh_end + scale * mT(qg_c) @ do_c - mT(w_c) @ dv_new
            return (dh_start, _scatter(dh0, f, dh_start)), (dh_end, dv_new)

        xs = _chunk_major(qg, kg, w, G[..., -1, :], do, dv_intra) + (layout.first.T, layout.last.T)
        # A sequence of length 0 has no chunk: its dh0 is its dht.
        dh0 = jnp.where(layout.empty[:, None, None, None], dht, 0.0)
        init = (jnp.zeros((R, HV, K, V), dht.dtype), dh0)
        (_, dh0), (dh, dv_new) = jax.lax.scan(step, init, xs, reverse=True)
        return DhuOut(_from_chunk_major(dh), dh0, _from_chunk_major(dv_new))
