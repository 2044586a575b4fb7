"""Inter-chunk state family: F4 (forward recurrence over chunks) and B2 (dhu, reverse).

Both scan over the chunk axis. Sequence boundaries come from the layout: chunk c of row r
starts sequence ``layout.first[r, c]`` (state reset to its initial state) and/or ends
sequence ``layout.last[r, c]`` (its final state is written / its ``dht`` enters), -1 for
neither.
"""

import abc
import functools
from types import MappingProxyType
from typing import ClassVar, Literal, Mapping, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from .._layouts.layout import ChunkLayout
from .._layouts.resets import from_start, mask_exponent, per_head, segments, select_zero, state_passes, to_end
from .._numerics import precision as _precision
from .._numerics.arrays import mT, vary_like, zeros_after
from .._numerics.chunk_loops import loop_unroll
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Specs
from .._annotations import ChunkK, ChunkState, ChunkV, ChunkValid, SeqState
from ._types import KDA, AbstractBackwardStage, AbstractForwardStage, DhuOut, StateOut


def _at(c):
    """Chunk ``c`` of ``[R, HV, NC, ...]`` (or column ``c`` of ``[R, NC]``), read in place:
    scanning a chunk-major copy costs more than the loop itself on CPU."""
    return lambda x: jax.lax.dynamic_index_in_dim(x, c, 2 if x.ndim > 2 else 1, keepdims=False)


def _mm(a, b, half):
    """``a @ b`` for the recurrences: with ``half`` (their operand dtype under the ``"fast"``
    policy, ``kdax._numerics.precision.operand``) float32 (or bf16-stored) operands rounded
    to bf16, products accumulated in float32 (what the GPU computes, emulated exactly on any
    backend: a bf16 x bf16 product is exact in float32); else ``a @ b``."""
    if half is not None and a.dtype in (jnp.float32, half):
        default = jax.lax.Precision.DEFAULT  # explicit: not the scope's algorithm
        return jnp.matmul(a.astype(half), b.astype(half), precision=default, preferred_element_type=jnp.float32)
    return a @ b


def _put(x, c, y):
    return jax.lax.dynamic_update_index_in_dim(x, y, c, 2)


def _select(ids, table, other):
    """Per row r: ``table[ids[r]]`` where ``ids[r] >= 0``, else ``other[r]``."""
    return jnp.where((ids >= 0)[:, None, None, None], table[jnp.maximum(ids, 0)], other)


def _enter(layout: ChunkLayout, c, at_c: int, ids, table, other):
    """``_select`` at chunk ``c``; a dense layout (row r is sequence r, entered at chunk
    ``at_c``) reads ``table`` whole instead of gathering by id, which would gather
    across devices when rows are sharded. A loop over a dense layout starts its carry at
    ``table`` instead (``_carried``) and enters nothing."""
    if layout.dense:
        return jnp.where(c == at_c, table, other)
    return _select(ids, table, other)


def _carried(layout: ChunkLayout, table, shape):
    """Whether a chunk loop starts its carry at ``table`` (a dense layout: every row's
    sequence enters at the loop's first chunk) instead of selecting it there at every
    step: a pass over the whole state per chunk saved (F4 and B2 ~7% on CPU)."""
    return layout.dense and tuple(table.shape) == tuple(shape)


class AbstractState(AbstractForwardStage):
    """F4: the recurrence over chunks. With ``h`` the state at a chunk's start
    (``h0`` of the sequence at its first chunk, ``layout.first``): ``v_new = u - w h`` and
    ``h <- e^Γ h + kg^T v_new`` (``e^Γ`` scales the K rows).

    Arguments: ``w``, ``kg`` ``[R, HV, NC, C, K]``, ``u`` ``[.., V]`` (F3); ``G`` (F1);
    ``h0`` ``[N, HV, K, V]`` each sequence's initial state; ``layout``.

    Returns ``StateOut``: ``h`` ``[R, HV, NC, K, V]`` the state at each chunk's *start*;
    ``v_new`` ``[.., V]``; ``final`` ``[N, HV, K, V]`` (a sequence of length 0 keeps its
    ``h0``).

    ``reset`` ``[R, NC, C]`` or None (shared chunks, ``kdax._layouts.resets``; the layout's
    ``reset``): the decay ``e^Γ`` is exactly zero through a chunk in which a sequence
    starts after its first token (the state is replaced). A stage not declaring it (``accepts``)
    cannot run shared chunks (the pipeline falls back)."""

    @abc.abstractmethod
    def __call__(
        self,
        w: ChunkK,
        u: ChunkV,
        kg: ChunkK,
        G: ChunkK,
        h0: SeqState,
        layout: ChunkLayout,
        reset: Optional[ChunkValid] = None,
    ) -> StateOut:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> StateOut:
        """What F4 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        w, u, h0 = kw["w"], kw["u"], kw["h0"]
        return StateOut(s.like(h0, w.shape[:3] + (w.shape[-1], u.shape[-1]), stored=True),
                        s.like(h0, u.shape, stored=True), s.like(h0))


@final
class ReferenceState(AbstractState):
    """F4 as a loop over chunks; unrolled for at most ``unroll`` chunks (a forward tile),
    which writes ``h`` and ``v_new`` once by stacking instead of into zero-filled buffers
    chunk by chunk (once 5% of the tiled CPU forward; session 27: no difference, and the
    loop compiles faster: ``"auto"`` unrolls on other backends only). (Its revert in
    session 27 answered a test artifact, benchmarks/results/codegen_splits.txt.)"""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    # "auto": 0 on CPU (the chunk loop: the forward's compile at B=1 T=2048 H=4 K=V=64 3.8 ->
    # 3.0 s of CPU, its time the same at the main job's shape, same process), 8 elsewhere.
    unroll: Union[int, Literal["auto"]] = eqx.field(static=True, default="auto")
    # fori_loop's unroll factor over the chunks ("auto": kdax._numerics.chunk_loops.loop_unroll): on a
    # GPU each loop iteration costs a launch and a round trip to the host.
    loop_unroll: Union[int, Literal["auto"]] = eqx.field(static=True, default="auto")

    def __call__(self, w, u, kg, G, h0, layout, reset=None, *, precision: str = "highest"):
        R, HV, NC, _, K = w.shape
        V = u.shape[-1]
        if NC == 0:  # T = 0: every sequence is empty and keeps its initial state
            return StateOut(jnp.zeros((R, HV, 0, K, V), h0.dtype), u, h0)
        decay = _decay(G, reset)
        half = _precision.operand(precision, AbstractState)
        guard = _guard(reset, HV)

        if NC <= _python_unroll(self.unroll):
            h = h0 if _carried(layout, h0, (R, HV, K, V)) else jnp.zeros((R, HV, K, V), h0.dtype)
            hs, v_news = [], []
            for c in range(NC):
                h_start, v_new, h = _chunk(layout, c, h, w, u, kg, decay, h0, half, guard)
                hs.append(h_start)
                v_news.append(v_new)
            hs, v_news = jnp.stack(hs, 2), jnp.stack(v_news, 2)
        else:
            unroll = max(1, min(loop_unroll(self.loop_unroll), NC))
            h, hs, v_news = _recurrence((unroll, half, _precision.captured()), layout, w, u, kg, G, decay, h0, guard)
        # Stored as FLA stores them (bf16 under "fast"; kdax._numerics.precision.stored). The
        # products above rounded the same values, so only the copies change.
        stored = lambda x: _precision.stored(x, precision)  # noqa: E731
        if layout.dense:  # row r is sequence r, which ends at the last chunk
            return StateOut(stored(hs), stored(v_news), h)
        # The final states after the loop, from each sequence's last chunk: a table update
        # per chunk inside the loop copied the whole [N, HV, K, V] table every chunk (13 s
        # for 1000 packed one-token sequences at H=4, K=V=64; 12 ms dense).
        r, c, ends = _chunk_of(layout.last, h0.shape[0], latest=True)
        take = lambda x: x[r, :, c]
        if guard is None:
            final = take(decay)[..., None] * take(hs) + _mm(mT(take(kg)), take(v_news), half)
        else:
            final = _end_state(half, take(hs), take(kg), take(v_news), take(decay), tuple(map(take, guard)))
        return StateOut(stored(hs), stored(v_news), jnp.where(ends[:, None, None, None], final, h0))


def _vary_like(init, deps):
    """``vary_like(init, deps)`` for a loop's initial carry, called only inside
    ``jax.shard_map`` (where an array of ``deps`` varies over a manual axis): elsewhere
    ``init`` as it is, so that a carried ``h0`` / ``dht`` (``_carried``) goes straight into
    the loop (tests/test_layout_goals.py follows ``h0`` through the files it enters)."""
    if any(_axes(d) for d in deps):
        return vary_like(init, deps)
    return init


def _axes(x) -> set:
    """The manual mesh axes ``x`` varies over (``kdax._numerics.arrays.varying_axes``)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()) or ())


def _python_unroll(unroll: Union[int, Literal["auto"]]) -> int:
    """``ReferenceState.unroll``: how many chunks at most the stage unrolls in Python."""
    if unroll == "auto":
        return 0 if jax.default_backend() == "cpu" else 8
    return unroll


def _chunk(layout, c, h, w, u, kg, decay, h0, half, guard=None):
    """Chunk ``c`` of F4: ``(h at its start, v_new, h at its end)`` from the state ``h``
    carried in (replaced by ``h0`` of a sequence that starts there)."""
    at = _at(c)
    if not _carried(layout, h0, h.shape):
        h = _enter(layout, c, 0, at(layout.first), h0, h)
    v_new, h_next = _step(half, h, w, u, kg, decay, at, guard)
    return h, v_new, h_next


def _guard(reset, HV: int):
    """``(from_start [R, HV, NC, C, 1], to_end, state_passes [R, 1, NC, 1])`` of shared chunks'
    ``reset`` (``kdax._layouts.resets``), or None: what ``_step`` selects by."""
    if reset is None:
        return None
    seg = per_head(segments(reset), HV)
    return from_start(seg), to_end(seg), state_passes(reset)


def _step(half, h, w, u, kg, decay, at=lambda x: x, guard=None):
    """``(v_new, h at the chunk's end)`` from ``h`` at its start, the chunk's arrays read
    by ``at`` (whole arrays and ``_at(c)``, or the chunk's slices); ``half``: ``_mm``'s;
    ``guard`` (``_guard``): the terms between sequences sharing the chunk (the decays' exact
    zeros) selected away, so that one's overflow (inf) never meets them as ``0 * inf``."""
    if guard is None:
        v_new = at(u) - _mm(at(w), h, half)
        return v_new, at(decay)[..., None] * h + _mm(mT(at(kg)), v_new, half)
    guard = tuple(map(at, guard))
    v_new = at(u) - select_zero(guard[0], _mm(at(w), h, half))
    return v_new, _end_state(half, h, at(kg), v_new, at(decay), guard)


def _end_state(half, h, kg, v_new, decay, guard):
    """The state at a chunk's end from ``h`` at its start and ``v_new``, as ``_step`` with ``guard``."""
    _, end, passes = guard
    return select_zero(passes[..., None], decay[..., None] * h) + _mm(mT(kg), select_zero(end, v_new), half)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recurrence(how, layout, w, u, kg, G, decay, h0, guard=None):
    """F4's loop over chunks: ``(h after the last chunk, hs, v_news)``. Its VJP walks the
    chunks backwards, each chunk's step differentiated alone from the state it started
    from (``_recurrence_bwd``): JAX's VJP of the loop kept each chunk's slices of every
    input and added each chunk's gradient into zeros the size of the whole input.
    ``how``: ``(unroll, half, the forward's matmul precision: precision.captured)``; ``G`` orders the
    buffers' zeros after the inputs (``zeros_after``) and gets no gradient."""
    R, HV, NC, _, K = w.shape
    V = u.shape[-1]
    unroll, half, _ = how

    def step(c, carry):
        h, hs, v_news = carry
        h_start, v_new, h = _chunk(layout, c, h, w, u, kg, decay, h0, half, guard)
        return h, _put(hs, c, h_start), _put(v_news, c, v_new)

    h = h0 if _carried(layout, h0, (R, HV, K, V)) else jnp.zeros((R, HV, K, V), h0.dtype)
    deps = (w, u, kg, G, h0)
    init = _vary_like((h, zeros_after((R, HV, NC, K, V), h0.dtype, deps), zeros_after(u.shape, u.dtype, deps, 1)), deps)
    return jax.lax.fori_loop(0, NC, step, init, unroll=unroll)


def _recurrence_fwd(how, layout, w, u, kg, G, decay, h0, guard=None):
    h, hs, v_news = out = _recurrence(how, layout, w, u, kg, G, decay, h0, guard)
    return out, (layout, w, u, kg, decay, h0, hs, guard)


def _recurrence_bwd(how, res, g):
    unroll, half, matmul = how
    layout, w, u, kg, decay, h0, hs, guard = res
    g_h, g_hs, g_v = g
    NC = w.shape[2]
    N = h0.shape[0]

    def back(i, carry):
        c = NC - 1 - i
        dh, dw, du, dkg, ddecay, dh0 = carry
        at = _at(c)
        parts = (at(hs), at(w), at(u), at(kg), at(decay))
        _, vjp = jax.vjp(lambda *p: _step(half, *p, guard=None if guard is None else tuple(map(at, guard))), *parts)
        d_h, d_w, d_u, d_kg, d_decay = vjp((at(g_v), dh))
        d_h = d_h + at(g_hs)
        # The state a sequence starts from is its h0 (``_enter``): its gradient goes there.
        if layout.dense:
            entered = jnp.full(d_h.shape[:1], c == 0)
            dh0 = jnp.where(c == 0, d_h, dh0)
        else:
            ids = at(layout.first)
            entered = ids >= 0
            dh0 = dh0.at[jnp.where(entered, ids, N)].add(d_h, mode="drop")
        dh = jnp.where(entered[:, None, None, None], 0.0, d_h).astype(dh.dtype)
        return (dh, _put(dw, c, d_w), _put(du, c, d_u), _put(dkg, c, d_kg), _put(ddecay, c, d_decay), dh0)

    deps = (w, u, kg, decay, h0, hs, g_hs, g_v)
    init = vary_like((g_h, jnp.zeros_like(w), jnp.zeros_like(u), jnp.zeros_like(kg), jnp.zeros_like(decay),
                      jnp.zeros_like(h0)), deps)
    with _precision.restored(matmul):
        _, dw, du, dkg, ddecay, dh0 = jax.lax.fori_loop(0, NC, back, init, unroll=unroll)
    # Inside shard_map an input that does not vary over a manual axis the cotangents vary
    # over (zeros made inside, a replicated argument) gets the sum over that axis: the
    # transpose of its implicit broadcast, and the type the custom VJP must return.
    fit = lambda d, x: _psum_to(d, x)
    return None, fit(dw, w), fit(du, u), fit(dkg, kg), None, fit(ddecay, decay), fit(dh0, h0), None


def _psum_to(d, x):
    """``d`` (a cotangent of ``x``) summed over the manual axes it varies over and ``x`` does not."""
    extra = tuple(sorted(_axes(d) - _axes(x)))
    return jax.lax.psum(d, extra) if extra else d


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def _decay(G, reset):
    """``e^Γ`` ``[R, HV, NC, K]``: zero through chunks in which a sequence starts after
    the first token (``reset``, or None)."""
    return jnp.exp(mask_exponent(None if reset is None else state_passes(reset), G[..., -1, :]))


def _chunk_of(ids, N: int, latest: bool):
    """For each of N sequences, the (row, chunk) whose entry in ``ids [R, NC]`` is that
    sequence, and whether there is one (False for sequences of length 0, and, in a tile,
    for those that do not start / end in it). An entry named at several chunks (the shared
    layout's table) takes the latest or earliest, as the kernels' last write (a set of
    repeated indices leaves any one: on a GPU not the CPU's last)."""
    R, NC = ids.shape
    flat = ids.reshape(-1)
    at, seq = jnp.where(flat >= 0, flat, N), jnp.arange(R * NC, dtype=jnp.int32)
    pos = jnp.full((N,), 0 if latest else R * NC - 1, jnp.int32)
    pos = pos.at[at].max(seq, mode="drop") if latest else pos.at[at].min(seq, mode="drop")
    has = jnp.zeros((N,), bool).at[at].set(True, mode="drop")
    return pos // NC, pos % NC, has


class AbstractDhu(AbstractBackwardStage):
    """B2: reverse over chunks. ``dv_new = dv_intra + kg dh``; the gradient of the state at
    a chunk's start is ``e^Γ dh + scale qg^T do - w^T dv_new`` where ``dh`` is that at the
    chunk's end (``dht`` of the sequence at its last chunk).

    Arguments: ``scale``; ``qg``, ``kg``, ``w`` (F3); ``G``; ``do`` ``[R, HV, NC, C, V]``;
    ``dv_intra`` (B1); ``dht`` ``[N, HV, K, V]`` the final states' cotangent (zeros when
    none); ``layout``.

    Returns ``DhuOut``: ``dh`` ``[R, HV, NC, K, V]`` at each chunk's *end*, ``dh0``
    ``[N, HV, K, V]`` (``dht`` for a sequence of length 0), the full ``dv_new``.
    ``reset`` as F4's. A stage declaring ``dh_start`` may be given ``dh_start``
    ``[R, HV, NC, K, V]``, cotangents of F4's chunk-start states ``h`` from outside the
    recurrence (a loss on packed sequences' final states; a custom F5's VJP), added to each
    chunk's start-state cotangent; without it the pipeline runs B2 once more on them."""

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
        reset: Optional[ChunkValid] = None,
    ) -> DhuOut:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> DhuOut:
        """What B2 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        qg, do = kw["qg"], kw["do"]
        return DhuOut(s.computed(qg, qg.shape[:3] + (qg.shape[-1], do.shape[-1]), stored=True), s.like(kw["dht"]),
                      s.like(kw["dv_intra"]))


@final
class ReferenceDhu(AbstractDhu):
    """B2 as a reverse loop over chunks (``loop_unroll``: as in ``ReferenceState``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"state": KDA, "output": KDA})
    accepts: ClassVar[frozenset] = frozenset({"reset", "dh_start"})

    loop_unroll: Union[int, Literal["auto"]] = eqx.field(static=True, default="auto")

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout, reset=None, *,
                 dh_start: Optional[ChunkState] = None, precision: str = "highest"):
        half = _precision.operand(precision, AbstractDhu)
        own = lambda pick: scale * _mm(mT(pick(qg)), pick(do), half)  # (pick: a chunk, or each sequence's first)
        source = own if dh_start is None else (lambda pick: own(pick) + pick(dh_start))
        deps = (qg, kg, w, G, do, dv_intra, dht) + (() if dh_start is None else (dh_start,))
        return self._recurrence(kg, w, _decay(G, reset), source, dv_intra, dht, layout, deps, do, half,
                                _guard(reset, kg.shape[1]))

    def _recurrence(self, kg, w, decay, source, dv_intra, dht, layout, deps, like, half, guard=None) -> DhuOut:
        """The reverse loop over chunks, ``source(pick)`` the term each chunk's start-state
        cotangent gains (``pick`` selects the chunk's arrays); ``deps``, ``like``: what the
        loop's buffers depend on (``zeros_after``) and the ``dv_new`` buffer's shape and dtype;
        ``half``: the products' operand dtype (``_mm``); ``guard``: F4's ``_step``'s."""
        R, HV, NC, _, K = kg.shape
        V = dht.shape[-1]
        carried = _carried(layout, dht, (R, HV, K, V))

        def back(pick, dh_end, dv_new):  # (the start state's cotangent)
            if guard is None:
                return pick(decay)[..., None] * dh_end + source(pick) - _mm(mT(pick(w)), dv_new, half)
            start, _, passes = (pick(m) for m in guard)
            carry = select_zero(passes[..., None], pick(decay)[..., None] * dh_end)
            # (w's rows after a reset: zeros, or a sequence's overflow)
            return carry + source(pick) - _mm(mT(select_zero(start, pick(w))), select_zero(start, dv_new), half)

        def step(i, carry):
            dh_c, dhs, dv_news = carry
            c = NC - 1 - i
            at = _at(c)
            dh_end = dh_c if carried else _enter(layout, c, NC - 1, at(layout.last), dht, dh_c)
            if guard is None:
                dv_new = at(dv_intra) + _mm(at(kg), dh_end, half)
            else:
                dv_new = at(dv_intra) + select_zero(at(guard[1]), _mm(at(kg), dh_end, half))
            return back(at, dh_end, dv_new), _put(dhs, c, dh_end), _put(dv_news, c, dv_new)

        # A sequence of length 0 has no chunk: its dh0 is its dht.
        dh0 = jnp.where(layout.empty[:, None, None, None], dht, 0.0)
        if NC == 0:
            return DhuOut(jnp.zeros((R, HV, 0, K, V), dht.dtype), dh0, dv_intra)
        dhs = zeros_after((R, HV, NC, K, V), dht.dtype, deps)
        start = dht if carried else jnp.zeros((R, HV, K, V), dht.dtype)
        init = _vary_like((start, dhs, zeros_after(like.shape, like.dtype, deps, 1)), deps)
        dh_first, dh, dv_new = jax.lax.fori_loop(0, NC, step, init, unroll=max(1, min(loop_unroll(self.loop_unroll), NC)))
        if layout.dense:  # row r is sequence r, which starts at chunk 0
            return DhuOut(dh, dh_first, dv_new)
        # dh0 after the loop, from each sequence's first chunk (see ReferenceState).
        r, c, starts = _chunk_of(layout.first, dht.shape[0], latest=False)
        take = lambda x: x[r, :, c]
        if guard is None:
            first = take(decay)[..., None] * take(dh) + source(take) - _mm(mT(take(w)), take(dv_new), half)
        else:
            first = back(take, take(dh), take(dv_new))
        return DhuOut(dh, jnp.where(starts[:, None, None, None], first, dh0), dv_new)
