"""fused_recurrent_kda: golden parity, options, varlen, jit, gradients."""

import jax
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
    """The golden-case tests are parametrized over ../shared/golden: never let them vanish."""
    assert {"dense_basic", "gate_softplus_l2", "varlen_basic"} <= set(GOLDEN_CASES), GOLDEN_CASES
