"""Pallas intra-chunk family: F2 (Aqk, Akk) and B4 (intra-chunk backward).

Per (p, chunk) block, in 2-D: off-diagonal sub-blocks by anchored matmuls (anchor = first
row of the row block, both factors with non-positive exponents) in a ``fori_loop`` over the
row blocks, diagonal sub-blocks one column (or row) at a time in another, ``(I + L)^-1``
by row-wise forward substitution. Masks are applied in the exponent. The row-block loops
are loops rather than unrolled Python: unrolled, Triton kept the C x C operands of every
block alive (B4 at chunk 128 in float64 asked for 1040 KiB of shared memory) and took many
minutes to compile at chunk 128. On Triton, B4 takes a block of rows and of feature
columns at a time (``intra_bwd_rows_kernel``), as FLA's kernel does.
"""

from typing import ClassVar, Mapping, Optional

import equinox as eqx
from types import MappingProxyType
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._typing import ChunkK, ChunkMat, ChunkScalar, typecheck
from ..stages import KDA, AbstractIntra, AbstractIntraBackward, ChunkGrads, IntraOut
from .._final import final
from ._common import (
    PallasFeatureBlocks, blockwise, chunk_spec, col_of, decay, dot, flat, idiv, iota, loop, ref_or_none,
    row_of, row_or_none, tuned, unflat,
)


def _blocks(C: int, block: int):
    b = min(block, C)
    rC = iota((C, 1), 0)
    return b, C // b, rC, idiv(rC, b)


def scores_body(q, k, G, block: int, lo=None):
    """``(sum_d q_id k_jd e^(G_id-G_jd), sum_d k_id k_jd e^(G_id-G_jd))`` for j <= i in
    anchored form; entries above the diagonal are unspecified (callers mask them). ``lo``:
    G's low part (``kdax._hilo``) or None."""
    C = q.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    row, col = iota((C, C), 0), iota((C, C), 1)

    def anchored(I, S):
        Sqk, Skk = S
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        rows_in = decay(blk == I, G, Ga, lo, La)
        kc = k * decay(blk < I, Ga, G, La, lo)
        return Sqk + dot(q * rows_in, kc, tb=True), Skk + dot(k * rows_in, kc, tb=True)

    zeros = jnp.zeros((C, C), q.dtype)
    Sqk, Skk = loop(1, nb, anchored, (zeros, zeros))

    def diag(j, S):
        Sqk, Skk = S
        e = decay((rC >= j) & (blk == idiv(j, b)), G, row_of(G, j), lo, row_or_none(lo, j)) * row_of(k, j)
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


def pair_rows_body(S, b_, G, block: int, lo=None):
    """``R_id = sum_{j <= i} S_ij b_jd e^(G_id - G_jd)`` for lower-triangular ``S``
    (``lo`` as ``scores_body``)."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, R):
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        return R + decay(blk == I, G, Ga, lo, La) * dot(SI, b_ * decay(blk < I, Ga, G, La, lo))

    R = loop(1, nb, anchored, jnp.zeros(b_.shape, b_.dtype))

    def diag(j, R):
        m = (rC >= j) & (blk == idiv(j, b))
        return R + col_of(S, j) * row_of(b_, j) * decay(m, G, row_of(G, j), lo, row_or_none(lo, j))

    return loop(0, C, diag, R)


def pair_cols_body(S, a, G, block: int, lo=None):
    """``C_jd = sum_{i >= j} S_ij a_id e^(G_id - G_jd)`` for lower-triangular ``S``
    (``lo`` as ``scores_body``)."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, out):
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        return out + decay(blk < I, Ga, G, La, lo) * dot(SI, a * decay(blk == I, G, Ga, lo, La), ta=True)

    out = loop(1, nb, anchored, jnp.zeros(a.shape, a.dtype))
    St = S.T

    def diag(i, out):
        m = (rC <= i) & (blk == idiv(i, b))
        return out + col_of(St, i) * row_of(a, i) * decay(m, row_of(G, i), G, row_or_none(lo, i), lo)

    return loop(0, C, diag, out)


def intra_bwd_outputs(q, k, beta, dq_a, dk_a, r, c, dq, dk, dG):
    """B4's gradients ``(dq, dk, dG, dbeta's increment)`` from the pair sums ``dq_a``,
    ``dk_a`` (scaled), ``r``, ``c`` and the incoming ``dq``, ``dk``, ``dG``."""
    return (dq + dq_a, dk + dk_a + beta * r + c, dG + q * dq_a - k * dk_a + beta * k * r - k * c,
            jnp.sum(k * r, axis=1, keepdims=True))


def intra_bwd_rows_kernel(scale: float, block: int, C: int, blocks, has_lo: bool):
    """B4's kernel on Triton, as FLA's ``chunk_kda_bwd_intra`` takes it: one block of
    ``block`` output rows at a time (a loop), within it ``blocks`` of feature columns
    (``column_blocks``), and the other row blocks one at a time: every product is
    ``[block, block] x [block, bk]``, every value a tile of at most ``[block, bk]``. Whole
    ``[C, C]`` and ``[C, K]`` tiles took the kernel past the 255 registers a thread has at
    K = 128, spilling kilobytes. Blocks before this one are anchored at its first row,
    blocks after it at the next block's first row; the diagonal block is taken one token
    at a time."""
    b, nb = min(block, C), C // min(block, C)

    def kernel(q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, db_ref, dg_ref, *rest):
        lo_ref = rest[0] if has_lo else None
        dq_out, dk_out, db_out, dg_out = rest[-4:]
        rb = iota((b, 1), 0)

        def row_block(I, carry):
            r0 = I * b
            rs = pl.ds(r0, b)
            nxt = pl.ds(jnp.minimum(r0 + b, C - 1), 1)  # the next block's first row (unused after the last)
            beta = b_ref[rs, :]
            dA_d, dL_d = da_ref[rs, rs], dl_ref[rs, rs]
            dA_dt, dL_dt = dA_d.T, dL_d.T
            db = db_ref[rs, :]
            for k0, bk in blocks:
                cols = pl.ds(k0, bk)
                ld = lambda ref, rows: ref_or_none(ref, (rows, cols))
                q, k, G, lo = ld(q_ref, rs), ld(k_ref, rs), ld(g_ref, rs), ld(lo_ref, rs)
                Ga, La = ld(g_ref, pl.ds(r0, 1)), ld(lo_ref, pl.ds(r0, 1))
                Gn, Ln = ld(g_ref, nxt), ld(lo_ref, nxt)
                zero = jnp.zeros(q.shape, q.dtype)

                def before(J, acc):  # R_i += e^(G_i - G_a) sum_j S_ij k_j e^(G_a - G_j), j in block J < I
                    js = pl.ds(J * b, b)
                    kx = ld(k_ref, js) * decay(None, Ga, ld(g_ref, js), La, ld(lo_ref, js))
                    return acc[0] + dot(da_ref[rs, js], kx), acc[1] + dot(dl_ref[rs, js], kx)

                def after(J, acc):  # C_j += e^(G_n - G_j) sum_i S_ij a_i e^(G_i - G_n), i in block J > I
                    js = pl.ds(J * b, b)
                    out = decay(None, ld(g_ref, js), Gn, ld(lo_ref, js), Ln)
                    return (acc[0] + dot(da_ref[js, rs], ld(q_ref, js) * out, ta=True),
                            acc[1] + dot(dl_ref[js, rs], b_ref[js, :] * ld(k_ref, js) * out, ta=True))

                dq_a, r = loop(0, I, before, (zero, zero))
                into = decay(None, G, Ga, lo, La)
                dq_a, r = into * dq_a, into * r
                dk_a, c = loop(I + 1, nb, after, (zero, zero))
                back = decay(None, Gn, G, Ln, lo)
                dk_a, c = back * dk_a, back * c

                def diag(t, acc):
                    dq_a, r, dk_a, c = acc
                    row = pl.ds(r0 + t, 1)
                    Gt, Lt, kt = ld(g_ref, row), ld(lo_ref, row), ld(k_ref, row)
                    e_in = kt * decay(rb >= t, G, Gt, lo, Lt)  # token t into the block's later rows
                    e_out = decay(rb <= t, Gt, G, Lt, lo)  # token t back to the block's earlier rows
                    return (dq_a + col_of(dA_d, t) * e_in, r + col_of(dL_d, t) * e_in,
                            dk_a + col_of(dA_dt, t) * ld(q_ref, row) * e_out,
                            c + col_of(dL_dt, t) * (b_ref[row, :] * kt) * e_out)

                dq_a, r, dk_a, c = loop(0, b, diag, (dq_a, r, dk_a, c))
                at = (rs, cols)
                dq_out[at], dk_out[at], dg_out[at], ddb = intra_bwd_outputs(
                    q, k, beta, scale * dq_a, scale * dk_a, r, c, dq_ref[at], dk_ref[at], dg_ref[at])
                db = db + ddb
            db_out[rs, :] = db
            return carry

        loop(0, nb, row_block, jnp.int32(0))

    kernel.__qualname__ = "PallasIntraBackward.kernel"  # its name in profiles
    return kernel


@final
class PallasIntra(AbstractIntra, PallasFeatureBlocks):
    """F2 as a Pallas kernel over (row * head, chunk); with ``G_lo`` (``kdax._hilo``) every
    exponent is the difference of the exact sums ``G + G_lo``. On Triton the scores sum
    over ``block_k`` feature columns at a time (32: compiled for sm_90 at K = 128, 8 B of
    spills a thread at 4 warps and none at 8, against 1104 B and none with all 128)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True

    block: int = eqx.field(static=True, default=16)
    block_k: int = eqx.field(static=True, default=32)

    @tuned
    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        G_lo: Optional[ChunkK] = None,
    ) -> IntraOut:
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        ins = tuple(self.padded(x) for x in (q, k, G)) + (flat(beta),)
        if G_lo is not None:
            ins += (self.padded(G_lo),)
        Kp = ins[0].shape[-1]
        block = self.block

        blocks = self.feature_blocks(Kp)

        def kernel(*refs):
            q_ref, k_ref, g_ref, b_ref = refs[:4]
            lo_ref = refs[4] if G_lo is not None else None
            aqk_ref, akk_ref = refs[-2:]

            def feature_block(k0, bk, S):
                kc = (slice(None), pl.ds(k0, bk))
                Sqk, Skk = scores_body(q_ref[kc], k_ref[kc], g_ref[kc], block, ref_or_none(lo_ref, kc))
                return S[0] + Sqk, S[1] + Skk

            zeros = jnp.zeros((C, C), q.dtype)
            Sqk, Skk = blockwise(blocks, feature_block, (zeros, zeros))
            row, col = iota((C, C), 0), iota((C, C), 1)
            aqk_ref[...] = scale * jnp.where(col <= row, Sqk, 0.0)
            akk_ref[...] = unit_lower_inverse_body(b_ref[...] * jnp.where(col < row, Skk, 0.0))

        spec = chunk_spec((C, Kp))
        specs = [spec, spec, spec, chunk_spec((C, 1))] + ([spec] if G_lo is not None else [])
        Aqk, Akk = self.call(kernel, ins, specs, [(C, C), (C, C)], R * HV, NC, q.dtype)
        return IntraOut(unflat(Aqk, R, HV), unflat(Akk, R, HV))


@final
class PallasIntraBackward(AbstractIntraBackward, PallasFeatureBlocks):
    """B4 as a Pallas kernel over (row * head, chunk); ``G_lo`` as ``PallasIntra``. On
    Triton it takes ``block`` rows and ``block_k`` feature columns at a time
    (``intra_bwd_rows_kernel``; every gradient column depends on its own feature column
    alone, and dbeta sums over them); on TPU the whole chunk at once."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"intra": KDA})

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
        G_lo: Optional[ChunkK] = None,
    ) -> ChunkGrads:
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        qf, kf, Gf, dqf, dkf, dGf = (
            self.padded(x) for x in (q, k, G, grads.dq, grads.dk, grads.dG)
        )
        Kp = qf.shape[-1]
        block, blocks = self.block, self.feature_blocks(Kp)
        sk, sc, s1 = chunk_spec((C, Kp)), chunk_spec((C, C)), chunk_spec((C, 1))
        ins = (qf, kf, flat(beta), Gf, flat(dAqk), flat(grads.dL), dqf, dkf, flat(grads.dbeta), dGf)
        specs = [sk, sk, s1, sk, sc, sc, sk, sk, s1, sk]
        if G_lo is not None:
            ins, specs = ins + (self.padded(G_lo),), specs + [sk]

        if self.target == "triton":
            kernel = intra_bwd_rows_kernel(scale, block, C, blocks, G_lo is not None)
        else:
            def kernel(*refs):  # the whole chunk at once
                q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, db_ref, dg_ref = refs[:10]
                lo = refs[10][...] if G_lo is not None else None
                dq_out, dk_out, db_out, dg_out = refs[-4:]
                q, k, beta, G = q_ref[...], k_ref[...], b_ref[...], g_ref[...]
                dA, dL = da_ref[...], dl_ref[...]
                dq_a = scale * pair_rows_body(dA, k, G, block, lo)
                dk_a = scale * pair_cols_body(dA, q, G, block, lo)
                r = pair_rows_body(dL, k, G, block, lo)
                c = pair_cols_body(dL * beta, k, G, block, lo)
                dq_out[...], dk_out[...], dg_out[...], ddb = intra_bwd_outputs(
                    q, k, beta, dq_a, dk_a, r, c, dq_ref[...], dk_ref[...], dg_ref[...])
                db_out[...] = db_ref[...] + ddb
        dq, dk, db, dG = self.call(kernel, ins, specs, [(C, Kp), (C, Kp), (C, 1), (C, Kp)], R * HV, NC, q.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
