"""F5 output and B1 dAv."""

import jax
import jax.numpy as jnp
import numpy as np

from kdax.stages import ReferenceDAv, ReferenceOutput

from .._util import assert_close, jitted
from ._chunked import chunked, intra_chunk, output_chunk, rand_like


def _parts(x):
    Aqk, _ = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    qg = x["q"] * jnp.exp(x["G"])
    h = rand_like(jnp.zeros(x["q"].shape[:3] + (x["q"].shape[-1], x["v"].shape[-1])), 5)
    return qg, h, Aqk, rand_like(x["v"], 6)


def test_output_forward():
    x = chunked()
    qg, h, Aqk, v_new = _parts(x)
    assert_close(jitted(ReferenceOutput())(x["scale"], qg, h, Aqk, v_new), output_chunk(qg, h, Aqk, v_new, x["scale"]), 1e-14)


def test_dav_is_vjp_of_output():
    x = chunked(1)
    qg, h, Aqk, v_new = _parts(x)
    o, vjp = jax.vjp(lambda A, vn: jitted(ReferenceOutput())(x["scale"], qg, h, A, vn), Aqk, v_new)
    do = rand_like(o, 7)
    dA_ref, dv_ref = vjp(do)
    dA, dv = jitted(ReferenceDAv())(v_new, Aqk, do)
    assert_close(dA, jnp.tril(dA_ref), 1e-12, "dAqk")
    assert np.all(np.asarray(jnp.triu(dA, 1)) == 0)
    assert_close(dv, dv_ref, 1e-12, "dv_intra")
