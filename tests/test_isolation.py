"""Issue 25: a sequence never touches another. float64 against the per-sequence
recurrence (``oracle_kda``), a huge (x1e30) or non-finite value injected at one token of
one sequence into each of q, k, v, g, beta: every other sequence's outputs, final states
and gradients are the recurrence's; the bad sequence's are exact before the token (where
the recurrence's are finite) and non-finite wherever the recurrence's are. Shared chunks
(exact resets, ``kdax._layouts.resets``), one sequence per chunk, dense rows; and the
causal-gradient case of the issue (garbage right padding, a loss on the valid outputs)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._numerics import isolation as _isolation

from ._util import assert_close, make_inputs, one_device_env, oracle_kda, split_args

C = 16
# Sequence 1 (tokens 5..19) crosses a chunk boundary and shares chunks with 0 and 2; 3
# starts right after a one-token sequence inside chunk 1; 4 shares chunk 2 with 3.
CU = [0, 5, 20, 21, 40, 47]
BAD_SEQ, BAD_T = 1, 12
NAMES = ("q", "k", "v", "g", "beta")
VALUES = {"x1e30": None, "nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _inject(x, name, value, at):
    a = np.array(x[name])
    a[at] = a[at] * 1e30 if value is None else value
    return dict(x, **{name: jnp.asarray(a)})


def _runner(fn, options, final_loss):
    """``(o, ht, grads)`` of ``sum(o * W) + sum(ht * Wh)`` (Wh when ``final_loss``), jit."""

    @jax.jit
    def f(arrays, W, Wh):
        def loss(a):
            pos, kw = split_args(a)
            o, ht = fn(*pos, **kw, **options)
            val = jnp.sum(o * W)
            return (val + jnp.sum(ht * Wh) if final_loss else val), (o, ht)

        grads, (o, ht) = jax.grad(loss, has_aux=True)(arrays)
        return o, ht, grads

    return f


def _sequences(cu, B):
    """``[(row, start, end)]`` per sequence (dense: one per row)."""
    return [(0, s, e) for s, e in zip(cu[:-1], cu[1:])] if cu is not None else [(b, 0, None) for b in range(B)]


def _check_isolated(got, want, seqs, bad, t_bad, tol=1e-10, bad_exact=True):
    """Every sequence but ``bad`` equal to the oracle; ``bad`` equal before ``t_bad``
    where the oracle is finite (when ``bad_exact``), and non-finite wherever it is."""
    o, ht, grads = got
    o_ref, ht_ref, g_ref = want
    for n, (r, s, e) in enumerate(seqs):
        e = o.shape[1] if e is None else e
        if e == s:
            continue
        tok = lambda x: np.asarray(x)[r, s:e]
        if n != bad:
            assert_close(tok(o), tok(o_ref), tol, f"o of sequence {n}")
            if ht is not None:
                assert_close(ht[n], ht_ref[n], tol, f"ht of sequence {n}")
            for name in g_ref:
                if name in NAMES:
                    assert_close(tok(grads[name]), tok(g_ref[name]), tol, f"d{name} of sequence {n}")
            continue
        before = lambda x: np.asarray(x)[r, s:t_bad]
        assert_close(before(o), before(o_ref), tol, "o of the bad sequence before its bad token")
        assert np.all(~np.isfinite(tok(o)[~np.isfinite(tok(o_ref))])), "o: finite where the recurrence is not"
        if ht is not None and not np.all(np.isfinite(ht_ref[n])):
            assert not np.all(np.isfinite(ht[n]))
        if bad_exact:
            for name in g_ref:
                if name in NAMES:
                    w, x = before(g_ref[name]), before(grads[name])
                    ok = np.isfinite(w)
                    assert np.all(np.isfinite(x)), f"d{name}: non-finite before the bad token"
                    if ok.any():
                        assert_close(x[ok], w[ok], tol, f"d{name} of the bad sequence before its bad token")


def _sweep(fn, x, options, cu, bad_rows, final_loss, oracle_options=None, values=VALUES):
    # A 1e30-scaled beta is outside its domain, which chunk_kda refuses under jit by
    # default (tests/test_input_checks.py); isolation is what holds with the check off.
    f = _runner(fn, dict(options, check_inputs=False), final_loss)
    f_ref = _runner(oracle_kda, dict(options, **(oracle_options or {})), final_loss)
    r = np.random.default_rng(1)
    W = jnp.asarray(r.normal(size=x["v"].shape))
    N = len(cu) - 1 if cu is not None else x["v"].shape[0]
    Wh = jnp.asarray(r.normal(size=(N,) + x["v"].shape[2:3] + (x["q"].shape[-1], x["v"].shape[-1])))
    seqs = _sequences(cu, x["v"].shape[0])
    row, t = bad_rows
    for name in NAMES:
        for label, value in values.items():
            y = _inject(x, name, value, (row, t, 0))
            got = f(y, W, Wh)
            want = f_ref(y, W, Wh)
            bad = [n for n, (rr, s, e) in enumerate(seqs) if rr == row and s <= t and (e is None or t < e)][0]
            # x1e30: the bad sequence's later values are 1e30-scale (no exact reference).
            _check_isolated(got, want, seqs, bad, t if cu is not None else t, bad_exact=value is not None)


def _inputs(T, B=1, h0=False, seed=0):
    return make_inputs(seed=seed, B=B, T=T, H=1, HV=2, K=8, V=8, h0=h0, N=len(CU) - 1 if B == 1 else B)


def _fn(pipe=None):
    pipe = kdax.KDAPipeline.reference() if pipe is None else pipe
    return lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, **kw)


def test_shared_chunks_isolated():
    """Shared chunks (no initial_state), final states read per sequence, a loss on o."""
    x = _inputs(CU[-1])
    cu = jnp.asarray(CU, jnp.int32)
    pos, _ = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, chunk_size=C, cu_seqlens=cu).layout == "shared"
    _sweep(_fn(), x, dict(cu_seqlens=cu, output_final_state=True), CU, (0, BAD_T), final_loss=False,
           oracle_options=dict(cu_seqlens=CU))


def test_shared_chunks_with_initial_states_isolated():
    """Shared chunks with initial states entering them (``kdax._layouts.shared_states``), a loss
    on o and the final states."""
    x = _inputs(CU[-1], h0=True)
    cu = jnp.asarray(CU, jnp.int32)
    pos, kw = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, chunk_size=C, cu_seqlens=cu, **kw).layout == "shared"
    _sweep(_fn(), x, dict(cu_seqlens=cu, output_final_state=True), CU, (0, BAD_T), final_loss=True,
           oracle_options=dict(cu_seqlens=CU))


def test_per_sequence_chunks_isolated():
    """One sequence per chunk (``share_chunks=False``), initial states, a loss on o and
    the final states."""
    x = _inputs(CU[-1], h0=True)
    cu = jnp.asarray(CU, jnp.int32)
    pipe = dataclasses.replace(kdax.KDAPipeline.reference(), share_chunks=False)
    pos, kw = split_args(x)
    assert pipe.plan(*pos, chunk_size=C, cu_seqlens=cu, **kw).layout == "per-sequence"
    _sweep(_fn(pipe), x, dict(cu_seqlens=cu, output_final_state=True), CU, (0, BAD_T), final_loss=True,
           oracle_options=dict(cu_seqlens=CU))


def test_non_finite_initial_state_stays_in_its_sequence():
    """A NaN or inf in one packed sequence's initial state (shared chunks): that
    sequence's head is NaN (outputs from its first token, its final state); every other
    sequence's outputs, final states and gradients equal the float64 oracle's."""
    x = _inputs(CU[-1], h0=True)
    cu = jnp.asarray(CU, jnp.int32)
    r = np.random.default_rng(7)
    do = jnp.asarray(r.normal(size=x["v"].shape))
    dht = jnp.asarray(r.normal(size=x["initial_state"].shape))

    def run(fn, h0, **kw):
        def loss(q, k, v, g, beta, h0):
            o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
            return jnp.sum(jnp.where(jnp.isfinite(o), o * do, 0.0)) + jnp.sum(jnp.where(jnp.isfinite(ht), ht * dht, 0.0)), (o, ht)
        (_, (o, ht)), gr = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(*pos, h0)
        return o, ht, gr

    pos, _ = split_args(x)
    bad_n = 1
    got_f = jax.jit(lambda h0: run(_fn(), h0, cu_seqlens=cu))
    want_f = jax.jit(lambda h0: run(oracle_kda, h0, cu_seqlens=CU))
    for value in (jnp.nan, jnp.inf):
        h0 = x["initial_state"].at[bad_n, 0, 2, 3].set(value)
        o, ht, gr = got_f(h0)
        o_ref, ht_ref, gr_ref = want_f(h0)
        s, e = CU[bad_n], CU[bad_n + 1]
        assert not np.any(np.isfinite(np.asarray(o[0, s:e, 0]))) and not np.any(np.isfinite(np.asarray(ht[bad_n, 0])))
        others = np.r_[0:s, e:CU[-1]]
        assert_close(o[:, others], o_ref[:, others], 1e-12, "o")
        keep = [n for n in range(len(CU) - 1) if n != bad_n]
        assert_close(ht[jnp.asarray(keep)], ht_ref[jnp.asarray(keep)], 1e-12, "ht")
        for i, name in enumerate("qkvgb"):
            assert_close(gr[i][:, others], gr_ref[i][:, others], 1e-12, "d" + name)


@pytest.mark.parametrize("h0", [False, True], ids=["zero-states", "initial-states"])
def test_non_finite_final_state_cotangent_stays_in_its_sequence(h0):
    """A NaN or inf in one element of one sequence's final-state cotangent (shared
    chunks, ``kdax._layouts.shared_states.finals_vjp``: read as given, no cleaned copy): every
    other sequence's gradients (and initial-state gradient) equal the float64 oracle's,
    and the bad sequence's are non-finite wherever the oracle's are."""
    x = _inputs(CU[-1], h0=h0)
    cu = jnp.asarray(CU, jnp.int32)
    pos, kw = split_args(x)
    assert kdax.KDAPipeline.reference().plan(*pos, chunk_size=C, cu_seqlens=cu, **kw).layout == "shared"
    r = np.random.default_rng(8)
    N, HV, K, V = len(CU) - 1, x["v"].shape[2], x["q"].shape[-1], x["v"].shape[-1]
    do = jnp.asarray(r.normal(size=x["v"].shape))

    def run(fn, dht, **opts):
        def loss(a):
            p, k = split_args(a)
            o, ht = fn(*p, **k, output_final_state=True, **opts)
            return jnp.sum(o * do) + jnp.sum(ht * dht)
        return jax.grad(loss)(x)

    got_f = jax.jit(lambda dht: run(_fn(), dht, cu_seqlens=cu))
    want_f = jax.jit(lambda dht: run(oracle_kda, dht, cu_seqlens=CU))
    bad_n = 1
    s, e = CU[bad_n], CU[bad_n + 1]
    others = np.r_[0:s, e:CU[-1]]
    for value in (np.nan, np.inf):
        dht = jnp.asarray(r.normal(size=(N, HV, K, V))).at[bad_n, 1, 3, 2].set(value)
        got, want = got_f(dht), want_f(dht)
        for name in NAMES:
            assert_close(got[name][:, others], want[name][:, others], 1e-10, f"d{name} of the other sequences")
            w, g = np.asarray(want[name])[:, s:e], np.asarray(got[name])[:, s:e]
            assert np.all(~np.isfinite(g[~np.isfinite(w)])), f"d{name}: finite where the recurrence's is not"
        if h0:
            keep = jnp.asarray([n for n in range(N) if n != bad_n])
            assert_close(got["initial_state"][keep], want["initial_state"][keep], 1e-10, "dh0 of the other sequences")
            assert not np.all(np.isfinite(np.asarray(got["initial_state"][bad_n])))


@pytest.mark.slow  # (rows never share a chunk; the garbage-padding test below runs dense in the default run)
def test_dense_rows_isolated():
    """Dense rows (bad row 0 at token 20 of 40, inside chunk 1), a loss on o and states."""
    x = make_inputs(seed=2, B=2, T=40, H=1, HV=2, K=8, V=8, h0=True)
    _sweep(_fn(), x, dict(output_final_state=True), None, (0, 20), final_loss=True)


def test_exact_reset_whatever_the_neighbours_hold():
    """x1e30 in every input of a whole sequence at once (shared chunks): the others are
    bit-identical to the call with ordinary neighbours (the decay floor alone left
    exp(-60) x 1e30 of them)."""
    x = _inputs(CU[-1])
    cu = jnp.asarray(CU, jnp.int32)
    f = _runner(_fn(), dict(cu_seqlens=cu), final_loss=False)
    W = jnp.asarray(np.random.default_rng(3).normal(size=x["v"].shape))
    o0, _, g0 = f(x, W, None)
    y = dict(x)
    y["v"] = x["v"].at[0, 5:20].multiply(1e30)
    o, _, g = f(y, W, None)
    other = np.r_[0:5, 20:47]
    assert np.array_equal(np.asarray(o)[0, other], np.asarray(o0)[0, other])
    for n in NAMES:
        assert np.array_equal(np.asarray(g[n])[0, other], np.asarray(g0[n])[0, other]), n


@pytest.mark.parametrize("layout", ["dense", "shared"])
def test_gradients_before_garbage_padding(layout):
    """``v[0, 30:] = NaN`` (garbage right padding) and a loss on ``o[:, :30]``: every
    gradient at tokens < 30 finite and equal to the recurrence's autodiff."""
    B = 2 if layout == "dense" else 1
    x = make_inputs(seed=4, B=B, T=40, H=1, HV=2, K=8, V=8, h0=False)
    x["v"] = x["v"].at[0, 30:].set(jnp.nan)
    opts = {} if layout == "dense" else dict(cu_seqlens=jnp.asarray([0, 40], jnp.int32))

    def grads(fn, o_opts):
        def loss(a):
            pos, _ = split_args(a)
            return jnp.sum(fn(*pos, **o_opts)[0][:, :30] ** 2)

        return jax.jit(jax.grad(loss))({n: x[n] for n in NAMES})

    got = grads(_fn(), opts)
    want = grads(oracle_kda, dict(opts, cu_seqlens=[0, 40]) if opts else {})
    for n in NAMES:
        assert_close(np.asarray(got[n])[:, :30], np.asarray(want[n])[:, :30], 1e-10, "d" + n)


def test_nan_cotangent_stays_in_its_sequence():
    """A NaN cotangent at token 30 of sequence 1 (a loss whose gradient is NaN there):
    every other sequence's gradients are the recurrence's; sequence 1's are NaN up to the
    token, as the recurrence's autodiff gives (shared chunks)."""
    cu = [0, 25, 40, 47]
    x = make_inputs(seed=5, B=1, T=47, H=1, HV=2, K=8, V=8, h0=False)
    W = jnp.ones(x["v"].shape).at[0, 30].set(jnp.nan)

    def grads(fn, opts):
        def loss(a):
            pos, _ = split_args(a)
            return jnp.sum(fn(*pos, **opts)[0] * W)

        return jax.jit(jax.grad(loss))({n: x[n] for n in NAMES})

    got = grads(_fn(), dict(cu_seqlens=jnp.asarray(cu, jnp.int32)))
    want = grads(oracle_kda, dict(cu_seqlens=cu))
    for n in NAMES:
        g, w = np.asarray(got[n])[0], np.asarray(want[n])[0]
        for s, e in ((0, 25), (40, 47)):
            assert_close(g[s:e], w[s:e], 1e-10, f"d{n} [{s}:{e}]")
        assert np.all(~np.isfinite(g[25:41][~np.isfinite(w[25:41])])), n


# One sequence starting in chunk 1 after the bad one's last tokens: a decay of the chunk's
# start state through the chunk that were e^-60 (F1's reset floor) instead of exactly zero
# would carry the bad sequence's 1e30-sized state into it (two starts: e^-120, invisible).
CU_ONE_START = [0, 5, 20, 40, 47]


@pytest.mark.parametrize("bounds", [CU, CU_ONE_START], ids=["cu", "one_start"])
@pytest.mark.parametrize("pipe", ["pallas", pytest.param("mixed", marks=pytest.mark.slow), "untiled"])
def test_other_pipelines_exact_resets(pipe, bounds):
    """Every pipeline gives each sequence of shared chunks its own result whatever its
    neighbours hold (every Pallas stage runs the reset table itself; interpret mode on
    CPU)."""
    p = {"pallas": lambda: kdax.KDAPipeline.pallas(interpret=True),
         "mixed": lambda: kdax.KDAPipeline.mixed(interpret=True),
         "untiled": lambda: kdax.KDAPipeline.reference().untiled()}[pipe]()
    x = _inputs(bounds[-1])
    cu = jnp.asarray(bounds, jnp.int32)
    y = dict(x, v=x["v"].at[0, 5:20].multiply(1e30))
    y["beta"] = y["beta"].at[0, 8].set(jnp.nan)
    pos, _ = split_args(x)
    plan = p.plan(*pos, chunk_size=C, cu_seqlens=cu)
    assert plan.layout == "shared"
    assert not plan.fallbacks, plan.fallbacks  # (every Pallas stage takes `reset`)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        f = _runner(_fn(p), dict(cu_seqlens=cu), final_loss=False)
        W = jnp.asarray(np.random.default_rng(3).normal(size=x["v"].shape))
        got = f(y, W, None)
    want = _runner(oracle_kda, dict(cu_seqlens=bounds), final_loss=False)(y, W, None)
    _check_isolated(got, want, _sequences(bounds, 1), BAD_SEQ, 8, tol=1e-10, bad_exact=False)



def test_recurrent_numpy_initial_state_with_cu_seqlens():
    """``fused_recurrent_kda(..., cu_seqlens=[...], initial_state=np.zeros(...))`` runs
    (it raised TracerArrayConversionError) and equals the jnp state's result."""
    x = make_inputs(seed=6, B=1, T=40, H=1, HV=2, K=8, V=8, h0=False)
    pos, _ = split_args(x)
    h0 = np.zeros((2, 2, 8, 8))
    o, ht = kdax.fused_recurrent_kda(*pos, cu_seqlens=[0, 20, 40], initial_state=h0, output_final_state=True)
    o2, ht2 = kdax.fused_recurrent_kda(*pos, cu_seqlens=[0, 20, 40], initial_state=jnp.asarray(h0),
                                       output_final_state=True)
    assert np.array_equal(np.asarray(o), np.asarray(o2)) and np.array_equal(np.asarray(ht), np.asarray(ht2))


def test_unknown_cleaning_kind_is_refused():
    # A kind the isolation does not know never passes as "any non-finite value".
    from kdax._numerics.isolation import is_bad

    x = jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf])
    np.testing.assert_array_equal(np.asarray(is_bad("any", x)), [False, True, True, True])
    np.testing.assert_array_equal(np.asarray(is_bad("decay", x)), [False, True, True, False])
    with pytest.raises(ValueError, match="kind: expected 'nan', 'decay' or 'any', got 'nans'"):
        is_bad("nans", x)


def test_entering_states_only_where_they_can_enter():
    """``Bad``'s ``entering`` (initial states that may enter shared chunks) is for packed
    sequences on one device; a dense row's state never meets another row's tokens, so the
    VJP hands none there (kdax._runner.vjp), and a dense or per-device call is refused."""
    r = np.random.default_rng(3)
    q, k, v, g = (jnp.asarray(r.normal(size=(1, 8, 2, 4))) for _ in range(4))
    beta = jnp.asarray(r.uniform(size=(1, 8, 2)))
    h0 = jnp.zeros((2, 2, 4, 4)).at[1, 0, 0, 0].set(jnp.nan)
    cu = jnp.asarray([0, 3, 8])
    bad = _isolation.Bad((q, k, v, -jnp.abs(g), beta), cu, False, False, entering=h0)
    # sequence 1's head 0 is NaN from its first token on; nothing else
    want = np.zeros((1, 8, 2), bool)
    want[0, 3:, 0] = True
    np.testing.assert_array_equal(np.asarray(bad.where), want)
    np.testing.assert_array_equal(np.asarray(bad.state_bad), [[False, False], [True, False]])
    with pytest.raises(ValueError, match="entering: packed initial states on one device only"):
        _isolation.Bad((q, k, v, -jnp.abs(g), beta), None, False, False, entering=h0[:1])


def test_reaches_against_a_token_loop():
    """``_numerics.isolation._reaches`` (one reduction per sequence) against its definition, a loop
    over tokens: a bad token of the same sequence at or before (reverse: at or after)
    each token; dense rows and packed sequences with empty ones, tokens past the last
    sequence (they count as its tokens, as ``sequence_ids`` assigns them), and T = 0."""
    r = np.random.default_rng(0)
    for trial in range(16):  # (few shapes: each is a compile)
        T, HV = (23, 2) if trial > 1 else (0, 2)
        if trial % 2 == 0:
            B, cu = 3, None
        else:
            B, N = 1, (0, 4)[trial % 4 != 1]
            cu = np.concatenate([[0], np.sort(r.integers(0, T + 1, size=N - 1)), [max(T - trial % 3, 0)]]) if N else np.array([0])
            cu = np.maximum.accumulate(cu).astype(np.int32)
        bad = r.uniform(size=(B, T, HV)) < 0.15
        seq, N = _isolation.sequence_ids(B, T, None if cu is None else jnp.asarray(cu))
        s = np.asarray(seq)
        for reverse in (False, True):
            got = np.asarray(_isolation._reaches(jnp.asarray(bad), seq, None if cu is None else N, reverse))
            want = np.zeros_like(bad)
            for b in range(B):
                for t in range(T):
                    span = range(t, T) if reverse else range(t + 1)
                    want[b, t] = np.any([bad[b, u] for u in span if s[b, u] == s[b, t]], axis=0)
            assert np.array_equal(got, want), (trial, cu, reverse)


_PEAKS = """
import jax, jax.numpy as jnp, numpy as np, kdax
B, T, H, K = 1, 4096, 8, 128
r = np.random.default_rng(0)
f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
x = (f(B, T, H, K), f(B, T, H, K), f(B, T, H, K), -jnp.abs(f(B, T, H, K)), jax.nn.sigmoid(f(B, T, H)))
for checked in (True, False):
    fwd = jax.jit(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True, check_inputs=checked)[0])
    print(jax.device_count(), checked, fwd.lower(*x).compile().memory_analysis().temp_size_in_bytes)
"""


def test_the_non_finite_tests_hold_one_boolean_at_a_time():
    """XLA:CPU stores the full-size boolean each input's non-finite test reduces; made in
    turn (``isolation._in_turn``) one is alive at a time. At the main job's shape four of
    them (16 MiB) were the forward's peak, and the one-device domain check's a fifth
    (20.7 MiB); now the forward's temporaries stay under four booleans' worth, checked or
    not (one device, in a fresh process: the suite's eight devices check the domain
    elementwise instead)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _PEAKS], env=one_device_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    temp = {line.split()[1] == "True": int(line.split()[2]) for line in run.stdout.split("\n") if line.strip()}
    assert run.stdout.split()[0] == "1" and len(temp) == 2, run.stdout
    one_bool = 1 * 4096 * 8 * 128
    assert temp[False] < 4 * one_bool, temp
    assert temp[True] <= temp[False] + 64 * 1024, temp  # the domain check adds no boolean of g


# Sequence 1 crosses chunks 0-1 (C = 16), 3 crosses 1-2 beside a one-token 2, 4 and 5 share
# chunk 2 and 5 goes on to the end: every way a sequence meets another in a chunk.
CU_OVERFLOW = [0, 5, 20, 21, 40, 47, 80]


def _overflow_stays(cu, C, final, h0, HV=1, injections=None, pipeline=None, **options):
    """float32 packed sequences sharing chunks (``cu``), one sequence's ``k`` at ±1e19 or ±1e38,
    or its ``v`` or ``q`` at ±1e38 (finite inputs whose products overflow to inf inside the
    chunked algorithm): every other sequence's outputs, final states and gradients (of the
    inputs and the initial states) are bit-identical to those beside ordinary values, in the
    training step and in the forward alone run in tiles of one chunk (the state carried
    between them). The overflowing sequence's own are what its overflow makes them.
    ``pipeline``: the step's (None: the reference pipeline), its forward tiled alike."""
    T, N = cu[-1], len(cu) - 1
    r = np.random.default_rng(1)
    x = make_inputs(seed=0, B=1, T=T, H=1, K=8, V=8, dtype=jnp.float32, h0=False)
    raw_gate, raw_beta = options.get("use_gate_in_kernel"), options.get("use_beta_sigmoid_in_kernel")
    x = dict(x, v=r.normal(size=(1, T, HV, 8)), g=r.normal(size=(1, T, HV, 8)) if raw_gate else
             -r.uniform(0, 0.5, size=(1, T, HV, 8)), beta=r.normal(size=(1, T, HV)) if raw_beta else r.uniform(size=(1, T, HV)))
    x = {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}
    W, Wh, hx = (jnp.asarray(a, jnp.float32) for a in (r.normal(size=(1, T, HV, 8)), r.normal(size=(N, HV, 8, 8)),
                                                        r.normal(size=(N, HV, 8, 8)) * 0.3))
    hx = hx if h0 else None
    params = dict(A_log=jnp.zeros(HV), dt_bias=jnp.zeros(HV * 8)) if raw_gate else {}
    pipeline = kdax.KDAPipeline.reference() if pipeline is None else pipeline
    kw = dict(cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=C, output_final_state=final, pipeline=pipeline,
              **options, **params)
    tiles = dataclasses.replace(pipeline, tile=1)

    @jax.jit
    def run(x, h):
        def loss(a, h):
            o, ht = kdax.chunk_kda(**a, initial_state=h, **kw)
            return jnp.sum(o * W) + (jnp.sum(ht * Wh) if final else 0.0)

        grads = jax.grad(loss, argnums=(0, 1))(x, h)
        forward = {n: a for n, a in kw.items() if n not in ("disable_recompute", "pipeline")}
        return kdax.chunk_kda(**x, initial_state=h, pipeline=tiles, **forward), grads

    (o0, ht0), (g0, gh0) = run(x, hx)
    for name, size, bad in injections or [("k", 1e19, 1), ("k", 1e38, 3), ("v", 1e38, 1), ("q", 1e38, 4), ("k", 1e38, 4)]:
        s, e = cu[bad], cu[bad + 1]
        a = x[name]
        (o1, ht1), (g1, gh1) = run(dict(x, **{name: a.at[0, s:e].set(jnp.where(a[0, s:e] < 0, -size, size))}), hx)
        for n, (cs, ce) in enumerate(zip(cu[:-1], cu[1:])):
            if n == bad:
                continue
            said = f"{name}={size:g} in sequence {bad}: sequence {n}'s"
            assert np.array_equal(np.asarray(o1)[0, cs:ce], np.asarray(o0)[0, cs:ce]), f"{said} outputs"
            if final:
                assert np.array_equal(np.asarray(ht1)[n], np.asarray(ht0)[n]), f"{said} final state"
            for g in NAMES:
                assert np.array_equal(np.asarray(g1[g])[0, cs:ce], np.asarray(g0[g])[0, cs:ce]), f"{said} d{g}"
            if h0:
                assert np.array_equal(np.asarray(gh1)[n], np.asarray(gh0)[n]), f"{said} initial state's gradient"


@pytest.mark.parametrize("final, h0", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["no-states", "final-states", "initial-states", "both"])
def test_float32_overflow_in_a_shared_chunk_stays_in_its_sequence(final, h0):
    """``_overflow_stays`` on ``CU_OVERFLOW``, chunks of 16, with and without initial and final states."""
    _overflow_stays(CU_OVERFLOW, 16, final, h0)


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_float32_overflow_in_a_shared_chunk_stays_in_its_sequence_pallas(target):
    """``_overflow_stays`` with every stage a Pallas kernel (interpreted), initial and final
    states: each kernel selects the products between sequences sharing a chunk as the
    reference stages do (F2's inverse, F3 and F5's ``lower_dot``, F4 and B2's steps, B3,
    B5's sums: ``kdax.pallas``). Before, every other sequence of the chunk took NaN."""
    pipe = kdax.KDAPipeline.pallas(target, interpret=True)
    _overflow_stays(CU_OVERFLOW, 16, True, True, pipeline=dataclasses.replace(pipe, fallback=False),
                    injections=[("k", 1e19, 3), ("k", 1e38, 1), ("v", 1e38, 4), ("q", 1e38, 4)])


@pytest.mark.parametrize("cu, C, HV, options", [
    ([0, 5, 40, 41, 70, 77, 128], 32, 2, dict(use_qk_l2norm_in_kernel=True)),
    ([0, 10, 70, 71, 100, 130, 160], 64, 1, dict(disable_recompute=True)),
    (CU_OVERFLOW, 16, 2, dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
], ids=["l2norm-gva-C32", "no-recompute-C64", "in-kernel-gate-beta"])
def test_float32_overflow_stays_in_its_sequence_with_options(cu, C, HV, options):
    """``_overflow_stays`` with initial and final states and FLA's options: l2norm (k cannot
    overflow then: v and q do), two value heads a q/k head, the forward kept for the
    backward, the in-kernel gate and beta's sigmoid with negative eigenvalues."""
    names = ("v", "q") if options.get("use_qk_l2norm_in_kernel") else ("k", "v")
    injections = [(n, size, bad) for n in names for size, bad in [(1e19, 1), (1e38, 3)]]
    _overflow_stays(cu, C, True, True, HV=HV, injections=injections, **options)


@pytest.mark.parametrize("tuning", ["fastest-modelled", "candidate-rows16-f2"])
def test_float32_overflow_in_a_shared_chunk_stays_in_its_sequence_triton_presets(tuning):
    """As the Pallas test above, with the Triton tunings whose F2 inverse does not select its
    products by sequence (16 warps; ``rows`` 16: the selects spilled on sm_90)."""
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True, tuning=tuning)
    _overflow_stays(CU_OVERFLOW, 16, True, True, pipeline=dataclasses.replace(pipe, fallback=False),
                    injections=[("k", 1e19, 3), ("k", 1e19, 1), ("k", 1e38, 1), ("v", 1e38, 4)])
