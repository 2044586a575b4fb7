"""Pallas pipelines (interpret mode on CPU) inside jax.shard_map: sequence parallel and
per-shard batch/head sharding equal the same pipeline on one device (float64 <= 1e-12),
forward and every gradient."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kdax
from tests._util import assert_close, make_inputs, split_args

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

PALLAS = kdax.KDAPipeline.pallas(interpret=True)


def _loss(fn, x, opts):
    pos, kw = split_args(x)
    o, ht = fn(*pos, **kw, **opts)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2), (o, ht)


def _run(fn, x, opts):
    """``(o, ht, grads)`` under one jit."""
    grads, (o, ht) = jax.jit(jax.grad(lambda x: _loss(fn, x, opts), has_aux=True))(x)
    return o, ht, grads


def _compare(got, want):
    assert_close(got[0], want[0], 1e-12, "o")
    assert_close(got[1], want[1], 1e-12, "ht")
    for n in want[2]:
        assert_close(got[2][n], want[2][n], 1e-12, "d" + n)


@pytest.mark.slow  # (the packed case below stays in the core)
def test_sequence_parallel():
    """Two devices, dense, initial states, the gate in kernel."""
    x = make_inputs(0, B=2, T=32, H=1, HV=2, K=8, V=8, gate="raw", A_log=True, dt_bias=True)
    opts = dict(output_final_state=True, chunk_size=16, pipeline=PALLAS, use_gate_in_kernel=True)
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    want = _run(kdax.chunk_kda, x, opts)
    _compare(_run(functools.partial(kdax.parallel.chunk_kda, mesh, "sp"), x, opts), want)


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_sequence_parallel_packed(target):
    """Two devices, packed sequences (one crossing the devices' boundary) with initial
    states: the state kernels on each device's layout (the TPU's with its sequence
    boundaries scalar-prefetched, the Triton's with its state table: ``default_pipeline()``
    on a Hopper GPU), every other kernel on its shared chunks' reset table (no fallback),
    equal to the same pipeline on one device."""
    cu = [0, 5, 21, 21, 32]
    x = make_inputs(3, B=1, T=32, H=1, HV=2, K=8, V=8, N=4)
    strict = dataclasses.replace(kdax.KDAPipeline.pallas(target, interpret=True), fallback=False)
    opts = dict(output_final_state=True, chunk_size=16, pipeline=strict, cu_seqlens=jnp.asarray(cu, jnp.int32))
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    want = _run(kdax.chunk_kda, x, opts)
    _compare(_run(functools.partial(kdax.parallel.chunk_kda, mesh, "sp"), x, opts), want)


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_batch_head_sharded_jit(target):
    """jit on inputs sharded over batch and heads of an Explicit mesh: per shard, the
    Pallas state kernels included (dense)."""
    x = make_inputs(1, B=2, T=32, H=2, K=8, V=8)
    opts = dict(output_final_state=True, chunk_size=16, pipeline=kdax.KDAPipeline.pallas(target, interpret=True))
    want = _run(kdax.chunk_kda, x, opts)
    mesh = jax.make_mesh((2, 2), ("b", "h"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
    specs = dict(q=P("b", None, "h"), k=P("b", None, "h"), v=P("b", None, "h"), g=P("b", None, "h"),
                 beta=P("b", None, "h"), initial_state=P("b", "h"))
    xs = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in x.items()}
    with jax.set_mesh(mesh):
        got = _run(kdax.chunk_kda, xs, opts)
    _compare(got, want)
    assert tuple(got[0].sharding.spec)[:3] == ("b", None, "h")
    assert tuple(got[2]["k"].sharding.spec)[:3] == ("b", None, "h")


def test_own_shard_map_needs_check_vma_false():
    x = make_inputs(2, B=1, T=32, H=1, K=8, V=8, h0=False)
    names = ("q", "k", "v", "g", "beta")
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    xs = [jax.sharding.reshard(x[n], NamedSharding(mesh, P(None, "sp"))) for n in names]
    body = lambda *a: kdax.chunk_kda(*a, chunk_size=16, pipeline=PALLAS, seq_axis_name="sp")[0]
    sm = functools.partial(jax.shard_map, body, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match="check_vma=False"):
        sm()(*xs)
    o = jax.jit(sm(check_vma=False))(*xs)
    want = kdax.chunk_kda(*(x[n] for n in names), chunk_size=16, pipeline=PALLAS)[0]
    assert_close(o, want, 1e-12, "o")
