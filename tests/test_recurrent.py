"""fused_recurrent_kda: golden parity, options, varlen, jit, gradients."""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

from ._util import (
    GOLDEN_CASES, assert_close, check_golden, loss_grads, make_inputs, oracle_kda, split_args,
)


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_float64(name):
    check_golden(kdax.fused_recurrent_kda, name, jnp.float64, 1e-9, 1e-9)


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_float32(name):
    check_golden(kdax.fused_recurrent_kda, name, jnp.float32, 1e-5, 1e-4)


OPTION_GRID = [
    dict(),
    dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    dict(use_gate_in_kernel=True, A_log=True, dt_bias=True),
    dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=True, dt_bias=True),
    dict(use_gate_in_kernel=True, lower_bound=-3.0),
    dict(state_v_first=True),
    dict(scale=0.7, HV=4),
]


def _case(opts, seed=0, **shape):
    opts = dict(opts)
    kw = dict(B=2, T=37, H=2, K=8, V=4, seed=seed)
    kw.update(shape)
    kw["HV"] = opts.pop("HV", kw.get("HV"))
    gate_raw = opts.get("use_gate_in_kernel", False)
    x = make_inputs(gate="raw" if gate_raw else "log", A_log=opts.pop("A_log", False),
                    dt_bias=opts.pop("dt_bias", False),
                    beta_raw=opts.get("use_beta_sigmoid_in_kernel", False), **kw)
    if opts.get("state_v_first"):
        x["initial_state"] = jnp.swapaxes(x["initial_state"], -1, -2)
    return x, opts


@pytest.mark.parametrize("opts", OPTION_GRID, ids=lambda o: ",".join(o) or "plain")
def test_options_against_oracle(opts):
    x, opts = _case(opts)
    opts["output_final_state"] = True
    pos, kw = split_args(x)
    o, ht = kdax.fused_recurrent_kda(*pos, **kw, **opts)
    o_ref, ht_ref = oracle_kda(*pos, **kw, **opts)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(ht, ht_ref, 1e-12, "ht")


def test_varlen_equals_per_sequence_and_grads():
    cu = jnp.array([0, 0, 1, 17, 17, 40, 41], jnp.int32)  # lengths 0, 1, 16, 0, 23, 1
    x = make_inputs(B=1, T=41, H=2, HV=4, K=8, V=4, N=6, seed=3)
    opts = dict(cu_seqlens=cu, output_final_state=True)
    pos, kw = split_args(x)
    o, ht = kdax.fused_recurrent_kda(*pos, **kw, **opts)
    o_ref, ht_ref = oracle_kda(*pos, **kw, **opts)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(ht, ht_ref, 1e-12, "ht")
    np.testing.assert_array_equal(ht[0], x["initial_state"][0])  # empty sequence keeps h0
    r = np.random.default_rng(0)
    do, dht = jnp.asarray(r.normal(size=o.shape)), jnp.asarray(r.normal(size=ht.shape))
    g1 = loss_grads(kdax.fused_recurrent_kda, x, opts, do, dht)
    g2 = loss_grads(oracle_kda, x, opts, do, dht)
    for n in g1:
        assert_close(g1[n], g2[n], 1e-12, "d" + n)


def test_varlen_jit_compiles_once():
    x = make_inputs(B=1, T=30, H=1, K=8, V=8, N=3, h0=False)
    traces = []

    @jax.jit
    def f(q, k, v, g, beta, cu):
        traces.append(1)
        return kdax.fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)

    pos, _ = split_args(x)
    cu1, cu2 = jnp.array([0, 10, 11, 30], jnp.int32), jnp.array([0, 0, 29, 30], jnp.int32)
    for cu in (cu1, cu2):
        o, ht = f(*pos, cu)
        o_ref, ht_ref = oracle_kda(*pos, cu_seqlens=cu, output_final_state=True)
        assert_close(o, o_ref, 1e-12, "o")
        assert_close(ht, ht_ref, 1e-12, "ht")
    assert len(traces) == 1


def test_low_precision_inputs():
    """bf16/fp16 inputs accumulate in float32: within 5e-3 of the float64 oracle run on the
    same (rounded) inputs; o in v's dtype, the final state in float32."""
    x = make_inputs(B=1, T=33, H=2, K=16, V=16)
    for dt in (jnp.bfloat16, jnp.float16):
        xl = {n: a.astype(dt) for n, a in x.items()}
        pos, kw = split_args({n: a.astype(jnp.float64) for n, a in xl.items()})
        o_ref, ht_ref = oracle_kda(*pos, **kw, output_final_state=True)
        pos_l, kw_l = split_args(xl)
        o, ht = kdax.fused_recurrent_kda(*pos_l, **kw_l, output_final_state=True)
        assert o.dtype == dt and ht.dtype == jnp.float32
        assert_close(o, o_ref, 5e-3, "o")
        assert_close(ht, ht_ref, 1e-5, "ht")


def test_golden_cases_present():
    """The golden-case tests are parametrized over tests/golden: never let them vanish."""
    assert {"dense_basic", "gate_softplus_l2", "varlen_basic"} <= set(GOLDEN_CASES), GOLDEN_CASES


def _headwise_loop(q, k, v, g, beta, scale):
    """Head-wise beta ``[B, T, HV, V]`` written out in numpy: ``S += k (beta * (v - S^T k))^T``."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, HV, V = v.shape
    S = np.zeros((B, HV, q.shape[-1], V))
    o = np.zeros((B, T, HV, V))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]
        pred = np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t][..., None] * (beta[:, t] * (v[:, t] - pred))[..., None, :]
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def test_headwise_beta():
    """FLA's head-wise beta ``[B, T, HV, V]``: against a loop written out, equal to the
    per-head beta when constant over V, and differentiable."""
    x = make_inputs(seed=3, B=2, T=20, H=2, K=8, V=6, h0=False)
    r = np.random.default_rng(4)
    beta_hw = jnp.asarray(r.uniform(0.05, 0.95, size=x["v"].shape))
    o, ht = kdax.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], beta_hw, output_final_state=True)
    o_ref, ht_ref = _headwise_loop(x["q"], x["k"], x["v"], x["g"], beta_hw, 8**-0.5)
    assert_close(o, o_ref, 1e-12, "o")
    assert_close(ht, ht_ref, 1e-12, "ht")
    same = jnp.broadcast_to(x["beta"][..., None], x["v"].shape)
    o1, _ = kdax.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], same)
    o2, _ = kdax.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert_close(o1, o2, 1e-13, "constant head-wise beta")
    loss = jax.jit(lambda b: jnp.sum(kdax.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], b)[0] ** 2))
    db = jax.grad(loss)(beta_hw)
    e = jnp.zeros_like(beta_hw).at[0, 5, 1, 2].set(1e-6)
    fd = (loss(beta_hw + e) - loss(beta_hw - e)) / 2e-6
    np.testing.assert_allclose(db[0, 5, 1, 2], fd, rtol=1e-6)
    with pytest.raises(Exception, match="beta"):
        kdax.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], beta_hw[..., :5])


def test_kda_gate_public_and_differentiable():
    """``kdax.kda_gate`` (FLA's ``fused_kda_gate``): the activation alone, with gradients."""
    x = make_inputs(seed=5, B=1, T=6, H=2, K=4, V=4, gate="raw", A_log=True, dt_bias=True)
    g, A, b = x["g"], x["A_log"], x["dt_bias"]
    want = -np.exp(np.asarray(A))[:, None] * np.log1p(np.exp(np.asarray(g) + np.asarray(b).reshape(2, 4)))
    np.testing.assert_allclose(kdax.kda_gate(g, A, b), want, rtol=1e-13)
    for lb in (None, -5.0):
        jax.test_util.check_grads(lambda g, A, b: kdax.kda_gate(g, A, b, lb), (g, A, b), order=1, modes=["rev"])


@pytest.mark.parametrize("headwise", [False, True])
def test_fused_step_is_the_readable_step(headwise):
    """``fused_recurrent_kda``'s step (the decay folded into k and q, one product for both,
    the output from the old state) against ``kdax.ref.recurrent_step`` in float64: the same
    state and output, with a hard decay (g = -inf: that row forgotten exactly), per-head or
    head-wise beta."""
    from kdax.recurrent import _fused_step

    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float64)
    S, q, k, v = f(3, 2, 8, 5), f(3, 2, 8), f(3, 2, 8), f(3, 2, 5)
    g = (-jnp.abs(f(3, 2, 8))).at[0, 1, 3].set(-jnp.inf)
    b = jax.nn.sigmoid(f(3, 2, 5) if headwise else f(3, 2))
    S_ref, o_ref = kdax.ref.recurrent_step(S, q, k, v, g, b, 0.7)
    S_new, o_new = _fused_step(S, q, k, v, g, b, 0.7)
    assert_close(S_new, S_ref, 1e-14, "state")
    assert_close(o_new, o_ref, 1e-14, "output")
    # the forgotten row: what the old state held there changes nothing, bit for bit
    S_other = S.at[0, 1, 3].set(f(5) * 1e6)
    for a, c in zip(_fused_step(S_other, q, k, v, g, b, 0.7), (S_new, o_new)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_varlen_branches_equal_selects():
    """The packed scan's two forms of loading and storing each sequence's state (branches on
    CPU, selects elsewhere) give the same outputs and final states, bit for bit, with an
    empty sequence and a one-token one."""
    from kdax.recurrent import _varlen_scan

    r = np.random.default_rng(1)
    T, H, K, V = 13, 2, 4, 3
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float64)
    xs = (f(T, H, K), f(T, H, K), f(T, H, V), -jnp.abs(f(T, H, K)), jax.nn.sigmoid(f(T, H)))
    h0 = f(4, H, K, V)
    cu = jnp.asarray([0, 5, 5, 6, 13], jnp.int32)
    got = [_varlen_scan(xs, h0, cu, 0.5, branches=b) for b in (True, False)]
    for a, b in zip(*got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(got[0][1][1]), np.asarray(h0[1]))  # the empty sequence keeps h0
