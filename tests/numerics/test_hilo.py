"""G as an unevaluated sum G + G_lo (kdax._numerics.hilo): F1's exact split, and every stage
that takes G_lo computing with the sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax import KDAConfig
from kdax.ref._gates import clamp_log_decay
from kdax.stages import (
    ChunkGrads, ReferenceGate, ReferenceIntra, ReferenceIntraBackward, ReferenceRecompute, ReferenceWY,
    ReferenceWYDqkg,
)
from kdax.stages._gate import chunk_cumsum, split_cumsum
from kdax._numerics.hilo import exponent, grid_bits, split_log_decay

from .._util import assert_close, jitted
from ..stages._chunked import chunked, intra_chunk, rand_like


def _extreme_log_decays(C, seed=0, R=1, HV=2, NC=3, K=16):
    """float32 log decays, clamped as F1 clamps them: ordinary ones, a fifth at the floor
    (-20, from gates down to -1e4 and -inf), and whole chunks at the floor (|G| = 20 C)."""
    r = np.random.default_rng(seed)
    g = -r.uniform(0.01, 0.5, size=(R, HV, NC, C, K))
    g[r.uniform(size=g.shape) < 0.2] = -1e4
    g[..., 0, :, :] = -np.inf if NC > 1 else g[..., 0, :, :]
    g[:, :, -1] = -r.uniform(15.0, 20.0, size=g[:, :, -1].shape)
    return clamp_log_decay(jnp.asarray(g, jnp.float32))


@pytest.mark.parametrize("C", [16, 128])
def test_split_is_exact_and_G_plus_G_lo_is_the_float64_cumsum(C):
    g = _extreme_log_decays(C)
    m = grid_bits(jnp.float32, C)
    assert 20 * C * 2.0**m <= 2.0**24  # every partial sum of a chunk is a float32 on the grid
    hi, lo = split_log_decay(g, C)
    g64, hi64, lo64 = (np.asarray(a, np.float64) for a in (g, hi, lo))
    np.testing.assert_array_equal(hi64 + lo64, g64)
    np.testing.assert_array_equal(hi64 * 2.0**m, np.round(hi64 * 2.0**m))
    assert np.max(np.abs(lo64)) <= 2.0 ** -(m + 1)
    # The float32 chunk cumsum of g_hi (a triangular product) is exact.
    np.testing.assert_array_equal(np.asarray(chunk_cumsum(hi), np.float64), np.cumsum(hi64, axis=-2))
    exact = np.cumsum(g64, axis=-2)
    assert np.max(np.abs(exact)) >= 20 * C - 1e-3  # some chunk reaches the bound
    G, G_lo = split_cumsum(g)
    G64 = np.asarray(G, np.float64)
    err = np.max(np.abs(G64 + np.asarray(G_lo, np.float64) - exact))
    assert err <= 2e-9, err  # a single float32 G: eps |G| = 1.5e-4 at |G| = 2560
    # G alone is the exact cumsum rounded (within one float32 ulp).
    assert np.all(np.abs(G64 - exact) <= np.spacing(np.abs(exact).astype(np.float32)))


def test_gate_gives_G_lo_in_float32_only():
    r = np.random.default_rng(1)
    shape = (1, 2, 2, 16, 8)
    q, k, g = (jnp.asarray(r.normal(size=shape), jnp.float32) for _ in range(3))
    beta, valid = jnp.full(shape[:4], 0.5, jnp.float32), jnp.ones((1, 2, 16), bool)
    act = jitted(ReferenceGate())(KDAConfig(scale=1.0), q, k, -jnp.abs(g) * 300, beta, None, None, valid)
    assert act.G_lo is not None and act.G_lo.dtype == jnp.float32
    act64 = jitted(ReferenceGate())(KDAConfig(scale=1.0), *(x.astype(jnp.float64) for x in (q, k, -jnp.abs(g), beta)),
                            None, None, valid)
    assert act64.G_lo is None
    single = jitted(ReferenceGate(split=False))(KDAConfig(scale=1.0), q, k, -jnp.abs(g) * 300, beta, None, None, valid)
    assert single.G_lo is None
    assert np.max(np.abs(np.asarray(single.G) - np.asarray(act.G))) <= 1e-3  # eps |G| apart (|G| <= 320)


def test_exponent_is_never_positive():
    x = jnp.asarray([-3.0, -2.0, -2.0], jnp.float32)
    assert np.all(np.asarray(exponent(x, x, x * 0 + 1e-9, x * 0)) == 0)  # the low parts' rounding
    np.testing.assert_array_equal(exponent(x, x + 1, x * 0, x * 0), [-1, -1, -1])
    np.testing.assert_array_equal(exponent(x, x + 1), [-1, -1, -1])


def test_exponent_clamp_keeps_the_decays_derivative():
    """Issue 39 item 0: where the low parts' rounding gives 0 (a tie) or above, the clamp
    removes a rounding only; JAX's derivative of the decay ``exp(exponent(...))`` is still
    ``+exp`` in x and ``-exp`` in y (``jnp.minimum``'s would be 1/2 at a tie, 0 above),
    as the hand-written backward stages take it and as ``kdax._layouts.shared_states``' VJPs need."""
    x = jnp.asarray([-60.0, -60.0, -60.0, -3.0], jnp.float32)
    x_lo = jnp.asarray([1e-12, 0.0, -1e-7, 0.0], jnp.float32)  # above 0, a tie, below 0; no low part
    y, y_lo = x, jnp.zeros(4, jnp.float32)
    y = y + jnp.asarray([0.0, 0.0, 0.0, 1.0], jnp.float32)  # the last: an ordinary decay, exp(-1)
    np.testing.assert_array_equal(exponent(x, y, x_lo, y_lo), np.float32([0.0, 0.0, -1e-7, -1.0]))  # values as before
    decay = lambda x, y, x_lo, y_lo: jnp.sum(jnp.exp(exponent(x, y, x_lo, y_lo)))
    dx, dy, dx_lo, dy_lo = jax.grad(decay, argnums=(0, 1, 2, 3))(x, y, x_lo, y_lo)
    want = np.exp(np.asarray(exponent(x, y, x_lo, y_lo)))
    for d, sign in ((dx, 1), (dy, -1), (dx_lo, 1), (dy_lo, -1)):
        np.testing.assert_allclose(d, sign * want, rtol=1e-6)


def _split(G, seed):
    """``G`` as ``(G - d, d)`` with a random ``d``: a stage taking G_lo must compute with the sum."""
    d = 0.1 * rand_like(G, seed)
    return G - d, d


@pytest.mark.parametrize("C", [32])
def test_stages_compute_with_G_plus_G_lo(C):
    """Every reference stage that takes G_lo gives, for (G - d, d), what it gives for G alone
    (float64, so that only the formulas are compared)."""
    x = chunked(C, C=C, NC=2, strong=True)
    q, k, v, beta, G, scale = x["q"], x["k"], x["v"], x["beta"], x["G"], x["scale"]
    Gh, Gl = _split(G, 1)
    want = jitted(ReferenceIntra(group=2))(scale, q, k, beta, G)
    got = jitted(ReferenceIntra(group=2))(scale, q, k, beta, Gh, Gl)
    for n in ("Aqk", "Akk"):
        assert_close(getattr(got, n), getattr(want, n), 1e-10, n)
    Akk = intra_chunk(q, k, beta, G, scale)[1]
    want = jitted(ReferenceWY())(q, k, v, beta, G, Akk)
    got = jitted(ReferenceWY())(q, k, v, beta, Gh, Akk, Gl)
    alone = jitted(ReferenceWY())(q, k, v, beta, Gh, Akk)
    # kg = k e^(Γ - G) carries a difference: the sum's; w and qg carry e^G, G's own exponent
    # (its rounding error is at most eps/e absolute): G alone, by design.
    for n, ref in (("w", alone), ("u", want), ("qg", alone), ("kg", want)):
        assert_close(getattr(got, n), getattr(ref, n), 1e-10, n)
    wy_c, _ = jitted(ReferenceRecompute())(q, k, v, beta, Gh, Akk, x["h0"], x["layout"], Gl)
    assert_close(wy_c.kg, want.kg, 1e-10, "recompute kg")
    h = rand_like(jnp.zeros(q.shape[:3] + (q.shape[-1], v.shape[-1])), 4)
    dh, v_new, do, dv_new = rand_like(h, 5), rand_like(v, 6), rand_like(v, 7), rand_like(v, 8)
    args = (Akk, want.qg, want.kg, h, dh, v_new, do, dv_new)
    got = jitted(ReferenceWYDqkg())(scale, q, k, v, beta, Gh, *args, G_lo=Gl)
    alone = jitted(ReferenceWYDqkg())(scale, q, k, v, beta, Gh, *args)
    # Only dk's kg part, dkg e^(Γ - G) with dkg = v_new dh^T, carries a difference of G.
    dkg = v_new @ jnp.swapaxes(dh, -1, -2)
    decay = lambda G: jnp.exp(G[..., -1:, :] - G)
    assert_close(got.dk - alone.dk, dkg * (decay(G) - decay(Gh)), 1e-10, "dk")
    for n in ("dq", "dv", "dbeta", "dG", "dL"):
        assert_close(getattr(got, n), getattr(alone, n), 1e-10, n)
    dAqk, dL = jnp.tril(rand_like(Akk, 9)), jnp.tril(rand_like(Akk, 10), -1)
    zero = ChunkGrads(jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(beta),
                      jnp.zeros_like(G), dL)
    want_b = jitted(ReferenceIntraBackward(group=2))(scale, q, k, beta, G, dAqk, zero)
    got_b = jitted(ReferenceIntraBackward(group=2))(scale, q, k, beta, Gh, dAqk, zero, Gl)
    for n in ("dq", "dk", "dbeta", "dG"):
        assert_close(getattr(got_b, n), getattr(want_b, n), 1e-10, n)
