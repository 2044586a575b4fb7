"""Segment-split chunk recurrences: F4 and B2 with each row's chunks cut into segments that
run side by side, joined exactly by affine summaries (sequence parallelism inside one
device, DESIGN.md §5).

At small batch the recurrences have little parallel work (B = 1, H = 16: 16-32 programs
of a state kernel on a 132-SM GPU, each walking all 256 chunks). ``SegmentedState`` cuts
the chunk axis into ``segments`` spans of ``L`` chunks and runs its inner F4 stage on the
``R * S`` segment rows at once, three steps:

1. summaries: over a span the state map is affine, ``h_out = M h_in + b`` (``M [K, K]``,
   ``b [K, V]``); the inner stage on ``[u | 0_K]`` from ``[0 | I]`` gives ``[b | M]`` for
   every segment in one pass (a sequence that starts inside a segment loads its own
   ``[h0 | 0]``, so ``M = 0`` from there: resets need no bookkeeping);
2. the exclusive prefix over each row's segments (``kdax.parallel.scan_prefix``, the scan
   sequence parallelism runs over devices) gives each segment's true entry state;
3. the inner stage once more from those entries: ``h``, ``v_new`` and the final states.

``SegmentedDhu`` mirrors it in reverse: ``[c | M^T]`` from the inner B2 on
``[do | 0]``, ``[dv_intra | 0]`` from ``[0 | I]`` at each segment's end, the reverse
prefix, the local pass. B0 recomputes through the pipeline's own F4 stage, so a pipeline
with a ``SegmentedState`` recomputes segmented too.

How segments reach the inner stage: as rows of a packed layout (``layout.dense`` False).
Segment ``(r, s)`` is row ``r * S + s``; its first chunk enters state ``N + r * S + s`` of
an extended state table (unless a sequence starts there), its last chunk leaves to the
same entry of the final-state table (unless a sequence ends there: then the next chunk
starts a sequence or is padding, and the exit is that sequence's final state). The chunk
axis is zero-padded to ``S * L`` (zero ``w``, ``u``, ``kg``, ``G``: the identity map).
Any inner stage that takes packed layouts works (``ReferenceState``, the Triton state
kernels). Exact: every step is the unsplit recurrence's arithmetic regrouped (float64:
~1e-13 against the unsplit stage); the cost is the inner stage run twice on ``V + K``
then ``V`` columns, and the summaries' ``K x K`` compositions.
"""

import equinox as eqx
import jax.numpy as jnp

from .._layouts.layout import ChunkLayout
from .._numerics.affine import scan_prefix
from .._stage_protocol.capabilities import told
from .._stage_protocol.final import final
from ._state import AbstractDhu, AbstractState, ReferenceDhu, ReferenceState
from ._types import KDA, DhuOut, StateOut


def _split(NC: int, segments: int) -> tuple[int, int]:
    """``(S, L)``: S segments of L chunks covering NC (no segment only padding)."""
    L = -(-NC // max(1, min(segments, NC)))
    return -(-NC // L), L


def _to_segments(x, S: int, L: int):
    """``[R, HV, NC, ...] -> [R * S, HV, L, ...]``, the chunk axis zero-padded to S * L."""
    R, HV, NC = x.shape[:3]
    x = jnp.pad(x, [(0, 0), (0, 0), (0, S * L - NC)] + [(0, 0)] * (x.ndim - 3))
    x = x.reshape(R, HV, S, L, *x.shape[3:])
    return jnp.swapaxes(x, 1, 2).reshape(R * S, HV, L, *x.shape[4:])


def _from_segments(x, R: int, S: int, NC: int):
    """Inverse of ``_to_segments``: ``[R * S, HV, L, ...] -> [R, HV, NC, ...]``."""
    _, HV, L = x.shape[:3]
    x = jnp.swapaxes(x.reshape(R, S, HV, L, *x.shape[3:]), 1, 2)
    return x.reshape(R, HV, S * L, *x.shape[4:])[:, :, :NC]


def _segment_layout(layout: ChunkLayout, N: int, S: int, L: int) -> ChunkLayout:
    """The packed layout of the segment rows: sequence ids as in ``layout``; a segment
    whose first (last) chunk starts (ends) no sequence enters (leaves) through state
    ``N + segment``."""
    R, NC = layout.first.shape
    pad = lambda a, v: jnp.pad(a, [(0, 0), (0, S * L - NC)] + [(0, 0)] * (a.ndim - 2), constant_values=v)
    first = pad(layout.first, -1).reshape(R * S, L)
    last = pad(layout.last, -1).reshape(R * S, L)
    valid = pad(layout.valid, False).reshape(R * S, L, layout.valid.shape[-1])
    seg = N + jnp.arange(R * S, dtype=first.dtype)
    first = first.at[:, 0].set(jnp.where(first[:, 0] >= 0, first[:, 0], seg))
    last = last.at[:, -1].set(jnp.where(last[:, -1] >= 0, last[:, -1], seg))
    empty = jnp.concatenate([layout.empty, jnp.zeros((R * S,), bool)])
    return ChunkLayout(first, last, valid, empty, None, L * layout.chunk_size, layout.chunk_size, dense=False)


def _table(seq, seg_part, extra_seq, extra_seg):
    """The extended state table ``[N + R*S, HV, K, V + K]``: ``[seq | extra_seq]`` for the
    sequences, ``[seg_part | extra_seg]`` for the segments."""
    return jnp.concatenate([jnp.concatenate([seq, extra_seq], -1), jnp.concatenate([seg_part, extra_seg], -1)], 0)


def _identity_table(N: int, RS: int, HV: int, K: int, V: int, dtype):
    """``[h | 0]`` rows for the N sequences' ``h`` and ``[0 | I]`` for the RS segments."""
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dtype), (RS, HV, K, K))
    return jnp.zeros((RS, HV, K, V), dtype), jnp.zeros((N, HV, K, K), dtype), eye


def _prefix(M, b, R: int, S: int, reverse: bool):
    """Entries ``[R * S, HV, K, V]`` of each row's segments from their summaries
    ``M [R * S, HV, K, K]``, ``b [.., V]`` (zero entering the row's first segment, or its
    last with ``reverse``)."""
    lead = lambda x: jnp.moveaxis(x.reshape(R, S, *x.shape[1:]), 1, 0)
    entries = scan_prefix(lead(M), lead(b), reverse=reverse)
    return jnp.moveaxis(entries, 0, 1).reshape(R * S, *b.shape[1:])


def _check_segments(segments: int):
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ValueError(f"segments: expected an int >= 1, got {segments!r}.")


def _check_affine(state, dhu) -> None:
    """The summaries join segments exactly only for KDA's recurrences: an F4 whose state
    map is affine in its entry state (declared ``math = KDA``) and a B2 that transposes it.
    Anything else is refused by name (a split it cannot join would give other numbers)."""
    if state is not None and getattr(state, "math", None) != KDA:
        raise ValueError(
            f"segments: the split recurrence joins segments by affine summaries, exact only for an F4 whose state "
            f"map is affine in its entry state; F4 `state` ({type(state).__qualname__}) declares math "
            f"{getattr(state, 'math', None)!r}. If it computes KDA's state recurrence, declare math = "
            f"kdax.stages.KDA on its class; otherwise run it unsegmented.")
    if dhu is not None and dict(getattr(dhu, "transposes", {})).get("state") != KDA:
        raise ValueError(
            f"segments: the split reverse recurrence is exact only for a B2 that transposes KDA's F4; B2 `dhu` "
            f"({type(dhu).__qualname__}) declares transposes {dict(getattr(dhu, 'transposes', {}))!r}. If it does, "
            f"declare transposes = {{'state': kdax.stages.KDA, 'output': ...}} on its class; otherwise run it "
            f"unsegmented.")


@final
class SegmentedState(AbstractState):
    """F4 with each row's chunk recurrence split into ``segments`` spans run side by side
    (module docstring). ``inner``: the F4 stage each pass runs (any that takes packed
    layouts). ``segments = 1`` (or one chunk) runs ``inner`` unsplit."""

    inner: AbstractState = ReferenceState()
    segments: int = eqx.field(static=True, default=4)

    @property
    def math(self):  # (the split recurrence computes what its inner stage does)
        return self.inner.math

    @property
    def plan_note(self) -> str:
        return (f"each row's chunk recurrence in up to {self.segments} segments side by side, joined by "
                f"affine summaries ({type(self.inner).__qualname__} inside)")

    def __check_init__(self):
        _check_segments(self.segments)

    def __call__(self, w, u, kg, G, h0, layout, *, precision: str = "highest"):
        R, HV, NC, C, K = w.shape
        V, N = u.shape[-1], h0.shape[0]
        S, L = _split(NC, self.segments)
        told_ = told(self.inner, precision)  # (the policy, to an inner stage that takes it)
        if S <= 1:
            return self.inner(w, u, kg, G, h0, layout, **told_)
        _check_affine(self.inner, None)
        seg = lambda x: _to_segments(x, S, L)
        sl = _segment_layout(layout, N, S, L)
        ws, kgs, Gs = seg(w), seg(kg), seg(G)
        # (1) [b | M] of every segment: [u | 0] from [h0 | 0] (sequences) and [0 | I] (segments)
        zero_v, zero_k, eye = _identity_table(N, R * S, HV, K, V, h0.dtype)
        u_aug = seg(jnp.concatenate([u, jnp.zeros(u.shape[:-1] + (K,), u.dtype)], -1))
        summ = self.inner(ws, u_aug, kgs, Gs, _table(h0, zero_v, zero_k, eye), sl, **told_).final
        summ = summ[sl.last[:, -1]]  # each segment's exit (a sequence's final where one ends there)
        # (2) the true entry of each segment, (3) the local pass from it
        entry = _prefix(summ[..., V:], summ[..., :V], R, S, reverse=False)
        out = self.inner(ws, seg(u), kgs, Gs, jnp.concatenate([h0, entry], 0), sl, **told_)
        return StateOut(_from_segments(out.h, R, S, NC), _from_segments(out.v_new, R, S, NC), out.final[:N])


@final
class SegmentedDhu(AbstractDhu):
    """B2 with each row's reverse chunk recurrence split into ``segments`` spans (module
    docstring): ``[c | M^T]`` per segment, the reverse prefix, the local pass."""

    inner: AbstractDhu = ReferenceDhu()
    segments: int = eqx.field(static=True, default=4)

    @property
    def transposes(self):  # (the split recurrence transposes what its inner stage does)
        return self.inner.transposes

    @property
    def plan_note(self) -> str:
        return (f"each row's reverse chunk recurrence in up to {self.segments} segments side by side, joined by "
                f"affine summaries ({type(self.inner).__qualname__} inside)")

    def __check_init__(self):
        _check_segments(self.segments)

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout, *, precision: str = "highest"):
        R, HV, NC, C, K = qg.shape
        V, N = do.shape[-1], dht.shape[0]
        S, L = _split(NC, self.segments)
        told_ = told(self.inner, precision)
        if S <= 1:
            return self.inner(scale, qg, kg, w, G, do, dv_intra, dht, layout, **told_)
        _check_affine(None, self.inner)
        seg = lambda x: _to_segments(x, S, L)
        sl = _segment_layout(layout, N, S, L)
        qgs, kgs, ws, Gs = seg(qg), seg(kg), seg(w), seg(G)
        # (1) [c | M^T] of every segment: [do | 0], [dv_intra | 0] from [dht | 0] and [0 | I]
        zero_v, zero_k, eye = _identity_table(N, R * S, HV, K, V, dht.dtype)
        pad = lambda x: seg(jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (K,), x.dtype)], -1))
        summ = self.inner(scale, qgs, kgs, ws, Gs, pad(do), pad(dv_intra), _table(dht, zero_v, zero_k, eye), sl,
                          **told_).dh0
        summ = summ[sl.first[:, 0]]  # the gradient leaving each segment's start
        # (2) the gradient arriving at each segment's end, (3) the local pass
        exit_ = _prefix(summ[..., V:], summ[..., :V], R, S, reverse=True)
        out = self.inner(scale, qgs, kgs, ws, Gs, seg(do), seg(dv_intra), jnp.concatenate([dht, exit_], 0), sl, **told_)
        return DhuOut(_from_segments(out.dh, R, S, NC), out.dh0[:N], _from_segments(out.dv_new, R, S, NC))


def segmented(pipeline, segments: int = 4):
    """``pipeline`` with its F4 and B2 stages split into ``segments`` (wrapping the stages
    it has; B0 recomputes through F4, so it follows). Both must be KDA's recurrences
    (declared ``math`` / ``transposes``): the affine summaries join nothing else exactly
    (``ValueError`` naming the stage)."""
    if not all(hasattr(pipeline, n) for n in ("state", "dhu")):
        raise TypeError(f"pipeline: expected a KDAPipeline (segmented splits its F4 and B2 stages), got "
                        f"{type(pipeline).__name__}.")
    _check_segments(segments)
    _check_affine(pipeline.state, pipeline.dhu)
    return eqx.tree_at(lambda p: (p.state, p.dhu), pipeline,
                       (SegmentedState(pipeline.state, segments), SegmentedDhu(pipeline.dhu, segments)))
