"""Pallas intra-chunk family: F2 (Aqk, Akk) and B4 (intra-chunk backward). The Triton
kernels live in ``kdax.pallas._intra_levels``; the TPU kernels and both stage classes here.

F2 on Triton (``intra_levels_kernel``): no per-token loop and no row or column pulled out
of a tile. The chunk's pairs j < i are split into log2(C) halving levels (the reference
stage's recursion): the levels below 16 are the pairs inside the 16-token sub-blocks,
the others the sub-blocks' off-diagonal blocks, each level one masked tile product over
the whole chunk with each side's decay taken to the level's anchor row (both exponents
non-positive, anchors read by gather loads); ``(I + L)^-1`` by blocked substitution in
log2(C) doubling steps of two products (the first, from I, none). Whole-chunk tiles
rather than 16 x 16 ones: a 16-row tile product leaves most of a program's warps holding
copies (compiled for sm_90 that layout took F2 to 255 registers and 1.9 KiB of spills a
thread).

B4 on Triton (``intra_bwd_levels_kernel``), F2's VJP: the pairs inside each 16-token
sub-block one diagonal offset at a time (16 steps of elementwise work on ``[C, block]``
tiles, each pair's own decay, the other token's rows and the dA, dL entries by gather
loads), the pairs across sub-blocks by halving levels (the transposes of F2's level
products, ``[C, C] x [C, block]`` tile products of the level's selected dA and dL with the
token side's anchored decays); one program per (row * head, chunk, block of at most 32
feature columns).

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

from .._numerics import precision as _precision
from .._stage_protocol.final import final
from ..stages import KDA, AbstractIntra, AbstractIntraBackward, ChunkGrads, IntraOut
from ._arith import Products, decay, nonfinite
from ._common import (
    PallasFeatureBlocks, blockwise, chunk_spec, col_of, flat, idiv, iota, loop, ref_or_none, row_of, row_or_none,
    tuned, unflat,
)
from ._common import column_blocks, compiler_params, kernel_name, manual_inputs, put
from ._intra_levels import aqk_and_l, f2_refs, finite_inverse, intra_bwd_levels_kernel, intra_levels_kernel
from ._intra_rows import intra_bwd_rows_kernel, row_block_call
from ._intra_rows_f2 import intra_rows_scores_kernel, intra_solve_kernel, scores_rows_call
from ._shared_chunks import reached_rows, segment_operands, sequence_pairs


def _blocks(C: int, block: int):
    b = min(block, C)
    rC = iota((C, 1), 0)
    return b, C // b, rC, idiv(rC, b)


def scores_body(mm: Products, q, k, G, block: int, lo=None):
    """``(sum_d q_id k_jd e^(G_id-G_jd), sum_d k_id k_jd e^(G_id-G_jd))`` for j <= i in
    anchored form; entries above the diagonal are unspecified (callers mask them). ``lo``:
    G's low part (``kdax._numerics.hilo``) or None."""
    C = q.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    row, col = iota((C, C), 0), iota((C, C), 1)

    def anchored(I, S):
        Sqk, Skk = S
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        rows_in = decay(blk == I, G, Ga, lo, La)
        kc = k * decay(blk < I, Ga, G, La, lo)
        # (block I's rows selected after the product: a non-finite anchor, a later token,
        # makes every row of kc non-finite, and the other rows' zeros would carry it, 0 * NaN)
        mine = lambda x: jnp.where(blk == I, mm.dot(x * rows_in, kc, tb=True), 0.0)  # noqa: E731
        return Sqk + mine(q), Skk + mine(k)

    zeros = jnp.zeros((C, C), q.dtype)
    Sqk, Skk = loop(1, nb, anchored, (zeros, zeros))

    def diag(j, S):
        Sqk, Skk = S
        e = decay((rC >= j) & (blk == idiv(j, b)), G, row_of(G, j), lo, row_or_none(lo, j)) * row_of(k, j)
        sel = (col == j) & (idiv(row, b) == idiv(j, b))
        return (jnp.where(sel, jnp.sum(q * e, axis=1, keepdims=True), Sqk),
                jnp.where(sel, jnp.sum(k * e, axis=1, keepdims=True), Skk))

    return loop(0, C, diag, (Sqk, Skk))


def unit_lower_inverse_body(L, seg=None):
    """``(I + L)^-1`` for strictly lower ``L [C, C]``, one row at a time. ``seg`` (shared
    chunks: the sequences as a ``[C, 1]`` column and a ``[1, C]`` row, ``L`` zero between
    them): a row sums the rows of its own sequence only, so another's overflow (inf) never
    meets those zeros (and, each row made from the rows above it alone, an overflow
    reaches its own sequence's rows from it on, by itself)."""
    C = L.shape[0]
    row, col = iota((C, C), 0), iota((C, C), 1)
    eye = (row == col).astype(L.dtype)
    Lt = L.T

    def step(i, A):
        terms = col_of(Lt, i) * A
        if seg is not None:
            seg_i = jnp.max(jnp.where(iota(seg[0].shape, 0) == i, seg[0], 0), axis=0, keepdims=True)  # (seg >= 0)
            terms = jnp.where(seg[0] == seg_i, terms, 0.0)
        new = (iota((1, C), 1) == i).astype(A.dtype) - jnp.sum(terms, axis=0, keepdims=True)
        return jnp.where(row == i, new, A)

    return loop(1, C, step, eye)


# -- F2 on Triton: the chunk's pairs as log2(C) tile products, (I + L)^-1 in 2 log2(C) ----------


def pair_rows_body(mm: Products, S, b_, G, block: int, lo=None):
    """``R_id = sum_{j < i} S_ij b_jd e^(G_id - G_jd)`` for lower-triangular ``S``
    (``lo`` as ``scores_body``): the diagonal left out, as ``kdax.stages._intra_levels.pair_sums``
    leaves it out (``intra_bwd_outputs`` adds it where it does not cancel)."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, R):
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        # (the operand's rows and the product's selected, as in ``scores_body``: a later
        # token's NaN in b_ would meet SI's zeros)
        bI = jnp.where(blk < I, b_ * decay(blk < I, Ga, G, La, lo), 0.0)
        return R + jnp.where(blk == I, decay(blk == I, G, Ga, lo, La) * mm.dot(SI, bI), 0.0)

    R = loop(1, nb, anchored, jnp.zeros(b_.shape, b_.dtype))

    def diag(j, R):
        m = (rC > j) & (blk == idiv(j, b))
        return R + jnp.where(m, col_of(S, j) * row_of(b_, j) * decay(m, G, row_of(G, j), lo, row_or_none(lo, j)), 0.0)

    return loop(0, C, diag, R)


def pair_cols_body(mm: Products, S, a, G, block: int, lo=None):
    """``C_jd = sum_{i > j} S_ij a_id e^(G_id - G_jd)`` for lower-triangular ``S``
    (``lo`` as ``scores_body``; the diagonal left out, as in ``pair_rows_body``)."""
    C = S.shape[0]
    b, nb, rC, blk = _blocks(C, block)
    cblk = idiv(iota((C, C), 1), b)

    def anchored(I, out):
        Ga, La = row_of(G, I * b), row_or_none(lo, I * b)
        SI = jnp.where((idiv(iota((C, C), 0), b) == I) & (cblk < I), S, 0.0)
        # (the operand's rows and the product's selected, as in ``pair_rows_body``)
        aI = jnp.where(blk == I, a * decay(blk == I, G, Ga, lo, La), 0.0)
        return out + jnp.where(blk < I, decay(blk < I, Ga, G, La, lo) * mm.dot(SI, aI, ta=True), 0.0)

    out = loop(1, nb, anchored, jnp.zeros(a.shape, a.dtype))
    St = S.T

    def diag(i, out):
        m = (rC < i) & (blk == idiv(i, b))
        return out + jnp.where(m, col_of(St, i) * row_of(a, i) * decay(m, row_of(G, i), G, row_or_none(lo, i), lo), 0.0)

    return loop(0, C, diag, out)


def intra_bwd_outputs(q, k, beta, dq_a, dk_a, r, c, dA_d, dL_d, dq, dk, dG):
    """B4's gradients ``(dq, dk, dG, dbeta's increment)`` from the pair sums without the
    diagonal ``dq_a``, ``dk_a`` (scaled), ``r``, ``c``, the diagonals ``dA_d`` (scaled) and
    ``dL_d`` (``[C, 1]``) and the incoming ``dq``, ``dk``, ``dG``. dG from the pairs i != j
    alone: a diagonal pair adds to dG_i and takes from it alike."""
    dG = dG + q * dq_a - k * dk_a + beta * k * r - k * c
    dq_a, dk_a, r, c = dq_a + dA_d * k, dk_a + dA_d * q, r + dL_d * k, c + dL_d * beta * k
    return dq + dq_a, dk + dk_a + beta * r + c, dG, jnp.sum(k * r, axis=1, keepdims=True)


# The most feature columns one program of B4's Triton kernel takes (``block_k`` above it
# is cut to this): at 64 columns and eight warps the kernel spills (24 B a thread at the
# candidate tuning, sm_90, from the two halving levels' products; with the 64 columns as
# two 32-column parts sharing each level's [C, C] operands, 632 B). The cost: each
# 32-column program repeats the levels' [C, C] work and the offsets' index math
# (64 columns a program: 12.9k instructions a warp against 2 x 7.8k). Plain TF32 levels
# (``f32_dot="tf32"``) would fit 64 columns; since B5 sets dg = 0 below the floor they are
# within FLA's tolerances at hard gates too (``tests/test_precision.py::
# test_candidate_within_fla_tolerances``), not yet timed on a GPU.
B4_MAX_BLOCK = 32


def column_block_call(kernel, inputs, kinds, C: int, bk: int, nk: int, P: int, NC: int, dtype, interpret: bool,
                      params: dict):
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
        compiler_params=None if interpret else compiler_params("triton", False, 3, **params),
    )(*inputs)


def _check_rows(rows: int, target: str) -> None:
    """F2's and B4's ``rows``: 16, 32 or 64, and other than 64 a Triton grid only."""
    if rows not in (16, 32, 64):
        raise ValueError(f"rows: expected 16, 32 or 64, got {rows!r}.")
    if rows != 64 and target != "triton":
        raise ValueError(f"rows: {rows} is a Triton kernel's grid; target is {target!r} (leave rows at 64).")


@final
class PallasIntra(AbstractIntra, PallasFeatureBlocks):
    """F2 as a Pallas kernel over (row * head, chunk); with ``G_lo`` (``kdax._numerics.hilo``) every
    exponent is the difference of the exact sums ``G + G_lo``; with ``reset`` (shared
    chunks, ``kdax._layouts.resets``) pairs across sequences are exact zeros. On Triton
    (``intra_blocks_kernel``) the chunk is taken as ``block``-token sub-blocks, every score
    block and every step of ``(I + L)^-1`` a tile product, summing over ``block_k`` feature
    columns at a time; with ``rows`` 16 or 32, the scores one program per block of
    ``rows`` tokens and the inverse a second kernel (``kdax.pallas._intra_rows_f2``); on
    TPU the whole chunk at once (``scores_body``, ``unit_lower_inverse_body``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

    block: int = eqx.field(static=True, default=16)
    # (sm_90, 8 warps, the candidate's tuning: 64 columns a step 238 registers and 12.8k
    # instructions a warp; 32 columns spilled 176 B once the scores' decays took exp2)
    block_k: int = eqx.field(static=True, default=64)
    # The Triton kernel's rows a program: 64 (the default), the whole chunk
    # (``intra_levels_kernel``, at any chunk size); 16 or 32, the scores one program per
    # sub-block of that many tokens and ``(I + L)^-1`` a second kernel over the stored L
    # (``kdax.pallas._intra_rows_f2``; a chunk smaller than ``rows`` is one sub-block). The
    # same outputs and precision; Triton only (interpreted too).
    rows: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        _check_rows(self.rows, self.target)

    @tuned
    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None, *, precision: str = "highest"):
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        ins = tuple(self.padded(x) for x in (q, k, G)) + (flat(beta),)
        spec = chunk_spec((C, ins[0].shape[-1]))
        specs = [spec, spec, spec, chunk_spec((C, 1))]
        if G_lo is not None:
            ins, specs = ins + (self.padded(G_lo),), specs + [spec]
        shared = reset is not None
        if shared:  # each token's sequence within its chunk, as a column and as a row
            seg, seg_specs = segment_operands(reset, HV)
            ins, specs = ins + seg, specs + seg_specs
        blocks = self.feature_blocks(ins[0].shape[-1])
        stored = _precision.storage(q.dtype, precision)  # (bf16 under "fast")
        outs = [(C, C)] + [(C, 1)] * shared
        if self.target == "triton" and self.rows != 64:
            B = min(self.rows, C)
            mm = self.products(precision)
            kernel = intra_rows_scores_kernel(mm, scale, C, B, blocks, G_lo is not None, shared)
            Aqk, L = scores_rows_call(kernel, ins, C, B, R * HV, NC, stored, self.run_interpreted,
                                      self.triton_params())
            solve = lambda isolate: self.call(  # noqa: E731
                intra_solve_kernel(mm, precision == "fast", shared, isolate), [L, *seg] if isolate else [L],
                [chunk_spec((C, C)), *seg_specs] if isolate else [chunk_spec((C, C))], outs, R * HV, NC,
                [stored] + [L.dtype] * shared)
            Akk, *bad = solve(False)
            if shared:
                Akk = _isolated(Akk, lambda: solve(True)[0])
            return IntraOut(unflat(Aqk, R, HV), _akk(Akk, bad, reset, R, HV))
        if self.target == "triton":
            levels = lambda isolate: self.call(  # noqa: E731
                intra_levels_kernel(self.products(precision), scale, C, blocks, G_lo is not None, shared,
                                    precision == "fast", isolate_inverse=isolate),
                ins, specs, [(C, C)] + outs, R * HV, NC, [stored, stored] + [beta.dtype] * shared)
            Aqk, Akk, *bad = levels(self.num_warps <= 8)
            if shared and self.num_warps > 8:
                Akk = _isolated(Akk, lambda: levels(True)[1])
            return IntraOut(unflat(Aqk, R, HV), _akk(Akk, bad, reset, R, HV))
        kernel = intra_chunk_kernel(self.products(precision), scale, C, self.block, blocks, G_lo is not None, shared)
        Aqk, Akk, *bad = self.call(kernel, ins, specs, [(C, C)] + outs, R * HV, NC,
                                   [stored, stored] + [beta.dtype] * shared)
        return IntraOut(unflat(Aqk, R, HV), _akk(Akk, bad, reset, R, HV))


def _isolated(Akk, rerun):
    """Shared chunks, a Triton F2 whose inverse does not select its products by sequence
    (16 warps; ``rows`` 16 or 32: the selects spilled on sm_90): ``Akk`` ``[P, NC, C, C]``,
    or where any entry is not finite, ``rerun()``, the kernel with the selects. The kernel
    zeroes ``L``'s own non-finite entries, so such an entry is an inverse that overflowed
    from a finite ``L`` and may have met the zeros between sequences (``0 * inf``); the
    selects leave every entry of a finite inverse as it was, so the other sequences' entries
    are the first kernel's. The price on every shared-chunk call: one pass over ``Akk``."""
    return jax.lax.cond(jnp.any(nonfinite(Akk)), rerun, lambda: Akk)


def _akk(Akk, bad, reset, R: int, HV: int):
    """F2's ``Akk`` ``[R, HV, NC, C, C]`` from the kernel's ``[P, NC, C, C]``; in shared
    chunks (``bad``: the kernel's ``[P, NC, C, 1]`` rows of ``finite_inverse``) NaN in the
    rows an overflow reaches, from its row on and in its own sequence only, its entries
    between sequences left exact zeros."""
    Akk = unflat(Akk, R, HV)
    if reset is None:
        return Akk
    reached = reached_rows(unflat(bad[0], R, HV, squeeze=True) != 0, reset, later=False)
    return jnp.where(reached[..., None] & sequence_pairs(reset, HV), jnp.nan, Akk)


def intra_chunk_kernel(mm: Products, scale: float, C: int, block: int, blocks, has_lo: bool, has_reset: bool):
    """F2's kernel on TPU: the whole chunk at once, anchored products over row blocks and
    the diagonal blocks one column at a time (``scores_body``), ``(I + L)^-1`` row by row
    (``unit_lower_inverse_body``)."""

    def kernel(*refs):
        q_ref, k_ref, g_ref, b_ref, lo_ref, seg, aqk_ref, akk_ref, bad_ref = f2_refs(refs, has_lo, has_reset)

        def feature_block(k0, bk, S):
            kc = (slice(None), pl.ds(k0, bk))
            Sqk, Skk = scores_body(mm, q_ref[kc], k_ref[kc], g_ref[kc], block, ref_or_none(lo_ref, kc))
            return S[0] + Sqk, S[1] + Skk

        scores = lambda zeros: blockwise(blocks, feature_block, (zeros, zeros))  # noqa: E731
        L = aqk_and_l(scores, C, scale, seg, aqk_ref, b_ref)
        if seg is None:
            put(akk_ref, ..., unit_lower_inverse_body(L))
        else:  # (shared chunks: the rows an overflow reaches marked by the stage, as on Triton)
            A, bad_ref[...] = finite_inverse(lambda L: unit_lower_inverse_body(L, (seg[0][...], seg[1][...])), L)
            put(akk_ref, ..., A)

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


@final
class PallasIntraBackward(AbstractIntraBackward, PallasFeatureBlocks):
    """B4 as a Pallas kernel over (row * head, chunk); ``G_lo`` and ``reset`` as
    ``PallasIntra``. On Triton (``intra_bwd_levels_kernel``) the transposes of F2's
    halving-level tile products, one program per block of ``block_k`` feature columns, at
    most ``B4_MAX_BLOCK`` (every gradient column depends on its own feature column alone;
    dbeta's parts are summed after the call); with ``rows`` 16 or 32, one program per
    block of columns and ``rows``-token sub-block of the chunk (``intra_bwd_rows_kernel``,
    FLA's grid); on TPU the whole chunk at once (``pair_rows_body``, ``pair_cols_body``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"intra": KDA})
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

    block: int = eqx.field(static=True, default=16)
    # The Triton kernel's rows a program: 64 (the default), the whole chunk (the halving
    # levels of ``intra_bwd_levels_kernel``, at any chunk size); 16 or 32, sub-blocks of
    # that many tokens (``kdax.pallas._intra_rows``: its own pairs token by token, the other
    # sub-blocks' by [rows, rows] x [rows, block] products; a chunk smaller than ``rows``
    # is one sub-block). The same outputs and precision; Triton only (interpreted too).
    rows: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        _check_rows(self.rows, self.target)

    @tuned
    def __call__(self, scale, q, k, beta, G, dAqk, grads, G_lo=None, reset=None, *, precision: str = "highest"):
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
            extra, extra_specs = segment_operands(reset, HV)
            ins, specs = ins + extra, specs + extra_specs
        has_lo, has_reset = G_lo is not None, reset is not None

        if self.target == "triton" and self.rows != 64:
            bk = min(blocks[0][1], B4_MAX_BLOCK)
            B = min(self.rows, C)
            kernel = intra_bwd_rows_kernel(self.products(precision), scale, C, B, has_lo, has_reset)
            kinds = ["k", "k", "1", "k", "1", "1", "r", "r", "r"] + ["k"] * has_lo + ["1", "1"] * has_reset
            keep = [i for i in range(len(ins)) if i != 8]  # dbeta: its parts are summed here
            dq, dk, db, dG = row_block_call(kernel, [ins[i] for i in keep], kinds, C, B, bk, Kp // bk, R * HV, NC,
                                            q.dtype, self.run_interpreted, self.triton_params())
            db = flat(grads.dbeta) + jnp.sum(db, axis=-1, keepdims=True)
            cut = lambda x: unflat(x[..., :K], R, HV)
            return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
        if self.target == "triton":
            bk = min(blocks[0][1], B4_MAX_BLOCK)
            blocks = column_blocks("triton", Kp, bk)
            kernel = intra_bwd_levels_kernel(self.products(precision), scale, C, has_lo, has_reset)
            kinds = ["k", "k", "1", "k", "1", "1", "k", "k", "k"] + ["k"] * has_lo + ["1", "1"] * has_reset
            keep = [i for i in range(len(ins)) if i != 8]  # dbeta: its parts are summed here
            dq, dk, db, dG = column_block_call(kernel, [ins[i] for i in keep], kinds, C, bk, len(blocks), R * HV, NC,
                                               q.dtype, self.run_interpreted, self.triton_params())
            db = flat(grads.dbeta) + jnp.sum(db, axis=-1, keepdims=True)
            cut = lambda x: unflat(x[..., :K], R, HV)
            return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
        else:
            mm = self.products(precision)

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
                dq_a = scale * pair_rows_body(mm, dA, k, G, block, lo)
                dk_a = scale * pair_cols_body(mm, dA, q, G, block, lo)
                r = pair_rows_body(mm, dL, k, G, block, lo)
                c = pair_cols_body(mm, dL * beta, k, G, block, lo)
                diag = lambda S: jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), S, 0.0), axis=1, keepdims=True)
                dq_out[...], dk_out[...], dg_out[...], ddb = intra_bwd_outputs(
                    q, k, beta, dq_a, dk_a, r, c, scale * diag(dA), diag(dL), dq_ref[...], dk_ref[...], dg_ref[...])
                db_out[...] = db_ref[...] + ddb
        dq, dk, db, dG = self.call(kernel, ins, specs, [(C, Kp), (C, Kp), (C, 1), (C, Kp)], R * HV, NC, q.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        return ChunkGrads(cut(dq), cut(dk), grads.dv, unflat(db, R, HV, squeeze=True), cut(dG), None)
