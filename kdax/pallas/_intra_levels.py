"""The halving-level kernels of the intra-chunk family on Triton: F2
(``intra_levels_kernel``) and B4 (``intra_bwd_levels_kernel``), and F2's ref unpacking and
tail shared with the TPU kernel (``kdax.pallas._intra``).

No per-token loop and no row or column pulled out of a tile: the chunk's pairs j < i are
split into log2(C) halving levels (the reference stage's recursion); each level is one
masked tile product over the whole chunk with both decay factors taken to the level's
anchor row (every exponent non-positive; anchors read by gather loads; in F2 one
exponential a token a level: a level's rows and columns are the two halves of each
block, ``half_block_decay``). F2 inverts
``I + L`` by blocked doubling (2 log2(C) - 2 products); B4 takes the pairs inside each
16-token sub-block one diagonal offset at a time (elementwise, every row at once) and
runs the transposes of F2's level products for the pairs across sub-blocks (each over
the half of the tokens its pairs reach on the summed side), 32 feature columns a program.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._numerics.hilo import nonpositive
from .._numerics.isolation import finite_or_zero
from ._arith import (
    Products, exp_by_exp2, fast_decay, from_first, nonfinite, nonfinite_rows, reached_down, reached_up, tf32_product,
)
from ._common import blockwise, iota, loop, put, ref_or_none


def f2_refs(refs, has_lo: bool, has_reset: bool):
    """F2's kernel refs: ``(q, k, g, beta, G_lo or None, the reset table's two segment
    operands or None, Aqk out, Akk out, the bad rows out or None)`` (``finite_inverse``:
    with the reset table, a third output)."""
    lo_ref = refs[4] if has_lo else None
    if not has_reset:
        return (*refs[:4], lo_ref, None, *refs[-2:], None)
    return (*refs[:4], lo_ref, tuple(refs[-5:-3]), *refs[-3:])


def aqk_and_l(scores, C: int, scale: float, seg, aqk_ref, b_ref):
    """F2's tail on both targets: the scores ``(Sqk, Skk) = scores(zeros)`` summed over
    the feature columns, ``Aqk`` written (lower triangle with the diagonal; with ``seg``
    pairs across sequences exact zeros) and ``L`` returned (strictly lower, times beta, the
    same zeros)."""
    zeros = jnp.zeros((C, C), b_ref.dtype)  # (the compute dtype: Aqk may be stored bf16)
    Sqk, Skk = scores(zeros)
    row, col = iota((C, C), 0), iota((C, C), 1)
    lower, strict = col <= row, col < row
    if seg is not None:
        same = seg[0][...] == seg[1][...]
        lower, strict = lower & same, strict & same
    put(aqk_ref, ..., scale * jnp.where(lower, Sqk, 0.0))
    return jnp.where(strict, b_ref[...] * Skk, 0.0)


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


def half_block_decay(G, lo, g_ref, lo_ref, cols, C: int, lev):
    """``[C, w]``: each token's decay to the anchor a of halving level ``lev`` (the first
    row of the upper half of its ``2s``-token block, s = 2^lev), one exponential a token:
    ``e^(G_t - G_a)`` for a token in the upper half (a row of the level's pairs),
    ``e^(G_a - G_t)`` for one in the lower half (a column); both exponents non-positive,
    and each equal to the bit to ``fast_decay``'s on that side (``x - y = -(y - x)`` exactly
    in floating point). ``G``, ``lo``: ``cols`` of ``g_ref``, ``lo_ref`` (or None) at
    every row; the anchors are gather loads."""
    t = iota((C,), 0)
    sr, sl = jax.lax.shift_right_logical, jax.lax.shift_left
    a = sl(sr(t, lev + 1), lev + 1) + sl(jnp.int32(1), lev)
    upper = (sr(iota((C, 1), 0), lev) & 1) == 1
    d = G - gathered(g_ref, a, cols)
    if lo is not None:  # (``exponent``'s sum, negated on the lower half before its clamp)
        d = d + (lo - gathered(lo_ref, a, cols))
    d = jnp.where(upper, d, -d)
    return exp_by_exp2(d if lo is None else nonpositive(d))


def level_scores(mm: Products, q_ref, k_ref, g_ref, lo_ref, blocks, C: int, zeros):
    """``(Sqk, Skk)``: ``sum_d a_id k_jd e^(G_id - G_jd)`` (a = q, k) for j <= i (zeros
    above the diagonal), over the feature columns in ``blocks`` (``column_blocks``), ``G``
    read from ``g_ref`` (``lo_ref``: its low part, or None). The diagonal is a row sum; the
    pairs of each halving level (``level_pairs``) one tile product a block of columns,
    ``(a_i e^(G_i - G_a)) . (k_j e^(G_a - G_j))`` with a the first row of the upper half of
    the pair's ``2s``-token block, one exponential a token (``half_block_decay``: the
    upper half's rows and the lower half's columns; both exponents non-positive); the
    products' entries outside the level are selected away (a non-finite value there
    reaches nothing). The loop over levels holds the loop over feature blocks (the other
    way round, LLVM unrolled the six levels of one-exponential bodies and spilled 384 B)."""
    ri, cj = iota((C, C), 0), iota((C, C), 1)

    def diagonal(k0, bk, d):
        cols = (slice(None), pl.ds(k0, bk))
        return d + jnp.sum(q_ref[cols] * k_ref[cols], axis=1, keepdims=True)

    d = blockwise(blocks, diagonal, jnp.zeros((C, 1), zeros.dtype))
    Sqk = jnp.where(ri == cj, d, 0.0)

    def level(lev, S):
        def block(k0, bk, P):
            cols = pl.ds(k0, bk)
            q, k = q_ref[:, cols], k_ref[:, cols]
            E = half_block_decay(g_ref[:, cols], ref_or_none(lo_ref, (slice(None), cols)), g_ref, lo_ref, cols, C,
                                 lev)
            kE = k * E  # (the upper rows' k e^(G_i - G_a), the lower rows' k e^(G_a - G_j))
            return P[0] + mm.dot(q * E, kE, tb=True), P[1] + mm.dot(kE, kE, tb=True)

        # The blocks' products summed (on tensor cores, into one accumulator) before the
        # level's pairs are selected: S is zero at them until then, so the sums are the
        # same to the bit.
        Pqk, Pkk = blockwise(blocks, block, (zeros, zeros))
        pairs = level_pairs(C, lev)
        return S[0] + jnp.where(pairs, Pqk, 0.0), S[1] + jnp.where(pairs, Pkk, 0.0)

    return loop(0, C.bit_length() - 1, level, (Sqk, zeros))


def doubling_unit_lower_inverse(mm: Products, L, plain_tf32: bool = False, seg=None):
    """``(I + L)^-1`` for strictly lower ``L [C, C]`` with finite entries, by blocked
    substitution in log2(C) doubling steps of two products each (the first, from I,
    without): ``X <- X - X (B X)``, ``B`` the pairs of one halving level
    (``level_pairs``), takes the inverses of the s-token diagonal blocks to those of the
    2s-token ones (``[[A, 0], [B, D]]^-1 =
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``). Every intermediate is a principal block of the
    result, as in the reference stage's recursion; entries above the diagonal stay exact
    zeros. ``plain_tf32`` (the "fast" policy): where the tuning runs float32 products on
    tensor cores, one TF32 product each, as FLA's float32 ``tl.dot`` (the candidate within
    FLA's tolerances either way: tests/test_precision.py; sm_90: F2 -24% instructions).
    ``seg`` (shared chunks: refs of the sequences as a ``[C, 1]`` column and a ``[1, C]``
    row, ``L`` zero between them): each product's entries between sequences selected to
    exact zeros, so that an inverse overflowing (inf) in one sequence's block never
    meets another's zeros as ``0 * inf``."""
    C = L.shape[0]
    eye = (iota((C, C), 0) == iota((C, C), 1)).astype(L.dtype)
    plain = plain_tf32 and mm.f32_dot != "ieee" and L.dtype == jnp.float32
    product = tf32_product if plain else functools.partial(mm.scaled_dot, None)
    if seg is not None:
        plain_product = product
        product = lambda A, X: jnp.where(seg[0][...] == seg[1][...], plain_product(A, X), 0.0)  # noqa: E731

    def step(lev, X):  # (X split for each product: split once and held, F2 took +4% instructions)
        return X - product(X, product(jnp.where(level_pairs(C, lev), L, 0.0), X))

    if C < 2:
        return eye
    # The first step from X = I is I - B: its two products are products with I, exact in
    # IEEE (TF32x3 rounded lo(B) to TF32, 2^-22 of B; plain TF32 B itself: now exact).
    # F2: one of the inverse's six steps, -6.5%.
    first = eye - jnp.where(level_pairs(C, jnp.int32(0)), L, 0.0)
    return loop(1, C.bit_length() - 1, step, first)


def marked_inverse(inverse, L):
    """``inverse(L')`` (of ``I + L'``) on ``L'``, ``L`` with its non-finite entries zeroed,
    and NaN in the rows from the first non-finite row of ``L`` on (``lower_dot``'s way)."""
    return jnp.where(from_first(nonfinite_rows(L)), jnp.nan, inverse(jnp.where(jnp.abs(L) < jnp.inf, L, 0.0)))


def finite_inverse(inverse, L):
    """Shared chunks: ``(inverse(L'), bad)``, ``L'`` ``L`` with its non-finite entries
    zeroed, ``bad [C, 1]`` nonzero at their rows. The stage makes the rows they reach NaN,
    in their own sequence only (``kdax.pallas._intra._akk``): inside the kernel its
    ``[C, C]`` masks made Triton's F2 spill on sm_90."""
    return inverse(jnp.where(jnp.abs(L) < jnp.inf, L, 0.0)), nonfinite_rows(L)


def intra_levels_kernel(mm: Products, scale: float, C: int, blocks, has_lo: bool, has_reset: bool, fast: bool,
                        isolate_inverse: bool = True):
    """F2's kernel on Triton: every score and every step of ``(I + L)^-1`` a tile product
    over the whole chunk, no per-token loop and no row or column pulled out of a tile.
    Scores: ``level_scores`` (log2(C) products per output, summed over ``blocks`` of
    feature columns); ``(I + L)^-1``: ``doubling_unit_lower_inverse`` under float32
    products (``Products.float32``). ``fast``: the policy is ``"fast"`` (its
    inverse's products as plain TF32). With ``has_reset`` (shared chunks) pairs
    across sequences are selected to exact zeros in both outputs (``L`` is then
    block-diagonal by sequence, and so is its inverse, exactly). A non-finite entry of
    ``L`` in row t (a NaN in token t's k, beta or G) makes ``Akk``'s rows t on NaN, every
    column, and reaches no earlier row (``marked_inverse``) nor another sequence's
    (``finite_inverse``; an inverse that overflows from a finite ``L`` is kept to its
    sequence by ``isolate_inverse``, the doubling's products selected by sequence: at 16
    warps that spilled 24 B a thread on sm_90, so there the stage runs it only on a call
    whose inverse overflowed, ``kdax.pallas._intra._isolated``)."""

    def kernel(*refs):
        q_ref, k_ref, g_ref, b_ref, lo_ref, seg, aqk_ref, akk_ref, bad_ref = f2_refs(refs, has_lo, has_reset)

        scores = lambda zeros: level_scores(mm, q_ref, k_ref, g_ref, lo_ref, blocks, C, zeros)  # noqa: E731
        L = aqk_and_l(scores, C, scale, seg, aqk_ref, b_ref)
        inverse = functools.partial(doubling_unit_lower_inverse, mm.float32(), plain_tf32=fast,
                                    seg=seg if isolate_inverse else None)
        if has_reset:
            A, bad_ref[...] = finite_inverse(inverse, L)
            put(akk_ref, ..., A)
        else:
            put(akk_ref, ..., marked_inverse(inverse, L))

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


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


# B4 takes the pairs inside each SUB_BLOCK-token sub-block one diagonal offset at a time
# (``offset_loop``) and the pairs across sub-blocks by halving levels (``level_loop``): a
# level's [C, C/2] work (its dA and dL selected, split for TF32x3, held as the products'
# operands) is done by each of a chunk's column programs, an offset is elementwise work
# on [C, w] tiles alone. At C = 64, 32 columns, sm_90, with [C, C] level operands then:
# 16 offsets and 2 levels 7.8k SASS instructions a warp; 6 levels 11.3k; 8 offsets and 3
# levels as 16 and 2; 4 and 4 +3%.
SUB_BLOCK = 16


class B4Refs:
    """B4's operand refs ``(q, k, beta, G, G_lo or None, dA, dL)`` for one block of feature
    columns ``cols``, the chunk's ``C`` tokens in sub-blocks of ``B``, the score ``scale``,
    and ``seg`` (``[C, 1]``: each token's sequence, to select pairs within one; None
    without resets)."""

    def __init__(self, refs, cols, C: int, B: int, scale: float, seg, mm: Products):
        self.q, self.k, self.beta, self.G, self.lo, self.dA, self.dL = refs
        self.cols, self.C, self.B, self.scale, self.seg, self.mm = cols, C, B, scale, seg, mm

    def offset_loop(self, side: str, init):
        """``init`` plus the pairs i > j inside each sub-block, one offset o = i - j a step
        (B - 1 steps, every row at once; the diagonal, o = 0, is the caller's: it leaves
        dG alone), each pair's own decay:
        ``"rows"``: ``(dq_a, r)``, ``R_i += S_i,i-o k_i-o e^(G_i - G_i-o)`` (S = dA, dL);
        ``"columns"``: ``e``, ``e_j += (scale dA_j+o,j q_j+o + dL_j+o,j beta_j+o k_j+o)
        e^(G_j+o - G_j)``; ``"both"``: ``(e, dq_a, r)`` in one loop. The other token's rows and the
        entries of dA, dL are gather loads; the other token is clamped to the chunk, never
        past the row, so every exponent is non-positive, also for pairs left out. A pair
        outside the sub-block or across sequences leaves the sums as they are (selected,
        never multiplied by a mask); a pair's non-finite values reach only its own entry,
        one the caller sets to NaN anyway."""
        C, B, cols, scale = self.C, self.B, self.cols, self.scale
        t = iota((C,), 0)
        tc = t[:, None]
        inner = tc & (B - 1)  # position in its sub-block
        G, lo = self.G[:, cols], ref_or_none(self.lo, (slice(None), cols))

        def rows(o, acc):
            dq_a, r = acc
            j = jnp.maximum(t - o, 0)  # row i = t takes column j = t - o
            ok = inner >= o if self.seg is None else (inner >= o) & (self.seg[t, :] == self.seg[j, :])
            kx = self.k[j, cols] * fast_decay(G, self.G[j, cols], lo, gathered(self.lo, j, cols))
            return (jnp.where(ok, dq_a + self.dA[tc, j[:, None]] * kx, dq_a),
                    jnp.where(ok, r + self.dL[tc, j[:, None]] * kx, r))

        def columns(o, e):
            i = jnp.minimum(t + o, C - 1)  # column j = t takes row i = t + o
            ok = inner + o < B if self.seg is None else (inner + o < B) & (self.seg[i, :] == self.seg[t, :])
            ic = i[:, None]
            x = (scale * self.dA[ic, tc]) * self.q[i, cols] + (self.dL[ic, tc] * self.beta[i, :]) * self.k[i, cols]
            return jnp.where(ok, e + x * fast_decay(self.G[i, cols], G, gathered(self.lo, i, cols), lo), e)

        if side == "both":
            return loop(1, B, lambda o, acc: (columns(o, acc[0]), *rows(o, acc[1:])), init)
        return loop(1, B, rows if side == "rows" else columns, init)

    def half_rows(self, lev, z):
        """``(lower, upper)``: int32 ``[C/2]``, the tokens of the lower and of the upper half
        of each ``2s``-token block of halving level ``lev`` (s = 2^lev) in order, each
        plus ``z`` (a 0 Triton cannot prove constant: the gathers stay inside the loop;
        hoisted, every operand stayed live across the levels)."""
        sl, sr = jax.lax.shift_left, jax.lax.shift_right_logical
        m = iota((self.C // 2,), 0)
        s = sl(jnp.int32(1), lev)
        lower = sl(sr(m, lev), lev + 1) + (m & (s - 1)) + z
        return lower, lower + s

    def level_entries(self, w: int, lev, z, other, transposed: bool):
        """``[C, C/2]``: the entries of dA (``w = 5``) or dL (``w = 6``) of level ``lev``'s
        pairs between every token t (rows) and the tokens ``other`` (``[C/2]``, one half
        of each block: ``half_rows``; columns), within one sequence, exact zeros elsewhere:
        ``S[t, m] = S_t,other[m]`` (t in an upper half), or ``transposed``,
        ``S[t, m] = S_other[m],t`` (t in a lower half). A gather load."""
        C, sr = self.C, jax.lax.shift_right_logical
        t, o = iota((C, 1), 0) + z, other[None, :]
        up = (sr(t, lev) & 1) == (0 if transposed else 1)
        pairs = (sr(t, lev + 1) == sr(o, lev + 1)) & up
        if self.seg is not None:  # (the other side's sequences transposed: compared as 2-D
            # gathers, the bool tile went through shared memory, which Triton refuses for i1)
            pairs = pairs & (self.seg[pl.ds(z, C), :] == self.seg[other, :].T)
        ref = {5: self.dA, 6: self.dL}[w]
        return jnp.where(pairs, ref[o, t] if transposed else ref[t, o], 0.0)

    def decay(self, lev, z, into: bool, rows=None):
        """``e^(G_t - G_a)`` (``into``) or ``e^(G_c - G_t)`` for the tokens ``rows``
        (``[n]``, as ``[n, w]``; None: every token, ``[C, w]``) of level ``lev``: a the first
        row of t's half-block, c the next half-block's (``level_scores``' anchors; every
        exponent non-positive). Not ``half_block_decay``: on the tokens outside a level's
        pairs (whose products are zero) that one's anchor lies on the other side of t, so a
        non-finite G there would reach rows the reference's products do not."""
        C, cols, sl, sr = self.C, self.cols, jax.lax.shift_left, jax.lax.shift_right_logical
        t = iota((C,), 0) + z if rows is None else rows
        a = sl(sr(t, lev), lev)
        if not into:
            a = jnp.minimum(a + sl(jnp.int32(1), lev), C - 1)
        if rows is None:  # (every row: one block load)
            at = (pl.ds(z, C), cols)
            G, lo = self.G[at], None if self.lo is None else self.lo[at]
        else:
            G, lo = gathered(self.G, t, cols), gathered(self.lo, t, cols)
        Ga, loa = gathered(self.G, a, cols), gathered(self.lo, a, cols)
        return fast_decay(G, Ga, lo, loa) if into else fast_decay(Ga, G, loa, lo)

    def level_loop(self, side: str, init):
        """``init`` plus the pairs across sub-blocks, the transposes of F2's level products
        (``level_scores``) for the halving levels from log2(B) on, each side's decay taken
        to the level's anchor a, each a ``[C, C/2] x [C/2, w]`` tile product over the half
        of the tokens a level's pairs reach on the summed side (``half_rows``):

        - ``"rows"``: ``R_i += e^(G_i - G_a) sum_j S_ij (k_j e^(G_a - G_j))`` (S = dA: dq_a;
          S = dL: r; j over the lower halves);
        - ``"columns"``: ``e_j += e^(G_a - G_j) sum_i (scale dA_ij q_i + dL_ij beta_i k_i)
          e^(G_i - G_a)`` (the reference's ``scale dk_a + c``; i over the upper halves),
          S^T read transposed from memory.

        (Over all C tokens, half of each product's inner dimension met zeros: B4 at 16
        warps took 13% more instructions.) The token-side operands have their non-finite
        entries zeroed (a ``0 * NaN`` in a product would carry a non-finite token to every
        row of the chunk); the caller restores the rows they reach. Non-finite entries of
        dA, dL reach their rows and columns as in the reference."""
        scale, cols = self.scale, self.cols

        def columns(lev, e):
            z = jnp.minimum(lev, 0)
            _, upper = self.half_rows(lev, z)
            into = self.decay(lev, z, True, upper)
            qx = finite_or_zero(scale * self.q[upper, cols] * into)
            bx = finite_or_zero(self.beta[upper, :] * self.k[upper, cols] * into)
            back = self.decay(lev, z, False)
            return (e + self.mm.scaled_dot(back, self.level_entries(5, lev, z, upper, True), qx)
                    + self.mm.scaled_dot(back, self.level_entries(6, lev, z, upper, True), bx))

        def rows(lev, acc):
            z = jnp.minimum(lev, 0)
            lower, _ = self.half_rows(lev, z)
            kx = finite_or_zero(self.k[lower, cols] * self.decay(lev, z, False, lower))
            into = self.decay(lev, z, True)
            return (acc[0] + self.mm.scaled_dot(into, self.level_entries(5, lev, z, lower, False), kx),
                    acc[1] + self.mm.scaled_dot(into, self.level_entries(6, lev, z, lower, False), kx))

        first, n = self.B.bit_length() - 1, self.C.bit_length() - 1
        return init if first >= n else loop(first, n, rows if side == "rows" else columns, init)


def intra_bwd_levels_kernel(mm: Products, scale: float, C: int, has_lo: bool, has_reset: bool):
    """B4's kernel on Triton, the VJP of ``intra_levels_kernel`` at its granularity: no
    per-token loop and no row or column pulled out of a tile. One program per (row * head,
    chunk, block of feature columns), as FLA's ``chunk_kda_bwd_intra`` (every gradient
    column depends on its own feature column alone; dbeta's part of each block is summed
    outside; ``B4_MAX_BLOCK``): the pairs inside the 16-token sub-blocks one diagonal offset
    at a time, the others by halving levels of tile products (``B4Refs``), the diagonal
    pairs (dAqk's and dL's diagonals, gather loads) into dq, dk and dbeta alone (in dG they
    cancel); pairs above
    the diagonal (and, with ``has_reset``, across sequences) are selected to exact zeros. A non-finite token value
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

        ops = B4Refs((q_ref, k_ref, b_ref, g_ref, lo_ref, da_ref, dl_ref), pl.ds(0, bk), C, min(SUB_BLOCK, C),
                     scale, rest[-2] if has_reset else None, mm)
        zero = jnp.zeros((C, bk), q_ref.dtype)
        # The diagonal pairs (dA_tt, dL_tt: gather loads) join dq, dk and dbeta alone: in dG
        # they cancel exactly (kdax.stages._intra_levels.pair_sums). Loaded here, not after
        # the loops: 7.0k instructions a warp there against 7.2k, and with G_lo 185
        # registers against 230 (sm_90, 8 warps; [C, 1] operands of their own cost glue).
        t = iota((C, 1), 0)
        dA_d, dL_d = scale * da_ref[t, t], dl_ref[t, t]
        # Both sums' offsets in one loop (its index math and loads of the token's own rows
        # shared: B4 at 16 warps -3%), then each side's levels adding to them (with both
        # sides in one level loop, 64 columns a program spilled the more).
        e, dq_a, r = ops.offset_loop("both", (zero, zero, zero))
        e = ops.level_loop("columns", e)
        dq_a, r = ops.level_loop("rows", (dq_a, r))
        # The outputs, read after the levels (nothing but the sums live across them), the
        # row sums' outputs first; rows from a start Triton cannot prove is 0: addresses of
        # their own, not the levels' kept live to here.
        fresh = pl.ds(jnp.minimum(pl.program_id(2), 0), C)
        q_ref, k_ref, g_ref, b_ref, da_ref, dl_ref = (
            Rows(x, fresh) for x in (q_ref, k_ref, g_ref, b_ref, da_ref, dl_ref))
        lo_ref = None if lo_ref is None else Rows(lo_ref, fresh)
        beta, k, G, lo = b_ref[...], k_ref[...], g_ref[...], ref_or_none(lo_ref, Ellipsis)
        bad_G = nonfinite(G) if lo is None else nonfinite(G) | nonfinite(lo)
        down = reached_down(nonfinite(k) | bad_G)
        dq_a = jnp.where(down, jnp.nan, dq_a)
        r = jnp.where(down, jnp.nan, r)
        q = q_ref[...]
        part = scale * q * dq_a + k * (beta * r)
        bk_ = beta * k
        up = reached_up(nonfinite(q) | nonfinite(bk_) | bad_G)
        e = jnp.where(up, jnp.nan, e)
        dg_out[...] = dg_ref[...] + part - k * e
        dq_out[...] = dq_ref[...] + scale * dq_a + dA_d * k
        r = r + dL_d * k
        db_out[...] = jnp.sum(k * r, axis=1, keepdims=True)
        dk_out[...] = dk_ref[...] + e + dA_d * q + dL_d * bk_ + beta * r

    kernel.__qualname__ = "PallasIntraBackward.kernel"  # its name in profiles
    return kernel
