"""Final states of shared chunks, initial states entering them, and their backward
(docs/DESIGN.md §7).

Sequence n (tokens s..e) ending in chunk c has the final state
``S_n = e^(G_e) h_c [if it began before c] + sum_j (k_j e^(G_e - G_j)) v_new_j^T`` over
its tokens j in chunk c (``shared_finals``). A loss on them reaches ``k``, ``G``,
``v_new`` of those tokens and ``h_c`` (``jax.vjp``), which a B2 declaring ``dh_start`` adds
in its own pass, and B2 otherwise runs back once more as a ``dht`` entering at chunk c - 1's
end (``entry_layout``)."""

import collections
import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .._numerics.hilo import exponent
from .._numerics.isolation import finite_heads
from .._numerics.arrays import ranked, segment_matmul, tri_mask
from ..ref import activated_gate
from .layout import ChunkLayout
from .ragged import HI, Spans, matvec, narrow_width, outer, token_slots
from .resets import per_head, same_segment, segments, select_zero


_Seqs = collections.namedtuple("_Seqs", "s e some c tail began c0 f crosses")


def _injected(first, M: int):  # injected_layout's first -> the entry a chunk loads, M + 1 where none
    return jnp.where((first >= 0) & (first < M), first, M + 1)


def _seqs(cu_seqlens, C: int, slots=None) -> _Seqs:
    """Per sequence ``[N]``: first token ``s``, last ``e``, ``some`` (non-empty); ``c`` the chunk
    of e, ``tail`` the sequence's first token in it, ``began`` (begun before c); ``c0`` the
    chunk of s, ``f`` the sequence's last token in it, ``crosses`` (goes on past c0).
    ``slots [NC]`` (``last_chunk_slots``): ``e``, ``c``, ``tail`` as positions among the
    chunks gathered there (ascending, as ``Spans`` need), ``some`` and ``began`` only where
    a sequence ends in one of them (``s``, ``c0``, ``f``, ``crosses`` then unused)."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    s, e = cu[:-1], cu[1:] - 1
    some = e >= s
    c, c0 = jnp.maximum(e, 0) // C, s // C
    f = jnp.minimum(e, (c0 + 1) * C - 1)
    q = _Seqs(s, e, some, c, jnp.maximum(s, c * C), some & (s < c * C), c0, f, some & (e > f))
    if slots is None:
        return q
    kept = slots >= 0
    before = jnp.cumsum(kept, dtype=jnp.int32) - kept  # (the gathered chunks before each chunk)
    at = lambda t: jnp.clip(t // C, 0, slots.shape[0] - 1)
    pos = lambda t: before[at(t)] * C + jnp.where(kept[at(t)], t % C, 0)  # (non-decreasing in t)
    ends = some & kept[at(q.e)]
    return q._replace(e=pos(q.e), some=ends, c=before[at(q.e)], tail=pos(q.tail), began=q.began & ends)


def _per_chunk(mask, chunk, NC: int):
    """``[NC]``: the sequence n with ``mask[n]`` and ``chunk[n] == c`` (at most one), N where none."""
    return jnp.full((NC,), mask.shape[0]).at[jnp.where(mask, chunk, NC)].set(jnp.arange(mask.shape[0]), mode="drop")


def _tokens(x):
    """``[1, HV, NC, C, D] -> [HV, NC C, D]``: token t at t (None stays None)."""
    return None if x is None else x[0].reshape(x.shape[1], -1, x.shape[-1])


def _last_before_loads(first, zero: int):
    """``last [NC]``: ``zero`` (the table's zero entry) before every chunk that loads an entry
    and at the end, -1 elsewhere: no cotangent goes back through a replaced state."""
    loads_next = jnp.concatenate([first[1:] >= 0, jnp.ones((1,), bool)])
    return jnp.where(loads_next, zero, -1).astype(jnp.int32)


def last_chunk_slots(cu_seqlens, C: int, NC: int):
    """``slots [NC]``: where each chunk in which some sequence ends goes among those chunks,
    in order (at most min(N, NC)), -1 for the others."""
    q = _seqs(cu_seqlens, C)
    has = jnp.zeros((NC + 1,), bool).at[jnp.where(q.some, q.c, NC)].set(True)[:NC]
    return jnp.where(has, jnp.cumsum(has, dtype=jnp.int32) - 1, -1)


def shared_finals(layout: ChunkLayout, cu_seqlens, k, G, G_lo, v_new, h, slots=None):
    """Final states ``[N, HV, K, V]`` (zero initial states) from F1's ``k``, ``G``, ``G_lo``
    ``[1, HV, NC, C, K]``, F4's ``v_new`` and ``h`` ``[1, HV, NC, K, V]``; exact (masked in
    the exponent), zero for an empty sequence, differentiable. ``slots``
    (``last_chunk_slots``): the arrays hold only the chunks where sequences end, so placed."""
    C, HV, NC = layout.chunk_size, k.shape[1], k.shape[2]
    TT = NC * C
    q = _seqs(cu_seqlens, C, slots)
    e, N = q.e, q.s.shape[0]
    kf, Gf, lof, vf = _tokens(k), _tokens(G), _tokens(G_lo), _tokens(v_new)
    spans = Spans(q.tail, jnp.where(q.some, e - q.tail + 1, 0))  # (in chunk c: at most C tokens, outer's bound)
    n, _, inside = token_slots(spans, TT)
    at_end = lambda x: None if x is None else x[:, jnp.clip(e[n], 0, TT - 1)]  # each token's sequence end
    x = exponent(at_end(Gf), Gf, at_end(lof), lof)
    S = outer(kf * jnp.exp(jnp.where(inside[None, :, None], x, -jnp.inf)), vf, spans, N, narrow_width(layout.T, N), C)
    # e^(G_e) h_c for the sequence (at most one per chunk) that began before chunk c and ends in it
    ends_in = _per_chunk(q.began, q.c, NC)
    has = ends_in < N
    eC = jnp.clip(e[jnp.minimum(ends_in, N - 1)], 0, TT - 1)
    zero = jnp.zeros((HV, NC, G.shape[-1]), G.dtype)
    x0 = exponent(Gf[:, eC], zero, None if lof is None else lof[:, eC], None if lof is None else zero)
    S_in = jnp.exp(jnp.where(has[None, :, None], x0, -jnp.inf))[..., None] * h[0]  # [HV, NC, K, V]
    return S.at[ends_in].add(jnp.moveaxis(S_in, 1, 0).astype(S.dtype), mode="drop")


def finals_vjp(layout: ChunkLayout, cu_seqlens, fin, primals, dS):
    """``jax.vjp(fin, *primals)[1](dS)`` (``fin``: ``shared_finals`` or ``entry_finals`` over
    ``(k, G, v_new, h, a, h0)``), each cotangent selected to zero where it belongs to a
    sequence's head whose ``dS`` is not finite (the caller makes that head NaN). Each part
    depends on one head of ``dS`` (``outer``'s VJP: products per sequence and head), and a
    select keeps other NaN, so no cleaned copy of ``dS`` is made."""
    ok = finite_heads(dS)  # [N, HV]
    d_k, d_G, d_v, d_h, da, dh0 = jax.vjp(fin, *primals)[1](dS)
    (N, HV), C, NC = ok.shape, layout.chunk_size, layout.num_chunks
    q = _seqs(cu_seqlens, C)
    n, _, inside = token_slots(Spans(q.s, jnp.where(q.some, q.e - q.s + 1, 0)), NC * C)
    tok_ok = (ok[n].T | ~inside[None]).reshape(1, HV, NC, C, 1)
    ends_in = _per_chunk(q.began, q.c, NC)
    chunk_ok = (ok[jnp.minimum(ends_in, N - 1)].T | (ends_in >= N)[None])[None, :, :, None, None]  # [1, HV, NC, 1, 1]
    keep = lambda m, x: None if x is None else jnp.where(m, x, jnp.zeros((), x.dtype))
    return (keep(tok_ok, d_k), keep(tok_ok, d_G), keep(tok_ok, d_v), keep(chunk_ok, d_h), keep(ok[..., None], da),
            keep(ok[..., None, None], dh0))


def entry_layout(layout: ChunkLayout, cu_seqlens, first) -> ChunkLayout:
    """The layout of B2 on the chunk-start states' cotangents alone (table ``[dh_0, ...,
    dh_{NC-1}, 0]``): ``first`` the chunks loading a table entry, ``last[c - 1] = c`` where
    a sequence that began before chunk c ends in it (entry c enters at chunk c - 1's end,
    replacing the carried ``dh``, which is zero there); ``last`` = NC before a loaded chunk."""
    C, NC = layout.chunk_size, layout.num_chunks
    q = _seqs(cu_seqlens, C)
    ends_next = jnp.concatenate([_per_chunk(q.began, q.c, NC)[1:] < q.s.shape[0], jnp.zeros((1,), bool)])
    cut = _last_before_loads(first, NC)
    last = jnp.where(cut >= 0, cut, jnp.where(ends_next, jnp.arange(1, NC + 1), -1)).astype(jnp.int32)[None]
    return dataclasses.replace(layout, first=first[None].astype(jnp.int32), last=last, empty=jnp.zeros((NC + 1,), bool))


# -- initial states entering shared chunks -------------------------------------------------
#
# Sequence n's state Y_n, decayed by its first token's own log decay a_n (``start_decays``),
# enters between that token's decay and its update. In its first chunk, exponents relative
# to s (Γ'_j = G_j - G_s):
#
#     v_new'_j = -w'_j Y_n,  w' = Akk (beta k e^(Γ' + a_n)),   o'_j = scale (q_j e^(Γ'_j + a_n)) Y_n
#
# (F5 adds ``Aqk v_new'``); a sequence going on into chunk c0 + 1 enters it with
#
#     e^(Γ'_f + a_n) Y_n + sum_j (k_j e^(G_f - G_j)) (u_j + v_new'_j)^T   (j = s..f, its tokens in c0)
#
# which F4 loads (``injected_layout``). The decay rides on the token side: no decayed copy
# of the states is formed.


class FirstChunks(NamedTuple):
    """The M = min(N, NC) chunks holding some sequence's first token, ``idx [M]`` ascending (NC
    past them), where the entering states' first-chunk part runs (``take``; ``put`` adds its
    outputs back in place); ``starts [N]``: each sequence's first token among their tokens."""

    idx: jax.Array
    starts: jax.Array

    def take(self, x):  # [R, HV, NC, ...] -> [R, HV, M, ...] (past them: some chunk, its result dropped)
        return x if self.idx.shape[0] == x.shape[2] else jnp.take(x, jnp.minimum(self.idx, x.shape[2] - 1), axis=2)

    def put(self, full, part):  # full plus take's transpose of part
        part = part.astype(full.dtype)
        return full + part if self.idx.shape[0] == full.shape[2] else full.at[:, :, self.idx].add(part, mode="drop")


def first_chunks(cu_seqlens, C: int, NC: int) -> FirstChunks:
    """``FirstChunks`` of the packed ``cu_seqlens`` (traced or not)."""
    sq = _seqs(cu_seqlens, C)
    if sq.s.shape[0] >= NC:
        return FirstChunks(jnp.arange(NC), sq.s)
    has = jnp.zeros((NC + 1,), bool).at[jnp.where(sq.some, sq.c0, NC)].set(True)  # (c0 <= NC)
    before = jnp.cumsum(has, dtype=jnp.int32) - has  # the first chunks before each chunk
    idx = jnp.nonzero(has[:NC], size=sq.s.shape[0], fill_value=NC)[0]
    return FirstChunks(idx, before[sq.c0] * C + jnp.where(has[sq.c0], sq.s % C, 0))  # (ascending, as s)


def injected_layout(layout: ChunkLayout, cu_seqlens, fc: FirstChunks) -> ChunkLayout:
    """The shared layout with ``first_chunk_entries``' table of M + 1 entries: ``first[c] = m``
    where a sequence goes on into chunk c from its first chunk, the M chunks' m-th (entry m
    the state it carries), M (zero) where the shared layout enters its zero state; ``last`` =
    M before every load."""
    C, NC, M = layout.chunk_size, layout.num_chunks, fc.idx.shape[0]
    q = _seqs(cu_seqlens, C)
    into, N = _per_chunk(q.crosses, q.c0 + 1, NC), q.s.shape[0]
    slot = fc.starts[jnp.minimum(into, N - 1)] // C
    first = jnp.where(into < N, slot, jnp.where(layout.first[0] >= 0, M, -1)).astype(jnp.int32)
    return dataclasses.replace(layout, first=first[None], last=_last_before_loads(first, M)[None],
                               empty=jnp.zeros((M + 1,), bool))


def start_decays(cu_seqlens, config, g, A_log, dt_bias):
    """``a [N, HV, K]``: each sequence's first token's own log decay (F1 gives it the reset
    floor instead), KDA's gate (``kdax.ref.activated_gate``) on the packed raw ``g``;
    differentiable in ``g``, ``A_log``, ``dt_bias``."""
    s = jnp.clip(jnp.asarray(cu_seqlens, jnp.int32)[:-1], 0, g.shape[2] * g.shape[3] - 1)
    gs = _tokens(g)[:, s][None, :, None]  # [1, HV, 1, N, K]: one "chunk" of the N tokens
    act = activated_gate(config, gs, A_log, dt_bias, jnp.ones((1, 1, s.shape[0]), bool))
    return jnp.moveaxis(act[0, :, 0], 0, 1)


def first_chunk_entries(layout: ChunkLayout, cu_seqlens, scale: float, fc: FirstChunks, q, k, beta, G, G_lo, Akk,
                        v, a, h0, ok=None):
    """The initial states' part in each sequence's first chunk (comment above), on the M
    chunks ``fc`` (F1's, F2's and the packed inputs there: ``fc.take``): ``(v_new' [1, HV, M,
    C, V], o' [1, HV, M, C, V], table [M + 1, HV, K, V])`` from the start decays ``a`` and
    ``h0 [N, HV, K, V]`` (``ok [N, HV]``: False heads read a zero state); ``table[m]`` the
    state carried out of chunk m (``injected_layout``), zero if none. Differentiable: its VJP
    is this part's backward."""
    C, HV, M = layout.chunk_size, k.shape[1], k.shape[2]
    sq, s = _seqs(cu_seqlens, C), fc.starts  # (s: positions among the M chunks' tokens)
    N, TT = s.shape[0], M * C
    spans = Spans(s, jnp.where(sq.some, sq.f - sq.s + 1, 0))  # (in chunk c0: at most C tokens, matvec's bound)
    n, _, mine = token_slots(spans, TT)  # mine: a token in its sequence's first chunk
    Gf, lof = _tokens(G), _tokens(G_lo)
    sT = jnp.clip(s[n], 0, TT - 1)
    x = exponent(Gf, Gf[:, sT], lof, None if lof is None else lof[:, sT]) + jnp.moveaxis(a[n], 0, 1)
    ep = jnp.exp(jnp.where(mine[None, :, None], x, -jnp.inf)).reshape(G.shape)  # e^(Γ' + a) on those tokens
    same = same_segment(per_head(segments(fc.take(layout.reset[:, None])[:, 0]), HV))  # [1, HV, M, C, C]
    wp, u = segment_matmul(Akk, beta[..., None] * k * ep, same), segment_matmul(Akk, beta[..., None] * v, same)
    vx, ox = (x.reshape(1, HV, M, C, x.shape[-1])
              for x in matvec((-_tokens(wp), scale * _tokens(q * ep)), h0, spans, narrow_width(layout.T, N), ok, C))
    # The state carried out of chunk m by the sequence (at most one) that starts there and goes on.
    out_of = _per_chunk(sq.crosses, s // C, M)
    has, nn = out_of < N, jnp.minimum(out_of, N - 1)
    Gc, loc = G[0], None if G_lo is None else G_lo[0]
    last = lambda x: None if x is None else x[..., -1:, :]
    own = (has[:, None] & (jnp.arange(M, dtype=jnp.int32)[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None] >= s[nn][:, None]))[None, :, :, None]
    xk = jnp.where(own, exponent(last(Gc), Gc, last(loc), loc), -jnp.inf)
    part = jnp.einsum("hmck,hmcv->mhkv", select_zero(own, k[0] * jnp.exp(xk)), select_zero(own, u[0] + vx[0]), precision=HI)
    sC = jnp.clip(s[nn], 0, TT - 1)
    x0 = exponent(last(Gc)[..., 0, :], Gf[:, sC], None if loc is None else last(loc)[..., 0, :],
                  None if lof is None else lof[:, sC]) + jnp.moveaxis(a[nn], 0, 1)  # [HV, M, K]
    decay = jnp.exp(jnp.where(has[None, :, None], x0, -jnp.inf))
    entry = jnp.moveaxis(decay, 0, 1)[..., None] * _finite(h0[nn], None if ok is None else ok[nn]) + part
    return vx, ox, jnp.concatenate([entry, jnp.zeros_like(entry[:1])]).astype(h0.dtype)


def _finite(h0, ok):
    """``h0`` with the heads where ``ok`` is False zero (a select XLA fuses into the product)."""
    return h0 if ok is None else jnp.where(ok[..., None, None], h0, jnp.zeros((), h0.dtype))


def entry_finals(layout: ChunkLayout, cu_seqlens, k, G, G_lo, v_new, h, a, h0, ok=None):
    """``shared_finals`` with initial states entering (``v_new``, ``h`` on ``injected_layout``),
    plus ``e^(G_e - G_s + a_n) h0_n`` for a sequence ending in its first chunk; an empty
    sequence keeps ``h0``."""
    h0 = _finite(h0, ok)
    C, NC = layout.chunk_size, k.shape[2]
    S = shared_finals(layout, cu_seqlens, k, G, G_lo, v_new, h)
    q = _seqs(cu_seqlens, C)
    at = lambda x, i: None if x is None else jnp.moveaxis(_tokens(x)[:, jnp.clip(i, 0, NC * C - 1)], 0, 1)  # [N, HV, K]
    x = exponent(at(G, q.e), at(G, q.s), at(G_lo, q.e), at(G_lo, q.s)) + a
    S = S + jnp.exp(jnp.where((q.some & ~q.crosses)[:, None, None], x, -jnp.inf))[..., None] * h0
    return jnp.where(q.some[:, None, None, None], S, h0.astype(S.dtype))


class Entered(NamedTuple):
    """What entering states add to the forward: F4's table and layout, ``vx``, ``ox`` (on the
    first chunks ``chunks``), ``a`` and both VJPs."""

    table: jax.Array
    layout: ChunkLayout
    vx: jax.Array
    ox: jax.Array
    a: jax.Array
    ent_vjp: object
    a_vjp: object
    chunks: FirstChunks


class SharedForwardHooks:
    """The forward's part of shared chunks (``PlainHooks``' forward points): the final states
    (``shared_finals``, or zeros ``shape`` when not asked for); with entering states
    ``h0 [N, HV, K, V]``, after F3 their first-chunk part and F4's table (``Entered``)."""

    def __init__(self, config, layout: ChunkLayout, cu_seqlens, shape: tuple, dtype, h0=None, ok=None,
                 tiled: bool = False):
        self.config, self.layout, self.cu_seqlens, self.shape, self.dtype = config, layout, cu_seqlens, shape, dtype
        self.h0, self.ok = h0, ok
        self.slots = last_chunk_slots(cu_seqlens, layout.chunk_size, layout.num_chunks) if (
            tiled and config.output_final_state) else None  # (tile_finals)

    def f4_inputs(self, h0, layout, *, act, intra, v, g, A_log, dt_bias) -> tuple:
        if self.h0 is None:
            return h0, layout, None
        cu, config = self.cu_seqlens, self.config
        a, a_vjp = jax.vjp(lambda g_, A_, b_: start_decays(cu, config, g_, A_, b_), g, A_log, dt_bias)
        fc = first_chunks(cu, layout.chunk_size, layout.num_chunks)
        lo = None if act.G_lo is None else fc.take(act.G_lo)
        ent = lambda q_, k_, b_, G_, Akk_, v_, a_, h0_: first_chunk_entries(
            layout, cu, config.scale, fc, q_, k_, b_, G_, lo, Akk_, v_, a_, h0_, self.ok)
        (vx, ox, table), ent_vjp = jax.vjp(ent, *map(fc.take, (act.q, act.k, act.beta, act.G, intra.Akk, v)), a,
                                           self.h0)
        entered = Entered(table, injected_layout(layout, cu, fc), vx, ox, a, ent_vjp, a_vjp, fc)
        return table, entered.layout, entered

    def v_out(self, v_new, extra: Optional[Entered]):
        return v_new if extra is None else extra.chunks.put(v_new, extra.vx)

    def after_output(self, oc, extra: Optional[Entered]):
        return oc if extra is None else extra.chunks.put(oc, extra.ox)

    def tile_finals(self):
        """``(start, update)`` when the forward runs in tiles and the final states are asked
        for, else None: the chunks where sequences end (``last_chunk_slots``) gathered tile by
        tile into buffers ``start(a tile's stage outputs)``, ``update(buffers, fw, t0, n)``
        with the tile of chunks ``[t0, t0 + n)``, so that no stage output is kept whole for
        them (16 sequences in the main job's shape: the forward 0.87x the time)."""
        if self.slots is None:
            return None
        M = min(self.shape[0], self.layout.num_chunks)
        parts = lambda fw: (fw.act.k, fw.act.G, fw.act.G_lo, fw.v_new, fw.h)

        def update(bufs, fw, t0, n: int):  # chunk by chunk, in place (a scatter transposed each tile)
            at = jnp.where(self.slots >= 0, self.slots, M)[t0 + jnp.arange(n)]  # (M: the extra chunk, never read)
            put = lambda b, x: functools.reduce(lambda b, j: jax.lax.dynamic_update_slice_in_dim(
                b, x[:, :, j:j + 1], at[j], 2), range(n), b)
            return jax.tree.map(put, bufs, parts(fw))

        return lambda fw: jax.tree.map(lambda x: jnp.zeros(x.shape[:2] + (M + 1,) + x.shape[3:], x.dtype),
                                       parts(fw)), update

    def final_states(self, fw, final):
        """``shared_finals``/``entry_finals`` when asked for (``final`` itself when the tiles
        made them: ``tile_finals``); else zeros or the initial states."""
        if not self.config.output_final_state:
            return jnp.zeros(self.shape, self.dtype) if self.h0 is None else self.h0
        if self.slots is not None:  # (tile_finals' buffers)
            return shared_finals(self.layout, self.cu_seqlens, *final, slots=self.slots)
        act = fw.act
        if self.h0 is None:
            return shared_finals(self.layout, self.cu_seqlens, act.k, act.G, act.G_lo, fw.v_new, fw.h)
        return entry_finals(self.layout, self.cu_seqlens, act.k, act.G, act.G_lo, fw.v_out, fw.h, fw.extra.a,
                            self.h0, self.ok)

    def residuals(self, layout, h0, e: Optional[Entered]) -> tuple:
        if e is None:
            return layout, h0, None
        return e.layout, e.table, (self.h0, self.ok, e.a, e.vx, e.ent_vjp, e.a_vjp, e.chunks)


class SharedBackward(NamedTuple):
    """What ``SharedChunkHooks`` carries between points: ``finals_vjp``'s cotangents ``fin``,
    the loaded states' (``d_entries``), the start decays' and initial states' (``decays``, ``dh0``)."""

    fin: Optional[tuple] = None
    d_entries: Optional[jax.Array] = None
    decays: Optional[tuple] = None
    dh0: Optional[jax.Array] = None


class SharedChunkHooks:
    """The shared layout's part of the backward (``PlainHooks``' backward points): a loss on the
    final states (``dht``: ``finals_vjp``, one more B2 pass) and entering initial states
    (``res.entries``: the VJPs of their first-chunk part and start decays)."""

    def __init__(self, res, dht):
        self.res, self.E, self.L, self.cu = res, res.entries, res.layout, res.cu_seqlens
        self.dht = None if dht is None else dht.astype(res.h0.dtype)  # (as given: selected per head after the VJP)

    def b2_dht(self, dht, h0):
        return jnp.zeros_like(h0)  # (the state table's one zero entry; dht enters through after_dav)

    def v_out(self, v_new):
        return v_new if self.E is None else self.E.chunks.put(v_new, self.E.v_new)  # (+ the first-chunk part)

    def after_dav(self, dv_intra, *, k, G, v_out, h) -> tuple:
        if self.dht is None:
            return dv_intra, SharedBackward()
        L, cu, E, G_lo = self.L, self.cu, self.E, self.res.act.G_lo
        fin = lambda k_, G_, v_, h_, a_, h0_: (shared_finals(L, cu, k_, G_, G_lo, v_, h_) if E is None
                                               else entry_finals(L, cu, k_, G_, G_lo, v_, h_, a_, h0_, E.ok))
        primals = (k, G, v_out, h) + ((None, None) if E is None else (E.a, E.h0))
        d = finals_vjp(L, cu, fin, primals, self.dht)  # d_k, d_G, d_v, d_h, d_a, d_h0
        return dv_intra + d[2].astype(dv_intra.dtype), SharedBackward(fin=d)

    def dh_start(self, extra: SharedBackward):  # (the final states' part of them, [1, HV, NC, K, V])
        return None if extra.fin is None else extra.fin[3].astype(self.res.h0.dtype)

    def after_dhu(self, dhu, run_dhu, extra: SharedBackward, took: bool = False) -> tuple:
        d_entries = dhu.dh0  # (entries: the cotangents of the states F4 loaded)
        if extra.fin is None or took:  # (took: B2 had them as dh_start; its dh0 holds what reaches entries)
            return dhu, extra._replace(d_entries=d_entries)
        # The chunk-start states' cotangents from the final states, run back on their own.
        L, E, NC = self.L, self.E, self.L.num_chunks
        first = L.first[0] if E is not None else jnp.where(L.first[0] >= 0, NC, -1)
        per_chunk = jnp.moveaxis(extra.fin[3][0], 1, 0).astype(self.res.h0.dtype)  # [NC, HV, K, V]
        table = jnp.concatenate([per_chunk, jnp.zeros_like(per_chunk[:1])])
        more = run_dhu(table, lambda: entry_layout(L, self.cu, first))
        out = dataclasses.replace(dhu, dh=dhu.dh + more.dh, dv_new=dhu.dv_new + more.dv_new)
        if E is not None:  # a loaded state's own cotangent goes to its entry
            M = E.chunks.idx.shape[0]
            loaded = jnp.zeros_like(d_entries).at[_injected(first, M)].add(per_chunk, mode="drop")
            d_entries = d_entries + more.dh0[:M + 1] + loaded
        return out, extra._replace(d_entries=d_entries)

    def after_wy_dqkg(self, grads, extra: SharedBackward, *, dv_intra, doc, Akk) -> tuple:
        E, L, dt, fin = self.E, self.L, self.res.h0.dtype, extra.fin
        if E is not None:  # the first-chunk part's VJP, its Akk cotangent as B3's dL
            # Only the entries some chunk loads have a cotangent (a stage may leave the others
            # unwritten: the Triton B2 does).
            M = E.chunks.idx.shape[0]
            loads = jnp.zeros((M + 1,), bool).at[_injected(L.first[0], M)].set(True, mode="drop")
            d_entries = jnp.where(loads[:, None, None, None], extra.d_entries, 0.0).astype(dt)
            fc = E.chunks  # (the part ran on its sequences' first chunks alone)
            dq_, dk_, db_, dG_, dAkk, dv_, da, dh0 = E.entries_vjp((fc.take(dv_intra), fc.take(doc), d_entries))
            if fin is not None:
                da, dh0 = da + fin[4], dh0 + fin[5]
            extra = extra._replace(decays=E.decays_vjp(da), dh0=dh0)
            mT, mm = lambda x: jnp.swapaxes(x, -1, -2), functools.partial(jnp.matmul, precision=HI)
            reset = fc.take(L.reset[:, None])[:, 0]  # [R, M, C]
            Akk, same = fc.take(Akk), same_segment(per_head(segments(reset), Akk.shape[1]))  # L's pairs in a sequence
            keep = functools.partial(select_zero, same)  # (never 0 * inf between sequences)
            dL = jnp.where(ranked(tri_mask(L.chunk_size, strict=True), same) & same, -mm(keep(mm(mT(Akk), keep(dAkk))), mT(Akk)), 0.0)
            put = fc.put
            grads = dataclasses.replace(grads, dq=put(grads.dq, dq_), dk=put(grads.dk, dk_), dv=put(grads.dv, dv_),
                                        dbeta=put(grads.dbeta, db_), dG=put(grads.dG, dG_), dL=put(grads.dL, dL))
        if fin is not None:  # the final states' own cotangents of k and G
            grads = dataclasses.replace(grads, dk=grads.dk + fin[0].astype(grads.dk.dtype),
                                        dG=grads.dG + fin[1].astype(grads.dG.dtype))
        return grads, extra

    def after_gate_bwd(self, raw, extra: SharedBackward):
        if self.E is None:
            return raw
        dg_start, dA_start, db_start = extra.decays  # the start tokens' own decays (start_decays' VJP)
        add = lambda a, b: a if a is None or b is None else a + b.astype(a.dtype)
        return dataclasses.replace(raw, dg=add(raw.dg, dg_start), dA_log=add(raw.dA_log, dA_start),
                                   ddt_bias=add(raw.ddt_bias, db_start))

    def initial_state(self, dhu, extra: SharedBackward):
        return extra.dh0  # (None: the shared layout without entries had no initial states)
