"""The helpers the reference stages share: chunk groups, K-sums, the unit-lower inverse."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.bench import STAGES
from kdax import stage_inputs
from kdax.stages._gate import chunk_cumsum
from kdax.stages._intra_levels import unit_lower_inverse
from kdax._numerics.arrays import rowsum
from kdax._numerics.chunk_loops import over_chunks
from tests._util import dot_eqns


def _fn(a, b):
    # a [.., C, K], b [.., C]: a pytree of outputs with different trailing shapes
    return {"m": a @ jnp.swapaxes(a, -1, -2), "s": rowsum(a) * b}


@pytest.fixture(params=[True, False], ids=["nc-slices", "flat-groups"])
def loop_form(request, monkeypatch):
    """Both loops of ``over_chunks``: slices of NC (under a mesh with Auto axes) and
    contiguous groups of the flattened chunk axes (elsewhere)."""
    monkeypatch.setattr(kdax._numerics.chunk_loops, "split_rows_and_heads", lambda mode="auto": request.param)
    return request.param


# R * HV * NC chunks, looped over slices of NC of about group / (R * HV) chunks (or over
# groups of the flattened axes): slices that divide NC, one with a remainder (NC = 7,
# slices of 3), a group larger than all, one smaller than R * HV (slices of one chunk),
# and None (all at once).
@pytest.mark.parametrize("lead,group", [((2, 3, 2), 4), ((1, 2, 7), 6), ((1, 1, 5), 16), ((2, 1, 3), None), ((1, 2, 7), 1)])
def test_over_chunks_equals_one_call(lead, group, loop_form):
    r = np.random.default_rng(0)
    a = jnp.asarray(r.normal(size=lead + (8, 5)))
    b = jnp.asarray(r.normal(size=lead + (8,)))
    got = over_chunks(_fn, group, a, b)
    want = _fn(a, b)
    for key in want:
        assert got[key].shape == want[key].shape
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-13, atol=1e-13)


def test_rowsum():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4, 7)))
    np.testing.assert_allclose(np.asarray(rowsum(x)), np.asarray(x).sum(-1), rtol=1e-13)


@pytest.mark.parametrize("C", [16, 64, 128])
def test_unit_lower_inverse(C):
    r = np.random.default_rng(C)
    L = np.tril(r.normal(size=(2, 3, C, C)) * 0.3, -1)
    inv = np.asarray(unit_lower_inverse(jnp.asarray(L)))
    want = np.linalg.inv(np.eye(C) + L)
    assert np.all(np.triu(inv, 1) == 0.0)  # exactly lower triangular
    np.testing.assert_allclose(inv, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


@pytest.mark.parametrize("C", [16, 64])
def test_unit_lower_inverse_vjp(C):
    """The inverse's own VJP (``dL = -X^T dX X^T`` below the diagonal, F2's) equals JAX's VJP
    of the block recursion, float64; nothing reaches the diagonal and above (never read)."""
    from kdax.stages._intra_levels import inverse_vjp

    r = np.random.default_rng(C + 1)
    L = jnp.asarray(np.tril(r.normal(size=(2, 3, C, C)) * 0.3, -1) + np.triu(r.normal(size=(2, 3, C, C))))
    dX = jnp.asarray(r.normal(size=(2, 3, C, C)))
    got = inverse_vjp(unit_lower_inverse(L), dX)
    want = jax.vjp(unit_lower_inverse, L)[1](dX)[0]
    assert np.all(np.triu(np.asarray(got)) == 0.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-11, atol=1e-11 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_cumsum(reverse):
    x = np.random.default_rng(2).normal(size=(2, 3, 4, 16, 5))
    want = np.flip(np.cumsum(np.flip(x, -2), -2), -2) if reverse else np.cumsum(x, -2)
    got = np.asarray(chunk_cumsum(jnp.asarray(x), reverse=reverse, group=5))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lead,group", [((2, 3, 2), 4), ((1, 2, 7), 6), ((1, 1, 5), 16), ((2, 1, 3), None)])
def test_over_chunks_adds_into(lead, group, loop_form):
    # Outputs added into given arrays (None: a fresh output), remainders included.
    r = np.random.default_rng(3)
    a = jnp.asarray(r.normal(size=lead + (8, 5)))
    b = jnp.asarray(r.normal(size=lead + (8,)))
    acc = jnp.asarray(r.normal(size=lead + (8,)))

    def fn(a, b):
        out = _fn(a, b)
        return out["m"], out["s"]

    m, s = over_chunks(fn, group, a, b, into=(None, acc))
    want_m, want_s = fn(a, b)
    np.testing.assert_allclose(np.asarray(m), np.asarray(want_m), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np.asarray(s), np.asarray(acc + want_s), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("lead,group", [((2, 3, 2), 4), ((1, 2, 7), 6), ((1, 2, 7), 1)])
@pytest.mark.parametrize("jit", [False, True])
def test_over_chunks_vjp(lead, group, loop_form, jit):
    """Differentiated by JAX, the loop's own VJP (each group rematerialised and
    differentiated alone): equal to the VJP of one call, with ``into``, an integer input
    (no gradient), an input not differentiated and an output without a cotangent."""
    r = np.random.default_rng(4)
    a, c = (jnp.asarray(r.normal(size=lead + (8, 5))) for _ in range(2))
    b, acc = (jnp.asarray(r.normal(size=lead + (8,))) for _ in range(2))
    n = jnp.asarray(r.integers(0, 3, size=lead + (8,)))
    w = jnp.asarray(r.normal(size=lead + (8, 8)))

    def fn(a, b, n, c):
        out = _fn(a * c, b)
        return out["m"], out["s"] * n, jnp.sin(a)

    def loss(f, a, b, acc):
        m, s, unused = f(a, b, acc)
        return jnp.sum(m * w) + jnp.sum(jnp.cos(s))

    looped = lambda a, b, acc: over_chunks(fn, group, a, b, n, c, into=(None, acc, None))
    whole = lambda a, b, acc: (lambda m, s, x: (m, s + acc, x))(*fn(a, b, n, c))
    grad = lambda f: jax.grad(lambda *x: loss(f, *x), argnums=(0, 1, 2))
    got = (jax.jit(grad(looped)) if jit else grad(looped))(a, b, acc)
    want = grad(whole)(a, b, acc)
    for g, h, name in zip(got, want, ("a", "b", "acc")):
        assert float(jnp.max(jnp.abs(h))) > 0, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-12, atol=1e-12, err_msg=name)


def test_loop_forms_give_the_same_pipeline(monkeypatch):
    """The whole reference pipeline, forward and gradient, with either loop form
    (groups small enough that every stage loops, remainders included)."""
    from tests._util import make_inputs

    x = make_inputs(seed=4, B=2, T=70, H=3, K=8, V=8)
    # groups of 16 chunks: 30 chunks loop, with a remainder (untiled: the loops in question
    # are the stages' chunk-group loops, not the forward's tiles)
    pipe = kdax.KDAPipeline.reference().untiled()

    def run():
        def loss(q, k, v, g, beta):
            o, ht = kdax.chunk_kda(q, k, v, g, beta, initial_state=x["initial_state"], output_final_state=True,
                                   chunk_size=16, pipeline=pipe)
            return jnp.sum(o * o) + jnp.sum(ht)

        # (jitted: eager runs op by op; a fresh function per form, traced with that form)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x["q"], x["k"], x["v"], x["g"], x["beta"])

    outs = {}
    for form in (True, False):
        monkeypatch.setattr(kdax._numerics.chunk_loops, "split_rows_and_heads", lambda mode="auto", form=form: form)
        outs[form] = jax.tree.leaves(run())
    for a, b in zip(outs[True], outs[False]):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def _dot_precisions(jaxpr):
    """The ``precision`` of every dot_general in a jaxpr, sub-jaxprs (loops) included."""
    return [e.params["precision"] for e in dot_eqns(jaxpr)]


# (Slow: the pipeline-level check, tests/test_pipeline.py::test_products_at_full_precision,
# covers every stage's products in the default run; this one calls each stage alone.)
@pytest.mark.slow
def test_reference_stages_ask_for_full_precision():
    """Every reference stage, called on its own (outside a pipeline), traces its matrix
    products at HIGHEST precision: on GPUs the default is TF32 for float32."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(1, 40, 2, 16), f(1, 40, 2, 16) / 4, f(1, 40, 2, 16)
    g, beta = -jnp.abs(f(1, 40, 2, 16)) * 0.1, jax.nn.sigmoid(f(1, 40, 2))
    pipe = kdax.KDAPipeline.reference()
    taps = stage_inputs(pipe, q, k, v, g, beta, chunk_size=16, use_qk_l2norm_in_kernel=True)
    assert set(taps) == set(STAGES)
    highest = jax.lax.Precision.HIGHEST
    without = {"gate", "gate_bwd"}  # F1 and B5: chunk cumsums by additions (row_cumsum), no product
    for name, args in taps.items():
        precs = _dot_precisions(jax.make_jaxpr(lambda: getattr(pipe, name)(*args))().jaxpr)
        assert bool(precs) == (name not in without), (name, precs)
        assert all(p == (highest, highest) for p in precs), (name, precs)
