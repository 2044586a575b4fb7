"""Intra-chunk family: F2 (Aqk, Akk = (I + L)^-1) and B4 (their backward).

Every product here has the form ``sum_d a_id b_jd exp(G_id - G_jd)`` for j <= i. Forming
the pairwise ``[C, C, K]`` decay over a whole chunk is slow, and factoring it as
``exp(G_i) exp(-G_j)`` overflows. Instead the chunk is cut into sub-blocks of ``block``
rows: for a row block I and an earlier column block J the decay is split at the anchor
``a`` = first row of I, ``exp(G_i - G_a) * exp(G_a - G_j)``, both factors with
non-positive exponents, and the sum becomes a matmul; only the diagonal sub-blocks use
the pairwise form (``[block, block, K]``). Masks are applied in the exponent.
"""

import abc
from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkScalar, typecheck
from ._ops import tri_mask
from ._types import ChunkGrads, IntraOut


class AnchoredDecay(NamedTuple):
    """``Gb [..., nb, b, K]``: G cut into row blocks. ``rows [..., nb, b, K]``:
    exp(G_i - G_a(I)). ``cross [..., nb, nb, b, K]``: exp(G_a(I) - G_j) for column blocks
    J < I, else 0."""

    Gb: jax.Array
    rows: jax.Array
    cross: jax.Array


def _split(x, nb: int):
    return x.reshape(*x.shape[:-2], nb, x.shape[-2] // nb, x.shape[-1])


def _merge(x):
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def anchored_decay(G, block: int) -> AnchoredDecay:
    C = G.shape[-2]
    b = min(block, C)
    nb = C // b
    Gb = _split(G, nb)
    Ga = Gb[..., :, 0, :]
    rows = jnp.exp(Gb - Ga[..., :, None, :])
    blk = jnp.arange(nb)
    before = (blk[None, :] < blk[:, None])[:, :, None, None]
    cross = jnp.exp(jnp.where(before, Ga[..., :, None, None, :] - Gb[..., None, :, :, :], -jnp.inf))
    return AnchoredDecay(Gb, rows, cross)


def _decay_from(Gb, j: int):
    """``exp(G_i - G_j)`` for rows i >= j of each diagonal block, else 0: ``[..., nb, b, K]``."""
    later = (jnp.arange(Gb.shape[-2]) >= j)[:, None]
    return jnp.exp(jnp.where(later, Gb - Gb[..., j : j + 1, :], -jnp.inf))


def _decay_to(Gb, i: int):
    """``exp(G_i - G_j)`` for columns j <= i of each diagonal block, else 0."""
    earlier = (jnp.arange(Gb.shape[-2]) <= i)[:, None]
    return jnp.exp(jnp.where(earlier, Gb[..., i : i + 1, :] - Gb, -jnp.inf))


def _to_blocks(S, nb: int):
    """``[..., C, C] -> [..., I, J, i, j]``."""
    b = S.shape[-1] // nb
    S = S.reshape(*S.shape[:-2], nb, b, nb, b)
    return jnp.swapaxes(S, -3, -2)


def _diag_blocks(Sb):
    """``[..., I, J, i, j] -> [..., I, i, j]`` (J == I)."""
    return jnp.moveaxis(jnp.diagonal(Sb, axis1=-4, axis2=-3), -1, -3)


def intra_scores(q, k, dec: AnchoredDecay):
    """Both products F2 needs, sharing one decay: ``(sum_d q_id k_jd e^(G_id - G_jd))``
    for j <= i and ``(sum_d k_id k_jd e^(G_id - G_jd))`` for j < i, zeros elsewhere."""
    nb, bs = dec.rows.shape[-3], dec.rows.shape[-2]
    qb, kb = _split(q, nb), _split(k, nb)
    kc = kb[..., None, :, :, :] * dec.cross
    off_q = jnp.einsum("...Iik,...IJjk->...IJij", qb * dec.rows, kc)
    off_k = jnp.einsum("...Iik,...IJjk->...IJij", kb * dec.rows, kc)
    pair = jnp.exp(jnp.where(tri_mask(bs, strict=False)[:, :, None], dec.Gb[..., :, None, :] - dec.Gb[..., None, :, :], -jnp.inf))
    kp = kb[..., None, :, :] * pair  # [..., nb, i, j, K]: only b x b x K per diagonal block
    d_q = jnp.einsum("...ik,...ijk->...ij", qb, kp)
    d_k = jnp.where(tri_mask(bs, strict=True), jnp.einsum("...ik,...ijk->...ij", kb, kp), 0.0)
    same = jnp.eye(nb, dtype=bool)[:, :, None, None]

    def assemble(d, off):
        S = jnp.swapaxes(jnp.where(same, d[..., :, None, :, :], off), -3, -2)
        return S.reshape(*S.shape[:-4], nb * bs, nb * bs)

    return assemble(d_q, off_q), assemble(d_k, off_k)


def pair_rows(S, b, dec: AnchoredDecay):
    """``R_id = sum_{j <= i} S_ij b_jd exp(G_id - G_jd)`` for lower-triangular ``S``."""
    nb, bs = dec.rows.shape[-3], dec.rows.shape[-2]
    Sb, bb = _to_blocks(S, nb), _split(b, nb)
    off = jnp.einsum("...IJij,...IJjk->...Iik", Sb, bb[..., None, :, :, :] * dec.cross) * dec.rows
    Sd = _diag_blocks(Sb)
    # Diagonal blocks as a sum over columns: elementwise work that XLA fuses in one loop.
    d = sum(Sd[..., :, j, None] * bb[..., j, None, :] * _decay_from(dec.Gb, j) for j in range(bs))
    return _merge(off + d)


def pair_cols(S, a, dec: AnchoredDecay):
    """``C_jd = sum_{i >= j} S_ij a_id exp(G_id - G_jd)`` for lower-triangular ``S``."""
    nb, bs = dec.rows.shape[-3], dec.rows.shape[-2]
    Sb, ab = _to_blocks(S, nb), _split(a, nb)
    part = jnp.einsum("...IJij,...Iik->...IJjk", Sb, ab * dec.rows)
    off = sum(part[..., I, :, :, :] * dec.cross[..., I, :, :, :] for I in range(nb))
    Sd = _diag_blocks(Sb)
    d = sum(Sd[..., i, :, None] * ab[..., i, None, :] * _decay_to(dec.Gb, i) for i in range(bs))
    return _merge(off + d)


def unit_lower_inverse(L):
    """``(I + L)^-1`` for strictly lower ``L [..., C, C]``."""
    eye = jnp.eye(L.shape[-1], dtype=L.dtype)
    return jax.scipy.linalg.solve_triangular(
        eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True
    )


class AbstractIntra(eqx.Module):
    """F2: ``Aqk`` and ``Akk`` from the activated q, k, beta and G."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
    ) -> IntraOut:
        raise NotImplementedError


class ReferenceIntra(AbstractIntra):
    """F2 in jnp with anchored sub-blocks of ``block`` rows."""

    block: int = eqx.field(static=True, default=8)

    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
    ) -> IntraOut:
        qk, kk = intra_scores(q, k, anchored_decay(G, self.block))
        return IntraOut(scale * qk, unit_lower_inverse(beta[..., :, None] * kk))


class AbstractIntraBackward(eqx.Module):
    """B4: the intra-chunk parts of dq, dk, dbeta, dG from ``dAqk`` and ``dL``, added to
    the inter-chunk gradients ``grads`` coming from B3."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        dAqk: ChunkMat,
        grads: ChunkGrads,
    ) -> ChunkGrads:
        raise NotImplementedError


class ReferenceIntraBackward(AbstractIntraBackward):
    """B4 in jnp with the same anchored sub-blocks as ``ReferenceIntra``, ``heads_per_step``
    value heads at a time (None: all at once; fewer lowers peak memory; 4 was fastest and leanest at HV=8 on CPU)."""

    block: int = eqx.field(static=True, default=8)
    heads_per_step: Optional[int] = eqx.field(static=True, default=4)

    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        dAqk: ChunkMat,
        grads: ChunkGrads,
    ) -> ChunkGrads:
        def per_head(xs):
            q, k, beta, G, dAqk, dL = xs
            dec = anchored_decay(G, self.block)
            # Aqk = scale * sum_d q_i k_j e^(G_i - G_j)
            dq_a = scale * pair_rows(dAqk, k, dec)
            dk_a = scale * pair_cols(dAqk, q, dec)
            # L = beta_i * sum_d k_i k_j e^(G_i - G_j): row side carries beta_i
            r = pair_rows(dL, k, dec)
            c = pair_cols(dL * beta[..., :, None], k, dec)
            dk = dk_a + beta[..., None] * r + c
            dbeta = jnp.sum(k * r, axis=-1)
            dG = q * dq_a - k * dk_a + beta[..., None] * k * r - k * c
            return dq_a, dk, dbeta, dG

        xs = (q, k, beta, G, dAqk, grads.dL)
        if self.heads_per_step is None or self.heads_per_step >= q.shape[1]:
            dq_a, dk_i, dbeta_i, dG_i = per_head(xs)
        else:
            # The anchored decays are [R, NC, C/b, C, K] per head: a few heads at a time
            # keeps them from setting the peak memory of the whole backward (slower).
            heads_first = lambda x: jnp.moveaxis(x, 1, 0)
            outs = jax.lax.map(per_head, tuple(map(heads_first, xs)), batch_size=self.heads_per_step)
            dq_a, dk_i, dbeta_i, dG_i = (jnp.moveaxis(x, 0, 1) for x in outs)
        dq = grads.dq + dq_a
        dk = grads.dk + dk_i
        dbeta = grads.dbeta + dbeta_i
        dG = grads.dG + dG_i
        return ChunkGrads(dq, dk, grads.dv, dbeta, dG, None)
