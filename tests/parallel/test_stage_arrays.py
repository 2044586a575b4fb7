"""A user's stages holding arrays (examples/custom_stage.py, public names only), the
pipeline traced by ``eqx.filter_jit`` and differentiated by ``eqx.filter_grad``, run
sequence parallel on 8 simulated devices: equal to one device (float64), gain included."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import kdax
from tests._util import assert_close, load_example, make_inputs, split_args

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

@pytest.mark.parametrize("packed, interpreted", [(False, False), (True, False), (False, True)])
def test_traced_array_pipeline_sequence_parallel(packed, interpreted):
    """``interpreted``: one Pallas stage in interpret mode, so shard_map runs without
    check_vma (the other transpose of the replicated pipeline)."""
    EX = load_example("custom_stage")
    x = make_inputs(B=1, T=48, H=2, K=8, V=8, N=3 if packed else None)
    pos, kw = split_args(x)
    opts = dict(chunk_size=16, initial_state=kw["initial_state"], output_final_state=True)
    if packed:
        opts["cu_seqlens"] = jnp.array([0, 5, 30, 48], jnp.int32)
    pipe = EX.gain_pipeline(jnp.array([0.5, 2.0]))
    if interpreted:
        pipe = eqx.tree_at(lambda p: p.dav, pipe, kdax.pallas.PallasDAv(target="triton", interpret=True))
    mesh = jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8])
    w = jax.random.normal(jax.random.key(2), pos[2].shape, jnp.float64)

    def loss(fn, diff):
        p, q = diff
        o, ht = fn(q, *pos[1:], pipeline=p, **opts)
        return jnp.sum(o * w) + jnp.sum(ht**2)

    sp = lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, **k)
    d_sp, dq_sp = eqx.filter_jit(eqx.filter_grad(lambda d: loss(sp, d)))((pipe, pos[0]))
    d_one, dq_one = eqx.filter_jit(eqx.filter_grad(lambda d: loss(kdax.chunk_kda, d)))((pipe, pos[0]))
    assert_close(dq_sp, dq_one, 1e-12, "dq")
    assert_close(d_sp.gate.gain, d_one.gate.gain, 1e-12, "d gain (F1)")
    assert float(jnp.max(jnp.abs(d_one.gate.gain))) > 0
    assert float(jnp.max(jnp.abs(d_sp.gate_bwd.gain))) == 0.0
