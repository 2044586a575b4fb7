"""The per-chunk arithmetic of the Pallas state kernels, shared by both targets: one
chunk of F4 (``state_step``) and of B2 (``dhu_step``), whole or on the state held as row
tiles (``*_tiled``, ``k_tiles``)."""

import jax.numpy as jnp

from ._arith import dot


def state_step(w, u, kg, gam, h):
    v_new = u - dot(w, h)
    return v_new, jnp.exp(gam) * h + dot(kg, v_new, ta=True)


def k_tiles(Kp: int, block_k):
    """The state's row tiles ``[(start, size), ...]`` (Triton): ``block_k`` rows each
    (FLA holds the state as 64-row register tiles), or one tile of all Kp rows."""
    bk = Kp if block_k is None else min(block_k, Kp)
    return [(i, bk) for i in range(0, Kp, bk)]


def state_step_tiled(w, u, kg, gam, hs):
    """``state_step`` on the state as row tiles ``hs`` (``w``, ``kg`` and ``gam`` as
    matching lists of column / row tiles): the same sums, split along K."""
    v_new = u
    for wi, hi in zip(w, hs):
        v_new = v_new - dot(wi, hi)
    return v_new, tuple(jnp.exp(gi) * hi + dot(ki, v_new, ta=True) for ki, gi, hi in zip(kg, gam, hs))


def dhu_step_tiled(scale, qg, kg, w, gam, do, dv_intra, dhs):
    dv = dv_intra
    for ki, hi in zip(kg, dhs):
        dv = dv + dot(ki, hi)
    return dv, tuple(jnp.exp(gi) * hi + scale * dot(qi, do, ta=True) - dot(wi, dv, ta=True)
                     for qi, wi, gi, hi in zip(qg, w, gam, dhs))


def dhu_step(scale, qg, kg, w, gam, do, dv_intra, dh_end):
    dv = dv_intra + dot(kg, dh_end)
    return dv, jnp.exp(gam) * dh_end + scale * dot(qg, do, ta=True) - dot(w, dv, ta=True)
