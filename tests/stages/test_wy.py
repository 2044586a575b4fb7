"""F3 WY and B3 wy_dqkg."""

import jax
import jax.numpy as jnp

from kdax.stages import ReferenceWY, ReferenceWYDqkg
from kdax.stages._intra_levels import unit_lower_inverse

from .._util import assert_close, jitted
from ._chunked import chunked, intra_chunk, rand_like, wy_chunk


def test_wy_forward():
    x = chunked(2, strong=True)
    _, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    out = jitted(ReferenceWY())(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    for a, b, n in zip((out.w, out.u, out.qg, out.kg), wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk), "w u qg kg".split()):
        assert_close(a, b, 1e-13, n)


def test_wy_dqkg_is_vjp():
    x = chunked(3, strong=True)
    scale = x["scale"]
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], scale)
    L = jnp.tril(jnp.linalg.inv(Akk) - jnp.eye(Akk.shape[-1]), -1)
    h = rand_like(jnp.zeros(x["q"].shape[:3] + (x["q"].shape[-1], x["v"].shape[-1])), 4)
    v_new_fixed = rand_like(x["v"], 5)

    def piece(q, k, v, beta, G, L):
        """What B3 differentiates, with h and (on the state path) v_new held fixed."""
        w, u, qg, kg = wy_chunk(q, k, v, beta, G, unit_lower_inverse(L))
        gam = G[..., -1, :]
        h_end = jnp.exp(gam)[..., None] * h + jnp.swapaxes(kg, -1, -2) @ v_new_fixed
        return scale * qg @ h, u - w @ h, h_end

    args = (x["q"], x["k"], x["v"], x["beta"], x["G"], L)
    outs, vjp = jax.vjp(piece, *args)
    do, dv_new, dh = (rand_like(o, 10 + i) for i, o in enumerate(outs))
    dq, dk, dv, dbeta, dG, dL = vjp((do, dv_new, dh))
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    out = jitted(ReferenceWYDqkg())(scale, x["q"], x["k"], x["v"], x["beta"], x["G"], Akk, qg, kg, h, dh, v_new_fixed, do, dv_new)
    for got, want, n in zip((out.dq, out.dk, out.dv, out.dbeta, out.dG, out.dL), (dq, dk, dv, dbeta, dG, dL),
                            "dq dk dv dbeta dG dL".split()):
        assert_close(got, want, 1e-10, n)
