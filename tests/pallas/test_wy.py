"""kdax.pallas._wy's helpers (F3 and B3 themselves: tests/pallas/test_stages.py)."""

import jax.numpy as jnp


def test_policy_exp():
    """``policy_exp``: ``jnp.exp`` itself at full precision; under a half-precision policy
    (B3's and F3's products bf16) ``exp2(log2(e) x)``, within ``1.5e-7 |x|`` relative of
    ``exp`` in float32 over the exponents above float32's underflow (and 0 below it)."""
    import numpy as np

    from kdax._numerics import precision as _precision
    from kdax.pallas._wy import policy_exp

    x = -jnp.geomspace(1e-6, 87.0, 4001, dtype=jnp.float32)
    with _precision.stage_scope("highest", "wy_dqkg"):
        assert (np.asarray(policy_exp(x)) == np.asarray(jnp.exp(x))).all()
    with _precision.stage_scope("fast", "wy_dqkg"):
        assert _precision.operand_dtype() is not None
        got = np.asarray(policy_exp(x), np.float64)
    want = np.exp(np.asarray(x, np.float64))
    rel = np.abs(got - want) / want
    # x log2(e) rounded (2^-24) with log2(e) in float32 (1.3e-8): 7.3e-8 |x|; XLA:CPU's exp2
    # rounds its argument again (exp(y ln 2): up to 1.05e-7 |x| measured); the result 2 ulp
    assert np.all(rel <= 1.5e-7 * np.abs(np.asarray(x, np.float64)) + 2.4e-7), float(np.max(rel / (np.abs(x) + 1)))
    with _precision.stage_scope("fast", "wy_dqkg"):
        assert float(policy_exp(jnp.float32(-200.0))) == 0.0 and float(policy_exp(jnp.float32(0.0))) == 1.0
