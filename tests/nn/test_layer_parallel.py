"""KimiDeltaAttention sequence-parallel (``seq_axis_name`` inside ``jax.shard_map``,
``kdax.parallel.apply_layer`` on global arrays) equals the layer on one device: outputs,
the new cache and the gradients of every parameter, x and the cache (float64 <= 1e-12),
with packed sequences crossing device boundaries (and biases on the short convolutions)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import kdax

from .._util import assert_close
from .test_layer import D, make_layer, rand, rand_cache

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

T = 48  # P = 4: edges at 12, 24, 36; P = 2: at 24
# 0:3 inside a device, 3:3 empty, 3:4 length 1, 4:10, 10:13 across an edge with part of
# its halo before its start, 13:38 across two edges (one at P = 2), 38:38 empty, 38:39
# length 1, 39:48 to the end.
CU = [0, 3, 3, 4, 10, 13, 38, 38, 39, 48]
UNTILED = kdax.KDAPipeline.reference().untiled()
OPTS = dict(chunk_size=16, pipeline=UNTILED)


def _mesh(n, axis_type=AxisType.Explicit):
    return jax.make_mesh((n,), ("sp",), axis_types=(axis_type,), devices=jax.devices()[:n])


def _loss_and_grads(call, layer, x, cache, w):
    """``(y, cache, grads of layer params, x and cache)`` for a fixed random projection of
    every output, under one jit."""
    params, static = eqx.partition(layer, eqx.is_array)

    def loss(p, x, cache):
        y, new = call(eqx.combine(p, static), x, cache)
        val = jnp.sum(y * w["y"]) + sum(jnp.sum(a * w[f]) for f, a in zip(("q", "k", "v", "s"), new._fields()))
        return val, (y, new)

    (gp, gx, gc), (y, new) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, cache)
    return y, new, gp, gx, gc


def _check(mesh, layer, x, cu, cache, seed, opts=OPTS):
    r = np.random.default_rng(seed)
    N = x.shape[0] if cu is None else cu.shape[0] - 1
    fields = zip(("q", "k", "v", "s"), layer.init_cache(N)._fields())
    w = dict(y=jnp.asarray(r.normal(size=x.shape)), **{f: jnp.asarray(r.normal(size=a.shape)) for f, a in fields})
    one = lambda l, x, c: l(x, cu_seqlens=cu, cache=c, mode="chunk", **opts)
    sp = lambda l, x, c: kdax.parallel.apply_layer(mesh, "sp", l, x, cu_seqlens=cu, cache=c, **opts)
    ref = _loss_and_grads(one, layer, x, cache, w)
    got = _loss_and_grads(sp, layer, x, cache, w)
    assert_close(got[0], ref[0], 1e-12, "y")
    for f, a, b in zip(("conv_q", "conv_k", "conv_v", "state"), got[1]._fields(), ref[1]._fields()):
        assert_close(a, b, 1e-12, f)
    names = [n for n, v in vars(ref[2]).items() if eqx.is_array(v)]
    assert len(names) == 16 + 3 * (layer.q_conv_bias is not None)  # every parameter
    for n in names:
        assert_close(getattr(got[2], n), getattr(ref[2], n), 1e-12, "d" + n)
    assert_close(got[3], ref[3], 1e-12, "dx")
    if cache is not None:
        for f, a, b in zip(("conv_q", "conv_k", "conv_v", "state"), got[4]._fields(), ref[4]._fields()):
            assert_close(a, b, 1e-12, "d" + f)


@pytest.mark.parametrize("n,with_cache", [(4, True), pytest.param(2, False, marks=pytest.mark.slow)])
def test_packed_equals_one_device(n, with_cache):
    layer, _, _ = make_layer(3, conv_bias=True)  # the biases ride along the halo exchange unchanged
    x = rand(3, 1, T, D)
    cache = rand_cache(layer, len(CU) - 1, 4) if with_cache else None
    _check(_mesh(n), layer, x, jnp.asarray(CU, jnp.int32), cache, n)


def test_dense_with_cache_equals_one_device():
    """Dense rows (no cu_seqlens), each continuing from its cache row: every device's halo
    from the one before, the first device's from the cache, and the new cache's
    convolution rows from the last device (``sp_conv_tail``)."""
    layer, _, _ = make_layer(4)
    _check(_mesh(4), layer, rand(4, 2, T, D), None, rand_cache(layer, 2, 5), 4)


@pytest.mark.slow
def test_packed_8_devices_and_dense_data_by_sequence():
    layer, _, _ = make_layer(5)
    x = rand(5, 1, T, D)
    _check(_mesh(8, AxisType.Auto), layer, x, jnp.asarray(CU, jnp.int32), rand_cache(layer, len(CU) - 1, 6), 8)
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
    x = rand(6, 2, T, D)
    r = np.random.default_rng(0)
    w = jnp.asarray(r.normal(size=x.shape))
    one = jax.jit(lambda l, x: jnp.sum(l(x, mode="chunk", **OPTS)[0] * w))
    sp = jax.jit(lambda l, x: jnp.sum(kdax.parallel.apply_layer(mesh, "sp", l, x, batch_axis="data", **OPTS)[0] * w))
    g_ref = eqx.filter_grad(one)(layer, x)
    with jax.set_mesh(mesh):  # the loss of arrays on an Explicit mesh
        g = eqx.filter_grad(sp)(layer, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert_close(a, b, 1e-12)


def test_errors():
    layer, _, _ = make_layer(3)
    x = rand(3, 1, T, D)
    mesh = _mesh(4)
    xs = jax.sharding.reshard(x, jax.NamedSharding(mesh, P(None, "sp")))

    def call(**kw):
        return jax.shard_map(lambda x: layer(x, **kw)[0], mesh=mesh, in_specs=P(None, "sp"),
                             out_specs=P(None, "sp"))(xs)

    with pytest.raises(ValueError, match="seq_axis_name: 'nope' is not a mesh axis"):
        call(seq_axis_name="nope")
    with pytest.raises(ValueError, match="attention_mask: not supported with seq_axis_name"):
        call(seq_axis_name="sp", attention_mask=jnp.ones((1, T // 4)))
    # (a whole-history mask too: before, the mask's own check said to pass a cache)
    with pytest.raises(ValueError, match="attention_mask: not supported with seq_axis_name"):
        call(seq_axis_name="sp", attention_mask=jnp.ones((1, T)))
    with pytest.raises(ValueError, match="mode: 'recurrent'"):
        call(seq_axis_name="sp", mode="recurrent", cache=layer.init_cache(1))
    with pytest.raises(ValueError, match="return_intermediate_states"):
        call(seq_axis_name="sp", return_intermediate_states=True)
    with pytest.raises(ValueError, match="split evenly"):
        kdax.parallel.apply_layer(mesh, "sp", layer, x[:, :46])
    with pytest.raises(ValueError, match="seq_axis"):
        kdax.parallel.apply_layer(mesh, "data", layer, x)


@pytest.mark.slow
def test_pallas_pipeline_packed():
    """The layer sequence-parallel with a Pallas pipeline (interpret mode on CPU: kdax's
    shard_map runs unchecked, check_vma=False, whose transpose conventions differ)."""
    layer, _, _ = make_layer(7)
    x = rand(7, 1, T, D)
    opts = dict(chunk_size=16, pipeline=kdax.KDAPipeline.pallas(interpret=True))
    with warnings.catch_warnings():  # packed input runs on the Pallas stages (no longer a fallback)
        warnings.simplefilter("error", kdax.FallbackWarning)
        _check(_mesh(2), layer, x, jnp.asarray(CU, jnp.int32), rand_cache(layer, len(CU) - 1, 8), 9, opts)


# -- data parallel: x sharded over the batch on an Explicit mesh (jax.make_mesh's default) --


def _batch_mesh():
    return jax.make_mesh((4,), ("b",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])


def _on(mesh, tree, spec):
    return jax.tree.map(lambda a: jax.device_put(a, jax.NamedSharding(mesh, spec)), tree)


def _mask(B, T, seed):
    """Left and right padding, a row of one token and a full row."""
    lens = np.random.default_rng(seed).integers(1, T, size=B)
    lens[0], lens[1] = T, 1
    m = np.arange(T)[None] < lens[:, None]
    m[::2] = m[::2, ::-1]
    return jnp.asarray(m.astype(np.int32))


@pytest.mark.parametrize("what", ["dense", "mask", "cache", "intermediate"])
def test_batch_sharded_on_an_explicit_mesh_equals_one_device(what):
    """Each shard's rows run alone (``jax.shard_map``, no collective), as chunk_kda's
    inputs do: y, the new cache and the gradients of every parameter, x and the cache
    equal the layer's on unsharded arrays (float64 <= 1e-12), eager and under jit; the
    outputs stay sharded over the batch. Before: JAX's ShardingTypeError on any call
    ("Use `.at[...].get(out_sharding=)`", the short convolution's gather)."""
    layer, _, _ = make_layer(7)
    B, T = 8, 40
    mesh = _batch_mesh()
    x = rand(7, B, T, D)
    cache = rand_cache(layer, B, 3) if what == "cache" else None
    kw = dict(chunk_size=16, mode="chunk")
    kw.update(attention_mask=_mask(B, T, 1) if what == "mask" else None,
              return_intermediate_states=what == "intermediate")
    ref = layer(x, cache=cache, **kw)
    xs, cs = _on(mesh, x, P("b")), _on(mesh, cache, P("b"))
    eager = layer(xs, cache=cs, **dict(kw, attention_mask=_on(mesh, kw["attention_mask"], P("b"))))
    with jax.set_mesh(mesh):
        jitted = jax.jit(lambda l, x, c: l(x, cache=c, **kw))(layer, xs, cs)
    for got in (eager, jitted):
        assert got[0].sharding.spec[0] == "b"
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            assert_close(a, b, 1e-12, what)
    if what == "intermediate":
        return
    r = np.random.default_rng(5)
    w = dict(y=jnp.asarray(r.normal(size=x.shape)),
             **{f: jnp.asarray(r.normal(size=a.shape)) for f, a in zip("qkvs", layer.init_cache(B)._fields())})
    call = lambda l, x, c: l(x, cache=c, **kw)
    want = _loss_and_grads(call, layer, x, cache, w)
    with jax.set_mesh(mesh):
        got = _loss_and_grads(call, layer, xs, cs, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, 1e-12, what + " (gradients)")


@pytest.mark.parametrize("slots_spec", [P("b"), P()], ids=["slots-sharded", "slots-replicated"])
def test_batch_sharded_decode_into_a_pool(slots_spec):
    """A serving pool (``state_indices``) with x sharded over the batch: the pool's rows are
    taken and written replicated, the rows run per shard; the pool equals the one-device
    pool (rows not in ``state_indices`` bit-identical). A slot outside the pool or shared
    by two sequences cannot raise in this program (the error's callback runs on one
    device, the others wait: the process aborted after 40 s): each such sequence's output
    is NaN, its state NaN where it is written, the other sequences and rows exact."""
    layer, _, _ = make_layer(8)
    mesh = _batch_mesh()
    pool = rand_cache(layer, 12, 4)
    x = rand(8, 8, 1, D)
    slots = jnp.asarray([11, 0, 3, 7, 1, 9, 4, 6], jnp.int32)
    y0, pool0 = layer(x, cache=pool, state_indices=slots)
    call = jax.jit(lambda l, x, c, s: l(x, cache=c, state_indices=s))

    def sharded(slots):
        with jax.set_mesh(mesh):
            return call(layer, _on(mesh, x, P("b")), _on(mesh, pool, P()), _on(mesh, slots, slots_spec))

    y, new = sharded(slots)
    assert_close(y, y0, 1e-12, "y")
    for a, b in zip(new._fields(), pool0._fields()):
        assert_close(a, b, 1e-12, "pool")
    untouched = np.setdiff1d(np.arange(12), np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(new.state)[untouched], np.asarray(pool.state)[untouched])
    # sequence 2 outside the pool; sequences 3 and 5 sharing row 7
    y, new = sharded(slots.at[2].set(12).at[5].set(7))
    y, state, y0 = np.asarray(y), np.asarray(new.state), np.asarray(y0)
    bad = np.isin(np.arange(8), [2, 3, 5])
    assert np.all(np.isnan(y[bad])) and not np.any(np.isnan(y[~bad]))
    np.testing.assert_allclose(y[~bad], y0[~bad], rtol=1e-12, atol=1e-12)
    assert np.all(np.isnan(state[7])) and not np.any(np.isnan(np.delete(state, 7, axis=0)))
    for row in (11, 0, 1, 4, 6):  # written by good sequences
        np.testing.assert_allclose(state[row], np.asarray(pool0.state)[row], rtol=1e-12, atol=1e-12)
    for row in (3, 9):  # (slots of the bad sequences in the first call) untouched now
        np.testing.assert_array_equal(state[row], np.asarray(pool.state)[row])


def test_replicated_x_beside_fsdp_sharded_parameters():
    """Parameters sharded over a mesh axis in their types (FSDP) beside an unsharded x (a
    one-row eval or decode): every device runs the rows with the parameters gathered; y,
    the cache and every parameter's gradient equal the unsharded layer's (before: JAX's
    ShardingTypeError from a reshape of the sharded hidden axis)."""
    layer, _, _ = make_layer(9)
    mesh = _batch_mesh()
    x = rand(9, 1, 24, D)
    fsdp = jax.tree.map(lambda a: _on(mesh, a, P("b")) if eqx.is_array(a) and a.ndim == 2 and a.shape[0] % 4 == 0
                        else a, layer)
    assert any(getattr(a.sharding, "spec", P())[:1] == ("b",) for a in jax.tree.leaves(eqx.filter(fsdp, eqx.is_array)))
    r = np.random.default_rng(2)
    w = dict(y=jnp.asarray(r.normal(size=x.shape)),
             **{f: jnp.asarray(r.normal(size=a.shape)) for f, a in zip("qkvs", layer.init_cache(1)._fields())})
    call = lambda l, x, c: l(x, chunk_size=16)
    want = _loss_and_grads(call, layer, x, None, w)
    with jax.set_mesh(mesh):
        got = _loss_and_grads(call, fsdp, x, None, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, 1e-12, "fsdp")


def test_token_axis_sharded_on_an_explicit_mesh_is_refused():
    layer, _, _ = make_layer(3)
    mesh = _batch_mesh()
    with pytest.raises(ValueError, match="x: the token axis is sharded over 'b'; run sequence parallel"):
        layer(_on(mesh, rand(3, 1, 8, D), P(None, "b")))
