"""The gate, l2norm and beta activations follow the formulas of DESIGN.md §1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.ref import (beta_activation, kda_gate, l2norm, lower_bound_gate, naive_kda_gate, naive_kda_lowerbound_gate,
                      softplus_gate)


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


def test_flas_gate_functions():
    """FLA's ``fused_kda_gate``, ``naive_kda_gate`` and ``naive_kda_lowerbound_gate``
    (fla/ops/kda/gate.py) by name, arguments and defaults: computed in float32 whatever the
    inputs' dtypes and returned in float32 unless ``output_dtype`` says otherwise (a
    port of ``fused_kda_gate`` to ``kda_gate`` on bf16 g gave bf16 log decays, 4.6e-3 off)."""
    g, A, b = _x((3, 5, 2, 4)), _x((2,), 1), _x((8,), 2)
    z = np.asarray(g) + np.asarray(b).reshape(2, 4)
    softplus = -np.exp(np.asarray(A))[:, None] * np.logaddexp(0, z)
    bounded = lambda A: -5.0 / (1.0 + np.exp(-(z if A is None else np.exp(np.asarray(A))[:, None] * z)))
    np.testing.assert_allclose(kdax.fused_kda_gate(g, A, b), softplus, rtol=1e-13)  # (float64 stays float64)
    np.testing.assert_allclose(naive_kda_gate(g, A, b), softplus, rtol=1e-13)
    np.testing.assert_allclose(kdax.fused_kda_gate(g, A, b, lower_bound=-5.0), bounded(A), rtol=1e-13)
    np.testing.assert_allclose(naive_kda_lowerbound_gate(g, None, b), bounded(None), rtol=1e-13)  # (FLA's -5 default)
    half = g.astype(jnp.bfloat16)
    z = np.asarray(half, np.float64) + np.asarray(b).reshape(2, 4)
    want = -np.exp(np.asarray(A))[:, None] * np.logaddexp(0, z)
    for fn in (kdax.fused_kda_gate, naive_kda_gate):
        got = fn(g=half, A_log=A, dt_bias=b)
        assert got.dtype == jnp.float32, got.dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
    assert kdax.fused_kda_gate(half, A, b, output_dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"^A_log: required by the softplus gate \(lower_bound is None\)"):
        kdax.fused_kda_gate(g, None, b)  # (FLA: "A_log must be provided ... lower_bound is not set")
