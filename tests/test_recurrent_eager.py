"""fused_recurrent_kda called eagerly: one compiled program per shape, dtype and options
(issue 50), with the same numbers as the jitted call, the checks on concrete values run
before it, and eager gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
import kdax.recurrent as recurrent

from ._util import assert_close, make_inputs, split_args


@pytest.fixture
def traces(monkeypatch):
    """The number of times ``fused_recurrent_kda``'s computation is traced: its body calls
    ``activate_inputs`` once per trace (a cached compiled call calls nothing in Python)."""
    count = []
    inner = recurrent.activate_inputs

    def counting(*args, **kwargs):
        count.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(recurrent, "activate_inputs", counting)
    return count


def _jitted(**opts):
    return jax.jit(lambda q, k, v, g, beta, h0: kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                                                         **opts))


# (Shapes seen by no other test: a cached program from elsewhere would trace nothing.)
CASES = [
    dict(shape=dict(B=3, T=1, H=2, K=5, V=7), opts=dict()),
    dict(shape=dict(B=2, T=9, H=1, HV=3, K=6, V=5), opts=dict(use_qk_l2norm_in_kernel=True, scale=0.3)),
    dict(shape=dict(B=2, T=11, H=2, K=7, V=3), gate="raw", beta_raw=True,
         opts=dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, use_beta_sigmoid_in_kernel=True,
                   allow_neg_eigval=True)),
    dict(shape=dict(B=1, T=5, H=1, K=3, V=9), gate="raw", opts=dict(use_gate_in_kernel=True, lower_bound=-4)),
]


def _inputs(case, seed):
    opts = dict(case["opts"])
    x = make_inputs(seed=seed, gate=case.get("gate", "log"), beta_raw=case.get("beta_raw", False),
                    A_log=opts.pop("A_log", False), dt_bias=opts.pop("dt_bias", False), dtype=jnp.float32,
                    **case["shape"])
    pos, kw = split_args(x)
    return pos, kw.pop("initial_state"), {**kw, **opts, "output_final_state": True}


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c["opts"]) or "plain")
def test_eager_calls_trace_once_and_equal_jit(case, traces):
    for seed in (0, 1):  # new values, same shapes: the compiled program is reused
        pos, h0, opts = _inputs(case, seed)
        o, ht = kdax.fused_recurrent_kda(*pos, initial_state=h0, **opts)
        o_jit, ht_jit = _jitted(**opts)(*pos, h0)
        np.testing.assert_array_equal(o, o_jit)
        np.testing.assert_array_equal(ht, ht_jit)
    assert len(traces) == 1 + 2  # once eagerly; each jax.jit above traces its own (same shapes: once)


def test_new_options_or_shapes_compile_anew(traces):
    pos, h0, opts = _inputs(dict(shape=dict(B=2, T=3, H=3, K=4, V=5), opts=dict()), 0)
    kdax.fused_recurrent_kda(*pos, initial_state=h0, **opts)
    kdax.fused_recurrent_kda(*pos, initial_state=h0, **opts)
    assert len(traces) == 1
    kdax.fused_recurrent_kda(*pos, initial_state=h0, **opts, use_qk_l2norm_in_kernel=True)
    assert len(traces) == 2
    kdax.fused_recurrent_kda(*(x[:, :2] for x in pos), initial_state=h0, **opts)
    assert len(traces) == 3


def test_varlen_eager_equals_jit_and_new_offsets_reuse_the_program(traces):
    x = make_inputs(B=1, T=13, H=2, K=4, V=6, N=3, dtype=jnp.float32)
    pos, kw = split_args(x)
    f = jax.jit(lambda q, k, v, g, beta, h0, cu: kdax.fused_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True))
    for cu in ([0, 4, 4, 13], jnp.array([0, 1, 12, 13], jnp.int32)):  # a list too (kdax converts it)
        o, ht = kdax.fused_recurrent_kda(*pos, **kw, cu_seqlens=cu, output_final_state=True)
        o_jit, ht_jit = f(*pos, kw["initial_state"], jnp.asarray(cu, jnp.int32))
        np.testing.assert_array_equal(o, o_jit)
        np.testing.assert_array_equal(ht, ht_jit)
    assert len(traces) == 1 + 1


def test_state_v_first_and_numpy_inputs_eager_equal_jit(traces):
    x = make_inputs(B=2, T=6, H=2, K=3, V=8, dtype=jnp.float32, seed=4)
    pos, kw = split_args(x)
    h0 = np.asarray(jnp.swapaxes(kw["initial_state"], -1, -2))  # numpy, [N, HV, V, K]
    pos_np = tuple(np.asarray(a) for a in pos)
    o, ht = kdax.fused_recurrent_kda(*pos_np, initial_state=h0, state_v_first=True, output_final_state=True)
    o_jit, ht_jit = _jitted(state_v_first=True, output_final_state=True)(*pos, jnp.asarray(h0))
    np.testing.assert_array_equal(o, o_jit)
    np.testing.assert_array_equal(ht, ht_jit)
    assert ht.shape == h0.shape


@pytest.mark.parametrize("bad, match", [
    (dict(g=1e-3), "g: must be a log decay <= 0"),
    (dict(beta=1.5), r"beta: must lie in \[0, 1\]"),
])
def test_domain_checked_eagerly_before_any_kernel(bad, match, traces):
    """check_domain reads the caller's concrete g and beta: the ValueError comes before
    the compiled program is traced or run."""
    x = make_inputs(B=1, T=4, H=1, K=4, V=4, dtype=jnp.float32)
    name, value = next(iter(bad.items()))
    x[name] = x[name].at[0, 2].set(value)
    pos, kw = split_args(x)
    with pytest.raises(ValueError, match=match):
        kdax.fused_recurrent_kda(*pos, **kw)
    assert traces == []


def test_cu_seqlens_values_checked_eagerly(traces):
    x = make_inputs(B=1, T=6, H=1, K=4, V=4, N=2, dtype=jnp.float32, h0=False)
    pos, _ = split_args(x)
    with pytest.raises(ValueError, match="cu_seqlens: must be non-decreasing"):
        kdax.fused_recurrent_kda(*pos, cu_seqlens=jnp.array([0, 5, 3, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens: must end at T=6"):
        kdax.fused_recurrent_kda(*pos, cu_seqlens=[0, 2, 5])
    assert traces == []


def test_eager_grad_equals_jitted_grad_and_traces_once(traces):
    """An eager ``jax.grad`` differentiates the compiled program (traced once for two
    calls); its gradients are those of ``jax.jit(jax.grad(...))`` (float64: JAX splits a
    differentiated program into a forward and a linear one, which XLA may round
    differently from one jitted gradient)."""
    x = make_inputs(B=2, T=8, H=1, HV=2, K=5, V=3, gate="raw", A_log=True, dt_bias=True, seed=2)
    pos, kw = split_args(x)
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True)
    w = jnp.asarray(np.random.default_rng(0).normal(size=x["v"].shape))

    def loss(q, k, v, g, beta, h0, A_log, dt_bias):
        o, ht = kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias, **opts)
        return jnp.sum(o * w) + jnp.sum(ht**2)

    args = (*pos, kw["initial_state"], kw["A_log"], kw["dt_bias"])
    argnums = tuple(range(len(args)))
    eager = [jax.grad(loss, argnums)(*args) for _ in range(2)]
    assert len(traces) == 1
    jitted = jax.jit(jax.grad(loss, argnums))(*args)
    for d_eager in eager:
        for a, b, name in zip(d_eager, jitted, ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")):
            assert_close(a, b, 1e-12, "d" + name)


def test_under_transformations_traced_as_is(monkeypatch):
    """Under jit and vmap the body is traced into the caller's program: the eager path's
    compiled call is not used (nested, it would only add a call boundary)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the eager path's compiled call ran under a transformation")

    monkeypatch.setattr(recurrent, "_compiled_recurrent", refuse)
    x = make_inputs(B=2, T=3, H=1, K=4, V=4, dtype=jnp.float32)
    pos, kw = split_args(x)
    o = jax.jit(lambda *a: kdax.fused_recurrent_kda(*a)[0])(*pos)
    ov = jax.vmap(lambda *a: kdax.fused_recurrent_kda(*(y[None] for y in a))[0][0])(*pos)
    np.testing.assert_allclose(ov, o, rtol=1e-6, atol=1e-6)
    assert o.shape == x["v"].shape
