"""kdax.pallas._wy's helpers (F3 and B3 themselves: tests/pallas/test_stages.py)."""

import jax.numpy as jnp


def test_policy_exp():
    """``Products.exp`` (the kernels' exponentials under their stage's policy): ``jnp.exp``
    itself at full precision; under a half-precision policy (B3's and F3's products bf16)
    ``exp2(log2(e) x)``, within ``1.5e-7 |x|`` relative of ``exp`` in float32 over the
    exponents above float32's underflow (and 0 below it)."""
    import numpy as np

    from kdax.pallas import PallasWYDqkg

    exact, fast = (PallasWYDqkg(target="triton").products(p) for p in ("highest", "fast"))
    x = -jnp.geomspace(1e-6, 87.0, 4001, dtype=jnp.float32)
    assert exact.operand is None and fast.operand == jnp.bfloat16
    assert (np.asarray(exact.exp(x)) == np.asarray(jnp.exp(x))).all()
    got = np.asarray(fast.exp(x), np.float64)
    want = np.exp(np.asarray(x, np.float64))
    rel = np.abs(got - want) / want
    # x log2(e) rounded (2^-24) with log2(e) in float32 (1.3e-8): 7.3e-8 |x|; XLA:CPU's exp2
    # rounds its argument again (exp(y ln 2): up to 1.05e-7 |x| measured); the result 2 ulp
    assert np.all(rel <= 1.5e-7 * np.abs(np.asarray(x, np.float64)) + 2.4e-7), float(np.max(rel / (np.abs(x) + 1)))
    assert float(fast.exp(jnp.float32(-200.0))) == 0.0 and float(fast.exp(jnp.float32(0.0))) == 1.0
