"""B4 on Triton over FLA's grid (``PallasIntraBackward(rows=16)``): one program per
(row * head, chunk, block of feature columns, ``B``-token sub-block of the chunk), 16 programs
a chunk and head at C = 64, K = 128, against the 4 of the whole-chunk kernel
(``kdax.pallas._intra_levels.intra_bwd_levels_kernel``, ``rows=64``). The same outputs, the
same precision (float32 operands; TF32x3 where ``f32_dot`` says so), the same reach of a
non-finite value; nothing ``[C, C]``-sized alive in a program (benchmarks/results/gpu_h200/
triton_candidates/b4_f2_vs_fla.md: the whole-chunk kernel's level operands hold it at one
178-register CTA per SM).

For the program's sub-block I (rows i in ``[r0, r0 + B)``), every sum of
``kdax.stages._intra._score_grads`` restricted to its rows:

- rows side, ``R_i = sum_{j < i} S_ij k_j e^(G_i - G_j)`` (S = dA: dq_a; S = dL: r):
  the earlier sub-blocks J < I as ``[B, B] x [B, w]`` products with the decay split at the
  anchor a = r0 (I's first row), ``e^(G_i - G_a) sum_j S_ij (k_j e^(G_a - G_j))``; the
  sub-block's own pairs one column j a step (``[B, w]`` elementwise, row j of k and G read
  once and broadcast, column j of dA and dL);
- columns side, ``e_j = sum_{i > j} (scale dA_ij q_i + dL_ij beta_i k_i) e^(G_i - G_j)``:
  the later sub-blocks J > I with dA, dL read transposed (``[B, B]^T x [B, w]``), anchor
  n = r0 + B - 1 (I's last row), ``e^(G_n - G_j) sum_i S_ij (x_i e^(G_i - G_n))``; the
  sub-block's own pairs one row i a step;
- the diagonal pairs (i = j) apart, added to dq, dk and dbeta after dG, in which they
  cancel exactly (``kdax.stages._intra_levels.pair_sums``).

Every exponent is non-positive (G non-increasing: a, n inside the sub-block, the other
token on the far side of them; the diagonal steps' pairs selected in the exponent and in
the sum, the exponent of a pair left out taken as 0). Pairs across sequences (resets) are
selected to exact zeros before any product. Non-finite token values (q, k, beta, G, G_lo at
token t, column d) are zeroed in the operands of the cross-sub-block products and their
reach set after, as the whole-chunk kernel does: the row sums NaN at rows i >= t in column d,
the column sums at rows j <= t (a flag per entry carried through each loop, one reduction
over the sub-block's rows at the end).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._numerics.hilo import exponent
from .._numerics.isolation import finite_or_zero
from ._arith import Products, exp_by_exp2, fast_decay, nonfinite
from ._common import compiler_params, iota, kernel_name, loop, manual_inputs


def _bad(*xs):
    """Entries where any of ``xs`` (None: left out) is NaN or infinite (bool)."""
    out = None
    for x in xs:
        if x is not None:
            out = nonfinite(x) if out is None else out | nonfinite(x)
    return out


def intra_bwd_rows_kernel(mm: Products, scale: float, C: int, B: int, has_lo: bool, has_reset: bool):
    """B4's kernel on Triton for ``B``-token sub-blocks (see the module docstring). Refs:
    ``q, k, beta, G, dA, dL`` of the whole chunk (the token ones in the program's ``w``
    feature columns), ``dq, dk, dG`` of the program's rows, ``G_lo`` (whole chunk, or left
    out), the reset table's column and row (or left out); outputs ``dq, dk`` of its rows,
    dbeta's part from its columns ``[B, 1]``, ``dG``."""
    nsub = C // B

    def kernel(*refs):
        q_ref, k_ref, b_ref, g_ref, da_ref, dl_ref, dq_ref, dk_ref, dg_ref = refs[:9]
        rest = refs[9:-4]
        lo_ref = rest[0] if has_lo else None
        seg_col, seg_row = (rest[-2], rest[-1]) if has_reset else (None, None)
        dq_out, dk_out, db_out, dg_out = refs[-4:]
        w = q_ref.shape[-1]
        dtype = q_ref.dtype

        I = jax.lax.rem(pl.program_id(2), jnp.int32(nsub))
        r0 = I * B
        mine = pl.ds(r0, B)
        rows = iota((B, w), 0)
        rows1 = iota((B, 1), 0)
        lo_at = lambda idx: None if lo_ref is None else lo_ref[idx]  # noqa: E731
        zero = jnp.zeros((B, w), dtype)

        def same(a, b):  # [B, B]: tokens a (rows) and b (columns) in one sequence, or None
            return None if seg_col is None else seg_col[a, :] == seg_row[:, b]

        def pairs(ref, a, b):  # the [B, B] block ref[a, b], pairs across sequences exact zeros
            S = ref[a, b]
            ok = same(a, b)
            return S if ok is None else jnp.where(ok, S, 0.0)

        # -- rows side: sub-blocks J < I, anchored at a = r0 ------------------------------
        first = pl.ds(r0, 1)
        Ga, loa = g_ref[first, :], lo_at(first)

        def rows_block(J, acc):
            dq_a, r, seen = acc
            theirs = pl.ds(J * B, B)
            k, G, lo = k_ref[theirs, :], g_ref[theirs, :], lo_at(theirs)
            seen = jnp.where(_bad(k, G, lo), 1.0, seen)
            kx = mm.split(finite_or_zero(k * fast_decay(Ga, G, loa, lo)))  # e^(G_a - G_j), j < a
            return (dq_a + mm.scaled_dot(None, pairs(da_ref, mine, theirs), kx),
                    r + mm.scaled_dot(None, pairs(dl_ref, mine, theirs), kx), seen)

        G, lo = g_ref[mine, :], lo_at(mine)
        seg_mine = None if seg_col is None else seg_col[mine, :]

        def rows_diag(j, acc):  # column t = r0 + j of the sub-block's own pairs i > t
            dq_a, r = acc
            t = pl.ds(r0 + j, 1)
            ok = rows1 > j if seg_mine is None else (rows1 > j) & (seg_mine == seg_col[t, :])
            d = jnp.where(ok, exponent(G, g_ref[t, :], lo, lo_at(t)), 0.0)
            kx = k_ref[t, :] * exp_by_exp2(d)
            return (jnp.where(ok, dq_a + da_ref[mine, t] * kx, dq_a),
                    jnp.where(ok, r + dl_ref[mine, t] * kx, r))

        # The sub-block's own pairs first, from zeros: their elementwise sums keep the
        # elementwise tiles' layout (added in after the products', each step's sum went
        # through shared memory into the products' layout).
        # (B steps, the last one empty: with B - 1, ptxas gave 130 registers, past 4 CTAs an SM)
        dq_a, r = loop(0, B, rows_diag, (zero, zero))
        pq, pr, before = loop(0, I, rows_block, (zero, zero, zero))
        into = fast_decay(G, Ga, lo, loa)  # e^(G_i - G_a), i >= a
        dq_a, r = dq_a + into * pq, r + into * pr

        # -- columns side: sub-blocks J > I, anchored at n = r0 + B - 1 --------------------
        last = pl.ds(r0 + B - 1, 1)
        Gn, lon = g_ref[last, :], lo_at(last)

        def cols_block(J, acc):
            e, seen = acc
            theirs = pl.ds(J * B, B)
            q, k, Gt, lot, beta = q_ref[theirs, :], k_ref[theirs, :], g_ref[theirs, :], lo_at(theirs), b_ref[theirs, :]
            to = fast_decay(Gt, Gn, lot, lon)  # e^(G_i - G_n), i > n
            bk = beta * k
            seen = jnp.where(_bad(q, bk, Gt, lot), 1.0, seen)
            qx = finite_or_zero(scale * q * to)
            bx = finite_or_zero(bk * to)
            return (e + mm.scaled_dot(None, pairs(da_ref, theirs, mine), qx, ta=True)
                    + mm.scaled_dot(None, pairs(dl_ref, theirs, mine), bx, ta=True)), seen

        mine_idx = r0 + rows1

        def cols_diag(i, e):  # row t = r0 + i of the sub-block's own pairs j < t
            t = pl.ds(r0 + i, 1)
            ti = jnp.zeros((B, 1), jnp.int32) + (r0 + i)
            ok = rows1 < i if seg_mine is None else (rows1 < i) & (seg_mine == seg_col[t, :])
            x = (scale * da_ref[ti, mine_idx]) * q_ref[t, :] + (dl_ref[ti, mine_idx] * b_ref[t, :]) * k_ref[t, :]
            d = jnp.where(ok, exponent(g_ref[t, :], G, lo_at(t), lo), 0.0)
            return jnp.where(ok, e + x * exp_by_exp2(d), e)

        e = loop(0, B, cols_diag, zero)
        pe, after = loop(I + 1, nsub, cols_block, (zero, zero))
        e = e + fast_decay(Gn, G, lon, lo) * pe  # e^(G_n - G_j), j <= n

        # -- the reach of non-finite token values, then the outputs ------------------------
        q, k, beta = q_ref[mine, :], k_ref[mine, :], b_ref[mine, :]
        bad_G = _bad(G, lo)
        down = rows >= jnp.min(jnp.where(nonfinite(k) | bad_G, rows, jnp.where(before > 0, -1, B)), axis=0,
                               keepdims=True)
        bk = beta * k
        up = rows <= jnp.max(jnp.where(nonfinite(q) | nonfinite(bk) | bad_G, rows, jnp.where(after > 0, B, -1)),
                             axis=0, keepdims=True)
        dq_a = jnp.where(down, jnp.nan, dq_a)
        r = jnp.where(down, jnp.nan, r)
        e = jnp.where(up, jnp.nan, e)
        dg_out[...] = dg_ref[...] + (scale * q * dq_a + k * (beta * r)) - k * e
        # the diagonal pairs, which cancel in dG, join dq, dk and dbeta alone
        dA_d = scale * da_ref[mine_idx, mine_idx]
        dq_out[...] = dq_ref[...] + scale * dq_a + dA_d * k
        e = e + dA_d * q
        dL_d = dl_ref[mine_idx, mine_idx]
        r = r + dL_d * k
        db_out[...] = jnp.sum(k * r, axis=1, keepdims=True)
        dk_out[...] = dk_ref[...] + e + dL_d * bk + beta * r

    kernel.__qualname__ = "PallasIntraBackward.kernel"  # its name in profiles
    return kernel


def row_block_call(kernel, inputs, kinds, C: int, B: int, bk: int, nk: int, P: int, NC: int, dtype, interpret: bool,
                   params: dict):
    """B4's Triton call over the grid (P, NC, nk * C / B), the sub-block fastest: inputs of
    kind ``"k"`` (``[P, NC, C, nk * bk]``) give each program its block of ``bk`` columns,
    ``"r"`` the same block of its ``B`` rows alone, the others (``[P, NC, *block]``) their
    whole chunk block. Outputs: three ``[P, NC, C, nk * bk]`` and dbeta's part of each
    column block, ``[P, NC, C, nk]``."""
    nsub = C // B
    kb = lambda g: jax.lax.div(g, jnp.int32(nsub))  # noqa: E731
    sub = lambda g: jax.lax.rem(g, jnp.int32(nsub))  # noqa: E731
    specs = []
    for x, kind in zip(inputs, kinds):
        if kind == "k":
            specs.append(pl.BlockSpec((None, None, C, bk), lambda p, c, g: (p, c, 0, kb(g))))
        elif kind == "r":
            specs.append(pl.BlockSpec((None, None, B, bk), lambda p, c, g: (p, c, sub(g), kb(g))))
        else:
            specs.append(pl.BlockSpec((None, None) + x.shape[2:], lambda p, c, g: (p, c, 0, 0)))
    inputs, mat = manual_inputs(inputs)
    wide = jax.ShapeDtypeStruct((P, NC, C, nk * bk), dtype, manual_axis_type=mat)
    rspec = pl.BlockSpec((None, None, B, bk), lambda p, c, g: (p, c, sub(g), kb(g)))
    return pl.pallas_call(
        kernel,
        name=kernel_name(kernel),
        out_shape=[wide, wide, jax.ShapeDtypeStruct((P, NC, C, nk), dtype, manual_axis_type=mat), wide],
        grid=(P, NC, nk * nsub),
        in_specs=specs,
        out_specs=[rspec, rspec, pl.BlockSpec((None, None, B, 1), lambda p, c, g: (p, c, sub(g), kb(g))), rspec],
        interpret=interpret,
        compiler_params=None if interpret else compiler_params("triton", False, 3, **params),
    )(*inputs)
