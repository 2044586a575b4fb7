"""The layer called eagerly (a decode loop without jit): one compiled program per shape,
dtype and options (issue 50), with the numbers of the jitted call, the argument checks run
on the caller's values before it, and eager gradients."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax.nn._layer as layer_module
from kdax.nn import KimiDeltaAttention

from .._util import assert_close

# (Shapes seen by no other test: a cached program from elsewhere would trace nothing.)
D, H, K, HV = 20, 2, 6, 4


@pytest.fixture
def traces(monkeypatch):
    """The number of times the layer's computation is traced: it calls ``layer_forward``
    once per trace (a cached compiled call calls nothing in Python)."""
    count = []
    inner = layer_module.layer_forward

    def counting(*args, **kwargs):
        count.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(layer_module, "layer_forward", counting)
    return count


def _layer(seed=0, dtype=jnp.float32, **options):
    return KimiDeltaAttention(D, H, K, num_v_heads=HV, key=jax.random.key(seed), param_dtype=dtype, **options)


def _x(seed, *shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for u, w in zip(la, lb):
        np.testing.assert_array_equal(u, w)


@eqx.filter_jit
def _jitted(layer, x, **kw):
    return layer(x, **kw)


def test_eager_decode_traces_once_and_equals_jit(traces):
    layer = _layer()
    cache = cache_jit = layer.init_cache(3)
    for t in range(4):
        x = _x(t, 3, 1, D)
        y, cache = layer(x, cache=cache)
        y_jit, cache_jit = _jitted(layer, x, cache=cache_jit)
        _assert_same((y, cache), (y_jit, cache_jit))
    assert len(traces) == 1 + 1  # once eagerly, once under the jit above


def test_eager_pool_step_equals_jit_and_refuses_a_shared_slot(traces):
    layer = _layer(1, conv_bias=True)
    pool = jax.tree.map(lambda a: a + 0.1, layer.init_cache(5))
    idx = jnp.asarray([4, 0], jnp.int32)
    x = _x(1, 2, 1, D)
    _assert_same(layer(x, cache=pool, state_indices=idx), _jitted(layer, x, cache=pool, state_indices=idx))
    with pytest.raises(Exception, match="state_indices: every slot must be distinct"):
        layer(x, cache=pool, state_indices=jnp.asarray([2, 2], jnp.int32))
    assert len(traces) == 1 + 1  # the refused call ran the program compiled for the first


def test_eager_masked_and_packed_calls_equal_jit(traces):
    layer = _layer(2)
    x = _x(2, 2, 5, D)
    mask = jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]], jnp.int32)
    kw = dict(attention_mask=mask, cache=layer.init_cache(2), chunk_size=16)
    _assert_same(layer(x, **kw), _jitted(layer, x, **kw))
    xp = _x(3, 1, 7, D)
    for cu in (jnp.asarray([0, 3, 7], jnp.int32), jnp.asarray([0, 6, 7], jnp.int32)):  # new offsets: same program
        _assert_same(layer(xp, cu_seqlens=cu), _jitted(layer, xp, cu_seqlens=cu))
    assert len(traces) == 2 + 2


def test_arguments_checked_eagerly_before_the_program(traces):
    layer = _layer(3)
    x = _x(4, 1, 6, D)
    with pytest.raises(ValueError, match="cu_seqlens: must be non-decreasing"):
        layer(x, cu_seqlens=jnp.asarray([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="state: expected"):
        layer(x[:, :1], cache=layer.init_cache(2))
    assert traces == []


def test_eager_grad_equals_jitted_grad_and_traces_once(traces):
    """An eager ``eqx.filter_grad`` of a decode step differentiates the compiled program
    (traced once for two calls): the gradients of the jitted one, every parameter and the
    cache included (float64: JAX splits a differentiated program into a forward and a
    linear one, which XLA may fuse and round differently from one jitted gradient)."""
    layer = _layer(4, jnp.float64)
    cache = jax.tree.map(lambda a: a + 0.2, layer.init_cache(2))
    x = _x(5, 2, 1, D, dtype=jnp.float64)
    w = _x(6, 2, 1, D, dtype=jnp.float64)

    def loss(layer, x, cache):
        y, new = layer(x, cache=cache)
        return jnp.sum(y * w) + jnp.sum(new.state**2)

    grad = eqx.filter_grad(lambda args: loss(*args))  # of every array: parameters, x and cache
    eager = [grad((layer, x, cache)) for _ in range(2)]
    assert len(traces) == 1
    jitted = eqx.filter_jit(grad)((layer, x, cache))
    for d in eager:
        leaves, ref = jax.tree.leaves(d), jax.tree.leaves(jitted)
        assert len(leaves) == len(ref) > 20
        for u, r in zip(leaves, ref):
            assert_close(u, r, 1e-12)


def test_under_jit_traced_as_is(monkeypatch):
    """Under a transformation the layer is traced into the caller's program: the eager
    path's compiled call is not used."""

    def refuse(*args, **kwargs):
        raise AssertionError("the eager path's compiled call ran under a transformation")

    monkeypatch.setattr(layer_module, "_compiled_call", refuse)
    layer = _layer(5)
    y, cache = eqx.filter_jit(lambda l, x, c: l(x, cache=c))(layer, _x(7, 2, 1, D), layer.init_cache(2))
    assert y.shape == (2, 1, D) and cache.state.shape == (2, HV, K, K)
