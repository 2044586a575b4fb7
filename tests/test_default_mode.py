"""kdax in JAX's default mode, as a user's program runs it: 64-bit types off. The rest of
the suite turns x64 on for its float64 oracles, so a path that only breaks with x64 off
(index dtypes, weakly typed constants, a float64 a user's numpy hands in) would go
unseen there. Here each call computes in float32 under ``jax.enable_x64(False)`` (this
thread) and is compared with a float64 truth computed under x64: ``fused_recurrent_kda``,
the token-by-token recurrence, and its gradients by JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

from ._util import assert_close

# Relative RMS against float64. Per-token arrays came within 4e-6 here (dg; the rest within
# 2e-7); the gate parameters' gradients are sums over every token and channel of terms that
# cancel: within 1.2e-5 here, dA_log up to 1.4e-4 in a random sweep of 60 option mixes (the
# chunked dG; the float32 recurrence: 1e-6; benchmarks/NOTES.md, "JAX's default mode").
TOL, TOL_SUMS = 3e-5, 3e-4

# name: (B, T, H, HV, K, V, cu_seqlens as a user's numpy gives it (int64), chunk_kda's options)
CASES = {
    "dense": (2, 45, 1, 2, 16, 8, None, dict(chunk_size=16, initial_state=True, output_final_state=True)),
    "packed, FLA's in-kernel options": (
        1, 50, 2, 2, 16, 16, np.array([0, 17, 17, 50]),
        dict(chunk_size=16, initial_state=True, output_final_state=True, state_v_first=True,
             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    "packed, safe_gate (Kimi Linear's)": (
        1, 70, 1, 2, 8, 8, np.array([0, 3, 70]),
        dict(chunk_size=64, initial_state=False, output_final_state=True, use_qk_l2norm_in_kernel=True,
             use_gate_in_kernel=True, A_log=True, safe_gate=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)),
}


def _inputs(B, T, H, HV, K, V, cu, opts, seed=0):
    """``(q, k, v, g, beta)``, the options with arrays for True placeholders, the differentiated
    options' names and the loss weights: float32 numpy, as a user's program holds them."""
    r = np.random.default_rng(seed)
    f32 = lambda *shape: r.normal(size=shape).astype(np.float32)
    q, k, v = f32(B, T, H, K), f32(B, T, H, K), f32(B, T, HV, V)
    if opts.get("use_gate_in_kernel"):
        g = f32(B, T, HV, K)
    else:
        g = np.log(r.uniform(0.6, 1.0, (B, T, HV, K))).astype(np.float32)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = f32(B, T, HV) if opts.get("use_beta_sigmoid_in_kernel") else r.uniform(0, 1, (B, T, HV)).astype(np.float32)
    N = B if cu is None else len(cu) - 1
    opts = dict(opts)
    if opts.get("initial_state"):
        opts["initial_state"] = 0.3 * f32(N, HV, V, K) if opts.get("state_v_first") else 0.3 * f32(N, HV, K, V)
    else:
        opts.pop("initial_state", None)
    if opts.get("A_log"):
        opts["A_log"] = np.log(r.uniform(1, 16, HV)).astype(np.float32)
    if opts.get("dt_bias"):
        opts["dt_bias"] = f32(HV * K)
    if cu is not None:
        opts["cu_seqlens"] = cu
    diff = tuple(n for n in ("initial_state", "A_log", "dt_bias") if n in opts)
    return (q, k, v, g, beta), opts, diff, (f32(B, T, HV, V), f32(N, HV, K, V))


def _loss(fn, opts, diff, w):
    """``value_and_grad`` of ``sum(o w_o) + sum(ht w_h)`` in the inputs and the options ``diff``."""
    w_o, w_h = w

    def loss(xs, extra):
        o, ht = fn(*xs, **dict(opts, **extra))
        if opts.get("state_v_first"):
            ht = jnp.swapaxes(ht, -1, -2)
        return jnp.sum(o * w_o.astype(o.dtype)) + jnp.sum(ht * w_h.astype(ht.dtype)), (o, ht)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _truth(x, opts, diff, w):
    """Outputs and gradients of the float64 recurrence (x64 on, in this thread only)."""
    with jax.enable_x64(True):
        def as64(a):
            return jnp.asarray(a, jnp.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a

        rec = {n: as64(a) for n, a in opts.items() if n not in ("chunk_size", "safe_gate")}
        (_, (o, ht)), (dx, de) = jax.jit(_loss(kdax.fused_recurrent_kda, rec, diff, w))(
            tuple(map(as64, x)), {n: rec[n] for n in diff})
        return jax.tree.map(np.asarray, (o, ht, dx, de))


def _compare(got, truth, diff):
    (o, ht, dx, de), (o64, ht64, dx64, de64) = got, truth
    assert o.dtype == jnp.float32 and ht.dtype == jnp.float32, (o.dtype, ht.dtype)
    assert_close(o, o64, TOL, "o")
    assert_close(ht, ht64, TOL, "ht")
    for name, a, b in zip(("q", "k", "v", "g", "beta"), dx, dx64):
        assert a.dtype == jnp.float32, (name, a.dtype)
        assert_close(a, b, TOL, "d" + name)
    for name in diff:
        assert_close(de[name], de64[name], TOL if name == "initial_state" else TOL_SUMS, "d" + name)


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_kda_in_float32_with_x64_off(name):
    """``jax.jit(jax.value_and_grad(...))`` of ``chunk_kda`` on float32 numpy inputs (packed
    offsets as numpy's int64) against the float64 recurrence: outputs, final states and
    every gradient float32 and within float32's rounding."""
    x, opts, diff, w = _inputs(*CASES[name])
    truth = _truth(x, opts, diff, w)
    with jax.enable_x64(False):
        (_, (o, ht)), (dx, de) = jax.jit(_loss(kdax.chunk_kda, opts, diff, w))(
            tuple(map(jnp.asarray, x)), {n: jnp.asarray(opts[n]) for n in diff})
    _compare(jax.tree.map(np.asarray, (o, ht, dx, de)), truth, diff)


def test_eager_calls_and_the_recurrence_with_x64_off():
    """Without ``jit``: ``chunk_kda``'s forward and ``fused_recurrent_kda`` on the packed case
    with FLA's options, float32, against the float64 recurrence."""
    x, opts, diff, w = _inputs(*CASES["packed, FLA's in-kernel options"])
    o64, ht64 = _truth(x, opts, diff, w)[:2]
    with jax.enable_x64(False):
        for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
            kw = opts if fn is kdax.chunk_kda else {n: a for n, a in opts.items() if n != "chunk_size"}
            o, ht = fn(*x, **kw)
            assert o.dtype == ht.dtype == jnp.float32, (fn.__name__, o.dtype, ht.dtype)
            assert_close(o, o64, TOL, f"{fn.__name__} o")
            assert_close(jnp.swapaxes(ht, -1, -2), ht64, TOL, f"{fn.__name__} ht")


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (the suite's conftest simulates 8)")
def test_sequence_parallel_with_x64_off():
    """``kdax.parallel.chunk_kda`` over 4 devices on the packed case (a sequence across device
    boundaries, an empty one): outputs, final states and gradients as the float64 truth."""
    x, opts, diff, w = _inputs(1, 52, 2, 2, 16, 16, np.array([0, 17, 17, 52]), CASES["packed, FLA's in-kernel options"][7])
    truth = _truth(x, opts, diff, w)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("sp",))
    sp = lambda *a, **kw: kdax.parallel.chunk_kda(mesh, "sp", *a, **kw)
    with jax.enable_x64(False):
        (_, (o, ht)), (dx, de) = jax.jit(_loss(sp, opts, diff, w))(
            tuple(map(jnp.asarray, x)), {n: jnp.asarray(opts[n]) for n in diff})
    _compare(jax.tree.map(np.asarray, (o, ht, dx, de)), truth, diff)
