"""Non-finite inputs and cotangents stay in their own sequence.

The chunked algorithm multiplies values of several tokens together: those of a chunk
(with one sequence per chunk, the padding's exact zeros; in shared chunks,
``_layouts.layout.make_shared_layout``, other sequences' tokens), and a state by exact zeros where a
reset replaces it. ``0 * NaN`` is NaN, so a NaN or inf would travel from its token to
earlier tokens of its chunk and to other sequences. ``chunk_kda`` therefore runs on
finite inputs and puts the non-finite values back where the per-sequence recurrence has
them:

- forward (``cleaner``, applied as the forward packs each tile, and ``poison_outputs``):
  each non-finite input element that the recurrence would carry (``bad_elements``) reads
  as zero; each sequence's first
  token holding one for a value head (``first_bad``) makes that head's outputs NaN from
  that token on, and its final state NaN; a non-finite ``q`` alone makes only its own
  token's outputs NaN (q is read, never written into the state). Every other output is
  what the recurrence gives: the tokens before are computed as before, other sequences
  never see the value.
- backward (``poison_inputs``): the gradients of that head's inputs from the same
  token on are NaN, those before are the recurrence's (the replaced zeros are after them).
- cotangents (``clean_cotangents``, in ``chunk_kda``'s VJP): a non-finite ``do`` at token
  u of a sequence, or ``dht`` of a sequence, is replaced by zero, and that sequence's
  gradients at tokens up to u (all of them, for ``dht``) and its ``dh0`` are NaN, as the
  recurrence's autodiff gives; other sequences are untouched.

A gate of ``-inf`` (a full reset) and a raw gate or beta whose in-kernel activation is
finite at ±inf (softplus/lower-bound gate, beta sigmoid) are valid inputs, not replaced.
Large finite inputs whose intermediates overflow are not detected (float64 keeps 1e30
inputs finite).
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp



def sequence_ids(B: int, T: int, cu_seqlens):
    """``([B, T] int32 sequence of each token, N)``: row b for dense input, else the
    sequence of ``cu_seqlens`` holding the token."""
    if cu_seqlens is None:
        return jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T)), B
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    N = cu.shape[0] - 1
    seq = jnp.searchsorted(cu, jnp.arange(T, dtype=jnp.int32), side="right") - 1
    return jnp.clip(seq, 0, max(N - 1, 0)).astype(jnp.int32)[None], N


# Which elements of an input the recurrence turns into NaN or inf, by kind (a static
# name, so that the test fuses into each pass that needs it instead of a stored mask).
def is_bad(kind: str, x, inf=jnp.inf):
    if kind == "nan":  # an activation finite at ±inf (softplus / lower-bound gate, beta sigmoid)
        return jnp.isnan(x) if inf is jnp.inf else jnp.isnan(x) | (x > inf)  # (x > inf: never; see _in_turn)
    if kind == "decay":  # a log decay: -inf is a full reset (clamped to the floor)
        return jnp.isnan(x) | (x == inf)
    if kind == "any":
        return ~(jnp.abs(x) < inf)  # any non-finite value
    raise ValueError(f"kind: expected 'nan', 'decay' or 'any', got {kind!r}.")


def input_kinds(gate_in_kernel: bool, beta_sigmoid: bool) -> tuple:
    """The ``is_bad`` kind of each of (q, k, v, g, beta)."""
    return ("any", "any", "any", "nan" if gate_in_kernel else "decay", "nan" if beta_sigmoid else "any")


def bad_elements(raw, gate_in_kernel: bool, beta_sigmoid: bool):
    """Per input of ``raw = (q, k, v, g, beta)``, the elements the recurrence turns into
    NaN or inf (same shapes)."""
    return tuple(is_bad(kind, x) for kind, x in zip(input_kinds(gate_in_kernel, beta_sigmoid), raw))


def _per_value_head(x, HV: int):
    """``[B, T, Hx]`` -> ``[B, T, HV]`` (value head i reads q/k head i // (HV // Hx))."""
    return x if x.shape[-1] == HV else jnp.repeat(x, HV // x.shape[-1], axis=-1)


def _reaches(bad, seq, N: Optional[int], reverse: bool = False):
    """``[B, T, HV]``: a ``bad [B, T, HV]`` token of the same sequence (``seq [B, T]``,
    non-decreasing along T; ``N`` packed sequences, None for dense rows) at or before the
    token (at or after it if ``reverse``): the token lies at or after its sequence's first
    bad token (at or before its last), one reduction per sequence (dense: over T; packed:
    a scatter-min/max by sequence id). A log-depth scan along T was ~40 small kernels for
    XLA:CPU to compile, twice in a training step (cummax runs quadratically there)."""
    B, T, HV = bad.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None], bad.shape)
    none = -1 if reverse else T  # (no bad token: no token reaches it)
    x = jnp.where(bad, t, none)
    if N is None:  # dense rows: one reduction per row
        edge = (jnp.max if reverse else jnp.min)(x, axis=1, keepdims=True, initial=none)
    else:  # packed (B = 1): per sequence; a token's sequence id is in [0, max(N, 1))
        rows = jnp.full((max(N, 1), HV), none, jnp.int32).at[seq[0]]
        edge = (rows.max(x[0], indices_are_sorted=True) if reverse else rows.min(x[0], indices_are_sorted=True))[seq]
    return t <= edge if reverse else t >= edge


def _at_ends(x, cu_seqlens, last: bool):
    """``x [B, T, HV]`` at each sequence's last (``last``) or first token, ``[N, HV]``,
    False for an empty sequence. Dense rows take a slice, not a gather: a gather's
    indices would be all-gathered when the rows are sharded."""
    B, T = x.shape[:2]
    if cu_seqlens is None:
        return x[:, -1 if last else 0] if T > 0 else jnp.zeros((B,) + x.shape[2:], bool)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    t = jnp.clip(cu[1:] - 1 if last else cu[:-1], 0, max(T - 1, 0))
    return x[0, t] & (cu[1:] > cu[:-1])[:, None]


def _to_tokens(x, seq, cu_seqlens):
    """Per-sequence ``x [N, HV]`` at each token, ``[B, T, HV]`` (dense: a broadcast, not a
    gather, for the rows' sharding)."""
    return jnp.broadcast_to(x[:, None], seq.shape + x.shape[1:]) if cu_seqlens is None else x[seq]


class Bad:
    """Where a call's non-finite inputs are and what they reach (arrays, not a pytree:
    built and used inside one trace). ``raw = (q, k, v, g, beta)``; ``cu_seqlens`` the
    offsets of this call's tokens (None: dense rows). ``axis``: inside ``shard_map`` with
    the token axis split over that mesh axis (``cu_seqlens`` then this device's offsets,
    clipped to its tokens): a bad token on an earlier device reaches the same sequence
    here, and final states are flagged for every device. ``entering``: packed initial
    states ``[N, HV, K, V]`` that may enter shared chunks (``kdax._layouts.shared_states``,
    one device: not with ``axis``), read as zero there when not finite. ``flag``: a
    scalar the masks depend on (False, or an ``eqx.error_if`` that raises: the inputs'
    domain check, ``kdax._validate.domain_flag``), or None."""

    def __init__(self, raw, cu_seqlens, gate_in_kernel: bool, beta_sigmoid: bool, axis: Optional[str] = None,
                 entering=None, flag=None):
        q, k, v, g, beta = raw
        B, T = q.shape[:2]
        HV = v.shape[2]
        self.kinds = input_kinds(gate_in_kernel, beta_sigmoid)
        # per token and head: one fused pass over each input
        tq, tk, tv, tg = _flags(self.kinds[:4], raw[:4], axis)
        state = _per_value_head(tk, HV) | tv | tg | is_bad(self.kinds[4], beta)  # [B, T, HV]
        self.q_only = _per_value_head(tq, HV)
        seq, N = sequence_ids(B, T, cu_seqlens)
        self.after = _reaches(state, seq, None if cu_seqlens is None else N)  # [B, T, HV]: from the state's first bad token on
        self.state_bad = _at_ends(self.after, cu_seqlens, last=True)  # [N, HV]
        if axis is not None:
            P, d = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
            every = jax.lax.all_gather(self.state_bad, axis)  # [P, N, HV]
            earlier = jnp.any(every & (jnp.arange(P) < d)[:, None, None], axis=0)
            self.after = self.after | _to_tokens(earlier, seq, cu_seqlens)
            # (a psum: replicated over the axis, as the final states are)
            self.state_bad = jax.lax.psum(self.state_bad.astype(jnp.int32), axis) > 0
        if entering is not None:
            if cu_seqlens is None or axis is not None:
                raise ValueError("entering: packed initial states on one device only (cu_seqlens given, no axis).")
            # Such a sequence's head is NaN from its first token on.
            h0_bad = ~finite_heads(entering)  # [N, HV]
            self.after = self.after | _to_tokens(h0_bad, seq, cu_seqlens)
            self.state_bad = self.state_bad | h0_bad
        if flag is not None:  # (what reads the masks then waits for the check, and nothing earlier)
            self.after, self.state_bad = self.after | flag, self.state_bad | flag
        self.where = self.after | self.q_only  # [B, T, HV]: the outputs the recurrence makes NaN


def _flags(kinds, xs, axis):
    """Per input of ``xs``, its tokens and heads holding a bad element
    (``jnp.any(is_bad, -1)``). On a one-device CPU backend each input's test comes after
    the one before (``_in_turn``); elsewhere all at once (GPU, TPU: the tests fuse into
    their reductions; several devices or a mesh axis: the order would take a collective).
    Decided when traced: a CUDA program lowered on such a CPU host carries the order's few
    small ops too."""
    if axis is None and jax.device_count() == 1 and jax.default_backend() == "cpu":
        return _in_turn(kinds, xs)
    return tuple(jnp.any(is_bad(kind, x), -1) for kind, x in zip(kinds, xs))


def _in_turn(kinds, xs):
    """``_flags`` with each input's test made after the one before. XLA:CPU stores the
    full-size boolean a reduction reads; made all at once, four of them were the forward's
    peak. The order comes from a data dependency (an ``optimization_barrier`` is dropped
    before scheduling): the test's ``inf`` is ``inf + 0 * (the count of the previous
    flags)``, inf exactly, but only once that count is known."""
    out, inf = [], jnp.inf
    for kind, x in zip(kinds, xs):
        if out:
            inf = jnp.inf + 0.0 * jnp.sum(out[-1], dtype=jnp.float32)
        out.append(jnp.any(is_bad(kind, x, jnp.asarray(inf, x.dtype)), -1))
    return tuple(out)


def finite_heads(x):
    """``[N, HV]``: whether each head's state ``x [N, HV, K, V]`` is finite: ``x`` times a zero
    vector is 0 where finite and NaN elsewhere, and its sum is 0 only if every element is.
    A product reads ``x`` once; inside a program XLA:CPU ran ``sum(x * 0)`` as a stored
    multiply and a split reduction, 21 ms for 1000 states of 4 x 64 x 64 against 4 ms (a
    boolean or max reduction is no better, and XLA folds it for half a minute at compile
    time when ``x`` is a constant, e.g. the ones of ``jax.grad`` of ``sum(ht)``). The
    pipeline's copy is the same expression, computed once."""
    zero = jnp.zeros(x.shape[-1:], x.dtype)
    return jnp.sum(jnp.einsum("...kv,v->...k", x, zero, precision="highest"), axis=-1) == 0


def finite_or_zero(x):
    """``x`` with its non-finite elements replaced by zero (elementwise: XLA fuses it into
    the op that reads it)."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, jnp.zeros((), x.dtype))


def cleaner(gate_in_kernel: bool, beta_sigmoid: bool):
    """``clean(raw) -> raw``: each input of ``raw = (q, k, v, g, beta)`` with the elements
    the recurrence turns into NaN or inf (``bad_elements``) read as zero; elementwise, for
    ``pack_inputs`` to fuse into its packing."""
    return lambda raw: tuple(jnp.where(bad, jnp.zeros((), x.dtype), x)
                             for bad, x in zip(bad_elements(raw, gate_in_kernel, beta_sigmoid), raw))


def cleaner_of(config):
    """``cleaner`` for a call's ``KDAConfig`` (its in-kernel gate and beta sigmoid): the
    one the forward, the forward with entries and the stage arrays' gradients use."""
    return cleaner(config.use_gate_in_kernel, config.use_beta_sigmoid_in_kernel)


def _token_mask(after, x):
    """``after [B, T, HV]`` as a mask broadcast to input ``x`` ``[B, T, Hx, ...]``
    (a q/k head: any of its value heads)."""
    Hx, HV = x.shape[2], after.shape[-1]
    m = after if Hx == HV else jnp.any(after.reshape(after.shape[:2] + (Hx, HV // Hx)), -1)
    return jnp.broadcast_to(m.reshape(m.shape + (1,) * (x.ndim - 3)), x.shape)


def poison_inputs(where, grads):
    """``grads`` (``KDAGrads``) NaN at the tokens and heads of ``where [B, T, HV]``
    (``Bad.where``, the outputs the recurrence makes NaN): there the recurrence's
    gradient of each input is NaN too; before, the replaced zeros are not involved."""
    nan = lambda x: _nan_at(where, x)
    return dataclasses.replace(grads, q=nan(grads.q), k=nan(grads.k), v=nan(grads.v), g=nan(grads.g),
                               beta=nan(grads.beta))


def _nan_at(mask, x):
    """Input-shaped ``x`` (or None) NaN at the tokens and heads of ``mask [B, T, HV]``."""
    return None if x is None else jnp.where(_token_mask(mask, x), jnp.asarray(jnp.nan, x.dtype), x)


def poison_outputs(bad: Bad, o, final):
    """``o [B, T, HV, V]`` NaN where the recurrence's is (``Bad``); ``final [N, HV, ...]``
    NaN for a sequence whose state met a bad token. Cotangents pass through."""
    nan = jnp.asarray(jnp.nan, o.dtype)
    o = o + jnp.where(bad.where[..., None], nan, jnp.zeros((), o.dtype))
    if final is not None:
        final = final + jnp.where(bad.state_bad[:, :, None, None], jnp.asarray(jnp.nan, final.dtype), 0.0).astype(final.dtype)
    return o, final


def clean_cotangents(do, dht, cu_seqlens, H: int, axis: Optional[str] = None):
    """``(do, poison)`` for ``chunk_kda``'s VJP: a non-finite ``do`` replaced by zero
    (``dht`` is kept out of other sequences by ``KDAPipeline.backward``), and ``poison``
    (``CotangentPoison``) putting NaN into the gradients
    that the recurrence's autodiff makes NaN: every token of a sequence up to its last
    non-finite ``do`` (``dq`` at that token only), all of a sequence with a non-finite
    ``dht``, and that sequence's ``dh0``. ``do [B, T, HV, V]``, ``dht [N, HV, K, V]`` or
    None; ``H`` the q/k heads. ``axis``: inside ``shard_map`` with the token axis split over
    that mesh axis (``cu_seqlens`` this device's offsets): a bad ``do`` on a later device
    reaches this one's tokens of its sequence, and ``dh0``'s sequences are those a bad ``do``
    reaches on any device, the same on every device (replicated, as ``dh0`` is when JAX's
    transpose has summed it over the devices)."""
    B, T, HV = do.shape[:3]
    seq, N = sequence_ids(B, T, cu_seqlens)
    bad_tok = ~jnp.all(jnp.abs(do) < jnp.inf, -1)  # [B, T, HV]
    do = finite_or_zero(do)
    upto = _reaches(bad_tok, seq, None if cu_seqlens is None else N, reverse=True)  # [B, T, HV]
    seq_bad = _at_ends(upto, cu_seqlens, last=False)  # [N, HV]: a bad do reaches the sequence's start
    if dht is not None:
        ht_bad = ~finite_heads(dht)  # [N, HV]
        upto = upto | _to_tokens(ht_bad, seq, cu_seqlens)
        seq_bad = seq_bad | ht_bad
    if axis is not None:
        P, d = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        every = jax.lax.all_gather(seq_bad, axis)  # [P, N, HV]
        upto = upto | _to_tokens(jnp.any(every & (jnp.arange(P) > d)[:, None, None], axis=0), seq, cu_seqlens)
        seq_bad = jax.lax.psum(seq_bad.astype(jnp.int32), axis) > 0  # (a psum: typed replicated, as dh0)
    return do, CotangentPoison(bad_tok, upto, seq_bad)


class CotangentPoison:
    """What ``clean_cotangents`` found: ``bad_tok``, ``upto`` ``[B, T, HV]`` (dq's tokens, the
    other inputs'), ``seq_bad`` ``[N, HV]`` (dh0's heads). Called on ``KDAGrads``: those NaN."""

    def __init__(self, bad_tok, upto, seq_bad):
        self.bad_tok, self.upto, self.seq_bad = bad_tok, upto, seq_bad

    def __call__(self, grads):
        grads = self.states(grads)
        return type(grads)(
            q=_nan_at(self.bad_tok, grads.q), k=_nan_at(self.upto, grads.k), v=_nan_at(self.upto, grads.v),
            g=_nan_at(self.upto, grads.g), beta=_nan_at(self.upto, grads.beta), initial_state=grads.initial_state,
            A_log=grads.A_log, dt_bias=grads.dt_bias,
        )

    def states(self, grads):
        """``grads`` with ``initial_state`` (``[N, HV, K, V]`` or None) NaN for the
        sequences a bad cotangent reaches."""
        dh0 = grads.initial_state
        if dh0 is not None:
            dh0 = jnp.where(self.seq_bad[:, :, None, None], jnp.asarray(jnp.nan, dh0.dtype), dh0)
        return dataclasses.replace(grads, initial_state=dh0)

    def masks(self, where, chunk_size: int):
        """``[B, T // C, C, HV, 2]`` float32, above zero where a gradient is NaN: column 0
        dq's tokens (``bad_tok`` or ``where``), column 1 those of dk, dv, dg, dbeta
        (``upto`` or ``where``); ``where`` is ``Bad.where`` (``poison_inputs``'). For
        ``kdax._layouts.tokens.FinalGrads``: q, k with a head per value head."""
        m = jnp.stack([self.bad_tok | where, self.upto | where], axis=-1).astype(jnp.float32)
        B, T, HV, _ = m.shape
        return m.reshape(B, T // chunk_size, chunk_size, HV, 2)
