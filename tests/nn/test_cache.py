"""KDACache and FLA's cache layout: exact converters both ways, a decode step continuing
from a cache built in FLA's layout, FLA's whole-history attention mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax.nn import KDACache

from .._util import assert_close
from .test_layer import FIELDS, D, check_cache, make_layer, oracle, rand, rand_cache, run
from .test_weights import FakeTensor


def test_converters_round_trip_exactly():
    layer, _, _ = make_layer(0)
    H, HV, K, V, W = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim, layer.conv_size
    c = rand_cache(layer, 3, 1)
    fla = c.to_fla()
    st, (cq, ck, cv) = fla["recurrent_state"], fla["conv_state"]
    assert st.shape == (3, HV, V, K) and cq.shape == ck.shape == (3, H * K, W) and cv.shape == (3, HV * V, W)
    assert np.array_equal(st, np.swapaxes(c.state, -1, -2))  # FLA's layer keeps [N, HV, V, K]
    # FLA's slot w holds the input W - w tokens back: slot W - 1 the newest, slot 0 unused (zero)
    assert np.array_equal(cq[:, :, 1:], np.swapaxes(c.conv_q, 1, 2)) and np.all(np.asarray(cq[:, :, 0]) == 0)
    assert np.array_equal(cv[:, :, W - 1], c.conv_v[:, W - 2])
    back = KDACache.from_fla(fla)
    for f in FIELDS:
        assert np.array_equal(getattr(back, f), getattr(c, f)) and getattr(back, f).dtype == getattr(c, f).dtype, f
    # FLA's side: a cache as FLA holds it (torch tensors; slot 0 never read again) and back
    r = np.random.default_rng(2)
    conv = tuple(np.concatenate([np.zeros((3, d, 1)), r.normal(size=(3, d, W - 1))], axis=2)
                 for d in (H * K, H * K, HV * V))
    theirs = {"recurrent_state": FakeTensor(r.normal(size=(3, HV, V, K))),
              "conv_state": tuple(FakeTensor(a) for a in conv)}
    again = KDACache.from_fla(theirs).to_fla()
    assert np.array_equal(again["recurrent_state"], theirs["recurrent_state"].a)
    assert all(np.array_equal(a, b) for a, b in zip(again["conv_state"], conv))
    # the chunk_kda layout ([N, HV, K, V]) and a cache without short convolutions
    plain = KDACache.from_fla(recurrent_state=c.state, state_v_first=False)
    assert plain.conv_q is None and np.array_equal(plain.state, c.state)
    assert np.array_equal(plain.to_fla(state_v_first=False)["recurrent_state"], c.state)
    assert plain.to_fla()["conv_state"] is None
    with pytest.raises(ValueError, match=r"conv_state\[k\]: expected \[N=3, D, W >= 2\]"):
        KDACache.from_fla(recurrent_state=st, conv_state=(cq, ck[:1], cv))


def fla_conv_state(sd, x, name, W):
    """FLA's convolution cache after the tokens x, from its definition: the last W
    projected inputs, channel-major ``[N, D, W]``, oldest first."""
    pre = np.asarray(x) @ sd[name + "_proj.weight"].T
    return np.swapaxes(pre[:, -W:], 1, 2)


def test_decode_continues_from_a_cache_in_flas_layout():
    """A prefix handed over from FLA (its cache built here from FLA's layout as defined:
    state [N, HV, V, K], convolution inputs [N, D, W], as torch tensors) and decoded by
    kdax equals the float64 oracle over the whole sequence; kdax's cache handed back
    holds what FLA's would."""
    layer, sd, options = make_layer(11)
    W, T0 = layer.conv_size, 12
    x = rand(11, 2, T0 + 1, D)
    _, prefix = oracle(sd, options, x[:, :T0])
    handed = {"recurrent_state": FakeTensor(np.swapaxes(prefix["state"], -1, -2)),
              "conv_state": tuple(FakeTensor(fla_conv_state(sd, x[:, :T0], n, W)) for n in "qkv")}
    y, cache = run(layer, x[:, T0:], cache=KDACache.from_fla(handed))
    ref, ref_cache = oracle(sd, options, x)
    assert_close(y, ref[:, T0:], 1e-10, "decoded token")
    check_cache(cache, ref_cache, 1e-10, "after the step")
    back = cache.to_fla()
    for n, got in zip("qkv", back["conv_state"]):
        assert_close(np.asarray(got)[:, :, 1:], fla_conv_state(sd, x, n, W)[:, :, 1:], 1e-12, f"conv {n}")
    assert_close(back["recurrent_state"], np.swapaxes(ref_cache["state"], -1, -2), 1e-10, "state")


def test_take_and_put_rows_of_a_pool():
    """``KDACache.take``/``put``, a server's pool of rows: exact rows in and out (a row taken
    twice: a forked sequence), the others bit-identical. A row outside the pool is an error,
    eager and compiled (JAX clamped a read to another row's state and dropped a write), as
    are two writes to one row and rows of another shape."""
    import equinox as eqx

    layer, _, _ = make_layer(0)
    pool, new = rand_cache(layer, 5, 1), rand_cache(layer, 2, 2)
    got = pool.take(np.array([3, 0, 3]))
    for f in FIELDS:
        assert np.array_equal(getattr(got, f), getattr(pool, f)[np.array([3, 0, 3])]), f
    put = eqx.filter_jit(KDACache.put)(pool, jnp.array([4, 1]), new)
    for f in FIELDS:
        a = np.asarray(getattr(put, f))
        old = np.asarray(getattr(pool, f))
        assert np.array_equal(a[[4, 1]], getattr(new, f)) and np.array_equal(a[[0, 2, 3]], old[[0, 2, 3]]), f
    for call in (lambda c, i: c.take(i), lambda c, i: c.put(i, new)):
        for bad in ([5, 0], [-1, 0]):
            for run_ in (call, eqx.filter_jit(call)):
                with pytest.raises(Exception, match=r"indices: every slot must lie in \[0, 5\)"):
                    jax.block_until_ready(run_(pool, jnp.array(bad)))
    with pytest.raises(Exception, match=r"indices: every slot must be distinct"):
        jax.block_until_ready(eqx.filter_jit(KDACache.put)(pool, jnp.array([2, 2]), new))
    with pytest.raises(ValueError, match=r"^rows: expected a KDACache of 1 rows shaped as this cache's"):
        pool.put(jnp.array([0]), new)
    with pytest.raises(ValueError, match=r"^indices: expected a 1-d array of row indices, got shape \(\)"):
        pool.take(0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"^batch_size: expected a number of sequences \(an integer >= 0\)"):
            layer.init_cache(bad)
    assert layer.init_cache(np.int64(0)).state.shape[0] == 0


def test_decode_takes_flas_whole_history_mask():
    """FLA's decode passes the mask of every token so far; its last columns are this
    call's (FLA: attention_mask[:, -q_len:])."""
    layer, _, _ = make_layer(12)
    cache = rand_cache(layer, 2, 12)
    x = rand(12, 2, 1, D)
    history = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)  # row 0 was left padded
    y, c = run(layer, x, cache=cache, attention_mask=history)
    y1, c1 = run(layer, x, cache=cache, attention_mask=history[:, -1:])
    y0, c0 = run(layer, x, cache=cache)
    assert_close(y, y0, 1e-12, "whole-history mask")
    assert np.array_equal(y, y1)
    assert np.array_equal(run(layer, x, cache=cache, mode="fused_recurrent")[0], y0)  # FLA's name for the path
    for f in FIELDS:
        assert_close(getattr(c, f), getattr(c0, f), 1e-12, f)
    with pytest.raises(ValueError, match=r"covers 6 tokens but x has 1 and no cache.*pass this call's mask, "
                                         r"shape \(2, 1\)"):
        run(layer, x, attention_mask=history)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[B, T\] = \(2, 3\)"):
        run(layer, rand(12, 2, 3, D), cache=cache, attention_mask=history[:, :2])


def test_a_call_keeps_the_cache_dtypes_so_a_decode_scan_runs():
    """bf16 parameters, float32 input: ``init_cache`` makes bf16 convolution states, and a
    call returned them in float32, so a ``lax.scan`` decode loop from ``init_cache`` failed
    ("carry input and carry output must have equal types"). The cache keeps its dtypes
    (FLA's is updated in place); the scan gives the eager loop's numbers."""
    from kdax.nn import KimiDeltaAttention

    layer = KimiDeltaAttention(16, 2, 8, key=jax.random.key(0), param_dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 6, 16), jnp.float32)
    c0 = layer.init_cache(2)
    want = [a.dtype for a in c0._fields()]
    assert want == [jnp.bfloat16] * 3 + [jnp.float32]
    for mode in ("recurrent", "chunk"):
        _, c1 = layer(x[:, :1], cache=c0, mode=mode)
        assert [a.dtype for a in c1._fields()] == want, mode

    def step(c, xt):
        y, c = layer(xt[:, None], cache=c)
        return c, y[:, 0]

    c_scan, ys = jax.lax.scan(step, c0, jnp.swapaxes(x, 0, 1))
    c = c0
    for t in range(x.shape[1]):
        c, y = step(c, x[:, t])
        assert_close(ys[t], y, 1e-6, f"token {t}")
    for a, b in zip(c_scan._fields(), c._fields()):
        assert a.dtype == b.dtype
        assert_close(a.astype(jnp.float32), b.astype(jnp.float32), 1e-6)
