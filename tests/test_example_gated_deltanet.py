"""examples/gated_deltanet.py: Gated DeltaNet (a scalar decay per head) as one F1 stage in
KDA's pipeline, exact against a plain-JAX recurrence of that model (float64) on one device
and in sequence parallel, with the hand-written B0-B4 kept (B5: the F1's VJP)."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import kdax
from tests._util import load_example

EX = load_example("gated_deltanet")


def test_exact_against_the_plain_recurrence():
    errs = EX.compare(EX.inputs())
    assert set(errs) == {"o", "dq", "dk", "dv", "da", "db", "dA_log", "ddt_bias"}
    assert max(errs.values()) <= 1e-10


def test_only_b5_is_derived():
    """No stage but B5 differs from the reference pipeline's; nothing is derived whole
    (no FallbackWarning), and plan names F1's VJP in B5's row."""
    x = EX.inputs(T=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.FallbackWarning)
        jax.grad(lambda q: EX.gated_deltanet(q, *list(x.values())[1:], chunk_size=16)[0].sum())(x["q"])
    K = x["q"].shape[-1]
    g = jnp.broadcast_to(x["a"][..., None], x["a"].shape + (K,))
    plan = EX.gdn_pipeline().plan(x["q"], x["k"], x["v"], g, x["b"], chunk_size=16, use_gate_in_kernel=True,
                                  A_log=x["A_log"], dt_bias=jnp.zeros(x["A_log"].shape[0] * K),
                                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    rows = {r.field: r for r in plan.rows}
    assert (rows["gate_bwd"].requested, rows["gate_bwd"].runs) == ("ReferenceGateBackward", "GateVjpBackward")
    assert all(type(getattr(kdax.KDAPipeline.reference(), f)).__qualname__ == rows[f].requested
               for f in ("intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd"))
    assert "derived by jax.vjp" not in str(plan)


def test_a_bad_gate_is_caught():
    """The check is not vacuous: a gate using the wrong sign of dt_bias disagrees."""
    wrong = lambda q, k, v, a, b, A_log, dt_bias, **o: EX.gated_deltanet(q, k, v, a, b, A_log, -dt_bias, **o)
    with pytest.raises(EX.GDNMismatch, match="ddt_bias"):
        EX.compare(EX.inputs(T=32), fn=wrong)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices: see tests/conftest.py")
def test_sequence_parallel_exact():
    x = EX.inputs(B=1, T=64)
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    tok, rep = jax.P(None, "sp"), jax.P()
    specs = (tok, tok, tok, tok, tok, rep, rep)

    def sp(*a, **opts):
        f = jax.shard_map(lambda *a: EX.gated_deltanet(*a, seq_axis_name="sp", **opts)[0], mesh=mesh,
                          in_specs=specs, out_specs=tok)
        return f(*a), None

    errs = EX.compare(x, fn=sp)
    assert max(errs.values()) <= 1e-10
