"""``benchmarks/marginal_costs.py``: a stage left out returns zeros of the reference stage's
outputs and keeps what computes its inputs (speed is measured by the script, never
asserted here)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdax
from kdax._runner.contracts import STAGES

from .._util import make_inputs
from ._load import load_benchmark


def _inputs(T=32):
    x = make_inputs(seed=0, B=1, T=T, H=1, K=8, V=8, dtype=jnp.float32, h0=False)
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta"))


def test_a_zeroed_stage_keeps_the_route_and_gives_zeros():
    mc = load_benchmark("marginal_costs")
    x = _inputs()
    ref = kdax.KDAPipeline.reference()
    for name in ("intra", "output"):
        stage = mc.zeroed(name)
        assert isinstance(stage, STAGES[name].family)
        for k in ("math", "tile_safe", "accepts"):
            assert getattr(type(stage), k) == getattr(STAGES[name].reference, k), (name, k)
        pipe = mc.without(ref, name)
        assert pipe.trust_declarations and pipe.plan(*x, chunk_size=16).layout == ref.plan(*x, chunk_size=16).layout
    o = kdax.chunk_kda(*x, chunk_size=16, pipeline=mc.without(ref, "output"))[0]
    assert o.shape == x[2].shape and not np.any(np.asarray(o))  # F5's zeros are the output
    o_ref = kdax.chunk_kda(*x, chunk_size=16, pipeline=ref)[0]
    o_f2 = kdax.chunk_kda(*x, chunk_size=16, pipeline=mc.without(ref, "intra"))[0]
    assert np.all(np.isfinite(np.asarray(o_f2))) and not np.allclose(o_f2, o_ref)


def test_the_zeros_keep_their_inputs_work():
    """Without F5 the forward still computes what F5 would read (the zeros read one element
    of each input behind a barrier): XLA's FLOP count of the program stays near the full
    one's (zeros reading nothing, or one element before the barrier, left little more than
    the all-zeroed program's), and the five left out together leave little."""
    mc = load_benchmark("marginal_costs")
    x = _inputs(T=64)
    ref = kdax.KDAPipeline.reference()

    def flops(pipe):
        f = jax.jit(lambda *a: kdax.chunk_kda(*a, chunk_size=16, pipeline=pipe)[0])
        return f.lower(*x).compile().cost_analysis()["flops"]

    none = ref
    for name in ("gate", "intra", "wy", "state", "output"):
        none = eqx.tree_at(lambda p: getattr(p, name), none, mc.zeroed(name))
    none = dataclasses.replace(none, trust_declarations=True)
    full, no_f5, nothing = flops(ref), flops(mc.without(ref, "output")), flops(none)
    assert 0.7 * full < no_f5 < full and nothing < 0.2 * full, (full, no_f5, nothing)


def test_rows_at_a_tiny_shape():
    rows = load_benchmark("marginal_costs").main(["--T", "64", "--H", "1", "--K", "8", "--V", "8", "--rounds", "2",
                                                  "--forward-only"])
    assert [r[0] for r in rows["forward"]] == ["gate", "intra", "wy", "state", "output"]
    assert all(np.isfinite(r[1]) and np.isfinite(r[2]) for r in rows["forward"])
