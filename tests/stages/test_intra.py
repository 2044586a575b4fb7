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
