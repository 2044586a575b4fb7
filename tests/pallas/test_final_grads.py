"""chunk_kda's isolation inside the Triton stages (issue 53's glue): B3 and B5 write the
gradients of v and of q, k, g, beta as the call's results (the capability
``final_grads``: caller's layout and dtype, NaN where the isolation puts it), with no
XLA pass after them. Exact: every gradient what the pipeline gave with the isolation
outside the stages (``kdax._runner.vjp.final_in_stages`` turned off), non-finite inputs
and cotangents included: the same dtype, NaN at the same elements, the same values. The
kernels' arithmetic is unchanged (only where their results go, and the select and cast
XLA made after them); under the suite's XLA:CPU flags (``tests/conftest.py``: backend
optimisation level 0) an interpreted kernel's sums may round differently with the program
around it (a chunk's first rows of dg, 1 float32 ulp), so values are compared to a few
ulps here; at XLA's default flags every case below was bitwise equal (issue 53's report)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax import pallas as P
from kdax._layouts.tokens import FinalGrads
from kdax._runner import vjp as _vjp
from kdax._stage_protocol.capabilities import capabilities
from kdax.stages import ReferenceGateBackward, ReferenceWYDqkg


def _grads(pipe, dt, H, HV, bad_in, bad_do, cu=None, T=64, B=2):
    ks = jax.random.split(jax.random.key(0), 6)
    K = 32
    q = jax.random.normal(ks[0], (B, T, H, K)).astype(dt)
    k = jax.random.normal(ks[1], (B, T, H, K)).astype(dt)
    v = jax.random.normal(ks[2], (B, T, HV, K)).astype(dt)
    g = (-jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV, K)))).astype(dt)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV))).astype(dt)
    w = jax.random.normal(ks[5], (B, T, HV, K))
    if bad_in:
        k = k.at[0, 20, 0, 3].set(jnp.nan)
        v = v.at[B - 1, 40, HV - 1, 0].set(jnp.inf)
        q = q.at[B - 1, 5, H - 1, 2].set(jnp.nan)
    if bad_do:
        w = w.at[0, 30, HV - 1, 1].set(jnp.nan).at[B - 1, 50, 0, 0].set(jnp.inf)

    def loss(*x):
        o, ht = kdax.chunk_kda(*x, pipeline=pipe, chunk_size=16, cu_seqlens=cu, output_final_state=True)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(ht)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)


def _same(pipe, monkeypatch, **kw):
    new = _grads(pipe, **kw)
    with monkeypatch.context() as m:
        m.setattr(_vjp, "final_in_stages", lambda p, r: False)
        old = _grads(pipe, **kw)
    for name, a, b in zip("q k v g beta".split(), new, old):
        assert a.dtype == b.dtype, name
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        ok = ~np.isnan(b)
        ulps = 2.0 ** -22 if new[0].dtype == jnp.float32 else 2.0 ** -7  # (bf16: one ulp either side)
        np.testing.assert_allclose(a[ok], b[ok], rtol=ulps, atol=ulps * np.abs(b[ok]).max(initial=0.0), err_msg=name)
    return new



@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bad", ["finite", "inputs", "cotangents", "both"])
def test_triton_isolation_in_stages_exact(dt, bad, monkeypatch):
    """H = HV = 2 (the kernels write dq to dbeta): the same numbers as with the isolation
    outside, NaN where it was."""
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True)
    got = _same(pipe, monkeypatch, dt=dt, H=2, HV=2, bad_in=bad in ("inputs", "both"),
                bad_do=bad in ("cotangents", "both"))
    nans = [int(jnp.isnan(x.astype(jnp.float32)).sum()) for x in got]
    assert (sum(nans) > 0) == (bad != "finite"), nans


@pytest.mark.parametrize("case", ["grouped", "packed", "tpu"])
def test_other_cases_exact(case, monkeypatch):
    """Grouped heads (H < HV: no final gradients), packed input (no views: the old path)
    and the TPU target's kernels (interpreted: the pipeline finishes the gradients they
    return chunked): the same numbers."""
    pipe = kdax.KDAPipeline.pallas("tpu" if case == "tpu" else "triton", interpret=True)
    kw = dict(dt=jnp.float32, H=1 if case == "grouped" else 2, HV=2, bad_in=True, bad_do=True)
    if case == "packed":
        kw.update(B=1, cu=jnp.array([0, 20, 64], jnp.int32))
    _same(pipe, monkeypatch, **kw)


def test_declarations():
    """Only the Triton B3 and B5 declare ``final_grads``; the reference stages do not."""
    assert capabilities(P.PallasWYDqkg).final_grads and capabilities(P.PallasGateBackward).final_grads
    assert not capabilities(ReferenceWYDqkg).final_grads and not capabilities(ReferenceGateBackward).final_grads


def test_stages_write_final(monkeypatch):
    """In the Triton pipeline B3 returns dv and B5 dq, dk, dg, dbeta as ``Written``
    (caller's layout, the inputs' dtype), standing for the chunked float32 arrays."""
    seen = {}
    orig = FinalGrads.written

    def spy(self, name, x, like):
        out = orig(self, name, x, like)
        seen[name] = (x.shape, x.dtype, out.shape, out.dtype)
        return out

    monkeypatch.setattr(FinalGrads, "written", spy)
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True)
    _grads(pipe, jnp.bfloat16, 2, 2, False, False)
    assert sorted(seen) == ["beta", "g", "k", "q", "v"], seen
    assert seen["v"][:2] == ((2, 64, 2, 32), jnp.bfloat16) and seen["v"][2:] == ((2, 2, 4, 16, 32), jnp.float32)
    assert seen["beta"][:2] == ((2, 64, 2), jnp.bfloat16) and seen["beta"][2] == (2, 2, 4, 16)
