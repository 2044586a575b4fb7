"""F2 intra (recursive halving) against the pairwise oracle, and B4 against jax.vjp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax.stages import ChunkGrads, ReferenceIntra, ReferenceIntraBackward

from .._util import assert_close, jitted
from ._chunked import chunked, intra_chunk, pairwise_decay, rand_like


# group: chunks per loop step (None: all at once). R = 2 rows x HV x NC chunks: 8 chunks
# split exactly; 14 chunks (HV=1, NC=7) in groups of 6 leave a remainder of 2.
@pytest.mark.parametrize(
    "C,group,strong,HV,NC",
    [(16, 3, False, 2, 2), (32, None, True, 2, 2), (64, 4, True, 2, 2), (64, 6, False, 1, 7), (128, 5, True, 2, 2)],
)
def test_intra_forward(C, group, strong, HV, NC):
    x = chunked(C, C=C, NC=NC, HV=HV, strong=strong)
    out = jitted(ReferenceIntra(group=group))(x["scale"], x["q"], x["k"], x["beta"], x["G"])
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    assert_close(out.Aqk, Aqk, 1e-12, "Aqk")
    assert_close(out.Akk, Akk, 1e-12, "Akk")


def _intra_piece(scale, q, k, beta, G):
    """(Aqk, L): the products B4 differentiates."""
    Aqk = scale * jnp.einsum("...id,...jd,...ijd->...ij", q, k, pairwise_decay(G, False))
    L = beta[..., :, None] * jnp.einsum("...id,...jd,...ijd->...ij", k, k, pairwise_decay(G, True))
    return Aqk, L


@pytest.mark.parametrize(
    "C,group,strong,HV,NC", [(16, None, False, 3, 2), (64, 4, True, 3, 2), (32, 1, True, 3, 2), (128, 6, True, 1, 7)]
)
def test_intra_backward_is_vjp(C, group, strong, HV, NC):
    x = chunked(C + 1, C=C, NC=NC, HV=HV, strong=strong)
    args = (x["q"], x["k"], x["beta"], x["G"])
    Aqk, L = jax.eval_shape(lambda *a: _intra_piece(x["scale"], *a), *args)
    dAqk = jnp.tril(rand_like(Aqk, 1))
    dL = jnp.tril(rand_like(L, 2), -1)
    piece_vjp = lambda a, ct: jax.vjp(lambda *a: _intra_piece(x["scale"], *a), *a)[1](ct)
    dq, dk, dbeta, dG = jitted(piece_vjp)(args, (dAqk, dL))
    zero = ChunkGrads(jnp.zeros_like(x["q"]), jnp.zeros_like(x["k"]), jnp.zeros_like(x["v"]),
                      jnp.zeros_like(x["beta"]), jnp.zeros_like(x["G"]), dL)
    out = jitted(ReferenceIntraBackward(group=group))(x["scale"], *args, dAqk, zero)
    assert_close(out.dq, dq, 1e-10, "dq")
    assert_close(out.dk, dk, 1e-10, "dk")
    assert_close(out.dbeta, dbeta, 1e-10, "dbeta")
    assert_close(out.dG, dG, 1e-10, "dG")
    assert np.all(np.isfinite(np.asarray(out.dG)))


@pytest.mark.parametrize("group", [None, 2])
def test_intra_backward_diagonal_leaves_dG_exactly(group):
    """A diagonal entry of dAqk (i = j: ``q_i k_i e^0``) adds ``scale dAqk_ii q_i k_i`` to
    dG_i through the row sum and takes it away through the column sum. B4 leaves those terms
    out of both sums, so a cotangent on the diagonal alone gives dG = 0 to the bit, float32,
    while dq and dk carry them. (With them in both sums, each rounded differently, dG got
    their rounding noise in every row; B5's reverse cumsum carried it to the chunk's first
    row, where a gate below ~-20 leaves a true dg near zero: ``tests/test_hard_decay.py``'s
    float32 dg 3.1e-6 rel-RMS at strong gates against 8.4e-7 at weak ones, now 5.2e-7.)"""
    x = chunked(3, C=16, NC=4, HV=2, strong=True)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    q, k, beta, G = (f32(x[n]) for n in ("q", "k", "beta", "G"))
    eye = jnp.eye(16, dtype=bool)
    dAqk = jnp.where(eye, rand_like(jnp.zeros(q.shape[:-1] + (16,), jnp.float32), 1), 0.0)
    zero = ChunkGrads(jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(f32(x["v"])), jnp.zeros_like(beta),
                      jnp.zeros_like(G), jnp.zeros_like(dAqk))
    out = jitted(ReferenceIntraBackward(group=group))(0.37, q, k, beta, G, dAqk, zero)
    d = jnp.diagonal(dAqk, axis1=-2, axis2=-1)[..., None]
    np.testing.assert_array_equal(np.asarray(out.dG), 0.0)
    assert_close(out.dq, 0.37 * d * k, 1e-6, "dq")
    assert_close(out.dk, 0.37 * d * q, 1e-6, "dk")


@pytest.mark.parametrize("low", [False, True], ids=["G", "G + G_lo"])
@pytest.mark.parametrize("C,group,strong", [(16, 3, True), (64, None, False)])
def test_intra_vjp_is_the_formulas(C, group, strong, low):
    """F2 differentiated by JAX (a derived backward): its products' VJP (B4's formula) and
    its inverse's (``-X^T dX X^T``) give JAX's VJP of the pairwise formulas, float64;
    ``G_lo`` enters every exponent as ``G`` does, and gets the same gradient."""
    x = chunked(C + 2, C=C, NC=3, HV=2, strong=strong)
    G_lo = rand_like(x["G"], 5) * 1e-9 if low else None
    args = (x["q"], x["k"], x["beta"], x["G"])

    def oracle(q, k, beta, G):
        Aqk, L = _intra_piece(x["scale"], q, k, beta, G if G_lo is None else G + G_lo)
        eye = jnp.eye(C, dtype=L.dtype)
        return Aqk, jnp.linalg.solve(eye + L, jnp.broadcast_to(eye, L.shape))

    def stage(*a):
        out = ReferenceIntra(group=group)(x["scale"], *a[:4], G_lo=a[4] if low else None)
        return out.Aqk, out.Akk

    mat = jnp.zeros(x["q"].shape[:-1] + (C,))
    cts = (rand_like(mat, 6), rand_like(mat, 7))
    vjp = lambda f, a, ct: jax.vjp(f, *a)[1](ct)
    got = jitted(vjp)(stage, (*args, *((G_lo,) if low else ())), cts)
    want = jitted(vjp)(oracle, args, cts)
    for name, a, b in zip(("dq", "dk", "dbeta", "dG"), got, want):
        assert_close(a, b, 1e-10, name)
    if low:
        assert_close(got[4], want[3], 1e-10, "dG_lo")
