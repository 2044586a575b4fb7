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

B4 on Triton (``intra_bwd_levels_kernel``), F2's VJP at the same granularity: per halving
level the transposes of F2's level products, ``[C, C] x [C, block]`` tile products of the
level's masked dA and dL with the token side's anchored decays, in two loops over the
levels (the column sums', then the row sums'); one program per (row * head, chunk, block
of at most 32 feature columns).

F2 on TPU and B4 on TPU, per (p, chunk) block, in 2-D: off-diagonal sub-blocks by
anchored matmuls (anchor = first row of the row block, both factors with non-positive
exponents) in a ``fori_loop`` over the row blocks, diagonal sub-blocks one column (or
row) at a time in another, ``(I + L)^-1`` by row-wise forward substitution. Masks are
applied in the exponent. The row-block loops are loops rather than unrolled Python:
unrolled, Triton kept the C x C operands of every block alive (B4 at chunk 128 in float64
asked for 1040 KiB of shared memory) and took many minutes to compile at chunk 128.
"""

from typing import ClassVar, Mapping, Optional

import equinox as eqx
from types import MappingProxyType
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import _precision
from .._hilo import exponent
from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkValid, typecheck
from .._resets import per_head, segments
from ..stages import KDA, AbstractIntra, AbstractIntraBackward, ChunkGrads, IntraOut
from .._final import final
from ._common import (
    PallasFeatureBlocks, blockwise, chunk_spec, col_of, decay, dot, flat, idiv, iota, loop, nonfinite_rows,
    ref_or_none, row_of, row_or_none, tuned, unflat,
)
from ._common import _TUNING, column_blocks, compiler_params, kernel_name, manual_inputs


def _f2_refs(refs, has_lo: bool, has_reset: bool):
    """F2's kernel refs: ``(q, k, g, beta, G_lo or None, the reset table's two segment
    operands or None, Aqk out, Akk out)``."""
    lo_ref = refs[4] if has_lo else None
    seg = tuple(refs[-4:-2]) if has_reset else None
    return (*refs[:4], lo_ref, seg, *refs[-2:])


def _aqk_and_l(blocks, feature_block, C: int, scale: float, seg, aqk_ref, b_ref):
    """F2's tail on both targets: the scores summed over the feature blocks
    (``feature_block(k0, bk, (Sqk, Skk))``), ``Aqk`` written (lower triangle with the
    diagonal; with ``seg`` pairs across sequences exact zeros) and ``L`` returned (strictly
    lower, times beta, the same zeros)."""
    zeros = jnp.zeros((C, C), aqk_ref.dtype)
    Sqk, Skk = blockwise(blocks, feature_block, (zeros, zeros))
    row, col = iota((C, C), 0), iota((C, C), 1)
    lower, strict = col <= row, col < row
    if seg is not None:
        same = seg[0][...] == seg[1][...]
        lower, strict = lower & same, strict & same
    aqk_ref[...] = scale * jnp.where(lower, Sqk, 0.0)
    return jnp.where(strict, b_ref[...] * Skk, 0.0)


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
        q_ref, k_ref, g_ref, b_ref, lo_ref, seg, aqk_ref, akk_ref = _f2_refs(refs, has_lo, has_reset)

        def feature_block(k0, bk, S):
            cols = (slice(None), pl.ds(k0, bk))
            return level_scores(q_ref[cols], k_ref[cols], g_ref, lo_ref, cols[1], C, S)

        L = _aqk_and_l(blocks, feature_block, C, scale, seg, aqk_ref, b_ref)
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


def finite_or_zero(x):
    """``x`` with its non-finite entries replaced by exact zeros."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, 0.0)


def nonfinite(x):
    """1 where an entry of ``x`` is NaN or infinite, else 0 (x's dtype)."""
    return (~(jnp.abs(x) < jnp.inf)).astype(x.dtype)


def reached_down(bad):
    """``[C, D]`` bool: entry (i, d) has a nonzero ``bad`` at some row t <= i of column d."""
    return jax.lax.cumsum(bad, axis=0) > 0


def reached_up(bad):
    """``[C, D]`` bool: entry (j, d) has a nonzero ``bad`` at some row t >= j of column d
    (a forward cumsum: the counts are small integers, exact)."""
    return jnp.sum(bad, axis=0, keepdims=True) - jax.lax.cumsum(bad, axis=0) + bad > 0


def fast_decay(x, y, x_lo=None, y_lo=None):
    """``decay`` (no mask) as ``2^(log2(e) (x - y))``: on the GPU an ``ex2`` and a multiply
    (``__nv_exp2f``) where ``exp`` takes a range reduction of several instructions (B4's
    instructions -11%); the exponent's rounding adds a relative error of about
    ``eps |x - y|`` (exponents here are differences inside one chunk, non-positive)."""
    return jnp.exp2(exponent(x, y, x_lo, y_lo) * 1.4426950408889634)


def scaled_dot(f, a, b, ta: bool = False):
    """``f * (op(a) @ b)`` (``dot``). Compiled under the ``"tf32x3"`` tuning, as the three
    TF32 products of the split ``x = hi(x) + lo(x)`` (``hi``: x's top 19 bits, exact in
    TF32), each scaled by ``f`` before the sum: Triton's own TF32x3 chains its three
    products through the accumulator, and a product that feeds another one gets its
    warps laid along the rows (``warpsPerCTA = [8, 1]``), which at 64 rows and eight warps
    holds every accumulator twice (B4 at 255 registers and 1.2 KiB of spills); unchained,
    each product is laid as a lone one."""
    tuning = _TUNING.get()
    if tuning is None or tuning.f32_dot != "tf32x3" or a.dtype != jnp.float32 or _precision.operand_dtype() is not None:
        return f * dot(a, b, ta=ta)

    def hi(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-8192)  # the low 13 mantissa bits cleared
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    dims = (((0 if ta else 1,), (0,)), ((), ()))
    def tf32(x, y):
        return jax.lax.dot_general(x, y, dims, precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
                                   preferred_element_type=jnp.float32)

    ah, bh = hi(a), hi(b)
    return f * tf32(ah, bh) + f * tf32(ah, b - bh) + f * tf32(a - ah, bh)  # (hi(a) dead before lo(a))


class Rows:
    """A ref whose reads take the rows ``rows`` (a ``pl.ds``) in place of the full row
    range (``ref[...]``, ``ref[:, cols]``); other indexings (gathers) as they are."""

    def __init__(self, ref, rows):
        self.ref, self.rows = ref, rows

    def __getitem__(self, idx):
        if idx is Ellipsis:
            idx = (slice(None), slice(None))
        if isinstance(idx[0], slice) and idx[0] == slice(None):
            idx = (self.rows,) + tuple(idx[1:])
        return self.ref[idx]


# The most feature columns one program of B4's Triton kernel takes (``block_k`` above it
# is cut to this): at 64 columns and eight warps the kernel spilled (64 B a thread at the
# candidate tuning, sm_90; with the 64 columns as two 32-column sums sharing each level's
# [C, C] operands, 664 B). The cost: each 32-column program repeats the levels' [C, C]
# work (the masked dA and dL, split for TF32x3), about 5k of its 11.5k instructions a warp.
B4_MAX_BLOCK = 32


def level_pair_sums(scale: float, refs, cols, pick, C: int, width: int):
    """B4's pair sums ``(dq_a, r, e)`` for the feature columns ``cols`` (each ``[C, width]``),
    the transposes of F2's level products (``level_scores``): for each halving level
    (``level_pairs``) the level's entries of ``dA`` and ``dL`` (``pick(ref, pairs, at)``:
    selected, never multiplied by a mask) in ``[C, C] x [C, w]`` tile products, each
    side's decay taken to the level's anchor a as in F2:

    - rows: ``R_i += e^(G_i - G_a) sum_j S_ij (k_j e^(G_a - G_j))`` (S = dA: dq_a; S = dL: r);
    - columns: ``e_j += e^(G_a - G_j) sum_i (scale dA_ij q_i + dL_ij beta_i k_i) e^(G_i - G_a)``
      (the reference's ``scale dk_a + c``: both products into one tile), ``S^T`` read
      transposed from memory (a gather load).

    Two loops over the levels, the column sums' then the row sums' (one loop with all
    four products spilled). ``refs``: ``(q, k, beta, G, G_lo or None, dA, dL)``. Every exponent is
    non-positive (``level_scores``' anchors). The products' token-side operands have
    their non-finite entries zeroed (a ``0 * NaN`` in a product would carry a non-finite
    token to every row of the chunk); the caller restores the rows they reach. Non-finite
    entries of ``dA``, ``dL`` reach their rows and columns as in the reference."""
    t = iota((C,), 0)
    sr = jax.lax.shift_right_logical

    def level_operands(lev):
        # Rows 0..C-1 from a start Triton cannot prove constant (it is 0), so that it keeps
        # the loads inside the loop: hoisted, every operand stayed live across the levels.
        z = jnp.minimum(lev, 0)
        ri, cj = iota((C, 1), 0), iota((1, C), 1)  # (from vectors: no [C, C] index tiles live)
        pairs = (sr(ri, lev + 1) == sr(cj, lev + 1)) & (sr(ri, lev) > sr(cj, lev))
        pairs_t = (sr(ri, lev + 1) == sr(cj, lev + 1)) & (sr(ri, lev) < sr(cj, lev))
        S = lambda w: pick(refs[w], pairs, (pl.ds(z, C), slice(None)))  # noqa: E731
        St = lambda w: pick(refs[w], pairs_t, (cj + z, ri))  # S^T (a gather load)  # noqa: E731
        return z, S, St

    def token_operands(lev, z):
        at = (pl.ds(z, C), cols)
        q_ref, k_ref, b_ref, g_ref, lo_ref = (None if x is None else Rows(x, at[0]) for x in refs[:5])
        ra = jax.lax.shift_left(sr(t, lev), lev)  # first row of each token's half-block
        ca = jnp.minimum(ra + jax.lax.shift_left(jnp.int32(1), lev), C - 1)  # the next one's
        G, lo = g_ref[at], ref_or_none(lo_ref, at)
        into = fast_decay(G, gathered(g_ref, ra, cols), lo, gathered(lo_ref, ra, cols))  # e^(G_i - G_a)
        back = fast_decay(gathered(g_ref, ca, cols), G, gathered(lo_ref, ca, cols), lo)  # e^(G_a - G_j)
        return q_ref[at], k_ref[at], b_ref[pl.ds(z, C), :], into, back

    def columns(lev, e):
        z, _, St = level_operands(lev)
        q, k, beta, into, back = token_operands(lev, z)
        qx, bx = finite_or_zero(scale * q * into), finite_or_zero(beta * k * into)
        return e + scaled_dot(back, St(5), qx) + scaled_dot(back, St(6), bx)

    def rows(lev, acc):
        z, S, _ = level_operands(lev)
        _, k, _, into, back = token_operands(lev, z)
        kx = finite_or_zero(k * back)
        return acc[0] + scaled_dot(into, S(5), kx), acc[1] + scaled_dot(into, S(6), kx)

    n = C.bit_length() - 1
    zero = jnp.zeros((C, width), refs[0].dtype)
    e = loop(0, n, columns, zero)  # (one tile live across the row sums' loop)
    dq_a, r = loop(0, n, rows, (zero, zero))
    return dq_a, r, e


def intra_bwd_levels_kernel(scale: float, C: int, has_lo: bool, has_reset: bool):
    """B4's kernel on Triton, the VJP of ``intra_levels_kernel`` at its granularity: no
    per-token loop and no row or column pulled out of a tile. One program per (row * head,
    chunk, block of feature columns), as FLA's ``chunk_kda_bwd_intra`` (every gradient
    column depends on its own feature column alone; dbeta's part of each block is summed
    outside; ``B4_MAX_BLOCK``): the diagonal terms (the diagonals of ``dA``, ``dL`` as
    row sums) and ``level_pair_sums``, log2(C) levels of four tile products into three
    tiles; pairs above the diagonal (and, with
    ``has_reset``, across sequences) are selected to exact zeros. A non-finite token value
    (q, k, beta, G, G_lo at token t, column d) reaches what it reaches in the reference
    stage's products: the row sums' rows t on and the column sums' rows up to t, in
    column d (set to NaN after the products, which ran on zeroed operands); dbeta from
    those rows."""

    def kernel(*refs):
        q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, dg_ref = refs[:9]
        rest = refs[9:-4]
        lo_ref = rest[0] if has_lo else None
        dq_out, dk_out, db_out, dg_out = refs[-4:]
        bk = q_ref.shape[-1]

        def pick(ref, pairs, at=Ellipsis):  # ref[at]'s entries at pairs (within one sequence), exact zeros elsewhere
            if has_reset:
                pairs = pairs & (rest[-2][...] == rest[-1][...])
            return jnp.where(pairs, ref[at], 0.0)

        dq_a, r, e = level_pair_sums(scale, (q_ref, k_ref, b_ref, g_ref, lo_ref, da_ref, dl_ref), pl.ds(0, bk),
                                     pick, C, bk)
        # The diagonal terms and the outputs, read after the levels (nothing but the sums
        # live across them), the row sums' outputs first; rows from a start Triton cannot
        # prove is 0: addresses of their own, not the levels' kept live to here.
        fresh = pl.ds(jnp.minimum(pl.program_id(2), 0), C)
        q_ref, k_ref, g_ref, b_ref, da_ref, dl_ref = (
            Rows(x, fresh) for x in (q_ref, k_ref, g_ref, b_ref, da_ref, dl_ref))
        lo_ref = None if lo_ref is None else Rows(lo_ref, fresh)
        eye = iota((C, 1), 0) == iota((1, C), 1)
        dA_d = jnp.sum(pick(da_ref, eye), axis=1, keepdims=True)  # the diagonals ([C, 1])
        dL_d = jnp.sum(pick(dl_ref, eye), axis=1, keepdims=True)
        beta, k, G, lo = b_ref[...], k_ref[...], g_ref[...], ref_or_none(lo_ref, Ellipsis)
        bad_G = nonfinite(G) if lo is None else jnp.maximum(nonfinite(G), nonfinite(lo))
        down = reached_down(jnp.maximum(nonfinite(k), bad_G))
        dq_a = jnp.where(down, jnp.nan, dq_a + dA_d * k)
        r = jnp.where(down, jnp.nan, r + dL_d * k)
        dq_out[...] = dq_ref[...] + scale * dq_a
        db_out[...] = jnp.sum(k * r, axis=1, keepdims=True)
        q = q_ref[...]
        br = beta * r
        part = scale * q * dq_a + k * br
        bk_ = beta * k
        up = reached_up(jnp.maximum(jnp.maximum(nonfinite(q), nonfinite(bk_)), bad_G))
        e = jnp.where(up, jnp.nan, e + dA_d * (scale * q) + dL_d * bk_)
        dk_out[...] = dk_ref[...] + e + br
        dg_out[...] = dg_ref[...] + part - k * e

    kernel.__qualname__ = "PallasIntraBackward.kernel"  # its name in profiles
    return kernel


def column_block_call(kernel, inputs, kinds, C: int, bk: int, nk: int, P: int, NC: int, dtype, interpret: bool):
    """B4's Triton call over the grid (P, NC, nk): inputs of kind ``"k"`` (``[P, NC, C,
    nk * bk]``) give each program its block of ``bk`` columns, the others (``[P, NC, *block]``)
    their whole chunk block. Outputs: three ``[P, NC, C, nk * bk]`` and dbeta's part of each
    block, ``[P, NC, C, nk]``."""
    specs = []
    for x, kind in zip(inputs, kinds):
        if kind == "k":
            specs.append(pl.BlockSpec((None, None, C, bk), lambda p, c, j: (p, c, 0, j)))
        else:
            specs.append(pl.BlockSpec((None, None) + x.shape[2:], lambda p, c, j: (p, c, 0, 0)))
    inputs, mat = manual_inputs(inputs)
    wide = jax.ShapeDtypeStruct((P, NC, C, nk * bk), dtype, manual_axis_type=mat)
    kspec = pl.BlockSpec((None, None, C, bk), lambda p, c, j: (p, c, 0, j))
    return pl.pallas_call(
        kernel,
        name=kernel_name(kernel),
        out_shape=[wide, wide, jax.ShapeDtypeStruct((P, NC, C, nk), dtype, manual_axis_type=mat), wide],
        grid=(P, NC, nk),
        in_specs=specs,
        out_specs=[kspec, kspec, pl.BlockSpec((None, None, C, 1), lambda p, c, j: (p, c, 0, j)), kspec],
        interpret=interpret,
        compiler_params=None if interpret else compiler_params("triton", False, 3),
    )(*inputs)


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
        q_ref, k_ref, g_ref, b_ref, lo_ref, seg, aqk_ref, akk_ref = _f2_refs(refs, has_lo, has_reset)

        def feature_block(k0, bk, S):
            kc = (slice(None), pl.ds(k0, bk))
            Sqk, Skk = scores_body(q_ref[kc], k_ref[kc], g_ref[kc], block, ref_or_none(lo_ref, kc))
            return S[0] + Sqk, S[1] + Skk

        akk_ref[...] = unit_lower_inverse_body(_aqk_and_l(blocks, feature_block, C, scale, seg, aqk_ref, b_ref))

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


@final
class PallasIntraBackward(AbstractIntraBackward, PallasFeatureBlocks):
    """B4 as a Pallas kernel over (row * head, chunk); ``G_lo`` and ``reset`` as
    ``PallasIntra``. On Triton (``intra_bwd_levels_kernel``) the transposes of F2's
    halving-level tile products, one program per block of ``block_k`` feature columns, at
    most ``B4_MAX_BLOCK`` (every gradient column depends on its own feature column alone;
    dbeta's parts are summed after the call); on TPU the whole chunk at once
    (``pair_rows_body``, ``pair_cols_body``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"intra": KDA})
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

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
        reset: Optional[ChunkValid] = None,
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
        if reset is not None:  # each token's sequence within its chunk, as a column and as a row
            seg = flat(per_head(segments(reset), HV))
            ins += (seg, seg.reshape(seg.shape[0], NC, 1, C))
            specs += [s1, chunk_spec((1, C))]
        has_lo, has_reset = G_lo is not None, reset is not None

        if self.target == "triton":
            bk = min(blocks[0][1], B4_MAX_BLOCK)
            blocks = column_blocks("triton", Kp, bk)
            kernel = intra_bwd_levels_kernel(scale, C, has_lo, has_reset)
            kinds = ["k", "k", "1", "k", "1", "1", "k", "k", "k"] + ["k"] * has_lo + ["1", "1"] * has_reset
            keep = [i for i in range(len(ins)) if i != 8]  # dbeta: its parts are summed here
            dq, dk, db, dG = column_block_call(kernel, [ins[i] for i in keep], kinds, C, bk, len(blocks), R * HV, NC,
                                               q.dtype, self.run_interpreted)
            db = flat(grads.dbeta) + jnp.sum(db, axis=-1, keepdims=True)
            cut = lambda x: unflat(x[..., :K], R, HV)
            return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
        else:
            def kernel(*refs):  # the whole chunk at once
                q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, db_ref, dg_ref = refs[:10]
                rest = refs[10:-4]
                lo = rest[0][...] if has_lo else None
                dq_out, dk_out, db_out, dg_out = refs[-4:]
                q, k, beta, G = q_ref[...], k_ref[...], b_ref[...], g_ref[...]
                dA, dL = da_ref[...], dl_ref[...]
                if has_reset:  # F2's pairs across sequences are constant zeros
                    same = rest[-2][...] == rest[-1][...]
                    dA, dL = jnp.where(same, dA, 0.0), jnp.where(same, dL, 0.0)
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
