"""The gate, l2norm and beta activations follow the formulas of DESIGN.md §1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax.ref import beta_activation, kda_gate, l2norm, lower_bound_gate, softplus_gate


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def test_softplus_gate():
    g, A, b = _x((3, 2, 4)), _x((2,), 1), _x((8,), 2)
    want = -np.exp(np.asarray(A))[:, None] * np.log1p(np.exp(np.asarray(g) + np.asarray(b).reshape(2, 4)))
    np.testing.assert_allclose(softplus_gate(g, A, b), want, rtol=1e-13)
    np.testing.assert_allclose(kda_gate(g, A, b), want, rtol=1e-13)


@pytest.mark.parametrize("with_A", [True, False])
def test_lower_bound_gate(with_A):
    g, A, b = _x((3, 2, 4)), _x((2,), 1), _x((8,), 2)
    z = np.asarray(g) + np.asarray(b).reshape(2, 4)
    if with_A:
        z = np.exp(np.asarray(A))[:, None] * z
    want = -5.0 / (1.0 + np.exp(-z))
    got = lower_bound_gate(g, -5.0, A if with_A else None, b)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    np.testing.assert_allclose(kda_gate(g, A if with_A else None, b, -5.0), want, rtol=1e-13)
    assert np.all(np.asarray(got) <= 0) and np.all(np.asarray(got) >= -5.0)


def test_kda_gate_names_a_wrong_parameter_shape():
    """``kdax.kda_gate``, public: a wrong ``A_log`` or ``dt_bias`` is named with the shape it
    takes (JAX's broadcasting and reshape errors named neither)."""
    from jaxtyping import TypeCheckError

    g = _x((1, 5, 2, 4))
    assert kda_gate(g, _x((1, 1, 2, 1), 1), _x((8,), 2)).shape == g.shape  # (Kimi Linear's A_log)
    with pytest.raises(TypeCheckError, match=r"^A_log: expected layout \[HV\] or \[1, 1, HV, 1\], got shape \(3,\)"):
        kda_gate(g, _x((3,), 1))
    with pytest.raises(ValueError, match=r"^dt_bias: expected shape \[HV \* K\] = \(8,\) for g_raw \[\.\.\., 2, 4\], got \(2,\)"):
        kda_gate(g, _x((2,), 1), _x((2,), 2))


def test_l2norm_and_beta():
    x = _x((5, 7))
    want = np.asarray(x) / np.sqrt(np.sum(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(l2norm(x), want, rtol=1e-13)
    b = _x((4,))
    np.testing.assert_allclose(beta_activation(b, True, False), jax.nn.sigmoid(b), rtol=1e-14)
    np.testing.assert_allclose(beta_activation(b, True, True), 2 * jax.nn.sigmoid(b), rtol=1e-14)
    assert beta_activation(b, False, True) is b
