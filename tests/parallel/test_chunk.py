"""Sequence-parallel chunk_kda on 8 simulated CPU devices equals single-device chunk_kda:
outputs, final states and every gradient (float64 <= 1e-12, float32 <= 1e-5)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import kdax
from tests._util import assert_close, make_inputs, run, split_args

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

T = 96  # 8 devices x 12 tokens, 4 x 24, 2 x 48; chunk 16 never aligns with a device edge
# Device edges at multiples of 12 (P = 8): a sequence inside one device (0:3), an empty one
# (3:3), length 1 (3:4), across one edge (4:18), ending on an edge (18:24), empty on an
# edge (24:24), starting on an edge and crossing three (24:61), length 1 (61:62), across
# two edges to the end (62:96).
CU = [0, 3, 3, 4, 18, 24, 24, 61, 62, 96]


def _mesh(n, axis_type=AxisType.Explicit):
    return jax.make_mesh((n,), ("sp",), axis_types=(axis_type,), devices=jax.devices()[:n])


# Every stage called once over the whole input: the same numbers as the default CPU
# pipeline's tiles, compiled in half the time (the slow sweep runs the default one).
UNTILED = kdax.KDAPipeline.reference().untiled()


def _outputs_and_grads(fn, x, opts, do, dht):
    """``(o, ht, gradients of sum(o * do) + sum(ht * dht))`` under one jit: one compile
    per function (the forward shared by both)."""
    def loss(xs):
        pos, kw = split_args(xs)
        o, ht = fn(*pos, **kw, **opts)
        val = jnp.sum(o * do)
        if ht is not None:
            val = val + jnp.sum(ht * dht)
        return val, (o, ht)

    grads, (o, ht) = jax.jit(jax.grad(loss, has_aux=True))(x)
    return o, ht, grads


def _compare(mesh, x, opts, dtype, tol, prefix="auto", seq_axis="sp", batch_axis=None, pipeline=UNTILED,
             forward_only=False):
    """``forward_only``: also the outputs of a call without gradients (its own passes)."""
    x = {n: a.astype(dtype) for n, a in x.items()}
    opts = dict(opts, pipeline=pipeline)
    sp = lambda *a, **kw: kdax.parallel.chunk_kda(mesh, seq_axis, *a, batch_axis=batch_axis, prefix=prefix, **kw)
    o_ref, ht_ref = jax.eval_shape(lambda x: run(kdax.chunk_kda, x, opts), x)
    r = np.random.default_rng(7)
    do = jnp.asarray(r.normal(size=o_ref.shape), dtype)
    dht = None if ht_ref is None else jnp.asarray(r.normal(size=ht_ref.shape), ht_ref.dtype)
    o_ref, ht_ref, g_ref = _outputs_and_grads(kdax.chunk_kda, x, opts, do, dht)
    o, ht, g = _outputs_and_grads(sp, x, opts, do, dht)
    assert o.dtype == o_ref.dtype
    assert_close(o, o_ref, tol, "o")
    if opts.get("output_final_state"):
        assert_close(ht, ht_ref, tol, "ht")
    for n in g_ref:
        assert g[n].dtype == g_ref[n].dtype, n
        assert_close(g[n], g_ref[n], tol, "d" + n)
    if forward_only:
        pos, kw = split_args(x)
        o, ht = jax.jit(lambda pos, kw: sp(*pos, **kw, **opts))(pos, kw)
        assert_close(o, o_ref, tol, "o (forward only)")
        if opts.get("output_final_state"):
            assert_close(ht, ht_ref, tol, "ht (forward only)")


def _packed(seed=0, h0=True, **kw):
    x = make_inputs(seed, B=1, T=T, H=2, HV=4, K=8, V=8, N=len(CU) - 1, h0=h0, **kw)
    return x, dict(cu_seqlens=jnp.asarray(CU, jnp.int32), chunk_size=16)


@pytest.mark.slow  # (sequences across four devices, forward and backward: tests/parallel/test_isolation.py)
def test_packed_8_devices_float64():
    x, opts = _packed()
    _compare(_mesh(8), x, dict(opts, output_final_state=True), jnp.float64, 1e-12, forward_only=True)


@pytest.mark.slow
def test_packed_every_option_float64():
    x, opts = _packed(1, gate="raw", A_log=True, dt_bias=True, beta_raw=True)
    x["initial_state"] = jnp.swapaxes(x["initial_state"], -1, -2)
    opts.update(output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, state_v_first=True, scale=0.3)
    _compare(_mesh(8), x, opts, jnp.float64, 1e-12)


@pytest.mark.slow  # (packed gradients across devices, either prefix: tests/parallel/test_isolation.py)
def test_packed_float32_doubling_no_states():
    x, opts = _packed(2, h0=False)
    _compare(_mesh(8), x, opts, jnp.float32, 1e-5, prefix="doubling")


def test_recompute_rebuilds_the_kept_cache_bitwise_float32():
    # B0 is called in one place (KDAPipeline.recomputed) with the forward's G_lo and reset
    # table, by the one-device backward and by the sequence-parallel one alike: the cache
    # it rebuilds is the one disable_recompute keeps, to the bit (the sequence-parallel B0
    # once took neither: 8.5e-8 apart in float32). Eager, so that both sides run the same
    # operations (two compiled programs may fuse and round differently: the end-to-end
    # recompute and disable_recompute training steps differ by up to 2.4e-7 in float32 on
    # one device as on eight, from XLA's fusion alone).
    from kdax.parallel._chunk import _Static, _with_cache

    x, opts = _packed(3)
    x = {n: a.astype(jnp.float32) for n, a in x.items()}
    pos, kw = split_args(x)
    pipe = kdax.KDAPipeline.reference().untiled()
    _, _, res = pipe.forward(*pos, **kw, **opts, output_final_state=True)
    assert res.act.G_lo is not None  # (float32: the exact hi/lo gate)
    dropped = eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda c: c is None)
    for name, cache in (("one device", pipe.recomputed(dropped)),
                        ("sequence parallel", _with_cache(_Static(pipe, "sp", "auto", ()), dropped).cache)):
        for f in ("w", "u", "qg", "kg", "h", "v_new"):
            np.testing.assert_array_equal(np.asarray(getattr(cache, f)), np.asarray(getattr(res.cache, f)),
                                          err_msg=f"{name}: {f}")


def test_dense_4_devices_float64_doubling():
    x = make_inputs(3, B=2, T=T, H=2, K=8, V=8)
    _compare(_mesh(4), x, dict(output_final_state=True, chunk_size=16), jnp.float64, 1e-12, prefix="doubling")


def test_data_by_sequence_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
    x = make_inputs(4, B=2, T=T, H=2, K=8, V=8)
    _compare(mesh, x, dict(output_final_state=True, chunk_size=16), jnp.float64, 1e-12, batch_axis="data")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("prefix", ["gather", "doubling"])
@pytest.mark.parametrize("packed", [False, True])
def test_sweep(n, prefix, packed):
    """The default (tiled) pipeline, float64, on an Auto mesh; float32 at P = 8."""
    if packed:
        x, opts = _packed(5)
    else:
        x, opts = make_inputs(5, B=2, T=T, H=2, K=8, V=8), dict(chunk_size=16)
    for dtype, tol in [(jnp.float64, 1e-12)] + ([(jnp.float32, 1e-5)] if n == 8 else []):
        _compare(_mesh(n, AxisType.Auto), x, dict(opts, output_final_state=True), dtype, tol, prefix=prefix,
                 pipeline=kdax.default_pipeline())


def _collectives(hlo: str):
    """(kind, bytes of the result) of every collective in compiled HLO text."""
    size = {"f64": 8, "f32": 4, "s32": 4, "pred": 1, "u32": 4}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(", line)
        if m:
            dims = [int(d) for d in m.group(2).split(",") if d]
            out.append((m.group(3), size[m.group(1)] * int(np.prod(dims))))
    return out


@pytest.mark.parametrize("prefix", ["gather", pytest.param("doubling", marks=pytest.mark.slow)])
def test_collectives_no_larger_than_summaries(prefix):
    """Forward and backward: every collective moves at most the gathered summaries
    [P, HV, K, K + V] per row, or the final states (the output itself)."""
    n, HV, K, V = 8, 4, 8, 8
    x, opts = _packed(6)
    mesh = _mesh(n)
    pos, kw = split_args(x)

    def loss(pos, kw):
        o, ht = kdax.parallel.chunk_kda(mesh, "sp", *pos, prefix=prefix, **kw, output_final_state=True,
                                        pipeline=UNTILED, **opts)
        return jnp.sum(o**2) + jnp.sum(ht**2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(pos, kw).compile().as_text()
    found = _collectives(hlo)
    assert found, "expected the summary collectives"
    summaries = n * HV * K * (K + V) * 8
    finals = (len(CU) - 1) * HV * K * V * 8
    for kind, nbytes in found:
        assert nbytes <= max(summaries, finals), (kind, nbytes)
    # Nothing proportional to T: the largest token-axis array per device is 12 x HV x K.
    assert sum(b for _, b in found) < 40 * summaries


def test_errors():
    x, opts = _packed()
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match="seq_axis_name"):
        kdax.chunk_kda(q, k, v, g, beta, seq_axis_name="sp", **opts)
    mesh = _mesh(8)
    with pytest.raises(ValueError, match="seq_axis_name"):
        jax.shard_map(lambda *a: kdax.chunk_kda(*a, seq_axis_name="nope")[0], mesh=mesh,
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False)(
            *(jax.sharding.reshard(a, jax.NamedSharding(mesh, P(None, "sp"))) for a in (q, k, v, g, beta)))
    with pytest.raises(ValueError, match="local T"):
        kdax.parallel.chunk_kda(mesh, "sp", q[:, :90], k[:, :90], v[:, :90], g[:, :90], beta[:, :90])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kdax.parallel.chunk_kda(mesh, "sp", q, k, v, g, beta, cu_seqlens=jnp.asarray([0, 5, 90], jnp.int32))
    with pytest.raises(ValueError, match="seq_axis"):
        kdax.parallel.chunk_kda(mesh, "data", q, k, v, g, beta)
