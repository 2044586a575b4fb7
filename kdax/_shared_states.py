"""Final states of shared chunks (``_layout.make_shared_layout``) and the backward of a
loss on them.

In the shared layout a sequence ends anywhere in a chunk, and the state stages keep the
state only at chunk boundaries. Sequence n (tokens s..e, zero initial state) ending in
chunk c at position i has the final state

    S_n = e^(G_e) h_c [if it began before chunk c] + sum_j (k_j e^(G_e - G_j)) v_new_j^T

over its own tokens j of chunk c (``h_c`` the state at chunk c's start, ``v_new`` F4's),
masked in the exponent. ``shared_finals`` computes it in blocks of ``W`` tokens counted
back from each sequence's end, as many blocks as the longest tail needs (one for short
sequences): ``N W K V`` work per head and block, where a full chunk each would cost
``N C K V``.

A loss on the final states (``dht``) reaches, by the chain rule through ``S_n``: ``k``,
``G``, ``v_new`` of those tokens and ``h_c`` (``jax.vjp`` of ``shared_finals``: a pure
function, differentiated exactly). ``v_new``'s part joins B1's ``dv_intra``; ``h_c``'s is
a cotangent of the state at chunk c's start, which B2 takes as a ``dht`` entering at chunk
c - 1's end (``entry_layout``): ``KDAPipeline.backward`` runs B2 once more on that alone.
No forward is rerun.
"""

import jax
import jax.numpy as jnp

from ._hilo import exponent
from ._layout import ChunkLayout

# Tokens per block of a sequence's tail (see the module docstring).
W = 16


def _ends(cu_seqlens, C: int):
    """Per sequence: first token, last token, its chunk, the first token of its tail (in
    that chunk), whether it is non-empty and whether it began before that chunk."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    s, e = cu[:-1], cu[1:] - 1
    some = e >= s
    c = jnp.maximum(e, 0) // C
    tail = jnp.maximum(s, c * C)
    return s, e, c, tail, some, some & (s < c * C)


def shared_finals(layout: ChunkLayout, cu_seqlens, k, G, G_lo, v_new, h):
    """Final states ``[N, HV, K, V]`` of the sequences of shared layout ``layout`` (zero
    initial states), from F1's ``k``, ``G``, ``G_lo`` (or None) ``[1, HV, NC, C, K]``,
    F4's ``v_new`` ``[.., V]`` and ``h`` ``[1, HV, NC, K, V]``. Exact (masked in the
    exponent); an empty sequence's is zero."""
    C = layout.chunk_size
    HV, NC = k.shape[1], k.shape[2]
    s, e, c, tail, some, began = _ends(cu_seqlens, C)
    flat = lambda x: x[0].reshape(HV, NC * C, x.shape[-1])  # [HV, NC * C, D]: token t at t
    kf, Gf, vf = flat(k), flat(G), flat(v_new)
    lof = None if G_lo is None else flat(G_lo)
    per_seq = lambda x, t: jnp.moveaxis(x[:, t], 1, 0)  # [HV, N(, W), D] -> [N, HV(, W), D]
    eN = jnp.maximum(e, 0)
    Ge = per_seq(Gf, eN)  # [N, HV, K]
    le = None if lof is None else per_seq(lof, eN)
    # the state at the chunk's start, decayed to e (the sequences that began before it)
    x0 = exponent(Ge, jnp.zeros_like(Ge), le, None if le is None else jnp.zeros_like(le))
    x0 = jnp.where(began[:, None, None], x0, -jnp.inf)
    S = jnp.exp(x0)[..., None] * per_seq(h[0], c)

    def block(b):
        d = b * W + jnp.arange(W)  # offsets back from the end
        t = e[:, None] - d[None]  # [N, W]
        mine = some[:, None] & (t >= tail[:, None])
        t = jnp.clip(t, 0, NC * C - 1)
        Gt = jnp.moveaxis(Gf[:, t], 0, 1)  # [N, HV, W, K]
        lt = None if lof is None else jnp.moveaxis(lof[:, t], 0, 1)
        x = exponent(Ge[:, :, None], Gt, None if le is None else le[:, :, None], lt)
        x = jnp.where(mine[:, None, :, None], x, -jnp.inf)
        u = jnp.moveaxis(kf[:, t], 0, 1) * jnp.exp(x)
        return jnp.einsum("nhwk,nhwv->nhkv", u, jnp.moveaxis(vf[:, t], 0, 1))

    # Blocks beyond the first only when a tail is longer than W (lax.cond: differentiable).
    longest = jnp.max(jnp.where(some, e - tail + 1, 0), initial=0)
    S = S + block(0)
    for b in range(1, -(-C // W)):
        S = jax.lax.cond(longest > b * W, lambda S, b=b: S + block(b), lambda S: S, S)
    return S


def entry_layout(layout: ChunkLayout, cu_seqlens) -> ChunkLayout:
    """The shared layout with ``last[c - 1] = c`` (table entry c) wherever a sequence that
    began before chunk c ends in it, and ``last`` = ``NC`` (a zero entry) where the shared
    layout ends its stream: B2 on this layout with do = 0, dv_intra = 0 and the table
    ``[dh_0, ..., dh_{NC-1}, 0]`` (cotangents of the states at the chunks' starts) runs those
    cotangents back through the chunks. Entering replaces the carried ``dh`` there, which is
    exact: what would be carried back from chunk c is zero (the sequence ends in it, and what
    follows starts afresh)."""
    C, NC = layout.chunk_size, layout.num_chunks
    _, _, c, _, _, began = _ends(cu_seqlens, C)
    # (index NC + 1 is out of range: mode="drop" skips the other sequences)
    ends_in = jnp.zeros((NC + 1,), bool).at[jnp.where(began, c, NC + 1)].set(True, mode="drop")[1:]  # chunk c + 1
    stream_end = layout.last[0] >= 0
    last = jnp.where(ends_in, jnp.arange(1, NC + 1), -1)
    last = jnp.where(stream_end, NC, last).astype(jnp.int32)[None]
    return ChunkLayout(layout.first, last, layout.valid, jnp.zeros((NC + 1,), bool), None, layout.T, C,
                       reset=layout.reset)
