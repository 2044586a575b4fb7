"""Issue 18, item 8: many short packed sequences share chunks (``_layouts.layout.make_shared_layout``):
exact against the float64 oracle (outputs, final states and every gradient), the layout
visible in ``plan``, shapes independent of the ``cu_seqlens`` values, checks under jit,
NaN containment, tiles; initial states entering them and a loss on final states."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._layouts.layout import make_shared_layout
from kdax._layouts.shared_states import first_chunks

from ._util import assert_close, make_inputs, oracle_kda, rel_rms, split_args

C = 16
# Lengths 0..3C: empty sequences (also the first and the last), one-token ones, a start on
# a chunk boundary (16), one of 3C straddling three boundaries, T not a multiple of C.
MIX = [0, 0, 1, 2, 2, 3, 16, 17, 65, 66, 70, 70, 85, 85]
ONES = list(range(49))  # 48 one-token sequences: three chunks of 16


def _fn(pipe=None, C=C):
    pipe = kdax.KDAPipeline.reference() if pipe is None else pipe
    return lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, **kw)


def _inputs(cu, dtype=jnp.float64, seed=0, h0=False, gate=False, **kw):
    return make_inputs(seed=seed, B=1, T=cu[-1], H=1, HV=2, K=8, V=8, N=len(cu) - 1, dtype=dtype, h0=h0,
                       gate="raw" if gate else "log", A_log=gate, dt_bias=gate, beta_raw=gate, **kw)


def _outputs_and_grads(fn, x, options, do, dht):
    """``(o, ht, gradients of sum(o * do) + sum(ht * dht))`` of ``fn`` under one jit."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias") if n in x]

    @jax.jit
    def f(arrays):
        def loss(arrays):
            pos, kw = split_args(arrays)
            o, ht = fn(*pos, **kw, **options)
            val = jnp.sum(o * do)
            return val + (jnp.sum(ht * dht) if dht is not None else 0.0), (o, ht)

        grads, (o, ht) = jax.grad(loss, has_aux=True)(arrays)
        return o, ht, grads

    o, ht, grads = f({n: x[n] for n in names})
    return o, ht, grads


def _check(fn, x, options, tol, seed=3, oracle=oracle_kda, oracle_options=None, final_loss=True):
    """Outputs, final states (if asked) and every gradient (of a loss on the final states
    too, if ``final_loss``) against the float64 oracle; returns the gradients."""
    r = np.random.default_rng(seed)
    do = jnp.asarray(r.normal(size=x["v"].shape))
    N, HV, K, V = len(options["cu_seqlens"]) - 1, *x["v"].shape[2:3], x["q"].shape[-1], x["v"].shape[-1]
    dht = jnp.asarray(r.normal(size=(N, HV, K, V))) if final_loss and options.get("output_final_state") else None
    o, ht, got = _outputs_and_grads(fn, x, options, do, dht)
    o_ref, ht_ref, want = _outputs_and_grads(oracle, x, dict(options, **(oracle_options or {})), do, dht)
    assert_close(o, o_ref, tol, "o")
    if options.get("output_final_state"):
        assert_close(ht, ht_ref, tol, "ht")
    for n in want:
        assert_close(got[n], want[n], tol, "d" + n)
    return got


@jax.jit
def _recurrent(cu, *a):
    """float64 recurrence, ``cu_seqlens`` traced (one compile): the reference of the tests
    below that check layouts and tiles rather than exactness (the oracle checks that)."""
    return kdax.fused_recurrent_kda(*a, cu_seqlens=cu)[0]


def _starts(cu):
    """The first token of each sequence (the shared layout's resets)."""
    return sorted({s for s, e in zip(cu[:-1], cu[1:]) if e > s})


def _rows_oracle(*a, cu_seqlens=None, **kw):
    """The float64 oracle for sequences of one token each: each sequence a row of a dense
    batch from a zero state (one scan instead of one per sequence)."""
    rows = lambda x: jnp.swapaxes(x, 0, 1)  # [1, N, ...] -> [N, 1, ...]
    o, ht = oracle_kda(*(rows(x) for x in a), **kw)
    return rows(o), ht


# (the mix of lengths runs in the default run with the in-kernel gate, below)
@pytest.mark.parametrize("cu", [ONES, pytest.param(MIX, marks=pytest.mark.slow)], ids=["one_token", "mix"])
def test_shared_chunks_exact(cu):
    x = _inputs(cu)
    options = dict(cu_seqlens=jnp.asarray(cu, jnp.int32))
    pos, _ = split_args(x)
    plan = kdax.KDAPipeline.reference().plan(*pos, chunk_size=C, **options)
    assert plan.layout == "shared" and "layout: shared" in str(plan) and not plan.fallbacks
    oracle = _rows_oracle if cu == ONES else oracle_kda
    grads = _check(_fn(), x, options, 1e-12, oracle=oracle, oracle_options=dict(cu_seqlens=cu if cu != ONES else None))
    # A sequence's first token meets a zero state: its gate gradient is exactly 0.
    assert np.all(np.asarray(grads["g"])[0, _starts(cu)] == 0)


def test_shared_chunks_in_kernel_gate_and_activations():
    """The mix of lengths with the softplus gate (A_log, dt_bias), l2norm, beta sigmoid and
    the final states (``output_final_state`` without an initial state: still shared
    chunks, each final state read from the chunk of its sequence's last token): outputs,
    final states, every gradient of a loss on o (the shared backward)."""
    x = _inputs(MIX, gate=True)
    options = dict(cu_seqlens=jnp.asarray(MIX, jnp.int32), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, output_final_state=True)
    pos, kw = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, chunk_size=C, **kw, **options).layout == "shared"
    grads = _check(_fn(), x, options, 1e-12, final_loss=False)
    assert set(grads) == {"q", "k", "v", "g", "beta", "A_log", "dt_bias"}
    assert np.all(np.asarray(grads["g"])[0, _starts(MIX)] == 0)


@pytest.mark.parametrize("final", [True, False])
def test_initial_states_enter_shared_chunks_plan(final):
    """Initial states (issue 25 item 4): still shared chunks, said by plan; with
    ``share_chunks=False``, one sequence per chunk."""
    x = _inputs(MIX, h0=True)
    pos, kw = split_args(x)
    opts = dict(chunk_size=C, cu_seqlens=jnp.asarray(MIX), output_final_state=final, **kw)
    plan = kdax.KDAPipeline.reference().plan(*pos, **opts)
    assert plan.layout == "shared" and "layout: shared" in str(plan)
    off = dataclasses.replace(kdax.KDAPipeline.reference(), share_chunks=False).plan(*pos, **opts)
    assert off.layout == "per-sequence"


@pytest.mark.parametrize("chunk,gate", [(C, False), (64, True), pytest.param(64, False, marks=pytest.mark.slow)],
                         ids=["C16", "C64_in_kernel_gate", "C64"])
def test_initial_states_enter_shared_chunks(chunk, gate):
    """Initial states entering shared chunks (``kdax._layouts.shared_states``): outputs, final
    states and every gradient (a loss on o and on the final states; ``dh0`` and, with the
    in-kernel gate, ``dA_log``/``ddt_bias``, which the start tokens' own decays reach)
    exact against the float64 oracle, for the mix of lengths: first-chunk stretches of one
    to three blocks of ``kdax._layouts.ragged.W`` tokens, sequences going on into one and two
    later chunks, starts on a chunk boundary, empty sequences (which keep their state)."""
    x = _inputs(MIX, h0=True, gate=gate)
    options = dict(cu_seqlens=jnp.asarray(MIX, jnp.int32), output_final_state=True)
    if gate:
        options.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    got = _check(_fn(C=chunk), x, options, 1e-12)
    assert "initial_state" in got


# Fewer sequences than chunks (N = 9, NC = 13): the entering states' first-chunk part runs
# on the M = 9 chunks where some sequence starts (five distinct, four past them), not on all
# 13. Two sequences start in chunk 0, one mid-chunk ends before the next boundary, one
# starts on a boundary (48), empty ones first, between and last.
FEW = [0, 0, 5, 40, 48, 48, 90, 130, 200, 200]


def test_first_chunks_of_few_sequences():
    """``first_chunks``: the chunks holding a sequence's first token, padded with NC, and
    each sequence's first token among those chunks' tokens (ascending, as ``cu_seqlens``)."""
    fc = first_chunks(jnp.asarray(FEW, jnp.int32), C, 13)
    assert fc.idx.tolist() == [0, 2, 3, 5, 8, 13, 13, 13, 13]
    # s = 0 0 5 40 48 48 90 130 200 -> chunk 0, 0, 0, 2 (+8), 3, 3, 5 (+10), 8 (+2), 13 (none)
    assert fc.starts.tolist() == [0, 0, 5, 24, 32, 32, 58, 66, 80]
    x = jnp.arange(13.0).reshape(1, 1, 13)
    assert fc.take(x)[0, 0].tolist() == [0, 2, 3, 5, 8, 12, 12, 12, 12]
    assert fc.put(jnp.zeros_like(x), jnp.ones((1, 1, 9)))[0, 0].tolist() == [1, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("gate", [False, True], ids=["log_gate", "in_kernel_gate"])
def test_initial_states_enter_few_sequences_in_many_chunks(gate):
    """Initial states entering shared chunks with fewer sequences than chunks (``FEW``; the
    first-chunk part on the chunks where sequences start): outputs, final states and every
    gradient exact against the float64 oracle."""
    x = _inputs(FEW, h0=True, gate=gate)
    options = dict(cu_seqlens=jnp.asarray(FEW, jnp.int32), output_final_state=True)
    if gate:
        options.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert "initial_state" in _check(_fn(), x, options, 1e-12)


def test_initial_states_without_final_states():
    """The same without ``output_final_state`` (the loss on o alone)."""
    x = _inputs(MIX, h0=True)
    _check(_fn(), x, dict(cu_seqlens=jnp.asarray(MIX, jnp.int32)), 1e-12)


@pytest.mark.parametrize("chunk", [C, 64])
def test_loss_on_final_states_of_shared_chunks(chunk):
    """A loss on o and on the final states of shared chunks (issue 25 item 4: run back
    through the shared chunks, ``kdax._layouts.shared_states``, no forward rerun), the layout still
    shared: every gradient exact against the float64 oracle, for the mix of lengths
    (tails longer than one block of ``kdax._layouts.ragged.W`` tokens, sequences crossing one and
    two chunk boundaries, empty ones; at chunk 64, tails of up to four blocks)."""
    x = _inputs(MIX)
    options = dict(cu_seqlens=jnp.asarray(MIX, jnp.int32), output_final_state=True)
    pos, _ = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, chunk_size=chunk, **options).layout == "shared"
    _check(_fn(C=chunk), x, options, 1e-12)


def test_share_chunks_off_and_custom_gate_keep_the_per_sequence_layout():
    x = _inputs(MIX)
    pos, _ = split_args(x)
    cu = jnp.asarray(MIX, jnp.int32)
    ref = kdax.KDAPipeline.reference()
    off = dataclasses.replace(ref, share_chunks=False)
    assert off.plan(*pos, cu_seqlens=cu, chunk_size=C).layout == "per-sequence"

    class OldGate(kdax.stages.AbstractGate):  # a user's F1 written before `reset`, KDA's own math
        math: ClassVar[str] = kdax.stages.KDA

        def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
            return kdax.stages.ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)

    class OtherGate(kdax.stages.AbstractGate):  # the same, declaring no math: never replaced by the reference
        def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
            return kdax.stages.ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)

    custom = eqx.tree_at(lambda p: p.gate, ref, OldGate())
    assert custom.plan(*pos, cu_seqlens=cu, chunk_size=C).layout == "per-sequence"  # no fallback: not shared
    with_fallback = dataclasses.replace(custom, fallback=True)
    plan = with_fallback.plan(*pos, cu_seqlens=cu, chunk_size=C)
    assert plan.layout == "shared" and "reset" in plan.fallbacks["gate"]
    other = dataclasses.replace(eqx.tree_at(lambda p: p.gate, ref, OtherGate()), fallback=True)
    assert other.plan(*pos, cu_seqlens=cu, chunk_size=C).layout == "per-sequence"

    class OldIntra(kdax.stages.AbstractIntra):  # an F2 written before `reset` (issue 25)
        def __call__(self, scale, q, k, beta, G, G_lo=None):
            return kdax.stages.ReferenceIntra()(scale, q, k, beta, G, G_lo)

    custom = eqx.tree_at(lambda p: p.intra, ref, OldIntra())
    assert custom.plan(*pos, cu_seqlens=cu, chunk_size=C).layout == "per-sequence"


def test_no_padding_and_no_recompile_for_new_offsets():
    """NC = ceil(T / C) whatever the offsets; new offsets of the same N reuse the program."""
    layout = make_shared_layout(1000, 64, jnp.arange(1001, dtype=jnp.int32))
    assert layout.num_chunks == 16 and int(layout.reset.sum()) == 1000
    assert np.all(np.asarray(layout.first) == 0) and np.all(np.asarray(layout.last) == 0)  # exact at chunk starts
    x = _inputs(MIX)
    pos, _ = split_args(x)
    traces = []

    @jax.jit
    def f(cu, *a):
        traces.append(1)
        return _fn()(*a, cu_seqlens=cu)[0]

    T = MIX[-1]
    for cu in (MIX, [0] + sorted(np.random.default_rng(1).integers(0, T, len(MIX) - 2).tolist()) + [T]):
        cu = jnp.asarray(cu, jnp.int32)
        assert_close(f(cu, *pos), _recurrent(cu, *pos), 1e-12, "o")
    assert len(traces) == 1


def test_traced_cu_seqlens_still_checked():
    x = _inputs(MIX)
    pos, _ = split_args(x)
    f = jax.jit(lambda cu, *a: _fn()(*a, cu_seqlens=cu)[0])
    bad = np.array(MIX)
    bad[5] = bad[4] - 1  # decreasing
    with pytest.raises(Exception, match="cu_seqlens"):
        jax.block_until_ready(f(jnp.asarray(bad, jnp.int32), *pos))


def test_tiled_forward_equals_whole():
    """Without gradients the CPU forward runs in tiles; the resets travel with each tile
    (full tiles in the loop and the shorter tail)."""
    x = _inputs(MIX)
    pos, _ = split_args(x)
    cu = jnp.asarray(MIX, jnp.int32)
    tiled = dataclasses.replace(kdax.KDAPipeline.reference(), tile=4)  # 2 chunks per tile (HV = 2): 3 + tail
    assert tiled.plan(*pos, cu_seqlens=cu, chunk_size=C).tile == 4
    o = jax.jit(lambda *a: _fn(tiled)(*a, cu_seqlens=cu)[0])(*pos)
    assert_close(o, _recurrent(cu, *pos), 1e-12, "o tiled")


def test_float32_as_good_as_the_recurrence():
    """float32: a reset leaves exp(floor) = 2e-9 of the state it meets; outputs and every
    gradient within 10x the float32 recurrence's error against the float64 oracle."""
    cu = [0, 1, 2, 19, 20, 52, 53, 64]
    x64 = _inputs(cu, seed=5)
    x32 = {n: a.astype(jnp.float32) for n, a in x64.items()}
    do = jnp.asarray(np.random.default_rng(2).normal(size=x64["v"].shape))
    opts = dict(cu_seqlens=jnp.asarray(cu, jnp.int32))
    rec = lambda *a, **kw: kdax.fused_recurrent_kda(*a, **kw)
    o, _, want = _outputs_and_grads(oracle_kda, x64, dict(cu_seqlens=cu), do, None)
    want["o"] = o
    errs = {}
    for name, fn in (("chunk", _fn()), ("recurrent", rec)):
        o, _, got = _outputs_and_grads(fn, x32, opts, do.astype(jnp.float32), None)
        got["o"] = o
        errs[name] = {n: rel_rms(got[n], want[n]) for n in want}
    for n in want:
        assert errs["chunk"][n] <= max(10 * errs["recurrent"][n], 1e-6), (n, errs)


def test_non_finite_stays_where_it_entered():
    """A NaN or inf at token t (a sequence's first token, or inside one): outputs before t
    bit-identical, and so is every other sequence's (issue 25: exact resets, non-finite
    inputs kept out of the shared chunks, ``kdax._numerics.isolation``)."""
    cu = [0, 3, 9, 10, 21, 32, 40, 64]
    x = _inputs(cu, dtype=jnp.float32, seed=8)
    f = jax.jit(lambda xx: _fn()(xx["q"], xx["k"], xx["v"], xx["g"], xx["beta"], cu_seqlens=jnp.asarray(cu))[0])
    clean = np.asarray(f(x))
    for t, (s, e) in ((9, (9, 10)), (12, (10, 21))):  # the first token of a sequence; inside one
        for name in ("q", "k", "v", "g", "beta"):
            for bad in (np.nan, np.inf):
                y = dict(x)
                a = np.array(y[name])
                a[0, t] = bad
                y[name] = jnp.asarray(a)
                o = np.asarray(f(y))
                assert np.array_equal(o[0, :t], clean[0, :t]), (t, name, bad)
                assert np.array_equal(o[0, e:], clean[0, e:]), (t, name, bad)
                assert not np.any(np.isfinite(o[0, t])), (t, name, bad)  # and it did arrive


def test_forward_residuals_and_backward_of_shared_chunks():
    """``KDAPipeline.forward`` packs as ``chunk_kda`` does, final states included: token
    intermediates read per sequence as with one sequence per chunk; the per-chunk state per
    sequence is refused with the reason; ``backward`` with a ``dht`` (run back through the
    shared chunks, ``kdax._layouts.shared_states``) equals the per-sequence layout's."""
    x = _inputs(MIX)
    pos, _ = split_args(x)
    cu = jnp.asarray(MIX, jnp.int32)
    ref = kdax.KDAPipeline.reference().untiled()
    off = dataclasses.replace(ref, share_chunks=False)
    r = np.random.default_rng(5)
    do = jnp.asarray(r.normal(size=x["v"].shape))
    dht = jnp.asarray(r.normal(size=(len(MIX) - 1, 2, 8, 8)))

    @jax.jit
    def f(*a):
        _, ht, res = ref.forward(*a, chunk_size=C, cu_seqlens=cu, output_final_state=True)
        _, ht_off, res_off = off.forward(*a, chunk_size=C, cu_seqlens=cu, output_final_state=True)
        assert res.layout.reset is not None and res_off.layout.reset is None
        with pytest.raises(ValueError, match="per_sequence: the sequences of this forward share chunks"):
            res.read("h", per_sequence=True)
        with pytest.raises(ValueError, match=r"dht: expected shape \[N, HV, K, V\]"):
            ref.backward(res, do, jnp.zeros((len(MIX), 2, 8, 8)))
        grads, grads_off = ref.backward(res, do, dht), off.backward(res_off, do, dht)
        assert grads.initial_state is None
        return (ht, res.read("v_new", per_sequence=True), grads), (ht_off, res_off.read("v_new", per_sequence=True),
                                                                   grads_off)

    (ht, v_new, grads), (ht_off, v_new_off, grads_off) = f(*pos)
    assert_close(ht, ht_off, 1e-12, "ht")
    assert_close(v_new, v_new_off, 1e-12, "v_new")
    for n in ("q", "k", "v", "g", "beta"):
        assert_close(getattr(grads, n), getattr(grads_off, n), 1e-12, "d" + n)


# -- issue 39 item 0: float32 against the float64 oracle over random packed lengths --------
#
# A loss on o and on the final states, initial states, gates down to -1e4 beside tiny ones
# (the exponents of kdax._layouts.shared_states' VJPs round to 0 or above there: before the fix, dg
# was 2e-2 to 9e-2 off), l2norm on and off. cu_seqlens is traced, so each pipeline and
# option compiles once for every seed (N and T fixed, the lengths random).
SWEEP_N, SWEEP_HV, SWEEP_D = 12, 2, 8  # T = 10 C: ten chunks
SWEEP_TOL = 1e-4


def _sweep_lengths(r, C=C, N=SWEEP_N):
    """``cu_seqlens`` of N sequences of 0..3C tokens, T in all: two empty ones, a one-token
    and a two-token one, one of C and one of 3C, the rest random; shuffled. T = 10 C."""
    fixed = [0, 0, 1, 2, C, 3 * C]
    rest = 10 * C - sum(fixed)
    while True:
        cuts = np.sort(r.integers(0, rest + 1, N - len(fixed) - 1))
        lengths = np.diff(np.concatenate([[0], cuts, [rest]]))
        if lengths.max() <= 3 * C:
            break
    lengths = np.concatenate([fixed, lengths])
    r.shuffle(lengths)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _sweep_gates(r, shape):
    """Log decays: a quarter tiny (-1e-12..-1e-4), exact zeros, ordinary ones (-0.01..-1),
    hard ones (-1..-20) and a quarter strong (-20..-1e4, below the float32 floor)."""
    u = r.uniform(size=shape)
    g = -r.uniform(0.01, 1.0, size=shape)
    g = np.where(u < 0.25, -(10.0 ** r.uniform(-12, -4, size=shape)), g)
    g = np.where((u >= 0.55) & (u < 0.6), 0.0, g)
    g = np.where((u >= 0.6) & (u < 0.75), -r.uniform(1.0, 20.0, size=shape), g)
    return np.where(u >= 0.75, -(10.0 ** r.uniform(1.3, 4.0, size=shape)), g)


def _sweep_case(seed, C=C):
    """``(cu_seqlens, float64 inputs, do, dht)``: one random case of the sweep."""
    r = np.random.default_rng(seed)
    N, T, HV, D = SWEEP_N, 10 * C, SWEEP_HV, SWEEP_D
    cu = _sweep_lengths(r, C)
    x = dict(q=r.normal(size=(1, T, 1, D)), k=r.normal(size=(1, T, 1, D)) / np.sqrt(D), v=r.normal(size=(1, T, HV, D)),
             g=_sweep_gates(r, (1, T, HV, D)), beta=r.uniform(0.05, 0.95, size=(1, T, HV)),
             initial_state=r.normal(size=(N, HV, D, D)) * 0.3)
    x = {n: jnp.asarray(a, jnp.float64) for n, a in x.items()}
    return cu, x, jnp.asarray(r.normal(size=(1, T, HV, D))), jnp.asarray(r.normal(size=(N, HV, D, D)))


def _sweep_rows(cu, C=C):
    """``[N, 3C]``: the tokens of sequence n in row n, then T = 10 C (a padding token)."""
    rows = np.full((SWEEP_N, 3 * C), 10 * C, np.int32)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        rows[n, : e - s] = np.arange(s, e)
    return jnp.asarray(rows)


def _sweep_loss(fn, x, do, dht):
    o, ht = fn(x)
    return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)


def _sweep_grads(fn):
    """``jit((x, do, dht, arg) -> (o, ht, gradients))`` of ``fn(x, arg) -> (o, ht)``."""
    def f(x, do, dht, arg):
        grads, (o, ht) = jax.grad(lambda x: _sweep_loss(lambda x: fn(x, arg), x, do, dht), has_aux=True)(x)
        return o, ht, grads

    return jax.jit(f)


def _sweep_oracle(l2):
    """The float64 oracle on the sequences as rows of a dense batch (each from its initial
    state, one scan for all): padding tokens with k = beta = g = 0 keep the state, so the
    last row state is the final state."""
    def fn(x, rows):
        pad = lambda a, fill: jnp.concatenate([a[0], jnp.full((1,) + a.shape[2:], fill, a.dtype)])[rows]
        o, ht = oracle_kda(pad(x["q"], 1.0), pad(x["k"], 0.0), pad(x["v"], 0.0), pad(x["g"], 0.0), pad(x["beta"], 0.0),
                           initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=l2)
        T = x["q"].shape[1]
        o = jnp.zeros((T + 1,) + o.shape[2:], o.dtype).at[rows.reshape(-1)].set(o.reshape(-1, *o.shape[2:]))
        return o[None, :T], ht

    return _sweep_grads(fn)


def _sweep_chunked(pipeline, l2, C=C):
    def fn(x, cu):
        return kdax.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], cu_seqlens=cu,
                              output_final_state=True, use_qk_l2norm_in_kernel=l2, pipeline=pipeline, chunk_size=C)

    return _sweep_grads(fn)


def check_float32_sweep(pipeline, l2, seeds, C=C):
    """float32 through ``pipeline`` against the float64 oracle for each seed's case: o, the
    final states and every gradient (dq, dk, dv, dg, dbeta, dh0) within ``SWEEP_TOL``
    relative RMS (NaN never passes). Returns the worst error per name."""
    oracle, chunked = _sweep_oracle(l2), _sweep_chunked(pipeline, l2, C)
    worst = {}
    for seed in seeds:
        cu, x, do, dht = _sweep_case(seed, C)
        o, ht, want = oracle(x, do, dht, _sweep_rows(cu, C))
        want = dict(want, o=o, ht=ht)
        f32 = lambda a: a.astype(jnp.float32)
        o, ht, got = chunked(jax.tree.map(f32, x), f32(do), f32(dht), jnp.asarray(cu))
        got = dict(got, o=o, ht=ht)
        for n in want:
            assert got[n].dtype == jnp.float32, n
            err = assert_close(got[n], want[n], SWEEP_TOL, f"{n if n in ('o', 'ht') else 'd' + n} (seed {seed}, cu {cu.tolist()})")
            worst[n] = max(worst.get(n, 0.0), err)
    return worst


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "no_l2norm"])
def test_float32_sweep_random_packed_lengths(l2):
    """Issue 39 item 0: the reference pipeline in float32 on random packed lengths (0..3C,
    shared chunks), gates down to -1e4, initial states, a loss on o and the final states."""
    pipeline = kdax.KDAPipeline.reference()
    cu, x, _, _ = _sweep_case(0)
    pos, kw = split_args(x)
    assert pipeline.plan(*pos, **kw, chunk_size=C, cu_seqlens=jnp.asarray(cu), output_final_state=True).layout == "shared"
    check_float32_sweep(pipeline, l2, seeds=range(3))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [C, 64])
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "no_l2norm"])
def test_float32_sweep_random_packed_lengths_more_seeds(l2, chunk):
    """The sweep above over more seeds, at chunk 16 and 64 (lengths 0..3C of either)."""
    check_float32_sweep(kdax.KDAPipeline.reference(), l2, seeds=range(3, 15), C=chunk)


# Tails and first-chunk stretches of two blocks of kdax._layouts.ragged.WIDE at chunk 32 (the
# static loop's skipped-or-run block), empty and one-token sequences.
HVP_CU = [0, 0, 1, 3, 20, 21, 60, 61, 70]


def _packed_oracle(q, k, v, g, beta, initial_state=None, cu_seqlens=None, output_final_state=True, **_):
    """The float64 recurrence over packed tokens in one scan (``kdax.ref``'s step; a
    sequence's first token loads its initial state): a small program to differentiate
    twice, where ``oracle_kda`` runs a scan per sequence."""
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    N, HV, K, V = len(cu) - 1, v.shape[2], q.shape[-1], v.shape[-1]
    h0 = jnp.zeros((N, HV, K, V), q.dtype) if initial_state is None else initial_state
    seq = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
    start = np.arange(cu[-1]) == np.asarray(cu)[seq]
    q, k = (kdax.ref.expand_heads(x, HV)[0] for x in (q, k))

    def step(S, x):
        n, first, *tok = x
        S = jnp.where(first, h0[n], S)
        S, o = kdax.ref.recurrent_step(S, *tok, K**-0.5)
        return S, (o, S)

    _, (o, S) = jax.lax.scan(step, h0[0], (jnp.asarray(seq), jnp.asarray(start), q, k, v[0], g[0], beta[0]))
    ends = [e - 1 for e in cu[1:]]
    ht = jnp.stack([S[e] if e >= s else h0[i] for i, (s, e) in enumerate(zip(cu[:-1], ends))])
    return o[None], ht


@pytest.mark.parametrize("h0", [False, True], ids=["final_states_loss", "initial_states"])
def test_hessian_vector_product_through_shared_chunks(h0):
    """Issue 39 item 6: jax.grad of jax.grad through shared chunks (the default pipeline's
    layout) with a loss on the final states, and with initial states entering, used to
    fail on a loop of dynamic length (``kdax._layouts.ragged``): the Hessian-vector product
    (reverse over reverse, a loss nonlinear in o and the final states) against the
    float64 recurrence's."""
    x = _inputs(HVP_CU, h0=h0)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if n in x]
    arrays = {n: x[n] for n in names}
    r = np.random.default_rng(7)
    t = {n: jnp.asarray(r.normal(size=a.shape)) for n, a in arrays.items()}
    do = jnp.asarray(r.normal(size=x["v"].shape))
    dht = jnp.asarray(r.normal(size=(len(HVP_CU) - 1, 2, 8, 8)))
    cu = jnp.asarray(HVP_CU, jnp.int32)

    def hvp(fn):
        def loss(a):
            pos, kw = split_args(a)
            o, ht = fn(*pos, **kw, cu_seqlens=cu, output_final_state=True)
            return jnp.sum(jnp.sin(o) * do) + jnp.sum(jnp.sin(ht) * dht)

        inner = lambda a: sum(jnp.vdot(d, t[n]) for n, d in jax.grad(loss)(a).items())
        return jax.jit(jax.grad(inner))(arrays)

    pos, kw = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, **kw, chunk_size=32, cu_seqlens=cu,
                                             output_final_state=True).layout == "shared"
    got, want = hvp(_fn(C=32)), hvp(_packed_oracle)
    assert set(got) == set(names)
    for n in names:
        assert_close(got[n], want[n], 1e-10, "HVP d" + n)
