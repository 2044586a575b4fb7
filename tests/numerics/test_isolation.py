"""``kdax._numerics.isolation.finite_heads``: which heads of a state table are finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax._numerics.isolation import finite_heads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_finite_heads_flags_exactly_the_heads_holding_a_non_finite_element(dtype, bad):
    """A NaN or an infinity anywhere in a head's ``[K, V]`` state flags that head alone;
    finite extremes (the largest float, negative zero, subnormals) do not, under jit."""
    with jax.enable_x64(dtype == jnp.float64):
        x = np.random.default_rng(0).normal(size=(5, 3, 8, 16)).astype(dtype)
        big = float(jnp.finfo(dtype).max)
        x[0, 0, 0, 0], x[1, 2, 7, 15], x[4, 1, 3, 0] = big, -0.0, float(jnp.finfo(dtype).smallest_subnormal)
        x[2, 1, 7, 15], x[3, 0, 0, 0], x[3, 2, 4, 9] = bad, -big, bad
        got = np.asarray(jax.jit(finite_heads)(jnp.asarray(x)))
        want = np.ones((5, 3), bool)
        want[2, 1] = want[3, 2] = False
        np.testing.assert_array_equal(got, want)


def test_finite_heads_of_a_constant_runs_as_a_product():
    """A constant table (the ones of ``jax.grad`` of ``sum(ht)``) is tested by a product at
    run time, not folded at compile time (XLA:CPU folded a max or boolean reduction over
    1000 such states for half a minute)."""
    compiled = jax.jit(lambda: finite_heads(jnp.ones((1000, 4, 64, 64)))).lower().compile()
    assert " dot(" in compiled.as_text()
    out = compiled()
    assert bool(out.all()) and out.shape == (1000, 4)
