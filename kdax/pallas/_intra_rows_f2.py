"""F2 on Triton over smaller programs (``PallasIntra(rows=16)``): the scores one program per
(row * head, chunk, ``B``-token sub-block), each writing its ``B`` rows of ``Aqk`` and of
``L``; then ``(I + L)^-1`` one program per (row * head, chunk) from the stored ``L``
(``doubling_unit_lower_inverse``, the whole-chunk kernel's inverse, the same code on the
same ``L``). The whole-chunk kernel (``kdax.pallas._intra_levels.intra_levels_kernel``,
``rows=64``) holds the chunk's ``[C, C]`` level operands and the inverse in one program
of 207 registers (one CTA an SM; benchmarks/results/gpu_h200/triton_candidates/
b4_f2_vs_fla.md); here a scores program holds ``[B, C]`` tiles.

The scores of the program's sub-block I (rows i in ``[r0, r0 + B)``) are the whole-chunk
kernel's, entry for entry (``level_scores``: the same halving levels, the same anchors,
the same products over the same feature blocks), restricted to its rows:

- the pairs inside the sub-block (levels below log2(B)) as ``[B, B]`` products, each side's
  decay taken to the level's anchor inside the sub-block (``half_block_decay`` on the
  sub-block's rows), the diagonal a row sum; the ``[B, B]`` block is laid into the ``[B, C]``
  rows by tiling it over the column blocks and selecting the program's own;
- the pairs with earlier sub-blocks (levels log2(B) .. log2(C) - 1), one level at a time
  where the sub-block has pairs at it (bit ``lev`` of r0 set: the sub-block lies in the upper
  half of its ``2s``-token block, s = 2^lev; a ``cond``, so a program runs as many levels
  as r0 has bits set), as ``[B, w] x [w, s]`` products with the s tokens of the lower half,
  anchor a = the first row of the upper half, the rows' decay ``e^(G_i - G_a)``, the
  columns' ``e^(G_a - G_j)``; the ``[B, s]`` result laid into the lower half's columns
  by tiling (as the diagonal block).

Every exponent is non-positive, every pair has the reference stage's anchor, so a
non-finite value reaches the entries it reaches there (and in the whole-chunk kernel).
Under ``"fast"`` the score products take bf16 operands (``Products``), the inverse float32
(plain TF32, as the whole-chunk kernel's).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._numerics.hilo import nonpositive
from ._arith import Products, exp_by_exp2, fast_decay, nonfinite_rows
from ._common import blockwise, compiler_params, iota, kernel_name, loop, manual_inputs, put, ref_or_none
from ._intra_levels import doubling_unit_lower_inverse, level_pairs, marked_inverse


def _sub_block_decay(G, lo, g_ref, lo_ref, cols, r0, B: int, lev):
    """``half_block_decay`` for the sub-block's ``B`` rows from ``r0`` (``G``, ``lo``: those
    rows of ``cols``): ``e^(G_t - G_a)`` in the upper half of t's ``2s``-token block,
    ``e^(G_a - G_t)`` in the lower one, a the upper half's first row (inside the sub-block
    for ``lev < log2(B)``); both exponents non-positive."""
    sr, sl = jax.lax.shift_right_logical, jax.lax.shift_left
    t = r0 + iota((B,), 0)
    a = sl(sr(t, lev + 1), lev + 1) + sl(jnp.int32(1), lev)
    upper = (sr(r0 + iota((B, 1), 0), lev) & 1) == 1
    d = G - g_ref[a, cols]
    if lo is not None:
        d = d + (lo - lo_ref[a, cols])
    d = jnp.where(upper, d, -d)
    return exp_by_exp2(d if lo is None else nonpositive(d))


def intra_rows_scores_kernel(mm: Products, scale: float, C: int, B: int, blocks, has_lo: bool, has_reset: bool):
    """F2's scores for one ``B``-token sub-block (see the module docstring). Refs: ``q, k, G``
    (``[C, Kp]``), ``beta`` (``[C, 1]``), ``G_lo`` (or left out), the reset table's column
    and row (or left out), all the whole chunk; outputs the sub-block's rows of ``Aqk``
    (lower triangle with the diagonal) and of ``L`` (strictly lower, times beta), ``[B, C]``
    each, pairs across sequences exact zeros."""
    nb, nc = B.bit_length() - 1, C.bit_length() - 1

    def kernel(*refs):
        q_ref, k_ref, g_ref, b_ref = refs[:4]
        rest = refs[4:-2]
        lo_ref = rest[0] if has_lo else None
        seg_col, seg_row = (rest[-2], rest[-1]) if has_reset else (None, None)
        aqk_ref, l_ref = refs[-2:]
        dtype = b_ref.dtype  # (the compute dtype: Aqk may be stored bf16)
        I = pl.program_id(2)
        r0 = I * B
        mine = pl.ds(r0, B)

        # -- the sub-block's own pairs, [B, B] -----------------------------------------
        def diagonal(k0, bk, d):
            cols = (mine, pl.ds(k0, bk))
            return d + jnp.sum(q_ref[cols] * k_ref[cols], axis=1, keepdims=True)

        d = blockwise(blocks, diagonal, jnp.zeros((B, 1), dtype))
        zb = jnp.zeros((B, B), dtype)
        Dqk = jnp.where(iota((B, B), 0) == iota((B, B), 1), d, 0.0)

        def inner(lev, S):
            def block(k0, bk, P):
                cols = pl.ds(k0, bk)
                at = (mine, cols)
                E = _sub_block_decay(g_ref[at], ref_or_none(lo_ref, at), g_ref, lo_ref, cols, r0, B, lev)
                kE = k_ref[at] * E
                return P[0] + mm.dot(q_ref[at] * E, kE, tb=True), P[1] + mm.dot(kE, kE, tb=True)

            Pqk, Pkk = blockwise(blocks, block, (zb, zb))
            pairs = level_pairs(B, lev)
            return S[0] + jnp.where(pairs, Pqk, 0.0), S[1] + jnp.where(pairs, Pkk, 0.0)

        Dqk, Dkk = loop(0, nb, inner, (Dqk, zb))

        # -- the pairs with earlier sub-blocks, [B, C] ----------------------------------
        zc = jnp.zeros((B, C), dtype)
        j = iota((1, C), 1)
        sr, sl = jax.lax.shift_right_logical, jax.lax.shift_left

        def tile(D, w):  # [B, w] -> [B, C]: D repeated over the C / w column blocks
            return D if w == C else jnp.broadcast_to(D[:, None, :], (B, C // w, w)).reshape(B, C)

        def outer(lev, S):
            s = 1 << lev
            a = sl(sr(r0, jnp.int32(lev)), jnp.int32(lev))  # the first row of the sub-block's half (the anchor)
            theirs = pl.ds(jnp.maximum(a - s, 0), s)  # the lower half: s tokens

            def block(k0, bk, P):
                cols = pl.ds(k0, bk)
                at, first = (mine, cols), (pl.ds(a, 1), cols)
                Ga, loa = g_ref[first], ref_or_none(lo_ref, first)
                into = fast_decay(g_ref[at], Ga, ref_or_none(lo_ref, at), loa)  # e^(G_i - G_a), i >= a
                kx = k_ref[theirs, cols] * fast_decay(Ga, g_ref[theirs, cols], loa, ref_or_none(lo_ref, (theirs, cols)))
                return P[0] + mm.dot(q_ref[at] * into, kx, tb=True), P[1] + mm.dot(k_ref[at] * into, kx, tb=True)

            zs = jnp.zeros((B, s), dtype)
            Pqk, Pkk = blockwise(blocks, block, (zs, zs))
            pairs = sr(j, jnp.int32(lev)) == sr(a, jnp.int32(lev)) - 1  # the columns of the lower half
            return jnp.where(pairs, tile(Pqk, s), S[0]), jnp.where(pairs, tile(Pkk, s), S[1])

        Sqk, Skk = zc, zc
        for lev in range(nb, nc):  # (unrolled: each level's lower half s = 2^lev tokens wide; run where it has pairs)
            on = (sr(r0, jnp.int32(lev)) & 1) == 1
            Sqk, Skk = jax.lax.cond(on, functools.partial(outer, lev), lambda S: S, (Sqk, Skk))

        # -- the [B, B] block laid into its columns, the tail ---------------------------
        own = sr(j, jnp.int32(nb)) == I
        Sqk, Skk = jnp.where(own, tile(Dqk, B), Sqk), jnp.where(own, tile(Dkk, B), Skk)
        i = r0 + iota((B, 1), 0)
        lower, strict = j <= i, j < i
        if seg_col is not None:
            same = seg_col[mine, :] == seg_row[...]
            lower, strict = lower & same, strict & same
        put(aqk_ref, ..., scale * jnp.where(lower, Sqk, 0.0))
        l_ref[...] = jnp.where(strict, b_ref[mine, :] * Skk, 0.0).astype(l_ref.dtype)

    kernel.__qualname__ = "PallasIntra.kernel"  # its name in profiles
    return kernel


def intra_solve_kernel(mm: Products, fast: bool, has_reset: bool = False, isolate: bool = False):
    """F2's ``(I + L)^-1`` from the stored ``L`` of one chunk: ``intra_levels_kernel``'s
    tail, the same code on the same ``L`` (``marked_inverse`` of
    ``doubling_unit_lower_inverse``, float32 products, plain TF32 under ``fast``; with
    ``has_reset``, as ``finite_inverse``: its bad rows a second output). ``isolate``
    (shared chunks; the segment operands after ``L``): the doubling's products selected by
    sequence, ``intra_levels_kernel``'s ``isolate_inverse``. At four warps that took 173
    registers of the 165 that fit several CTAs an SM, 88 B of spills under "bfloat16", so
    the stage runs it only on a call whose inverse overflowed (``PallasIntra``). (In
    ``[16, 16]`` blocks, the zero blocks left out, sm_90 at 4 warps took 137 registers
    under "fast" against 165, 255 against 239 under "bfloat16", and 2.5x the
    instructions.)"""

    def kernel(l_ref, *refs):
        seg, (akk_ref, *bad_ref) = (refs[:2], refs[2:]) if isolate else (None, refs)
        inverse = functools.partial(doubling_unit_lower_inverse, mm.float32(), plain_tf32=fast, seg=seg)
        if has_reset:  # (L's bad rows written first: held across the inverse, 30 registers more)
            bad_ref[0][...] = nonfinite_rows(l_ref[...])
            put(akk_ref, ..., inverse(jnp.where(jnp.abs(l_ref[...]) < jnp.inf, l_ref[...], 0.0)))
        else:
            put(akk_ref, ..., marked_inverse(inverse, l_ref[...]))

    kernel.__qualname__ = "PallasIntra.kernel_solve"  # its name in profiles
    return kernel


def scores_rows_call(kernel, inputs, C: int, B: int, P: int, NC: int, stored, interpret: bool, params: dict):
    """The scores kernel over the grid (P, NC, C / B): every input its whole chunk block;
    outputs ``Aqk`` (``stored``) and ``L`` (the compute dtype, beta's), ``[P, NC, C, C]``,
    ``B`` rows a program."""
    specs = [pl.BlockSpec((None, None) + x.shape[2:], lambda p, c, g: (p, c, 0, 0)) for x in inputs]
    compute = inputs[3].dtype
    inputs, mat = manual_inputs(inputs)
    rspec = pl.BlockSpec((None, None, B, C), lambda p, c, g: (p, c, g, 0))
    return pl.pallas_call(
        kernel,
        name=kernel_name(kernel),
        out_shape=[jax.ShapeDtypeStruct((P, NC, C, C), stored, manual_axis_type=mat),
                   jax.ShapeDtypeStruct((P, NC, C, C), compute, manual_axis_type=mat)],
        grid=(P, NC, C // B),
        in_specs=specs,
        out_specs=[rspec, rspec],
        interpret=interpret,
        compiler_params=None if interpret else compiler_params("triton", False, 3, **params),
    )(*inputs)
