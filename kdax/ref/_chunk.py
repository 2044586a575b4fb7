"""Readable chunked KDA (the oracle for every chunked stage), exact in float64.

Pieces work on the chunked layout ``[B, HV, NC, C, D]`` with ``G`` the chunk-local cumsum
of ``g``. They form full pairwise ``[C, C, K]`` decay tensors: slow but plainly right, the
thing the fast anchored stages are checked against.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from .._annotations import ArrayIn, Beta, Float, Gate, QK, State, Values, typecheck
from ._gates import clamp_log_decay
from ._recurrent import compute_dtype, expand_heads


def to_chunks(x, chunk_size: int):
    """``[B, T, HV, ...] -> [B, HV, NC, C, ...]``, zero-padding T up to a multiple of C."""
    B, T = x.shape[:2]
    nc = -(-T // chunk_size)
    x = jnp.pad(x, [(0, 0), (0, nc * chunk_size - T)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(B, nc, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x, T: int):
    """Inverse of ``to_chunks``: ``[B, HV, NC, C, ...] -> [B, T, HV, ...]``."""
    x = jnp.moveaxis(x, 1, 3)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def pairwise_decay(G, strict: bool):
    """``exp(G_i - G_j)`` for j <= i (j < i when strict), 0 elsewhere; ``[..., C, C, K]``.
    The mask sits in the exponent, so no positive number is ever exponentiated."""
    C = G.shape[-2]
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    keep = (j < i) if strict else (j <= i)
    diff = G[..., :, None, :] - G[..., None, :, :]
    return jnp.exp(jnp.where(keep[..., None], diff, -jnp.inf))


def intra_chunk(q, k, beta, G, scale):
    """``Aqk = scale * sum_d q_id k_jd exp(G_id - G_jd)`` (j <= i); ``L = beta_i * sum_d
    k_id k_jd exp(G_id - G_jd)`` (j < i); ``Akk = (I + L)^-1``."""
    Aqk = scale * jnp.einsum("...id,...jd,...ijd->...ij", q, k, pairwise_decay(G, False))
    L = beta[..., :, None] * jnp.einsum("...id,...jd,...ijd->...ij", k, k, pairwise_decay(G, True))
    eye = jnp.eye(G.shape[-2], dtype=G.dtype)
    Akk = jax.scipy.linalg.solve_triangular(eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True)
    return Aqk, Akk


def wy_chunk(q, k, v, beta, G, Akk):
    """``w = Akk (beta k e^G)``, ``u = Akk (beta v)``, ``qg = q e^G``, ``kg = k e^(Γ-G)``."""
    eG = jnp.exp(G)
    w = Akk @ (beta[..., None] * k * eG)
    u = Akk @ (beta[..., None] * v)
    kg = k * jnp.exp(G[..., -1:, :] - G)
    return w, u, q * eG, kg


def state_scan(w, u, kg, G, h0):
    """Sequential over chunks: ``v_new = u - w h``; ``h <- e^Γ h + kg^T v_new``.
    Returns h at each chunk start ``[B, HV, NC, K, V]``, v_new, and the final state."""

    def step(h, x):
        w_c, u_c, kg_c, gam = x
        v_new = u_c - w_c @ h
        return jnp.exp(gam)[..., None] * h + jnp.swapaxes(kg_c, -1, -2) @ v_new, (h, v_new)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u, kg, G[..., -1, :]))
    hT, (h, v_new) = jax.lax.scan(step, h0, xs)
    return jnp.moveaxis(h, 0, 2), jnp.moveaxis(v_new, 0, 2), hT


def output_chunk(qg, h, Aqk, v_new, scale):
    """``o = scale qg h + Aqk v_new``."""
    return scale * qg @ h + Aqk @ v_new


@typecheck
def naive_chunk_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "B HV K V"]]]:
    """KDA in chunks of ``chunk_size`` (any T), the same arguments and results as
    ``naive_recurrent_kda``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    qc, kc, vc, gc, bc = (
        to_chunks(x.astype(dt), chunk_size)
        for x in (expand_heads(q, HV), expand_heads(k, HV), v, g, beta)
    )
    G = jnp.cumsum(clamp_log_decay(gc), axis=-2)  # see clamp_log_decay: any gate in [-inf, 0]
    Aqk, Akk = intra_chunk(qc, kc, bc, G, scale)
    w, u, qg, kg = wy_chunk(qc, kc, vc, bc, G, Akk)
    h0 = jnp.zeros((B, HV, K, V), dt) if initial_state is None else initial_state.astype(dt)
    h, v_new, hT = state_scan(w, u, kg, G, h0)
    o = from_chunks(output_chunk(qg, h, Aqk, v_new, scale), T)
    return o.astype(v.dtype), (hT if output_final_state else None)
