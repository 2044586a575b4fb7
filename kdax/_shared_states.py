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
from ._resets import same_segment, segments
from .stages import activated_gate

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


def entry_layout(layout: ChunkLayout, cu_seqlens, first) -> ChunkLayout:
    """For B2 on the cotangents of the chunk-start states alone (do = 0, dv_intra = 0, the
    table ``[dh_0, ..., dh_{NC-1}, 0]``): ``first [NC]`` the chunks whose start state is
    loaded from a table (value ``NC``: the zero entry; ``c``: ``injected_layout``'s entry c),
    and ``last[c - 1] = c`` wherever a sequence that began before chunk c ends in it, so
    that entry c's cotangent enters at chunk c - 1's end. Entering replaces the carried
    ``dh``, which is exact: what would be carried back from chunk c is zero (the sequence
    ends in it, and what follows starts afresh). Before a loaded chunk, ``last`` = NC (the
    state there did not come from chunk c - 1; the caller adds a loaded state's cotangent
    to its entry)."""
    C, NC = layout.chunk_size, layout.num_chunks
    _, _, c, _, _, began = _ends(cu_seqlens, C)
    # (index NC + 1 is out of range: mode="drop" skips the other sequences)
    ends_in = jnp.zeros((NC + 1,), bool).at[jnp.where(began, c, NC + 1)].set(True, mode="drop")[1:]  # chunk c + 1
    loads_next = jnp.concatenate([first[1:] >= 0, jnp.ones((1,), bool)])
    last = jnp.where(ends_in, jnp.arange(1, NC + 1), -1)
    last = jnp.where(loads_next, NC, last).astype(jnp.int32)[None]
    return ChunkLayout(first[None].astype(jnp.int32), last, layout.valid, jnp.zeros((NC + 1,), bool), None, layout.T,
                       C, reset=layout.reset)


def strictly_lower(layout: ChunkLayout):
    """``[1, 1, NC, C, C]``: the pairs of ``L`` (``Akk = (I + L)^-1``) within one sequence
    of a shared chunk, strictly below the diagonal."""
    seg = segments(layout.reset)
    C = layout.chunk_size
    return (jnp.tril(jnp.ones((C, C), bool), -1) & same_segment(seg))[:, None]


# -- initial states entering shared chunks -------------------------------------------------
#
# With initial states the outputs and final states are affine in them. Sequence n (tokens
# s..e) meets its state Y_n at its first token; decayed by that token's own log decay
# (``start_states``: KDA's gate on those tokens; F1 gives them the reset floor instead),
# Y'_n = e^(g_s) Y_n enters between the decay and the delta update of token s. In its
# first chunk, with the exponents relative to s (Γ'_j = G_j - G_s, the reset floor
# cancels), the chunk algorithm from an entry state gives
#
#     v_new'_j = -w'_j Y'_n,  w' = Akk (beta k e^(Γ')),   o'_j = scale (q_j e^(Γ'_j)) Y'_n
#
# (``first_chunk_entries``; F5 adds ``Aqk v_new'``), and, for a sequence that goes on into
# chunk c0 + 1, the state entering it:
#
#     e^(Γ'_f) Y'_n + sum_j (k_j e^(G_f - G_j)) (u_j + v_new'_j)^T   (j = s..f, its tokens in c0)
#
# which F4 loads there (``injected_layout``: an entry of the state table that replaces the
# carried state), running it on through the later chunks as any state. Everything per
# sequence is a batched ``[N, W, K] x [N, K, V]`` product over blocks of W tokens from s,
# as many blocks as the longest first-chunk stretch needs. No sequence gets a chunk of its
# own, so many short sequences cost what their tokens cost.


def _first_chunks(cu_seqlens, C: int):
    """Per sequence: first token s, last token e, the chunk c0 of s, the last token f of
    the sequence in c0, non-empty, and whether it goes on past c0."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    s, e = cu[:-1], cu[1:] - 1
    some = e >= s
    c0 = s // C
    f = jnp.minimum(e, (c0 + 1) * C - 1)
    return s, e, c0, f, some, some & (e > f)


def injected_layout(layout: ChunkLayout, cu_seqlens) -> ChunkLayout:
    """The shared layout with a state table of NC + 1 entries: ``first[c] = c`` where a
    sequence goes on into chunk c from its first chunk (entry c: the state
    ``first_chunk_entries`` made), ``NC`` (a zero entry) where the shared layout enters its
    zero state, and ``last`` = NC before every chunk that loads an entry (the carried state
    is replaced there, so no cotangent goes back through it)."""
    C, NC = layout.chunk_size, layout.num_chunks
    _, _, c0, _, _, crosses = _first_chunks(cu_seqlens, C)
    inject = jnp.zeros((NC + 1,), bool).at[jnp.where(crosses, c0 + 1, NC + 1)].set(True, mode="drop")[:NC]
    first = jnp.where(inject, jnp.arange(NC), jnp.where(layout.first[0] >= 0, NC, -1)).astype(jnp.int32)
    loads_next = jnp.concatenate([first[1:] >= 0, jnp.ones((1,), bool)])
    last = jnp.where(loads_next, NC, -1).astype(jnp.int32)
    return ChunkLayout(first[None], last[None], layout.valid, jnp.zeros((NC + 1,), bool), None, layout.T, C,
                       reset=layout.reset)


def start_states(cu_seqlens, config, g, A_log, dt_bias, h0):
    """``Y'_n = e^(g_s) Y_n`` ``[N, HV, K, V]``: each initial state decayed by its first
    token's own log decay (the shared layout's F1 gives that token the reset floor
    instead), computed from the packed raw gate input ``g`` ``[1, HV, NC, C, K]`` with KDA's
    gate (``kdax.stages.activated_gate``: the F1 stages that declare ``kda_gate``
    compute it). Differentiable in ``g``, ``A_log``, ``dt_bias`` and ``h0``. An empty
    sequence's is unused."""
    HV, NC, C = g.shape[1], g.shape[2], g.shape[3]
    s = jnp.clip(jnp.asarray(cu_seqlens, jnp.int32)[:-1], 0, NC * C - 1)
    gs = g[0].reshape(HV, NC * C, -1)[:, s][None, :, None]  # [1, HV, 1, N, K]: one "chunk" of the N tokens
    N = s.shape[0]
    act = activated_gate(config, gs, A_log, dt_bias, jnp.ones((1, 1, N), bool))
    return jnp.exp(jnp.moveaxis(act[0, :, 0], 0, 1))[..., None] * h0


def first_chunk_entries(layout: ChunkLayout, cu_seqlens, scale: float, q, k, beta, G, G_lo, Akk, v, Y):
    """The initial states' part in each sequence's first chunk (module comment above):
    ``(v_new' [1, HV, NC, C, V], o' [1, HV, NC, C, V], table [NC + 1, HV, K, V])`` from
    F1's activated ``q``, ``k``, ``beta``, ``G``, ``G_lo`` (shared layout), F2's ``Akk``,
    the packed ``v`` and ``Y = start_states(...)``. ``table[c]`` is the state entering
    chunk c (``injected_layout``), zero elsewhere. A pure function: its VJP is the
    backward of this part."""
    C, NC, T = layout.chunk_size, layout.num_chunks, layout.T
    HV, K, V = k.shape[1], k.shape[-1], v.shape[-1]
    TT = NC * C
    s, e, c0, f, some, crosses = _first_chunks(cu_seqlens, C)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    t = jnp.arange(TT)
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, s.shape[0] - 1)
    start = jnp.clip(s[seq], 0, TT - 1)
    mine = (t < T) & (t // C == start // C)  # a token in its sequence's first chunk
    flat = lambda x: x[0].reshape(HV, TT, x.shape[-1])  # [HV, TT, D]
    Gf = flat(G)
    lof = None if G_lo is None else flat(G_lo)
    x = exponent(Gf, Gf[:, start], None if lof is None else lof, None if lof is None else lof[:, start])
    ep = jnp.exp(jnp.where(mine[None, :, None], x, -jnp.inf)).reshape(G.shape)  # e^(Γ') on those tokens
    b = beta[..., None]
    wp = Akk @ (b * k * ep)
    u = Akk @ (b * v)
    wpf, qef, kf, uf = flat(wp), flat(q * ep), flat(k), flat(u)
    m = jnp.where(some, f - s + 1, 0)
    fN = jnp.clip(f, 0, TT - 1)
    per_seq = lambda a, i: jnp.moveaxis(a[:, i], 0, 1)  # [HV, N(, W), D] -> [N, HV(, W), D]
    Gfe = per_seq(Gf, fN)
    lofe = None if lof is None else per_seq(lof, fN)

    def block(bi, carry):
        vx_tok, ox_tok, acc = carry
        d = bi * W + jnp.arange(W)
        ok = d[None] < m[:, None]  # [N, W]
        ti = jnp.where(ok, s[:, None] + d[None], 0)
        vx = -jnp.einsum("nhwk,nhkv->nhwv", per_seq(wpf, ti), Y)
        ox = scale * jnp.einsum("nhwk,nhkv->nhwv", per_seq(qef, ti), Y)
        xe = exponent(Gfe[:, :, None], per_seq(Gf, ti), None if lofe is None else lofe[:, :, None],
                      None if lof is None else per_seq(lof, ti))
        xe = jnp.where((ok & crosses[:, None])[:, None, :, None], xe, -jnp.inf)
        acc = acc + jnp.einsum("nhwk,nhwv->nhkv", per_seq(kf, ti) * jnp.exp(xe), per_seq(uf, ti) + vx)
        at = jnp.where(ok, ti, TT)  # (out of range: dropped)
        put = lambda buf, y: buf.at[:, at].set(jnp.moveaxis(y, 1, 0), mode="drop")
        return put(vx_tok, vx), put(ox_tok, ox), acc

    zeros = jnp.zeros((HV, TT, V), Y.dtype)
    carry = block(0, (zeros, zeros, jnp.zeros_like(Y)))
    longest = jnp.max(m, initial=0)
    for bi in range(1, -(-C // W)):
        carry = jax.lax.cond(longest > bi * W, lambda c, bi=bi: block(bi, c), lambda c: c, carry)
    vx_tok, ox_tok, acc = carry
    sN = jnp.clip(s, 0, TT - 1)
    x0 = exponent(Gfe, per_seq(Gf, sN), lofe, None if lof is None else per_seq(lof, sN))
    entry = jnp.exp(jnp.where(crosses[:, None, None], x0, -jnp.inf))[..., None] * Y + acc
    table = jnp.zeros((NC + 1, HV, K, V), Y.dtype).at[jnp.where(crosses, c0 + 1, NC + 1)].set(entry, mode="drop")
    chunked = lambda x: x.reshape(1, HV, NC, C, V)
    return chunked(vx_tok), chunked(ox_tok), table


def entry_finals(layout: ChunkLayout, cu_seqlens, k, G, G_lo, v_new, h, Y, h0):
    """Final states ``[N, HV, K, V]`` with initial states entering (``v_new`` F4's plus
    ``first_chunk_entries``'s, ``h`` F4's on ``injected_layout``): ``shared_finals``, plus
    for a sequence that ends in its first chunk its decayed initial state ``e^(G_e - G_s)
    Y'_n``; an empty sequence keeps ``h0``."""
    C = layout.chunk_size
    HV, NC = k.shape[1], k.shape[2]
    S = shared_finals(layout, cu_seqlens, k, G, G_lo, v_new, h)
    s, e, _, _, some, crosses = _first_chunks(cu_seqlens, C)
    flat = lambda x: jnp.moveaxis(x[0].reshape(HV, NC * C, -1), 0, 1)
    at = lambda x, i: flat(x)[jnp.clip(i, 0, NC * C - 1)]
    x = exponent(at(G, e), at(G, s), None if G_lo is None else at(G_lo, e), None if G_lo is None else at(G_lo, s))
    S = S + jnp.exp(jnp.where((some & ~crosses)[:, None, None], x, -jnp.inf))[..., None] * Y
    return jnp.where(some[:, None, None, None], S, h0.astype(S.dtype))
