"""F1 gate (activations + chunk cumsum) and B5 gate backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax import KDAConfig
from kdax.ref import beta_activation, l2norm, log_decay_floor
from kdax.stages import ReferenceGate, ReferenceGateBackward

from .._util import assert_close, jitted
from ._chunked import in_kernel_decay, rand_like

CONFIGS = {
    "plain": dict(),
    "all_softplus": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    "lower_bound_neg": dict(use_gate_in_kernel=True, lower_bound=-4.0, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "lower_bound_noA": dict(use_gate_in_kernel=True, lower_bound=-2.0, use_qk_l2norm_in_kernel=True),
}


def _inputs(cfg, seed=0, R=2, HV=2, NC=2, C=16, K=8):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s))
    gate = cfg.use_gate_in_kernel
    g = f(R, HV, NC, C, K) if gate else -jnp.abs(f(R, HV, NC, C, K))
    A_log = f(HV) * 0.3 if gate and not (cfg.lower_bound == -2.0) else None
    dt_bias = f(HV * K) if gate else None
    valid = jnp.asarray(np.arange(NC * C).reshape(1, NC, C) < NC * C - 5).repeat(R, 0)
    return f(R, HV, NC, C, K), f(R, HV, NC, C, K), g, f(R, HV, NC, C), A_log, dt_bias, valid


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gate_forward(name):
    cfg = KDAConfig(scale=1.0, **CONFIGS[name])
    q, k, g, beta, A_log, dt_bias, valid = _inputs(cfg)
    act = jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid)
    ga = in_kernel_decay(g, A_log, dt_bias, cfg.lower_bound) if cfg.use_gate_in_kernel else g
    ga = jnp.where(valid[:, None, :, :, None], ga, 0.0)
    assert_close(act.G, jnp.cumsum(ga, axis=-2), 1e-13, "G")
    qq, kk = (l2norm(q), l2norm(k)) if cfg.use_qk_l2norm_in_kernel else (q, k)
    assert_close(act.q, qq, 1e-13, "q")
    assert_close(act.k, kk, 1e-13, "k")
    assert_close(act.beta, beta_activation(beta, cfg.use_beta_sigmoid_in_kernel, cfg.allow_neg_eigval), 1e-13, "beta")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gate_backward_is_vjp(name):
    cfg = KDAConfig(scale=1.0, **CONFIGS[name])
    q, k, g, beta, A_log, dt_bias, valid = _inputs(cfg, seed=1)

    def f(q, k, g, beta, A_log, dt_bias):
        a = jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid)
        return a.q, a.k, a.beta, a.G

    outs, vjp = jax.vjp(f, q, k, g, beta, A_log, dt_bias)
    cts = tuple(rand_like(o, 5 + i) for i, o in enumerate(outs))
    want = vjp(cts)
    act = jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid)
    got = jitted(ReferenceGateBackward())(cfg, act, g if cfg.use_gate_in_kernel else None, A_log, dt_bias, valid,
                                  cts[0], cts[1], cts[2], cts[3])
    for n, a, b in zip(("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias"),
                       (got.dq, got.dk, got.dg, got.dbeta, got.dA_log, got.ddt_bias), want):
        if b is None:
            assert a is None, n
        else:
            assert_close(a, b, 1e-12, n)


@pytest.mark.parametrize("lower_bound", [None, -2000.0], ids=["softplus", "lower-bound"])
def test_gate_backward_below_the_floor_is_the_vjp(lower_bound):
    """An in-kernel gate whose activated decay falls below the floor (here -exp(3) *
    softplus(x) and -2000 sigmoid(x) down to about -2000, float64's floor -1024) is clamped
    by F1, so it does not depend on the raw input there: B5 gives dg = 0 to the bit at those
    tokens and JAX's VJP of F1 everywhere (it once passed the cotangent through, the
    rounding noise of the six-stage backward where the true dg is ~0)."""
    cfg = KDAConfig(scale=1.0, use_gate_in_kernel=True, lower_bound=lower_bound)
    q, k, g, beta, _, dt_bias, valid = _inputs(cfg, seed=2)
    g = g * 40.0
    A_log = jnp.full((2,), 3.0)

    def f(g, A_log, dt_bias):
        return jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid).G

    G, vjp = jax.vjp(f, g, A_log, dt_bias)
    dG = rand_like(G, 7)
    want = vjp(dG)
    act = jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid)
    zero = jnp.zeros_like(q)
    got = jitted(ReferenceGateBackward())(cfg, act, g, A_log, dt_bias, valid, zero, zero, jnp.zeros_like(beta), dG)
    below = in_kernel_decay(g, A_log, dt_bias, lower_bound) < log_decay_floor(jnp.float64)
    assert 0.1 < float(jnp.mean(below)) < 0.9
    np.testing.assert_array_equal(np.asarray(got.dg)[np.asarray(below)], 0.0)
    for n, a, b in zip(("dg", "dA_log", "ddt_bias"), (got.dg, got.dA_log, got.ddt_bias), want):
        assert_close(a, b, 1e-12, n)


def test_gate_backward_below_the_floor_given_decays_is_the_vjp():
    """Log decays given directly (no in-kernel gate) down to about -2000 and -inf (below
    float64's floor, -1024): F1 clamps them, so B5, told them as ``g``, gives dg = 0 to the
    bit there and JAX's VJP of F1 everywhere. Told no ``g`` (a caller of the old contract),
    it still runs, passing the reverse cumsum through (no clamp known)."""
    cfg = KDAConfig(scale=1.0)
    q, k, g, beta, _, _, valid = _inputs(cfg, seed=2)
    g = g * 700.0
    g = g.at[0, 1, 0, 3, :4].set(-jnp.inf)

    def f(g):
        return jitted(ReferenceGate())(cfg, q, k, g, beta, None, None, valid).G

    G, vjp = jax.vjp(f, g)
    dG = rand_like(G, 7)
    (want,) = vjp(dG)
    act = jitted(ReferenceGate())(cfg, q, k, g, beta, None, None, valid)
    zero = jnp.zeros_like(q)
    b5 = lambda g: jitted(ReferenceGateBackward())(cfg, act, g, None, None, valid, zero, zero, jnp.zeros_like(beta), dG)
    got = b5(g)
    below = np.asarray(g < log_decay_floor(jnp.float64))
    assert 0.1 < below.mean() < 0.9
    np.testing.assert_array_equal(np.asarray(got.dg)[below], 0.0)
    assert_close(got.dg, want, 1e-12, "dg")
    assert got.dA_log is None and got.ddt_bias is None
    untold = np.asarray(b5(None).dg)
    assert np.isfinite(untold).all() and np.any(untold[below] != 0.0)


@pytest.mark.parametrize("name", ["plain", "all_softplus"])
def test_gate_reset(name):
    """``reset`` (shared chunks, issue 18.8): F1 gives those tokens ``reset_log_decay`` (a
    NaN or inf gate stays); B5's gate gradients are the VJP of the cumsum restarted at each
    reset, the reset token's own gate a constant (dg = 0 there, exactly)."""
    from kdax.ref._gates import clamp_log_decay
    from kdax.ref._gates import reset_log_decay

    cfg = KDAConfig(scale=1.0, **CONFIGS[name])
    q, k, g, beta, A_log, dt_bias, valid = _inputs(cfg, seed=2)
    R, HV, NC, C, K = q.shape
    reset = np.zeros((R, NC, C), bool)
    reset[0, 0, [0, 3, 4, 9]] = reset[0, 1, [0, 10]] = reset[1, 1, 7] = True  # (valid tokens)
    reset = jnp.asarray(reset)
    act = jitted(ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid, reset)
    G = np.asarray(act.G + (0 if act.G_lo is None else act.G_lo))
    step = np.diff(np.concatenate([np.zeros_like(G[..., :1, :]), G], axis=-2), axis=-2)
    assert np.allclose(step[np.broadcast_to(np.asarray(reset)[:, None, :, :, None], G.shape)], reset_log_decay(G.dtype))
    seg = np.cumsum(np.asarray(reset), axis=-1)  # sequence index within each chunk

    def restarted(g, A_log, dt_bias):  # the gate, then the cumsum restarted at each reset
        ga = in_kernel_decay(g, A_log, dt_bias, cfg.lower_bound) if cfg.use_gate_in_kernel else g
        ga = jnp.where(valid[:, None, ..., None] & ~reset[:, None, ..., None], clamp_log_decay(ga), 0.0)
        same = (np.arange(C)[:, None] >= np.arange(C)[None]) & (seg[..., :, None] == seg[..., None, :])
        return jnp.asarray(same, ga.dtype)[:, None] @ ga

    dG = rand_like(act.G, 3)
    _, vjp = jax.vjp(restarted, g, A_log, dt_bias)
    want = vjp(dG)
    got = jitted(ReferenceGateBackward())(cfg, act, g if cfg.use_gate_in_kernel else None, A_log, dt_bias, valid,
                                  act.q, act.k, act.beta, dG, reset)
    assert np.all(np.asarray(got.dg)[np.broadcast_to(np.asarray(reset)[:, None, :, :, None], G.shape)] == 0)
    for n, a, b in zip(("dg", "dA_log", "ddt_bias"), (got.dg, got.dA_log, got.ddt_bias), want):
        if b is None:
            assert a is None, n
        else:
            assert_close(a, b, 1e-12, n)
    bad = g.at[0, 0, 0, 3, 1].set(jnp.nan).at[1, 1, 1, 7, 2].set(jnp.inf)  # gates at reset tokens
    G_bad = np.asarray(jitted(ReferenceGate())(cfg, q, k, bad, beta, A_log, dt_bias, valid, reset).G)
    assert np.isnan(G_bad[0, 0, 0, 3, 1])
    if not cfg.use_gate_in_kernel:  # (a raw +inf in the softplus gate is a legitimate -inf gate)
        assert not np.isfinite(G_bad[1, 1, 1, 7, 2])
