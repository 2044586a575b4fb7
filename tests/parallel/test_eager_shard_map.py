"""Called eagerly (no ``jax.jit`` around it), every sharded front door runs and gives the
numbers of its jitted call: ``kdax.parallel.apply_layer``, and ``kdax.chunk_kda`` or the
layer inside an eager ``jax.shard_map`` (with ``seq_axis_name``, or on a shard of the
heads). JAX 0.10's eager shard_map does not run a custom VJP with symbolic zeros: all
four raised its ``NotImplementedError`` ("custom_vjp symbolic_zeros support with
shard_map is not implemented") before kdax compiled its custom-VJP calls there
(``kdax._platform.in_eager_shard_map``)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import kdax
from tests._util import assert_close, make_inputs, split_args

from ..nn.test_layer import D, make_layer, rand, rand_cache

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices: see tests/conftest.py")

T = 32
CU = [0, 5, 5, 19, 32]  # across device edges at 8, 16, 24; one empty
PIPE = kdax.KDAPipeline.reference().untiled()


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((4,), ("sp",), axis_types=(axis_type,), devices=jax.devices()[:4])


def _inputs(seed):
    return split_args(make_inputs(seed, B=1, T=T, H=2, HV=4, K=8, V=8, h0=False, dtype=jnp.float64))[0]


def _close_trees(got, want, tol, name):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert_close(a, b, tol, f"{name}[{i}]")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_apply_layer_eagerly_equals_one_device(axis_type):
    layer, _, _ = make_layer(3, conv_bias=True)
    x = rand(3, 1, T, D)
    cache = rand_cache(layer, len(CU) - 1, 4)
    cu = jnp.asarray(CU, jnp.int32)
    y, new = kdax.parallel.apply_layer(_mesh(axis_type), "sp", layer, x, cu_seqlens=CU, cache=cache,
                                       chunk_size=16, pipeline=PIPE)
    y1, new1 = layer(x, cu_seqlens=cu, cache=cache, mode="chunk", chunk_size=16, pipeline=PIPE)
    assert_close(y, y1, 1e-12, "y")
    _close_trees(new, new1, 1e-12, "cache")
    # and its eager gradients (the sum of an Explicit mesh's arrays needs the mesh in context)
    loss = lambda l, x: jnp.sum(kdax.parallel.apply_layer(_mesh(axis_type), "sp", l, x, cu_seqlens=CU,
                                                          chunk_size=16, pipeline=PIPE)[0] * x)
    loss1 = lambda l, x: jnp.sum(l(x, cu_seqlens=cu, mode="chunk", chunk_size=16, pipeline=PIPE)[0] * x)
    with jax.set_mesh(_mesh(axis_type)):
        g = eqx.filter_grad(loss)(layer, x)
    _close_trees(g, eqx.filter_grad(loss1)(layer, x), 1e-12, "grad")


def _chunk(q, k, v, g, beta, **kw):
    return kdax.chunk_kda(q, k, v, g, beta, cu_seqlens=jnp.asarray(CU, jnp.int32), output_final_state=True,
                          pipeline=PIPE, chunk_size=16, use_qk_l2norm_in_kernel=True, **kw)


def _in_shard_map(fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=True)


def test_chunk_kda_in_eager_shard_map_over_tokens():
    tok = P(None, "sp")
    sharded = _in_shard_map(lambda *a: _chunk(*a, seq_axis_name="sp"), (tok,) * 5, (tok, P()))
    args = _inputs(5)

    def loss(fn, *a):
        o, final = fn(*a)
        return jnp.sum(o * a[2]) + jnp.sum(final ** 2), (o, final)

    (_, got), dgot = jax.value_and_grad(loss, argnums=range(1, 6), has_aux=True)(sharded, *args)
    (_, want), dwant = jax.value_and_grad(loss, argnums=range(1, 6), has_aux=True)(_chunk, *args)
    _close_trees(got, want, 1e-12, "outputs")
    _close_trees(dgot, dwant, 1e-12, "grad")


def test_chunk_kda_in_eager_shard_map_over_heads():
    q, k, v, g, beta = _inputs(6)
    head, head_v = P(None, None, "sp"), P(None, None, "sp")
    call = lambda q, k, v, g, beta: kdax.chunk_kda(q, k, v, g, beta, pipeline=PIPE, chunk_size=16)[0]
    # H = 2 query heads for HV = 4 value heads: repeat q, k so that each device holds its own
    q, k = jnp.repeat(q, 2, axis=2), jnp.repeat(k, 2, axis=2)
    sharded = _in_shard_map(call, (head, head, head_v, head_v, head), head_v)
    want = call(q, k, v, g, beta)
    assert_close(sharded(q, k, v, g, beta), want, 1e-12, "o")
    loss = lambda *a: jnp.sum(sharded(*a) * a[2])
    _close_trees(jax.grad(loss, argnums=range(5))(q, k, v, g, beta),
                 jax.grad(lambda *a: jnp.sum(call(*a) * a[2]), argnums=range(5))(q, k, v, g, beta), 1e-12, "grad")


def test_layer_in_eager_shard_map():
    layer, _, _ = make_layer(7)
    x = rand(7, 1, T, D)
    tok = P(None, "sp")
    run = lambda l, x: l(x, cu_seqlens=jnp.asarray(CU, jnp.int32), seq_axis_name="sp", chunk_size=16,
                         pipeline=PIPE)
    sharded = _in_shard_map(run, (P(), tok), (tok, P()))
    y, new = sharded(layer, x)
    y1, new1 = layer(x, cu_seqlens=jnp.asarray(CU, jnp.int32), mode="chunk", chunk_size=16, pipeline=PIPE)
    assert_close(y, y1, 1e-12, "y")
    _close_trees(new, new1, 1e-12, "cache")
