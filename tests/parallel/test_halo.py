"""The short convolution sequence-parallel (one ppermute of the halo) equals the
convolution of the whole sequence on one device, dense and packed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import kdax
from kdax.parallel import causal_conv1d, conv_halo, sp_causal_conv1d
from tests._util import assert_close

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

# 8 devices x 6 tokens (edges at multiples of 6): inside a device (0:2, 3:6), empty (2:2),
# length 1 (2:3; 6:7 starting on an edge), across three edges (7:25), across one edge
# with part of its halo before its start (28:32), across two edges to the end (32:48).
CU = [0, 2, 2, 3, 6, 7, 25, 28, 32, 48]


def _conv_oracle(x, w, b, cu, silu):
    """Per token, per channel, the plain sum over the taps of its own sequence."""
    x, w = np.asarray(x), np.asarray(w)
    B, T, D = x.shape
    W = w.shape[1]
    starts = np.zeros(T, int) if cu is None else np.asarray(cu)[np.searchsorted(cu, np.arange(T), side="right") - 1]
    y = np.zeros_like(x)
    for t in range(T):
        for i in range(W):
            src = t - (W - 1) + i
            if src >= starts[t]:
                y[:, t] += x[:, src] * w[:, i]
    y = y + np.asarray(b)
    return y / (1 + np.exp(-y)) if silu else y


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("W", [2, 4])
def test_sp_conv_equals_one_device(packed, W):
    r = np.random.default_rng(W)
    B = 1 if packed else 2
    x = jnp.asarray(r.normal(size=(B, 48, 5)))
    w = jnp.asarray(r.normal(size=(5, W)))
    b = jnp.asarray(r.normal(size=(5,)))
    cu = jnp.asarray(CU, jnp.int32) if packed else None
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    one = causal_conv1d(x, w, b, cu_seqlens=cu, activation="silu")
    assert_close(one, _conv_oracle(x, w, b, None if cu is None else CU, True), 1e-14, "one device")

    def local(x, w, b, cu):
        return sp_causal_conv1d(x, w, b, axis_name="sp", cu_seqlens=cu, activation="silu")

    cu_arg = jnp.zeros((2,), jnp.int32) if cu is None else cu
    fn = jax.jit(jax.shard_map(lambda x, w, b, c: local(x, w, b, None if cu is None else c), mesh=mesh,
                               in_specs=(P(None, "sp"), P(), P(), P()), out_specs=P(None, "sp")))
    xs = jax.sharding.reshard(x, jax.NamedSharding(mesh, P(None, "sp")))
    y = fn(xs, w, b, cu_arg)
    assert_close(y, one, 1e-12, "sequence parallel")
    hlo = fn.lower(xs, w, b, cu_arg).compile().as_text()
    assert hlo.count("collective-permute(") + hlo.count("collective-permute-start(") == 1
    for c in ("all-gather", "all-reduce", "all-to-all"):
        assert c not in hlo


def test_halo_rows():
    """The halo is the previous device's last W - 1 rows, zero before the sequence start."""
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    x = jnp.arange(48.0)[None, :, None]
    cu = jnp.asarray(CU, jnp.int32)
    fn = jax.shard_map(lambda x: conv_halo(x, 4, "sp", cu), mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    h = np.asarray(fn(jax.sharding.reshard(x, jax.NamedSharding(mesh, P(None, "sp")))))[0, :, 0].reshape(8, 3)
    want = np.array([[0, 0, 0], [0, 0, 0], [9, 10, 11], [15, 16, 17], [21, 22, 23],
                     [0, 28, 29], [33, 34, 35], [39, 40, 41]], float)
    np.testing.assert_array_equal(h, want)


def test_errors():
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    x = jax.sharding.reshard(jnp.zeros((1, 16, 2)), jax.NamedSharding(mesh, P(None, "sp")))
    with pytest.raises(ValueError, match="conv_size - 1"):
        jax.shard_map(lambda x: conv_halo(x, 4, "sp"), mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(x)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(jnp.zeros((1, 4, 2)), jnp.zeros((2, 3)), activation="gelu")
    assert kdax.parallel.sp_causal_conv1d is sp_causal_conv1d
