"""kdax under JAX's strict numpy settings, as a user's program may set them for its own
code: ``jax_numpy_rank_promotion="raise"`` (no implicit leading axes) and
``jax_numpy_dtype_promotion="strict"`` (no implicit dtype promotion). kdax's broadcasts
are explicit (``kdax._numerics.arrays.ranked``), so every path runs under them and gives
what it gives under JAX's defaults, to the bit: packed sequences (shared chunks), the
in-kernel gates, the recurrent path, the Pallas stages, bf16 inputs beside float32 gates,
and the layer with its cache. (Before: packed calls, the in-kernel gates and every call
of the layer raised JAX's rank-promotion error, the TPU state kernels' chunk marks a
bool-int promotion error.) With 64-bit types on as well, float32 and float64 inputs
alike (before: the layer's "at least float32" sums promoted float64 with float32, and
its int64 ranges met int32 lengths)."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

from ._util import make_inputs


@contextlib.contextmanager
def strict(x64: bool = False):
    """The strict settings, in JAX's default mode (64-bit types off, as a user's program
    runs) unless ``x64``."""
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"), jax.enable_x64(x64):
        yield


def _outputs_and_grads(fn, x):
    """``fn(q, k, v, g, beta, h0)``'s outputs and the gradients of a loss on them w.r.t. every
    floating input."""
    def loss(args):
        o, ht = fn(*args)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape)).astype(o.dtype)
        return jnp.sum((o * w).astype(jnp.float32)) + (0.0 if ht is None else jnp.sum(ht.astype(jnp.float32)))

    args = tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    return fn(*args), jax.grad(loss)(args)


TRITON = kdax.KDAPipeline.pallas("triton", interpret=True)
GATE = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
CALLS = {
    "dense": lambda q, k, v, g, b, h0: kdax.chunk_kda(q, k, v, g, b, initial_state=h0[:1], output_final_state=True),
    "packed, shared chunks": lambda q, k, v, g, b, h0: kdax.chunk_kda(
        q, k, v, g, b, initial_state=h0, cu_seqlens=[0, 1, 3, 5, 40], output_final_state=True,
        use_qk_l2norm_in_kernel=True),
    "softplus gate in kernel": lambda q, k, v, g, b, h0: kdax.chunk_kda(
        q, k, v, g, b, A_log=jnp.full((1, 1, g.shape[2], 1), 0.3, g.dtype), dt_bias=jnp.full(g.shape[2:], 0.1, g.dtype).reshape(-1),
        **GATE),
    "lower-bound gate, packed": lambda q, k, v, g, b, h0: kdax.chunk_kda(
        q, k, v, g, b, A_log=jnp.zeros(g.shape[2], g.dtype), lower_bound=-3.0, safe_gate=True, cu_seqlens=[0, 30, 40],
        output_final_state=True, **GATE),
    "fused_recurrent, gate, packed": lambda q, k, v, g, b, h0: kdax.fused_recurrent_kda(
        q, k, v, g, b, A_log=jnp.zeros(g.shape[2], g.dtype), initial_state=h0[:2], cu_seqlens=[0, 30, 40],
        output_final_state=True, **GATE),
    "pallas triton, packed": lambda q, k, v, g, b, h0: kdax.chunk_kda(
        q, k, v, g, b, initial_state=h0, cu_seqlens=[0, 1, 3, 5, 40], output_final_state=True, pipeline=TRITON,
        use_qk_l2norm_in_kernel=True),
    "pallas tpu, packed": lambda q, k, v, g, b, h0: kdax.chunk_kda(
        q, k, v, g, b, initial_state=h0[:2], cu_seqlens=[0, 10, 40], output_final_state=True,
        pipeline=kdax.KDAPipeline.pallas("tpu", interpret=True), use_qk_l2norm_in_kernel=True),
}


X64 = dict(zip(["x32", "x64-float32", "x64-float64"], [None, jnp.float32, jnp.float64]))
# (64-bit types on: float32 inputs meet the same int64 ranges as float64 ones, and the two
# Pallas targets share the products at issue there: those cases run with the slow sweep)
_SLOW = lambda name, mode: mode == "x64-float32" or (mode == "x64-float64" and name.startswith("pallas triton"))


@pytest.mark.parametrize("name, x64", [
    pytest.param(name, x64, id=f"{name}-{mode}", marks=[pytest.mark.slow] if _SLOW(name, mode) else [])
    for name in CALLS for mode, x64 in X64.items()])
def test_strict_numpy_settings(name, x64):
    """``x64``: None in JAX's default mode, else the input dtype with 64-bit types on."""
    x = make_inputs(seed=3, B=1, T=40, H=2, K=16, V=8, dtype=x64 or jnp.float32, N=4)
    with jax.enable_x64(x64 is not None):  # (JAX's defaults, as strict() runs)
        want = _outputs_and_grads(CALLS[name], x)
    with strict(x64 is not None):
        got = _outputs_and_grads(CALLS[name], x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.isfinite(np.asarray(b, np.float64)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_strict_numpy_settings_bf16_beside_float32_gates():
    """FLA's layer hands bf16 q, k, v beside float32 g and beta: no implicit promotion."""
    x = make_inputs(seed=4, B=1, T=40, H=2, K=16, V=8, dtype=jnp.float32, N=1)
    x.update({n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")})
    fn = lambda q, k, v, g, b, h0: kdax.chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    with jax.enable_x64(False):  # (JAX's defaults, as strict() runs)
        want = _outputs_and_grads(fn, x)
    with strict():
        got = _outputs_and_grads(fn, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("x64", list(X64.values()), ids=list(X64))
def test_strict_numpy_settings_layer(x64):
    """The layer: a padded batch, its parameters' gradients, then a decode step from the cache."""
    with jax.enable_x64(x64 is not None):
        layer = kdax.nn.KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=16, key=jax.random.key(0),
                                           dtype=x64)
        x = jax.random.normal(jax.random.key(1), (2, 12, 32), x64 or jnp.float32)
    mask = jnp.ones((2, 12), jnp.int32).at[1, :3].set(0)

    def run():
        y, cache = layer(x, attention_mask=mask)
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x, attention_mask=mask)[0] ** 2))(layer)
        step, _ = layer(x[:, :1], cache=cache)
        return y, cache, step, grads

    with jax.enable_x64(x64 is not None):  # (JAX's defaults, as strict() runs)
        want = run()
    with strict(x64 is not None):
        got = run()
    leaves = lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_array))
    for a, b in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
