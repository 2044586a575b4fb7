"""Pallas intra-chunk family: F2 (Aqk, Akk) and B4 (intra-chunk backward).

F2 on Triton (``intra_levels_kernel``): no per-token loop and no row or column pulled out
of a tile. The chunk's pairs j < i are split into log2(C) halving levels (the reference
stage's recursion): the levels below 16 are the pairs inside the 16-token sub-blocks,
the others the sub-blocks' off-diagonal blocks, each level one masked tile product over
the whole chunk with each side's decay taken to the level's anchor row (both exponents
non-positive, anchors read by gather loads); ``(I + L)^-1`` by blocked substitution in
log2(C) doubling steps of two products. Whole-chunk tiles rather than 16 x 16 ones: a
16-row tile product leaves most of a program's warps holding copies (compiled for
sm_90 that layout took F2 to 255 registers and 1.9 KiB of spills a thread).

F2 on TPU and B4, per (p, chunk) block, in 2-D: off-diagonal sub-blocks by anchored
matmuls (anchor = first row of the row block, both factors with non-positive exponents)
in a ``fori_loop`` over the row blocks, diagonal sub-blocks one column (or row) at a time
in another, ``(I + L)^-1`` by row-wise forward substitution. Masks are applied in the
exponent. The row-block loops are loops rather than unrolled Python: unrolled, Triton
kept the C x C operands of every block alive (B4 at chunk 128 in float64 asked for 1040
KiB of shared memory) and took many minutes to compile at chunk 128. On Triton, B4 takes
a block of rows and of feature columns at a time (``intra_bwd_rows_kernel``), as FLA's
kernel does.
"""

from typing import ClassVar, Mapping, Optional

import equinox as eqx
from types import MappingProxyType
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import _precision
from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkValid, typecheck
from .._resets import per_head, segments
from ..stages import KDA, AbstractIntra, AbstractIntraBackward, ChunkGrads, IntraOut
from .._final import final
from ._common import (
    PallasFeatureBlocks, blockwise, chunk_spec, col_of, decay, dot, flat, idiv, iota, loop, nonfinite_rows,
    ref_or_none, row_of, row_or_none, tuned, unflat,
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


# -- F2 on Triton: the chunk's pairs as log2(C) tile products, (I + L)^-1 in 2 log2(C) ----------
def level_pairs(C: int, lev):
    """``[C, C]`` bool: the pairs (i, j) of halving level ``lev`` (traced or static; half
    size s = 2^lev): i in the upper and j in the lower half of one ``2s``-token block. Every
    pair j < i belongs to exactly one level (``kdax.stages._intra``'s halving): levels
    below log2(16) are the pairs inside the 16-token sub-blocks, the others the
    sub-blocks' off-diagonal blocks."""
    ri, cj = iota((C, C), 0), iota((C, C), 1)
    sr = jax.lax.shift_right_logical
    return (sr(ri, lev + 1) == sr(cj, lev + 1)) & (sr(ri, lev) > sr(cj, lev))


def gathered(ref, rows, cols):
    """``ref[rows, cols]`` for an int32 vector ``rows`` (a gather load: one row per
    token), or None for a missing ref."""
    return None if ref is None else ref[rows, cols]


def level_scores(q, k, g_ref, lo_ref, cols, C: int, S):
    """``S + (Sqk, Skk)`` for one block of feature columns: ``sum_d a_id k_jd e^(G_id - G_jd)``
    (a = q, k) for j <= i (zeros above the diagonal), ``G``'s columns ``cols`` read from
    ``g_ref`` (``lo_ref``: its low part, or None). The diagonal is a row sum; the pairs of
    each halving level (``level_pairs``) one tile product, each side's decay taken to the
    anchor a = the first row of i's half-block, ``(a_i e^(G_i - G_a)) . (k_j e^(G_a - G_j))``,
    both exponents non-positive; the anchors are gather loads. A token that a level does
    not use as a column is anchored at the next half-block's first row (clamped to the
    chunk), so every exponent is non-positive; the products' entries outside the level are
    selected away (a non-finite value there reaches nothing)."""
    G, lo = g_ref[:, cols], ref_or_none(lo_ref, (slice(None), cols))
    ri, cj = iota((C, C), 0), iota((C, C), 1)
    t = iota((C,), 0)
    Sqk = S[0] + jnp.where(ri == cj, jnp.sum(q * k, axis=1, keepdims=True), 0.0)

    def level(lev, S):
        ra = jax.lax.shift_left(jax.lax.shift_right_logical(t, lev), lev)  # first row of each token's half-block
        ca = jnp.minimum(ra + jax.lax.shift_left(jnp.int32(1), lev), C - 1)  # the next one's
        rf = decay(None, G, gathered(g_ref, ra, cols), lo, gathered(lo_ref, ra, cols))
        kc = k * decay(None, gathered(g_ref, ca, cols), G, gathered(lo_ref, ca, cols), lo)
        pairs = level_pairs(C, lev)
        return (S[0] + jnp.where(pairs, dot(q * rf, kc, tb=True), 0.0),
                S[1] + jnp.where(pairs, dot(k * rf, kc, tb=True), 0.0))

    return loop(0, C.bit_length() - 1, level, (Sqk, S[1]))


def doubling_unit_lower_inverse(L):
    """``(I + L)^-1`` for strictly lower ``L [C, C]`` with finite entries, by blocked
    substitution in log2(C) doubling steps of two products each: ``X <- X - X (B X)``,
    ``B`` the pairs of one halving level (``level_pairs``), takes the inverses of the
    s-token diagonal blocks to those of the 2s-token ones (``[[A, 0], [B, D]]^-1 =
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``). Every intermediate is a principal block of the
    result, as in the reference stage's recursion; entries above the diagonal stay exact
    zeros."""
    C = L.shape[0]
    eye = (iota((C, C), 0) == iota((C, C), 1)).astype(L.dtype)
    return loop(0, C.bit_length() - 1, lambda lev, X: X - dot(X, dot(jnp.where(level_pairs(C, lev), L, 0.0), X)), eye)


def intra_levels_kernel(scale: float, C: int, blocks, has_lo: bool, has_reset: bool):
    """F2's kernel on Triton: every score and every step of ``(I + L)^-1`` a tile product
    over the whole chunk, no per-token loop and no row or column pulled out of a tile.
    Scores: ``level_scores`` (log2(C) products per output, summed over ``blocks`` of
    feature columns); ``(I + L)^-1``: ``doubling_unit_lower_inverse`` under float32
    products (``_precision.float32_products``). With ``has_reset`` (shared chunks) pairs
    across sequences are selected to exact zeros in both outputs (``L`` is then
    block-diagonal by sequence, and so is its inverse, exactly). A non-finite entry of
    ``L`` in row t (a NaN in token t's k, beta or G) makes ``Akk``'s rows t on NaN, every
    column, and reaches no earlier row: the inverse runs on ``L`` with non-finite entries
    zeroed, those rows are set after (``lower_dot``'s way)."""

    def kernel(*refs):
        q_ref, k_ref, g_ref, b_ref = refs[:4]
        rest = refs[4:-2]
        lo_ref = rest[0] if has_lo else None
        aqk_ref, akk_ref = refs[-2:]

        def feature_block(k0, bk, S):
            cols = (slice(None), pl.ds(k0, bk))
            return level_scores(q_ref[cols], k_ref[cols], g_ref, lo_ref, cols[1], C, S)

        zeros = jnp.zeros((C, C), aqk_ref.dtype)
        Sqk, Skk = blockwise(blocks, feature_block, (zeros, zeros))
        row, col = iota((C, C), 0), iota((C, C), 1)
        lower, strict = col <= row, col < row
        if has_reset:
            same = rest[-2][...] == rest[-1][...]
            lower, strict = lower & same, strict & same
        aqk_ref[...] = scale * jnp.where(lower, Sqk, 0.0)
        L = jnp.where(strict, b_ref[...] * Skk, 0.0)
        seen = jax.lax.cumsum(nonfinite_rows(L), axis=0)  # > 0 from the first non-finite row on
        with _precision.float32_products():
            A = doubling_unit_lower_inverse(jnp.where(jnp.abs(L) < jnp.inf, L, 0.0))
        akk_ref[...] = jnp.where(seen > 0, jnp.nan, A)

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


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
    exponent is the difference of the exact sums ``G + G_lo``; with ``reset`` (shared
    chunks, ``kdax._resets``) pairs across sequences are exact zeros. On Triton
    (``intra_blocks_kernel``) the chunk is taken as ``block``-token sub-blocks, every score
    block and every step of ``(I + L)^-1`` a tile product, summing over ``block_k`` feature
    columns at a time; on TPU the whole chunk at once (``scores_body``,
    ``unit_lower_inverse_body``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

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
        reset: Optional[ChunkValid] = None,
    ) -> IntraOut:
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        ins = tuple(self.padded(x) for x in (q, k, G)) + (flat(beta),)
        spec = chunk_spec((C, ins[0].shape[-1]))
        specs = [spec, spec, spec, chunk_spec((C, 1))]
        if G_lo is not None:
            ins, specs = ins + (self.padded(G_lo),), specs + [spec]
        if reset is not None:  # each token's sequence within its chunk, as a column and as a row
            seg = flat(per_head(segments(reset), HV))
            ins += (seg, seg.reshape(seg.shape[0], NC, 1, C))
            specs += [chunk_spec((C, 1)), chunk_spec((1, C))]
        blocks = self.feature_blocks(ins[0].shape[-1])
        if self.target == "triton":
            kernel = intra_levels_kernel(scale, C, blocks, G_lo is not None, reset is not None)
        else:
            kernel = intra_chunk_kernel(scale, C, self.block, blocks, G_lo is not None, reset is not None)
        Aqk, Akk = self.call(kernel, ins, specs, [(C, C), (C, C)], R * HV, NC, q.dtype)
        return IntraOut(unflat(Aqk, R, HV), unflat(Akk, R, HV))


def intra_chunk_kernel(scale: float, C: int, block: int, blocks, has_lo: bool, has_reset: bool):
    """F2's kernel on TPU: the whole chunk at once, anchored products over row blocks and
    the diagonal blocks one column at a time (``scores_body``), ``(I + L)^-1`` row by row
    (``unit_lower_inverse_body``)."""

    def kernel(*refs):
        q_ref, k_ref, g_ref, b_ref = refs[:4]
        rest = refs[4:-2]
        lo_ref = rest[0] if has_lo else None
        aqk_ref, akk_ref = refs[-2:]

        def feature_block(k0, bk, S):
            kc = (slice(None), pl.ds(k0, bk))
            Sqk, Skk = scores_body(q_ref[kc], k_ref[kc], g_ref[kc], block, ref_or_none(lo_ref, kc))
            return S[0] + Sqk, S[1] + Skk

        zeros = jnp.zeros((C, C), aqk_ref.dtype)
        Sqk, Skk = blockwise(blocks, feature_block, (zeros, zeros))
        row, col = iota((C, C), 0), iota((C, C), 1)
        lower, strict = col <= row, col < row
        if has_reset:
            same = rest[-2][...] == rest[-1][...]
            lower, strict = lower & same, strict & same
        aqk_ref[...] = scale * jnp.where(lower, Sqk, 0.0)
        akk_ref[...] = unit_lower_inverse_body(jnp.where(strict, b_ref[...] * Skk, 0.0))

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


@final
class PallasIntraBackward(AbstractIntraBackward, PallasFeatureBlocks):
    """B4 as a Pallas kernel over (row * head, chunk); ``G_lo`` as ``PallasIntra``. On
    Triton it takes ``block`` rows and ``block_k`` feature columns at a time
    (``intra_bwd_rows_kernel``; every gradient column depends on its own feature column
    alone, and dbeta sums over them); on TPU the whole chunk at once."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"intra": KDA})
    accepts: ClassVar[frozenset] = frozenset({"G_lo"})

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
