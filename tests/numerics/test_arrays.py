"""kdax._numerics.arrays: the chunk cumsum by additions (``row_cumsum``) against numpy's
cumsum in float64, its NaN confinement (as ``lower_matmul``'s), causality to the bit
and its derivative (float64 from the suite's conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax._numerics.arrays import lower_matmul, row_cumsum


@pytest.mark.parametrize("C", [16, 64, 128, 40, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_cumsum_is_the_cumsum(C, reverse):
    """float64, every block form (C a multiple of the block, and not: one row a block)."""
    x = np.random.default_rng(C).normal(size=(2, 3, C, 5))
    want = np.flip(np.cumsum(np.flip(x, -2), -2), -2) if reverse else np.cumsum(x, -2)
    got = np.asarray(jax.jit(lambda x: row_cumsum(x, reverse))(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_row_cumsum_float32_matches_the_float64_sum():
    x = np.random.default_rng(0).normal(size=(4, 64, 128)).astype(np.float32)
    got = np.asarray(jax.jit(row_cumsum)(jnp.asarray(x)))
    want = np.cumsum(x.astype(np.float64), -2)
    rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rel < 1e-6 and np.max(np.abs(got - want)) < 2e-5, (rel, np.max(np.abs(got - want)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [0, 5, 16, 63])
def test_row_cumsum_confines_a_non_finite_entry(bad, row):
    """NaN from its row on, in every column (as ``lower_matmul``, which it replaced in F1);
    the rows before it bitwise those of the clean input; with ``nan_rows=False`` (B5's
    reverse sum) only its own column, the other columns bitwise the clean ones."""
    x = np.random.default_rng(1).normal(size=(2, 64, 8))
    y = x.copy()
    y[1, row, 3] = bad
    clean, got = (np.asarray(jax.jit(row_cumsum)(jnp.asarray(a))) for a in (x, y))
    assert np.isnan(got[1, row:]).all()
    np.testing.assert_array_equal(got[1, :row], clean[1, :row])
    np.testing.assert_array_equal(got[0], clean[0])
    ones = np.tril(np.ones((64, 64)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(np.asarray(lower_matmul(ones, jnp.asarray(y)))))
    rev = np.asarray(jax.jit(lambda a: row_cumsum(a, True, nan_rows=False))(jnp.asarray(y)))
    rev_clean = np.asarray(jax.jit(lambda a: row_cumsum(a, True, nan_rows=False))(jnp.asarray(x)))
    assert not np.isfinite(rev[1, :row + 1, 3]).any() and np.isfinite(np.delete(rev[1], 3, -1)).all()
    np.testing.assert_array_equal(np.delete(rev[1], 3, -1), np.delete(rev_clean[1], 3, -1))
    np.testing.assert_array_equal(rev[1, row + 1:], rev_clean[1, row + 1:])


def test_row_cumsum_is_causal_to_the_bit():
    """Changing rows from j on changes no bit of the rows before j (float32)."""
    r = np.random.default_rng(2)
    x = r.normal(size=(3, 64, 16)).astype(np.float32)
    f = jax.jit(row_cumsum)
    base = np.asarray(f(jnp.asarray(x)))
    for j in (1, 15, 16, 17, 40):
        y = x.copy()
        y[:, j:] = r.normal(size=y[:, j:].shape) * 1e6
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(y)))[:, :j], base[:, :j])


@pytest.mark.parametrize("reverse", [False, True])
def test_row_cumsum_derivative_is_the_transposed_sum(reverse):
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 32, 4)))
    w = jnp.asarray(np.random.default_rng(4).normal(size=(2, 32, 4)))
    grad = jax.grad(lambda x: jnp.sum(row_cumsum(x, reverse) * w))(x)
    w = np.asarray(w)  # the transpose of a (reverse) cumsum is the other direction's
    want = np.cumsum(w, -2) if reverse else np.flip(np.cumsum(np.flip(w, -2), -2), -2)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-13, atol=1e-13)
