"""Pallas intra-chunk family: F2 (Aqk, Akk) and B4 (intra-chunk backward).

Per (p, chunk) block, in 2-D: off-diagonal sub-blocks by anchored matmuls (anchor = first
row of the row block, both factors with non-positive exponents) in a ``fori_loop`` over the
row blocks, diagonal sub-blocks one column (or row) at a time in another, ``(I + L)^-1``
by row-wise forward substitution. Masks are applied in the exponent. The row-block loops
are loops rather than unrolled Python: unrolled, Triton kept the C x C operands of every
block alive (B4 at chunk 128 in float64 asked for 1040 KiB of shared memory) and took many
minutes to compile at chunk 128.
"""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkScalar, typecheck
from ..stages import AbstractIntra, AbstractIntraBackward, ChunkGrads, IntraOut
from .._final import final
from ._common import (
    PallasTarget, chunk_spec, col_of, dot, flat, idiv, iota, loop, masked_exp,
    row_of, tuned, unflat,
)


def _blocks(C: int, block: int):
    b = min(block, C)
    rC = iota((C, 1), 0)
    return b, C // b, rC, idiv(rC, b)


def scores_body(q, k, G, block: int):
    """``(sum_d q_id k_jd e^(G_id-G_jd), sum_d k_id k_jd e^(G_id-G_jd))`` for j <= i in
    anchored form; entries above the diagonal are unspecified (callers mask them)."""
    C = q.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    row, col = iota((C, C), 0), iota((C, C), 1)

    def anchored(I, S):
        Sqk, Skk = S
        Ga = row_of(G, I * b)
        rows_in = masked_exp(blk == I, G - Ga)
        kc = k * masked_exp(blk < I, Ga - G)
        return Sqk + dot(q * rows_in, kc, tb=True), Skk + dot(k * rows_in, kc, tb=True)

    zeros = jnp.zeros((C, C), q.dtype)
    Sqk, Skk = loop(1, nb, anchored, (zeros, zeros))

    def diag(j, S):
        Sqk, Skk = S
        e = masked_exp((rC >= j) & (blk == idiv(j, b)), G - row_of(G, j)) * row_of(k, j)
        sel = (col == j) & (idiv(row, b) == idiv(j, b))
        return (jnp.where(sel, jnp.sum(q * e, axis=1, keepdims=True), Sqk),
                jnp.where(sel, jnp.sum(k * e, axis=1, keepdims=True), Skk))

    return loop(0, C, diag, (Sqk, Skk))


def unit_lower_inverse_body(L):
    """``(I + L)^-1`` for strictly lower ``L [C, C]``, one row at a time."""
    C = L.shape[0]
    row, col = iota((C, C), 0), iota((C, C), 1)
    eye = (row == col).astype(L.dtype)
    Lt = L.T

    def step(i, A):
        new = (iota((1, C), 1) == i).astype(A.dtype) - jnp.sum(col_of(Lt, i) * A, axis=0, keepdims=True)
        return jnp.where(row == i, new, A)

    return loop(1, C, step, eye)


def pair_rows_body(S, b_, G, block: int):
    """``R_id = sum_{j <= i} S_ij b_jd e^(G_id - G_jd)`` for lower-triangular ``S``."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, R):
        Ga = row_of(G, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        return R + masked_exp(blk == I, G - Ga) * dot(SI, b_ * masked_exp(blk < I, Ga - G))

    R = loop(1, nb, anchored, jnp.zeros(b_.shape, b_.dtype))

    def diag(j, R):
        m = (rC >= j) & (blk == idiv(j, b))
        return R + col_of(S, j) * row_of(b_, j) * masked_exp(m, G - row_of(G, j))

    return loop(0, C, diag, R)


def pair_cols_body(S, a, G, block: int):
    """``C_jd = sum_{i >= j} S_ij a_id e^(G_id - G_jd)`` for lower-triangular ``S``."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, out):
        Ga = row_of(G, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        return out + masked_exp(blk < I, Ga - G) * dot(SI, a * masked_exp(blk == I, G - Ga), ta=True)

    out = loop(1, nb, anchored, jnp.zeros(a.shape, a.dtype))
    St = S.T

    def diag(i, out):
        m = (rC <= i) & (blk == idiv(i, b))
        return out + col_of(St, i) * row_of(a, i) * masked_exp(m, row_of(G, i) - G)

    return loop(0, C, diag, out)


@final
class PallasIntra(AbstractIntra, PallasTarget):
    """F2 as a Pallas kernel over (row * head, chunk)."""

    tile_safe: ClassVar[bool] = True

    block: int = eqx.field(static=True, default=16)

    @tuned
    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
    ) -> IntraOut:
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        qf, kf, Gf = (self.padded(x) for x in (q, k, G))
        bf = flat(beta)
        Kp = qf.shape[-1]
        block = self.block

        def kernel(q_ref, k_ref, b_ref, g_ref, aqk_ref, akk_ref):
            Sqk, Skk = scores_body(q_ref[...], k_ref[...], g_ref[...], block)
            row, col = iota((C, C), 0), iota((C, C), 1)
            aqk_ref[...] = scale * jnp.where(col <= row, Sqk, 0.0)
            akk_ref[...] = unit_lower_inverse_body(b_ref[...] * jnp.where(col < row, Skk, 0.0))

        spec = chunk_spec((C, Kp))
        Aqk, Akk = self.call(kernel, (qf, kf, bf, Gf), [spec, spec, chunk_spec((C, 1)), spec],
                             [(C, C), (C, C)], R * HV, NC, q.dtype)
        return IntraOut(unflat(Aqk, R, HV), unflat(Akk, R, HV))


@final
class PallasIntraBackward(AbstractIntraBackward, PallasTarget):
    """B4 as a Pallas kernel over (row * head, chunk)."""

    block: int = eqx.field(static=True, default=16)

    @tuned
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
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        qf, kf, Gf, dqf, dkf, dGf = (
            self.padded(x) for x in (q, k, G, grads.dq, grads.dk, grads.dG)
        )
        Kp = qf.shape[-1]
        block = self.block

        def kernel(q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, db_ref, dg_ref,
                   dq_out, dk_out, db_out, dg_out):
            q, k, beta, G = q_ref[...], k_ref[...], b_ref[...], g_ref[...]
            dA, dL = da_ref[...], dl_ref[...]
            dq_a = scale * pair_rows_body(dA, k, G, block)
            dk_a = scale * pair_cols_body(dA, q, G, block)
            r = pair_rows_body(dL, k, G, block)
            c = pair_cols_body(dL * beta, k, G, block)
            dq_out[...] = dq_ref[...] + dq_a
            dk_out[...] = dk_ref[...] + dk_a + beta * r + c
            db_out[...] = db_ref[...] + jnp.sum(k * r, axis=1, keepdims=True)
            dg_out[...] = dg_ref[...] + q * dq_a - k * dk_a + beta * k * r - k * c

        sk, sc, s1 = chunk_spec((C, Kp)), chunk_spec((C, C)), chunk_spec((C, 1))
        dq, dk, db, dG = self.call(
            kernel, (qf, kf, flat(beta), Gf, flat(dAqk), flat(grads.dL), dqf, dkf, flat(grads.dbeta), dGf),
            [sk, sk, s1, sk, sc, sc, sk, sk, s1, sk], [(C, Kp), (C, Kp), (C, 1), (C, Kp)],
            R * HV, NC, q.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
