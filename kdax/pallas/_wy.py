"""Pallas WY family: F3 (w, u, qg, kg) and B3 (wy_dqkg), one (p, chunk) block per program."""

from typing import ClassVar, Mapping, Optional, Union

import equinox as eqx
from types import MappingProxyType
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._layouts.resets import mask_exponent, per_head, segments
from .._layouts.tokens import FinalGrads, Tokens
from .._stage_protocol.final import final
from .._annotations import ChunkV
from .._numerics import precision as _precision
from .._numerics.arrays import at_least_float32, ranked, tri_mask
from .._numerics.hilo import exponent
from ..stages import KDA, AbstractWY, AbstractWYDqkg, ChunkGrads, WYOut
from ._arith import Products, decay, nonfinite, segment_masks
from ._common import (
    PallasFeatureBlocks, PallasValueBlocks, blockwise, check_block, chunk_spec, column_blocks, flat, iota, loaded, pow2,
    put, ref_or_none, row_of, token_operand, tuned, unflat,
)
from ._shared_chunks import reached_rows, segment_operands, sequence_pairs
from ._written import as_written, poison_operand, poisoned, writes_final, written_output


def _values(stage, x, C: int):
    """``token_operand`` for a ``[.., C, V]`` input (v, do) of ``stage``: a ``Tokens`` view
    read in place (``PallasTarget.view_or_copy``), else the chunked array."""
    V, t = x.shape[-1], stage.target
    return token_operand(t, stage.view_or_copy(x, V), stage.padded, (C, pow2(V) if t == "triton" else V))


def last_rows(row_loads: bool, refs, cols, tiles):
    """Row C - 1 of each ``ref[:, cols]`` as ``[1, w]`` (None for a missing ref):
    ``row_loads``, a one-row load (Triton: the masked reduction over the rows took 11% of
    B3's instructions on sm_90, its shuffles and barriers); else ``row_of`` the loaded
    ``tiles`` (TPU)."""
    if row_loads:
        return tuple(None if r is None else r[pl.ds(r.shape[0] - 1, 1), cols] for r in refs)
    return tuple(None if x is None else row_of(x, x.shape[0] - 1) for x in tiles)


def wy_kernel(mm: Products, k_blocks, v_blocks, has_lo: bool, load_v=None, row_loads: bool = False,
              has_reset: bool = False):
    """F3's kernel for one chunk: ``w``, ``qg``, ``kg`` over ``k_blocks`` of feature
    columns, ``u`` over ``v_blocks`` (``column_blocks``; on Triton whole ``[C, 128]``
    tiles spilled). A NaN/inf at a token reaches only the rows from it on (``lower_dot``),
    in the columns of its block and its own sequence. ``load_v``: v's blocks as read
    (``loaded``); ``row_loads``: ``last_rows``' way. ``has_reset``: a ``[C, 1]`` and a
    ``[1, C]`` input after ``G_lo`` hold each token's sequence within the chunk (shared
    chunks): ``e^G`` masked to the chunk's first sequence, ``e^(Γ - G)`` to its last
    (``segment_masks``)."""

    def kernel(q_r, k_r, v_r, b_r, g_r, a_r, *rest):
        v_r = loaded(v_r, load_v)
        lo_r = rest[0] if has_lo else None
        seg = (rest[int(has_lo)][...], rest[int(has_lo) + 1][...]) if has_reset else None
        start, end, _ = segment_masks(None if seg is None else seg[0])
        w_o, u_o, qg_o, kg_o = rest[-4:]
        beta = b_r[...]

        def feature_block(k0, bk, carry):
            kc = (slice(None), pl.ds(k0, bk))
            G, k = g_r[kc], k_r[kc]
            lo = ref_or_none(lo_r, kc)
            eG = mm.exp(mask_exponent(start, G))
            put(w_o, kc, mm.lower_dot(a_r[...], beta * k * eG, seg))  # (put: in the stored dtype)
            put(qg_o, kc, q_r[kc] * eG)
            gam, lo_gam = last_rows(row_loads, (g_r, lo_r), kc[1], (G, lo))
            put(kg_o, kc, k * mm.exp(mask_exponent(end, exponent(gam, G, lo_gam, lo))))
            return carry

        def value_block(j0, bv, carry):
            vc = (slice(None), pl.ds(j0, bv))
            put(u_o, vc, mm.lower_dot(a_r[...], beta * v_r[vc], seg))
            return carry

        blockwise(v_blocks, value_block, blockwise(k_blocks, feature_block, jnp.int32(0)))

    kernel.__qualname__ = "PallasWY.kernel"  # its name in profiles
    return kernel


# The shared memory one program may use on sm_90 (227 KiB, the per-block opt-in limit)
HOPPER_SHARED_BYTES = 232448


def dl_rows(C: int, itemsize: int, splits: bool) -> Optional[int]:
    """B3's rows of dL per product on Triton: None (the whole chunk) where its two
    ``[C, C]`` operands (``itemsize`` bytes an element, twice that where float32 products
    split into TF32 parts) fit sm_90's shared memory together; else the most rows whose
    block fits beside ``M = dAkk A^T`` (``dl_by_rows``): 64 in float64 at C = 128."""
    tile = C * C * itemsize * (2 if splits else 1)
    if 2 * tile <= HOPPER_SHARED_BYTES:
        return None
    rows = C // 2
    while rows > 16 and tile + tile // C * rows > HOPPER_SHARED_BYTES:
        rows //= 2
    return rows


def wy_dqkg_body(mm: Products, scale, beta, Akk, refs, out_refs, k_blocks, v_blocks, has_lo: bool,
                 row_loads: bool = False, seg=None, dL_r=None, seg_refs=None, rows=None):
    """B3 for one chunk, from refs: ``refs = (k, G, qg, kg, v, h, dh, v_new, do, dv_new
    [, G_lo])`` in, ``out_refs = (dq, dk, dv, dbeta, dG)`` out; ``beta [C, 1]`` loaded,
    ``Akk [C, C]`` a ref read where used; dL written to ``dL_r``, whole or (``rows``,
    ``dl_by_rows``; ``seg_refs``: ``seg``'s refs) by row blocks. ``seg``: None, or (shared chunks)
    each token's sequence within the chunk as a ``[C, 1]`` column and a ``[1, C]`` row,
    loaded: F3's masks (``segment_masks``), the state's decay through the chunk zero where a
    sequence starts in it, and dL zero between sequences. The value axis is walked
    ``v_blocks`` at a time for dv and dbeta, then the feature axis ``k_blocks`` at a time,
    each with the value blocks again for its ``[C, bk]`` gradients: no ``[C, K]`` or ``[C, V]`` operand is ever whole (on Triton at
    K = V = 128, whole tiles spilled kilobytes a thread; TPU takes one block of each).
    ``row_loads``: ``last_rows``' way, and (Triton) ``Akk`` the second operand of its
    products (``akk_t``), where it stays in shared memory: as the first, under TF32x3 its
    split parts sat in registers, laid twice over eight warps (B3 under ``"highest"``:
    0.6 KiB of spills a thread on sm_90).
    ``mm``: the kernel's ``Products``."""
    k_r, g_r, qg_r, kg_r, v_r, h_r, dh_r, vn_r, do_r, dvn_r = refs[:10]
    lo_r = refs[10] if has_lo else None
    dq_o, dk_o, dv_o, db_o, dG_o = out_refs
    C = Akk.shape[0]
    dt = beta.dtype
    start, end, passes = segment_masks(None if seg is None else seg[0])

    def value_block(j0, bv, carry):
        dAkk, dbeta = carry
        vc = (slice(None), pl.ds(j0, bv))
        dvn, v = dvn_r[vc], v_r[vc]
        dY = akk_t(dvn)
        dv_o[vc] = beta * dY
        return dAkk + mm.dot(dvn, beta * v, tb=True), dbeta + jnp.sum(v * dY, axis=1, keepdims=True)

    def akk_t(x):  # Akk^T x
        if seg is not None:  # (never 0 * inf: the rows a non-finite row reaches come NaN through beta)
            return akk_t_plain(jnp.where(jnp.abs(x) < jnp.inf, x, 0.0))
        return akk_t_plain(x)

    def akk_t_plain(x):
        if row_loads and mm.splits:
            return mm.dot(x, Akk[...], ta=True).T
        return mm.dot(Akk[...], x, ta=True)

    keep = (lambda m, x: x) if seg is None else (lambda m, x: jnp.where(m, x, 0.0))  # (shared chunks: never 0 * inf)

    dAkk, dbeta = blockwise(v_blocks, value_block, (jnp.zeros((C, C), dt), jnp.zeros((C, 1), dt)))
    last = iota((C, 1), 0) == C - 1
    bv = v_blocks[0][1]

    def over_values(k0, bk, terms, *rows):
        """``sum`` over the value blocks of ``terms(vc, h_block)``: a tuple of ``[C, bk]``
        values, then of ``[r, bk]`` ones for each ``r`` in ``rows``."""
        def step(j0, _, acc):
            t = terms((slice(None), pl.ds(j0, bv)), (pl.ds(k0, bk), pl.ds(j0, bv)))
            return tuple(a + b for a, b in zip(acc, t))

        return blockwise(v_blocks, step, tuple(jnp.zeros((r, bk), dt) for r in (C,) + rows))

    # Per feature block, one [C, bk] accumulator at a time, each consumed before the next.
    def feature_block(k0, bk, carry):
        dAkk, dbeta = carry
        kc = (slice(None), pl.ds(k0, bk))
        # G (and e^G) read again after each value loop rather than held through it
        gate = lambda: (g_r[kc], ref_or_none(lo_r, kc))
        (dqg,) = over_values(k0, bk, lambda vc, hb: (mm.dot(do_r[vc], h_r[hb], tb=True),))
        dqg = keep(start, scale * dqg)
        dq_o[kc] = dqg * mm.exp(mask_exponent(start, gate()[0]))
        dG = qg_r[kc] * dqg
        dkg, hdh = over_values(k0, bk, lambda vc, hb: (
            mm.dot(vn_r[vc], dh_r[hb], tb=True),
            # sum_v h dh as a [1, bk] row (a transpose keeps everything 2-D)
            jnp.sum((h_r[hb].astype(dt) * dh_r[hb].astype(dt)).T, axis=0, keepdims=True)), 1)
        G, lo = gate()
        gam, lo_gam = last_rows(row_loads, (g_r, lo_r), kc[1], (G, lo))
        kg = kg_r[kc]
        dkg = keep(end, dkg)
        kd = jnp.where(last, 0.0, kg * dkg)  # (the last row's O(1) term out of dgam's sum: ReferenceWYDqkg)
        dgam = jnp.sum(kd, axis=0, keepdims=True) + keep(passes, mm.exp(mask_exponent(passes, gam)) * hdh)
        dG = dG - kd + jnp.where(last, dgam, 0.0)
        dk = dkg * decay(end, gam, G, lo_gam, lo)  # (mm.exp here: 8 B of spills)
        (dw,) = over_values(k0, bk, lambda vc, hb: (-mm.dot(dvn_r[vc], h_r[hb], tb=True),))
        dw = keep(start, dw)
        k, eG = k_r[kc], mm.exp(mask_exponent(start, gate()[0]))
        X = beta * k * eG
        dAkk = dAkk + mm.dot(dw, X, tb=True)
        dX = akk_t(dw)
        dk_o[kc] = dk + beta * eG * dX
        dG_o[kc] = dG + X * dX
        return dAkk, dbeta + jnp.sum(k * eG * dX, axis=1, keepdims=True)

    dAkk, dbeta = blockwise(k_blocks, feature_block, (dAkk, dbeta))
    db_o[...] = dbeta
    if seg is not None:  # (dAkk between sequences, inf beside an overflow, never meets A's zeros; the
        # sequence's own dL is then finite: its dk, dv or dG carry the NaN)
        dAkk = jnp.where((seg[0] == seg[1]) & (jnp.abs(dAkk) < jnp.inf), dAkk, 0.0)
    if rows is not None and rows < C:
        return dl_by_rows(mm, dAkk, Akk, seg_refs, rows, dL_r)
    row, col = iota((C, C), 0), iota((C, C), 1)
    A = Akk[...]
    lower = col < row if seg is None else (col < row) & (seg[0] == seg[1])
    if row_loads:  # A^T dAkk A^T = ((dAkk A^T)^T A)^T: A the second operand of both products
        dL_r[...] = jnp.where(lower, -mm.dot(mm.dot(dAkk, A, tb=True), A, ta=True).T, 0.0)
    else:
        dL_r[...] = jnp.where(lower, -mm.dot(mm.dot(A, dAkk, ta=True), A, tb=True), 0.0)


def _reached_up(reset, dv_new, h):
    """``([R, HV, NC, C] bool, the same)``: the rows of B3's ``Akk^T x`` that a non-finite
    row of x reaches in shared chunks, at or before it in its own sequence
    (``reached_rows``: in the kernel, its ``[C, C]`` masks or a select on the products
    spilled 32-64 B a thread on sm_90). First for x = ``dv_new`` (and ``dw``'s rows of the
    chunk's first sequence, which read a non-finite start state ``h``): the kernel takes
    those rows as zero and ``beta`` is NaN there. Then for x = ``dw = -dv_new h^T`` (those
    rows), whose row may also overflow from finite operands, which the kernel cannot tell
    from the others: the product is formed here once more (a row within rounding of the
    float32 limit may overflow in one product and not in the other), and ``dk``,
    ``dbeta``, ``dG`` and ``dL`` are NaN where the reference's ``dX`` is."""
    first = per_head(segments(reset), h.shape[1]) == 0
    h_bad = jnp.any(nonfinite(h), axis=(-2, -1))[..., None]
    bad = jnp.any(nonfinite(dv_new), axis=-1) | (first & h_bad)
    dw = jnp.einsum("...cv,...kv->...ck", dv_new, h, precision="highest",  # (float64 stays: no cuBLAS f64 -> f32)
                    preferred_element_type=at_least_float32(dv_new.dtype, h.dtype))
    dw_bad = first & jnp.any(nonfinite(dw), axis=-1)
    return reached_rows(bad, reset, later=True), reached_rows(dw_bad, reset, later=True)


def _dw_reached(grads: ChunkGrads, rows, reset) -> ChunkGrads:
    """``grads`` NaN where a non-finite row of ``dw`` reaches (``rows`` ``[R, HV, NC, C]``) as
    the reference's ``dX``: rows of ``dk``, ``dbeta``, ``dG``, and of ``dL`` within the row's
    sequence (strictly lower)."""
    row = lambda x: jnp.where(rows[..., None], jnp.nan, x)
    lower = rows[..., None] & sequence_pairs(reset, rows.shape[1])
    lower = lower & ranked(tri_mask(rows.shape[-1], strict=True), lower)
    dL = jnp.where(lower, jnp.nan, grads.dL)
    return ChunkGrads(grads.dq, row(grads.dk), grads.dv, jnp.where(rows, jnp.nan, grads.dbeta), row(grads.dG), dL)


def dl_by_rows(mm: Products, dAkk, Akk, seg_refs, rows: int, dL_r):
    """``dL = -A^T dAkk A^T`` (strictly lower, within sequences) written ``rows`` rows at a
    time: ``M = dAkk A^T`` whole, then ``dL[r] = -(M^T A[:, r])^T`` with ``A[:, r]`` read
    from its ref, so no two ``[C, C]`` operands are held at once (the whole form's ``A`` and
    ``M``: 256 KiB of shared memory in float64 at C = 128, over sm_90's 227)."""
    C = Akk.shape[0]
    M = mm.dot(dAkk, Akk[...], tb=True)

    def block(r0, br, carry):
        rc = pl.ds(r0, br)
        row, col = r0 + iota((br, C), 0), iota((br, C), 1)
        lower = col < row
        if seg_refs is not None:
            lower = lower & (seg_refs[0][rc, :] == seg_refs[1][...])
        dL_r[rc, :] = jnp.where(lower, -mm.dot(M, Akk[:, rc], ta=True).T, 0.0)
        return carry

    blockwise([(r0, rows) for r0 in range(0, C, rows)], block, jnp.int32(0))


@final
class PallasWY(AbstractWY, PallasFeatureBlocks):
    """F3 as a Pallas kernel over (row * head, chunk), on Triton ``block_k`` columns of K
    and of V at a time (32: compiled for sm_90 at K = V = 128, no spills at 4 or 8 warps,
    against 64-112 B a thread with 64); with ``G_lo`` (``kdax._numerics.hilo``) kg's exponent is
    the difference of the exact sums; with ``reset`` (shared chunks) each token's sequence
    within its chunk is a ``[C, 1]`` input. Reads ``v`` from the caller's layout when handed a
    ``Tokens`` view (``tokens``; Triton, ``reads_tokens``): no chunked copy."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe", "tokens", "half_stored"})

    block_k: int = eqx.field(static=True, default=32)

    @tuned
    def __call__(
        self, q, k, v: Union[ChunkV, Tokens], beta, G, Akk, G_lo=None, reset=None, *, precision: str = "highest"
    ):
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        self.check_widths(K=K, V=V)
        fp = self.padded
        qf, kf, Gf = fp(q), fp(k), fp(G)
        vf, sv, load_v = _values(self, v, C)
        Kp, Vp = qf.shape[-1], pow2(V) if self.target == "triton" else V
        sk = chunk_spec((C, Kp))
        ins, specs = (qf, kf, vf, flat(beta), Gf, flat(Akk)), [sk, sk, sv, chunk_spec((C, 1)), sk, chunk_spec((C, C))]
        if G_lo is not None:
            ins, specs = ins + (fp(G_lo),), specs + [sk]
        if reset is not None:
            extra, extra_specs = segment_operands(reset, HV)
            ins, specs = ins + extra, specs + extra_specs

        kernel = wy_kernel(self.products(precision), self.feature_blocks(Kp), self.feature_blocks(Vp), G_lo is not None, load_v,
                           self.target == "triton", reset is not None)
        st = _precision.storage(q.dtype, precision)  # w, u, qg, kg as stored (bf16 under "fast")
        w, u, qg, kg = self.call(kernel, ins, specs, [(C, Kp), (C, Vp), (C, Kp), (C, Kp)], R * HV, NC,
                                 [st, st, st, st])
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        return WYOut(cut(w, K), cut(u, V), cut(qg, K), cut(kg, K))


@final
class PallasWYDqkg(AbstractWYDqkg, PallasValueBlocks, PallasFeatureBlocks):
    """B3 as a Pallas kernel over (row * head, chunk). ``block_v`` / ``block_k``: value /
    feature columns taken at a time on the Triton target (powers of 2; the TPU target
    takes whole blocks; 32 and 32: compiled for sm_90 at K = V = 128 and 8 warps, no
    spills, against 40-400 B a thread with 64); ``G_lo`` and ``reset`` as ``PallasWY`` (the
    sequences' column and row: dL's pairs within one sequence). Reads ``v`` and
    ``do`` from the caller's layout when handed ``Tokens`` views (``tokens``, as
    ``PallasWY``). Writes dv as the call's gradient of v when the pipeline asks
    (``final_grads``; Triton, V a power of 2): the input's layout and dtype, NaN where
    ``chunk_kda``'s isolation puts it (``kdax.pallas._written``). ``dl_rows`` (Triton): dL's
    rows per product (``dl_by_rows``); None: the whole chunk where its two ``[C, C]``
    operands fit sm_90's shared memory, else ``dl_rows``' choice (64 in float64 at C = 128)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"wy": KDA, "state": KDA, "output": KDA})

    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tokens", "half_stored", "final_grads"})

    block_v: int = eqx.field(static=True, default=32)
    block_k: int = eqx.field(static=True, default=32)
    # dL's rows per product on Triton (a power of 2; None: ``dl_rows``' choice, the whole
    # chunk where it fits sm_90's shared memory)
    dl_rows: Optional[int] = eqx.field(static=True, default=None)

    def __check_init__(self):
        check_block("dl_rows", self.dl_rows, optional=True)

    @tuned
    def __call__(
        self, scale, q, k, v: Union[ChunkV, Tokens], beta, G, Akk, qg, kg, h, dh, v_new, do: Union[ChunkV, Tokens],
        dv_new, G_lo=None, reset=None, final: Optional[FinalGrads] = None, *, precision: str = "highest"
    ):
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        self.check_widths(K=K, V=V)
        final = final if writes_final(self, final, V) else None  # (else dv chunked: the pipeline finishes it)
        fp = self.padded
        fp2 = lambda x: self.padded(x, axes=(-2, -1))
        Kp, Vp = (pow2(n) if self.target == "triton" else n for n in (K, V))
        v_in, v_spec, load_v = _values(self, v, C)
        do_in, do_spec, load_do = _values(self, do, C)
        ins = (fp(q), fp(k), v_in, flat(beta), fp(G), flat(Akk), fp(qg), fp(kg), fp2(h), fp2(dh),
               fp(v_new), do_in, fp(dv_new))
        sk, sv, s1, sc, sh = (chunk_spec(b) for b in ((C, Kp), (C, Vp), (C, 1), (C, C), (Kp, Vp)))
        specs = [sk, sk, v_spec, s1, sk, sc, sk, sk, sh, sh, sv, do_spec, sv]
        if G_lo is not None:
            ins, specs = ins + (fp(G_lo),), specs + [sk]
        has_lo, n_in = G_lo is not None, len(ins)
        reached, dw_rows = (None, None) if reset is None else _reached_up(reset, dv_new, h)
        if reset is not None:  # (beta NaN where a non-finite dv_new or dw reaches: dv, dk, dG NaN there)
            ins = ins[:3] + (flat(jnp.where(reached, jnp.nan, beta)),) + ins[4:]
            extra, extra_specs = segment_operands(reset, HV)
            ins, specs = ins + extra, specs + extra_specs
        n_all = len(ins)
        if final is not None:  # dv's poison column, last
            mask, mask_spec = poison_operand(final, "v", HV)
            ins, specs = ins + (mask,), specs + [mask_spec]

        k_blocks, v_blocks = self.feature_blocks(Kp), column_blocks(self.target, Vp, self.block_v)
        mm = self.products(precision)
        rows = None
        if self.target == "triton":
            rows = self.dl_rows or dl_rows(C, jnp.dtype(mm.operand or q.dtype).itemsize, mm.splits)

        n_mask = int(final is not None)

        def kernel(*refs):
            _, k, v, b, g, a, qg_, kg_, h_, dh_, vn, do_, dvn = refs[:13]  # B3 needs q only through qg
            ins = (k, g, qg_, kg_, loaded(v, load_v), h_, dh_, vn, loaded(do_, load_do), dvn) + tuple(refs[13:n_in])
            seg = tuple(r[...] for r in refs[n_in:n_all]) or None
            outs = list(refs[n_all + n_mask:-1])
            outs[2] = poisoned(outs[2], refs[n_all][...] if n_mask else None)  # dv: the call's, with final
            wy_dqkg_body(mm, scale, b[...], a, ins, outs, k_blocks, v_blocks, has_lo, self.target == "triton", seg,
                         refs[-1], refs[n_in:n_all] or None, rows)

        written = None if final is None else {2: written_output(final, "v", HV, C, V)}
        dq, dk, dv, db, dG, dL = self.call(
            kernel, ins, specs, [(C, Kp), (C, Kp), (C, Vp), (C, 1), (C, Kp), (C, C)], R * HV, NC, q.dtype, written)
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        db = unflat(db, R, HV, squeeze=True)
        db = db if reached is None else jnp.where(reached, jnp.nan, db)
        dv = cut(dv, V) if final is None else as_written(final, "v", dv, v)
        grads = ChunkGrads(cut(dq, K), cut(dk, K), dv, db, cut(dG, K), unflat(dL, R, HV))
        return grads if reset is None else _dw_reached(grads, dw_rows, reset)
