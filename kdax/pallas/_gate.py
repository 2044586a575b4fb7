"""Pallas gate family: F1 (activations + chunk cumsum) and B5 (their backward).

The chunk-local cumsum (and its reverse in B5) is a matmul with a triangular matrix of
ones on TPU, a scan on Triton (whose float32 products are FMA loops that hold whole rows
of both operands in registers; B5 reads the chunk's rows in reverse so that its reverse
cumsum is a forward scan). On Triton the kernels take the features a block of columns at
a time (``column_blocks``), the row statistics (l2 norms, non-finite rows) first. Sums
over a chunk for dA_log / ddt_bias are written per column and added up outside.

Shared chunks (``reset``, ``kdax._layouts.resets``): F1 gives a sequence's first token the
reset log decay, B5 sums each token's ``dG`` over its own sequence alone (``_segment_sums``:
a product with the chunk's same-sequence mask on both targets) and gives the first token
no gradient, as the reference stages.
"""

from typing import ClassVar, Mapping, Optional, Union

import equinox as eqx
from types import MappingProxyType
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._config import KDAConfig
from .._layouts.tokens import FinalGrads, Tokens
from .._numerics import precision as _precision
from .._numerics.hilo import grid_bits, split_log_decay
from .._stage_protocol.final import final
from .._annotations import ChunkK, ChunkScalar
from ..ref import L2NORM_EPS, log_decay_floor, reset_log_decay
from ..stages import KDA, AbstractGate, AbstractGateBackward, Activated, RawGrads
from ._arith import Products, from_first, nonfinite, nonfinite_rows
from ._common import (
    PallasTarget, chunk_spec, column_blocks, flat, iota, loaded, pow2, ref_or_none,
    token_operand, tuned, unflat,
)
from ._shared_chunks import reached_rows
from ._gate_operands import _all_valid, _param_refs, _params, _token_masks
from ._written import as_written, poison_operand, poisoned, writes_final, written_output


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _softplus(x, e=None):
    """``softplus(x)`` (``e``: ``exp(-|x|)`` if already at hand)."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)) if e is None else e)


def _softplus_and_sigmoid(x):
    """``(softplus(x), sigmoid(x))`` from one exponential ``e = exp(-|x|)``:
    ``sigmoid = 1 / (1 + e)`` for ``x >= 0``, ``e / (1 + e)`` below (B5 needs both)."""
    e = jnp.exp(-jnp.abs(x))
    r = 1.0 / (1.0 + e)
    return _softplus(x, e), jnp.where(x >= 0, r, e * r)


def _gate_input(g, a_log, dtb):
    """(x = g + dt_bias, a = exp(A_log) or None)."""
    x = g if dtb is None else g + dtb
    return x, (None if a_log is None else jnp.exp(a_log))


def _round_even(x):
    """``jnp.round`` (to nearest, ties to even) from ``floor``, which both lowerings have
    (Triton lowers no ``round``; XLA folds the ``(x + 1.5 2^23) - 1.5 2^23`` trick away).
    ``x + 0.5`` is exact for ``|x| < 2^22``."""
    r = jnp.floor(x + 0.5)
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return jnp.where(((r - x) == 0.5) & odd, r - 1.0, r)


def _rows_cumsum(mm: Products, x, lower):
    """The chunk-local inclusive cumsum of ``x [C, K]`` down its rows: ``lower @ x``
    (``lower`` the chunk's lower-triangular ones) on TPU; on Triton (``lower`` None) a
    scan (``tl.cumsum``): a float32 product there is a loop of FMAs that holds whole rows
    and columns of both operands in registers (F1 spilled ~15 KiB a thread at K = 128).
    Sums on the grid of ``kdax._numerics.hilo`` are exact in either order; the low parts' sum
    (small) may round differently, so G and G_lo are the reference's bit for bit where
    both sum in the same order (TPU, interpret mode), else to ~1e-9 relative."""
    return jnp.cumsum(x, axis=0) if lower is None else mm.dot(lower, x)


def _activate(cfg: KDAConfig, g, valid, a_log, dtb):
    """The clamped log decay of a block of columns: the in-kernel gate if asked, the
    dtype's floor, zero at padding (``valid [C, 1]``; None: no padding)."""
    if cfg.use_gate_in_kernel:
        x, a = _gate_input(g, a_log, dtb)
        if cfg.lower_bound is None:
            g = -a * _softplus(x)
        elif cfg.lower_bound == -jnp.inf:
            g = jnp.full_like(x, -jnp.inf)
        else:
            g = cfg.lower_bound * _sigmoid(x if a is None else a * x)
    # The floor keeps G small and finite for any gate in [-inf, 0] (see log_decay_floor).
    g = jnp.maximum(g, log_decay_floor(g.dtype))
    return g if valid is None else jnp.where(valid > 0, g, 0.0)


def _reset(g, r):
    """The log decay ``g`` with a sequence's first token (``r [C, 1]`` > 0, a token that
    starts a sequence inside a shared chunk) at the reset log decay; a NaN or inf gate
    stays (it reaches G from its own row on, as any)."""
    return jnp.where((r > 0) & (jnp.abs(g) < jnp.inf), jnp.asarray(reset_log_decay(g.dtype), g.dtype), g)


def _segment_sums(mm: Products, dG, r, reverse: bool, poison):
    """``dg[t] = sum of dG[s]`` over ``s >= t`` in t's sequence (up to the next token
    with ``r [C, 1] > 0``), for every column of ``dG [C, k]``; the rows in reverse token
    order when ``reverse`` (Triton's B5). The same-sequence mask from counts of resets
    (selects and sums of 0/1 values: exact, no product), then one product with ``dG``, so
    no other sequence's terms are summed (as the reference's ``segment_cumsum``: they
    would cancel to ~0, but round). The mask is exact in TF32: ``Products.mask_dot`` (B5
    on packed sequences spilled 160 B a thread on sm_90 with the mask split for TF32x3).
    ``dG`` arrives with its non-finite entries zeroed (in another sequence's rows they
    would meet the mask's zeros as ``0 * inf``), and ``poison [C, 1]``, NaN at the rows that
    sum one of them and 0 elsewhere, is added (both made by the stage before the kernel:
    ``kdax.pallas._shared_chunks.reached_rows``; selects in the kernel spilled 40 B on sm_90)."""
    C = r.shape[0]
    i0, i1 = iota((C, C), 0), iota((C, C), 1)
    R2 = jnp.broadcast_to(r, (C, C))  # [a, b] = r[a]
    cs_row = jnp.sum(jnp.where(i0 <= i1, R2, 0.0), axis=0, keepdims=True)  # [1, C]: resets at rows <= b
    diag = lambda x, axis: jnp.sum(jnp.where(i0 == i1, x, 0.0), axis=axis, keepdims=True)  # (a transpose)
    cs_col = diag(cs_row, 1)  # [C, 1]: the same, by row
    if reverse:  # row i is token C-1-i: the resets between are those at rows [j, i)
        r_row = diag(R2, 0)
        same = (i1 <= i0) & ((cs_col - r) == (cs_row - r_row))
    else:  # the resets in (t, s]
        same = (i1 >= i0) & (cs_col == cs_row)
    return mm.mask_dot(same.astype(dG.dtype), dG) + poison


def _rstd(ss):
    return 1.0 / jnp.sqrt(ss + L2NORM_EPS)


# Gate kernels take 16 columns at a time on Triton: whole [C, K] tiles of five operands held
# at once took them past the 255 registers a thread has, spilling; 32 columns still spilled
# B5 at four warps.
GATE_BLOCK = 16


def gate_kernel(mm: Products, cfg: KDAConfig, blocks, split: bool, scan: bool, has: tuple, loads=(None,) * 4,
                reset: bool = False, padded: bool = True):
    """F1's kernel over one (row * head, chunk) block, ``blocks`` of columns at a time
    (``column_blocks``): outputs ``(q, k, beta, G[, q_rstd, k_rstd][, G_lo])``. ``reset``:
    a ``[C, 1]`` input after ``valid`` marks the tokens that start a sequence (``_reset``).
    ``split``: G as the exact sum ``G + G_lo`` (``kdax._numerics.hilo``; float32), else G alone;
    ``scan``: the cumsums as scans (Triton), else products (``_rows_cumsum``). ``loads``:
    what each block of q, k, g, beta becomes as read (``loaded``: a ``Tokens`` view's
    cast and cleaning, ``kdax._layouts.tokens``; None: as is). ``padded``: a ``valid``
    ``[C, 1]`` input follows beta (False: every token is valid, no such input:
    ``_all_valid``)."""
    l2 = cfg.use_qk_l2norm_in_kernel

    def kernel(q_ref, k_ref, g_ref, b_ref, *refs):
        q_ref, k_ref, g_ref, b_ref = (loaded(r, ld) for r, ld in zip((q_ref, k_ref, g_ref, b_ref), loads))
        v_ref, refs = (refs[0], refs[1:]) if padded else (None, refs)
        r = refs[0][...] if reset else None
        refs = refs[1:] if reset else refs
        n = sum(has)
        params, outs = refs[:n], list(refs[n:])
        a_ref, d_ref = _param_refs(params, has)
        a = ref_or_none(a_ref, ...)
        valid = None if v_ref is None else v_ref[...]
        q_o, k_o, b_o, G_o = outs[:4]
        C = G_o.shape[0]
        rest = outs[4:]

        def gate(k0, bk):
            cols = pl.ds(k0, bk)
            g = _activate(cfg, g_ref[:, cols], valid, a, ref_or_none(d_ref, (slice(None), cols)))
            return g if r is None else _reset(g, r)

        # Row statistics over all columns first: the l2 norms, and the rows holding a
        # non-finite gate (NaN in every column of G from there on, as lower_dot has it).
        ss_q = ss_k = bad = None
        add = lambda acc, x: x if acc is None else acc + x
        for k0, bk in blocks:
            cols = pl.ds(k0, bk)
            if l2:
                qb, kb = q_ref[:, cols], k_ref[:, cols]
                ss_q, ss_k = add(ss_q, jnp.sum(qb * qb, axis=1, keepdims=True)), add(ss_k, jnp.sum(kb * kb, axis=1, keepdims=True))
            if scan:
                nf = nonfinite_rows(gate(k0, bk))
                bad = nf if bad is None else jnp.maximum(bad, nf)
        seen = None if bad is None else from_first(bad)
        q_rstd, k_rstd = (_rstd(ss_q), _rstd(ss_k)) if l2 else (None, None)
        lower = None if scan else (iota((C, C), 1) <= iota((C, C), 0)).astype(G_o.dtype)

        def cumsum_lower(x):  # lower_dot's result: a non-finite row reaches the rows below
            if lower is not None:
                return mm.lower_dot(lower, x)
            return jnp.where(seen, jnp.nan, jnp.cumsum(jnp.where(jnp.abs(x) < jnp.inf, x, 0.0), axis=0))

        for k0, bk in blocks:
            cols = pl.ds(k0, bk)
            qb, kb, g = q_ref[:, cols], k_ref[:, cols], gate(k0, bk)
            q_o[:, cols], k_o[:, cols] = (qb * q_rstd, kb * k_rstd) if l2 else (qb, kb)
            if split:
                hi, lo = split_log_decay(g, C, _round_even)
                G_hi = cumsum_lower(hi)  # a NaN gate reaches only its own row on
                lo_sum = _rows_cumsum(mm, jnp.where(jnp.abs(lo) < jnp.inf, lo, 0.0), lower)
                G = G_hi + lo_sum
                rest[-1][:, cols] = (G_hi - G) + lo_sum  # G_hi - G exact (Sterbenz)
            else:
                G = cumsum_lower(g)
            G_o[:, cols] = G
        beta = b_ref[...]
        if cfg.use_beta_sigmoid_in_kernel:
            beta = _sigmoid(beta) * (2.0 if cfg.allow_neg_eigval else 1.0)
        b_o[...] = beta
        if l2:
            rest[0][...], rest[1][...] = q_rstd, k_rstd

    kernel.__qualname__ = "PallasGate.kernel"  # its name in profiles: kdax_PallasGate_kernel
    return kernel


def gate_bwd_kernel(mm: Products, cfg: KDAConfig, blocks, reverse: bool, has: tuple, C: int, load_g=None,
                    reset: bool = False, padded: bool = True, written: bool = False, reads_g: bool = True):
    """B5's kernel over one (row * head, chunk) block, ``blocks`` of columns at a time:
    outputs ``(dq, dk, dg, dbeta[, dA [1, K]][, ddt [1, K]])`` (dA, ddt: sums over the
    chunk's rows per column). ``reverse`` (Triton): the chunk's rows read and written in
    reverse order (index arrays: addresses only), so that the reverse cumsum of ``dG`` is
    a forward scan; else a product with the upper-triangular ones. ``load_g``: what a block
    of the raw gate becomes as read (``gate_kernel``'s ``loads``). ``reset``: a ``[C, 1]``
    input after ``valid`` marks the tokens that start a sequence: sums within each
    sequence (``_segment_sums``), no gradient at such a token; a second, NaN at the rows a
    non-finite ``dG`` reaches there (``dG`` itself then finite). ``padded`` as
    ``gate_kernel``'s (False: no ``valid`` input). ``written``: two ``[C, 1]`` poison
    columns after ``dG`` (dq's, then dk's, dg's and dbeta's), the outputs the call's
    gradients (``kdax.pallas._written.Poisoned``). ``reads_g``: ``g`` is an input (the raw
    gate with the in-kernel gate, else the log decays as given: dg = 0 below F1's floor)."""
    l2, gate = cfg.use_qk_l2norm_in_kernel, cfg.use_gate_in_kernel

    def kernel(*refs):
        rows = (C - 1 - iota((C,), 0)) if reverse else slice(None)
        it = iter(refs)
        qn_r, kn_r, qr_r, kr_r = (next(it) for _ in range(4)) if l2 else (None,) * 4
        b_r = next(it)
        g_r = loaded(next(it), load_g) if reads_g else None
        v_r = next(it) if padded else None
        r_r, x_r = (next(it), next(it)) if reset else (None, None)
        a_ref, d_ref = _param_refs([next(it) for _ in range(sum(has))], has)
        dq_r, dk_r, db_r, dG_r = (next(it) for _ in range(4))
        mq_r, m_r = (next(it), next(it)) if written else (None, None)
        dq_o, dk_o, dg_o, db_o = (next(it) for _ in range(4))
        mq, m = (None, None) if mq_r is None else (mq_r[rows], m_r[rows])  # (the rows as written)
        dq_o, (dk_o, dg_o, db_o) = poisoned(dq_o, mq), (poisoned(o, m) for o in (dk_o, dg_o, db_o))
        dA_o = next(it) if a_ref is not None else None
        ddt_o = next(it) if d_ref is not None else None
        valid = None if v_r is None else v_r[rows]
        r = None if r_r is None else r_r[rows]
        if r is not None:  # the first token's decay meets a zero state: no gradient, exactly
            valid = jnp.where(r > 0, 0.0, valid)
        a = None if a_ref is None else jnp.exp(a_ref[...])
        if l2:  # <dy, y> over every column, first
            qr, kr = qr_r[rows], kr_r[rows]
            sq = sk = None
            for k0, bk in blocks:
                cols = pl.ds(k0, bk)
                tq = jnp.sum(dq_r[rows, cols] * qn_r[rows, cols], axis=1, keepdims=True)
                tk = jnp.sum(dk_r[rows, cols] * kn_r[rows, cols], axis=1, keepdims=True)
                sq, sk = (tq, tk) if sq is None else (sq + tq, sk + tk)
        upper = None if reverse else (iota((C, C), 1) >= iota((C, C), 0)).astype(dq_r.dtype)
        for k0, bk in blocks:
            cols = pl.ds(k0, bk)
            dG = dG_r[rows, cols]
            if r is not None:
                dg = _segment_sums(mm, dG, r, reverse, x_r[rows])
            else:
                dg = jnp.cumsum(dG, axis=0) if reverse else mm.dot(upper, dG)
            dg = dg if valid is None else jnp.where(valid > 0, dg, 0.0)
            if gate:
                x = g_r[rows, cols] if d_ref is None else g_r[rows, cols] + d_ref[:, cols]
                if cfg.lower_bound == -jnp.inf:  # g = -inf whatever the input: no gradient
                    dg = jnp.zeros_like(dg)
                    if dA_o is not None:
                        dA_o[:, cols] = jnp.zeros((1, bk), dg.dtype)
                elif cfg.lower_bound is None:
                    sp, sg = _softplus_and_sigmoid(x)
                    # (below the floor F1's decay does not depend on x: kdax.stages._gate)
                    dg = jnp.where(-(a * sp) < log_decay_floor(dg.dtype), 0.0, dg)
                    if dA_o is not None:
                        dA_o[:, cols] = -jnp.sum(dg * a * sp, axis=0, keepdims=True)
                    dg = -dg * a * sg
                else:
                    z = x if a is None else a * x
                    sg = _sigmoid(z)
                    dg = jnp.where(cfg.lower_bound * sg < log_decay_floor(dg.dtype), 0.0, dg)
                    dz = dg * cfg.lower_bound * sg * (1.0 - sg)
                    if dA_o is not None:
                        dA_o[:, cols] = jnp.sum(dz * z, axis=0, keepdims=True)
                    dg = dz if a is None else dz * a
                if ddt_o is not None:
                    ddt_o[:, cols] = jnp.sum(dg, axis=0, keepdims=True)
            elif g_r is not None:  # log decays as given: F1 clamps those below the floor
                dg = jnp.where(g_r[rows, cols] < log_decay_floor(dg.dtype), 0.0, dg)
            dg_o[rows, cols] = dg
            dq, dk = dq_r[rows, cols], dk_r[rows, cols]
            if l2:
                dq = qr * (dq - qn_r[rows, cols] * sq)
                dk = kr * (dk - kn_r[rows, cols] * sk)
            dq_o[rows, cols], dk_o[rows, cols] = dq, dk
        dbeta = db_r[rows]
        if cfg.use_beta_sigmoid_in_kernel:
            c = 2.0 if cfg.allow_neg_eigval else 1.0
            sb = b_r[rows] / c
            dbeta = dbeta * c * sb * (1.0 - sb)
        db_o[rows] = dbeta

    kernel.__qualname__ = "PallasGateBackward.kernel"
    return kernel


@final
class PallasGate(AbstractGate, PallasTarget):
    """F1 as a Pallas kernel over (row * head, chunk). ``split`` as ``ReferenceGate``'s:
    in float32 (not under ``"fast"``), G as the exact sum ``G + G_lo`` (``kdax._numerics.hilo``), bit for bit the
    reference's; False: G alone. Reads q, k, g and beta from the caller's layout when the
    pipeline hands it ``Tokens`` views (``tokens``; on Triton, ``reads_tokens``): each
    block cast and cleaned as it is loaded, no chunked copy made. Takes shared chunks'
    ``reset`` (``[R, NC, C]``: the reset log decay at each sequence's first token)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe", "tokens"})

    split: bool = eqx.field(static=True, default=True)

    @tuned
    def __call__(
        self, config, q: Union[ChunkK, Tokens], k: Union[ChunkK, Tokens], g: Union[ChunkK, Tokens],
        beta: Union[ChunkScalar, Tokens], A_log, dt_bias, valid, reset=None, *, precision: str = "highest"
    ):
        cfg = config
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        q, k, g, beta = (self.view_or_copy(x, K) for x in (q, k, g, beta))
        Kp = pow2(K) if self.target == "triton" else K
        ops = [token_operand(self.target, x, self.padded, b) for x, b in ((q, (C, Kp)), (k, (C, Kp)), (g, (C, Kp)))]
        ops.append(token_operand(self.target, beta, flat, (C, 1)))
        padded = not _all_valid(reset, q, k, g, beta)
        masks = _token_masks(valid if padded else None, reset, HV, q.dtype)
        p_arrays, p_specs, has = _params(cfg, self.target, HV, K, A_log, dt_bias)
        l2 = cfg.use_qk_l2norm_in_kernel
        # (float64, and the "fast" policy: G alone)
        split = self.split and grid_bits(q.dtype, C) is not None and _precision.keeps_low_part(precision)
        kernel = gate_kernel(self.products(precision), cfg, column_blocks(self.target, Kp, GATE_BLOCK), split,
                             self.target == "triton", has, tuple(load for _, _, load in ops), reset is not None,
                             padded)

        blocks = [(C, Kp), (C, Kp), (C, 1), (C, Kp)] + ([(C, 1), (C, 1)] if l2 else []) + ([(C, Kp)] if split else [])
        outs = self.call(kernel, (*(a for a, _, _ in ops), *masks, *p_arrays),
                         [*(sp for _, sp, _ in ops), *[chunk_spec((C, 1))] * len(masks), *p_specs], blocks, R * HV, NC,
                         q.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        rstd = (unflat(outs[4], R, HV), unflat(outs[5], R, HV)) if l2 else (None, None)
        G_lo = cut(outs[-1]) if split else None
        return Activated(cut(outs[0]), cut(outs[1]), unflat(outs[2], R, HV, squeeze=True), cut(outs[3]), *rstd, G_lo)


@final
class PallasGateBackward(AbstractGateBackward, PallasTarget):
    """B5 as a Pallas kernel over (row * head, chunk); dA_log / ddt_bias partial sums per
    block are added up outside. Reads ``g`` (the raw gate, or the log decays) from the
    caller's layout when handed a ``Tokens`` view (``tokens``, as ``PallasGate``). Takes
    shared chunks' ``reset`` (sums within each sequence, no gradient at its first token).
    Writes dq, dk, dg and dbeta as the call's gradients when the pipeline asks
    (``final_grads``; Triton, K a power of 2; ``kdax.pallas._written``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"gate": KDA})

    accepts: ClassVar[frozenset] = frozenset({"reset", "tokens", "final_grads"})

    @tuned
    def __call__(
        self, config, act, g: Optional[Union[ChunkK, Tokens]], A_log, dt_bias, valid, dq, dk, dbeta, dG, reset=None,
        final: Optional[FinalGrads] = None, *, precision: str = "highest"
    ):
        cfg = config
        R, HV, NC, C, K = dq.shape
        self.check_widths(K=K)
        final = final if writes_final(self, final, K) else None  # (else chunked: the pipeline finishes them)
        fp = self.padded
        l2 = cfg.use_qk_l2norm_in_kernel
        Kp = fp(dq).shape[-1]
        sk, s1 = chunk_spec((C, Kp)), chunk_spec((C, 1))
        ins, specs = [], []
        if l2:
            ins += [fp(act.q), fp(act.k), flat(act.q_rstd), flat(act.k_rstd)]
            specs += [sk, sk, s1, s1]
        ins.append(flat(act.beta))
        specs.append(s1)
        load_g = None
        g = None if g is None else self.view_or_copy(g, K)
        if g is not None:
            a, spec, load_g = token_operand(self.target, g, fp, (C, Kp))
            ins.append(a)
            specs.append(spec)
        padded = not _all_valid(reset, g)
        masks = _token_masks(valid if padded else None, reset, HV, dq.dtype)
        if reset is not None:  # (dG's non-finite entries apart: _segment_sums)
            reached = reached_rows(jnp.any(nonfinite(dG), axis=-1), reset, later=True)
            masks.append(flat(jnp.where(reached, jnp.nan, 0.0).astype(dq.dtype)))
            dG = jnp.where(nonfinite(dG), 0.0, dG)
        ins += masks
        specs += [s1] * len(masks)
        p_arrays, p_specs, has = _params(cfg, self.target, HV, K, A_log, dt_bias)
        ins += p_arrays + [fp(dq), fp(dk), flat(dbeta), fp(dG)]
        specs += p_specs + [sk, sk, s1, sk]
        names = ("q", "k", "g", "beta")
        for name in names[:2] if final is not None else ():  # the poison columns: dq's, the others'
            mask, mask_spec = poison_operand(final, name, HV)
            ins.append(mask)
            specs.append(mask_spec)
        has_dA, has_ddt = has
        blocks = [(C, Kp), (C, Kp), (C, Kp), (C, 1)] + ([(1, Kp)] if has_dA else []) + ([(1, Kp)] if has_ddt else [])
        # Triton: the chunk's rows in reverse, the reverse cumsum a scan (gate_bwd_kernel).
        kernel = gate_bwd_kernel(self.products(precision), cfg, column_blocks(self.target, Kp, GATE_BLOCK),
                                 self.target == "triton", has, C, load_g, reset is not None, padded, final is not None,
                                 g is not None)
        written = None if final is None else {
            i: written_output(final, n, HV, C, None if n == "beta" else K) for i, n in enumerate(names)}
        outs = self.call(kernel, ins, specs, blocks, R * HV, NC, dq.dtype, written)
        rest = list(outs[4:])
        dA = ddt = None
        if has_dA:
            dA = jnp.sum(unflat(rest.pop(0)[..., :K], R, HV), axis=(0, 2, 3, 4))
        if has_ddt:
            ddt = jnp.sum(unflat(rest.pop(0)[..., :K], R, HV), axis=(0, 2, 3)).reshape(HV * K)
        if final is None:
            cut = lambda x: unflat(x[..., :K], R, HV)
            grads = cut(outs[0]), cut(outs[1]), cut(outs[2]), unflat(outs[3], R, HV, squeeze=True)
        else:
            grads = tuple(as_written(final, n, x, like) for n, x, like in zip(names, outs[:4], (dq, dk, dG, dbeta)))
        return RawGrads(*grads, dA, ddt)
