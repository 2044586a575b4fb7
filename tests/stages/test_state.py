"""F4 inter-chunk state and B2 dhu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax.stages import ReferenceDAv, ReferenceDhu, ReferenceState

from .._util import assert_close, jitted
from ._chunked import chunked, intra_chunk, layout_of, output_chunk, rand_like, state_scan, wy_chunk


def _wy(x):
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    return (Aqk,) + wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)


# unroll=0: the chunk loop; 8: the unrolled form (at most 8 chunks, a forward tile).
@pytest.mark.parametrize("unroll", [0, 8])
def test_state_forward_dense(unroll):
    x = chunked(4, strong=True)
    _, w, u, qg, kg = _wy(x)
    out = jitted(ReferenceState(unroll=unroll))(w, u, kg, x["G"], x["h0"], x["layout"])
    h, v_new, hT = state_scan(w, u, kg, x["G"], x["h0"])
    assert_close(out.h, h, 1e-13, "h")
    assert_close(out.v_new, v_new, 1e-13, "v_new")
    assert_close(out.final, hT, 1e-13, "final")


@pytest.mark.parametrize("unroll", [0, 8])
def test_state_forward_sequences_in_one_row(unroll):
    """Row of 4 chunks holding sequence 1 (chunks 0-1) and sequence 0 (chunks 2-3)."""
    x = chunked(5, R=1, NC=4)
    _, w, u, qg, kg = _wy(x)
    h0 = rand_like(jnp.zeros((2,) + x["h0"].shape[1:]), 9)
    first = jnp.array([[1, -1, 0, -1]], jnp.int32)
    last = jnp.array([[-1, 1, -1, 0]], jnp.int32)
    out = jitted(ReferenceState(unroll=unroll))(w, u, kg, x["G"], h0, layout_of(first, last, [False, False]))
    for seq, sl in ((1, slice(0, 2)), (0, slice(2, 4))):
        h, v_new, hT = state_scan(w[:, :, sl], u[:, :, sl], kg[:, :, sl], x["G"][:, :, sl], h0[seq : seq + 1])
        assert_close(out.h[:, :, sl], h, 1e-13, "h")
        assert_close(out.v_new[:, :, sl], v_new, 1e-13, "v_new")
        assert_close(out.final[seq], hT[0], 1e-13, "final")


def test_dhu_is_vjp():
    x = chunked(6, strong=True)
    scale = x["scale"]
    Aqk, w, u, qg, kg = _wy(x)
    gam = x["G"][..., -1, :]

    def piece(u, h0, eps):
        """F4 + F5 with ``eps`` added to the state at each chunk's end: d/d eps = dh."""

        def step(h, xs):
            w_c, u_c, kg_c, gam_c, e_c = xs
            v_new = u_c - w_c @ h
            return jnp.exp(gam_c)[..., None] * h + jnp.swapaxes(kg_c, -1, -2) @ v_new + e_c, (h, v_new)

        xs = tuple(jnp.moveaxis(a, 2, 0) for a in (w, u, kg, gam, eps))
        hT, (h, v_new) = jax.lax.scan(step, h0, xs)
        h, v_new = jnp.moveaxis(h, 0, 2), jnp.moveaxis(v_new, 0, 2)
        return output_chunk(qg, h, Aqk, v_new, scale), hT

    eps = jnp.zeros(x["q"].shape[:3] + (x["q"].shape[-1], x["v"].shape[-1]))
    (o, hT), vjp = jax.vjp(piece, u, x["h0"], eps)
    do, dht = rand_like(o, 1), rand_like(hT, 2)
    du, dh0, deps = vjp((do, dht))
    h, v_new, _ = state_scan(w, u, kg, x["G"], x["h0"])
    _, dv_intra = jitted(ReferenceDAv())(v_new, Aqk, do)
    out = jitted(ReferenceDhu())(scale, qg, kg, w, x["G"], do, dv_intra, dht, x["layout"])
    assert_close(out.dv_new, du, 1e-10, "dv_new")
    assert_close(out.dh0, dh0, 1e-10, "dh0")
    assert_close(out.dh, deps, 1e-10, "dh")


def test_dhu_empty_sequence_passes_dht():
    x = chunked(7, R=1, NC=2)
    Aqk, w, u, qg, kg = _wy(x)
    dht = rand_like(jnp.zeros((2,) + x["h0"].shape[1:]), 3)
    first = jnp.array([[1, -1]], jnp.int32)
    last = jnp.array([[-1, 1]], jnp.int32)
    do = jnp.zeros(x["v"].shape)
    out = jitted(ReferenceDhu())(x["scale"], qg, kg, w, x["G"], do, do, dht, layout_of(first, last, [True, False]))
    np.testing.assert_array_equal(out.dh0[0], dht[0])


def test_state_loops_without_chunks():
    # A packed row with no chunk (cu_seqlens [0, 0], T = 0): both loops pass the states through.
    from kdax._layouts.layout import make_layout

    layout = make_layout(1, 0, 64, jnp.asarray([0, 0], jnp.int32))
    assert layout.num_chunks == 0
    z = jnp.zeros((1, 2, 0, 64, 16))
    h0 = rand_like(jnp.zeros((1, 2, 16, 8)), 3)
    out = jitted(ReferenceState())(z, z[..., :8], z, z, h0, layout)
    assert out.h.shape == (1, 2, 0, 16, 8) and out.v_new.shape == (1, 2, 0, 64, 8)
    np.testing.assert_array_equal(np.asarray(out.final), np.asarray(h0))
    d = jitted(ReferenceDhu())(1.0, z, z, z, z, z[..., :8], z[..., :8], h0, layout)
    assert d.dh.shape == (1, 2, 0, 16, 8)
    np.testing.assert_array_equal(np.asarray(d.dh0), np.asarray(h0))


@pytest.mark.parametrize("layout", ["dense", "sequences in one row"])
def test_state_vjp_through_the_loop(layout):
    """F4 differentiated by JAX (a derived backward): the loop's own VJP (chunks walked
    backwards, each step differentiated alone) equals JAX's VJP of the unrolled form,
    every input, with cotangents on h, v_new and the final states."""
    if layout == "dense":
        x = chunked(6, NC=5, strong=True)
        h0, lay = x["h0"], x["layout"]
    else:
        x = chunked(7, R=1, NC=5)
        h0 = rand_like(jnp.zeros((2,) + x["h0"].shape[1:]), 9)
        first = jnp.array([[1, -1, 0, -1, -1]], jnp.int32)
        last = jnp.array([[-1, 1, -1, -1, 0]], jnp.int32)
        lay = layout_of(first, last, [False, False])
    _, w, u, qg, kg = _wy(x)
    args = (w, u, kg, x["G"], h0)

    def grads(unroll):
        out, vjp = jax.vjp(lambda *a: jitted(ReferenceState(unroll=unroll))(*a, lay), *args)
        ct = type(out)(rand_like(out.h, 11), rand_like(out.v_new, 12), rand_like(out.final, 13))
        return vjp(ct)

    looped, unrolled = grads(0), grads(100)
    for name, a, b in zip(("w", "u", "kg", "G", "h0"), looped, unrolled):
        assert_close(a, b, 1e-13, name)
        assert float(jnp.max(jnp.abs(b))) > 0, name
