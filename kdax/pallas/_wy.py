"""Pallas WY family: F3 (w, u, qg, kg) and B3 (wy_dqkg), one (p, chunk) block per program."""

from typing import ClassVar, Optional

import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkState, ChunkV, typecheck
from ..stages import AbstractWY, AbstractWYDqkg, ChunkGrads, WYOut
from .._final import final
from ._common import (
    PallasTarget, PallasValueBlocks, chunk_spec, decay, dot, flat, iota, lower_dot, row_of,
    row_or_none, tuned, unflat,
)


def wy_body(q, k, v, beta, G, Akk, lo=None):
    """F3 for one chunk (``lo``: G's low part, ``kdax._hilo``, or None)."""
    eG = jnp.exp(G)
    C = G.shape[0]
    w = lower_dot(Akk, beta * k * eG)  # NaN/inf at a token reaches only the rows from it on
    u = lower_dot(Akk, beta * v)
    kg = k * decay(None, row_of(G, C - 1), G, row_or_none(lo, C - 1), lo)
    return w, u, q * eG, kg


def wy_dqkg_body(scale, k, beta, G, Akk, qg, kg, v_ref, h_ref, dh_ref, vn_ref, do_ref, dvn_ref, dv_ref,
                 block_v: int, lo=None):
    """B3 for one chunk. The value axis is walked ``block_v`` columns at a time through
    static slices of the refs (v, h, dh, v_new, do, dv_new in; dv out): the V-sized
    operands are never all live at once, which keeps a Triton program at K = V = 128
    within Hopper's 227 KiB of shared memory (248 KiB with whole blocks)."""
    C, Kp = G.shape
    Vp = v_ref.shape[-1]
    eG = jnp.exp(G)
    gam = row_of(G, C - 1)
    X = beta * k * eG
    zero = jnp.zeros((C, Kp), G.dtype)
    dqg, dkg, dw = zero, zero, zero
    hdh = jnp.zeros((1, Kp), G.dtype)
    dAkk = jnp.zeros((C, C), G.dtype)
    dbeta = jnp.zeros((C, 1), G.dtype)
    for j in range(0, Vp, block_v):
        cols = (slice(None), slice(j, j + block_v))
        h, dh, v, dvn = h_ref[cols], dh_ref[cols], v_ref[cols], dvn_ref[cols]
        dqg = dqg + dot(do_ref[cols], h, tb=True)
        dkg = dkg + dot(vn_ref[cols], dh, tb=True)
        # sum_v h dh as a [1, K] row (a transpose keeps everything 2-D)
        hdh = hdh + jnp.sum((h * dh).T, axis=0, keepdims=True)
        dw = dw - dot(dvn, h, tb=True)
        dAkk = dAkk + dot(dvn, beta * v, tb=True)
        dY = dot(Akk, dvn, ta=True)
        dv_ref[cols] = beta * dY
        dbeta = dbeta + jnp.sum(v * dY, axis=1, keepdims=True)
    dqg = scale * dqg
    dgam = jnp.sum(kg * dkg, axis=0, keepdims=True) + jnp.exp(gam) * hdh
    dAkk = dAkk + dot(dw, X, tb=True)
    dX = dot(Akk, dw, ta=True)
    row, col = iota((C, C), 0), iota((C, C), 1)
    dL = jnp.where(col < row, -dot(dot(Akk, dAkk, ta=True), Akk, tb=True), 0.0)
    dq = dqg * eG
    dk = dkg * decay(None, gam, G, row_or_none(lo, C - 1), lo) + beta * eG * dX
    dbeta = dbeta + jnp.sum(k * eG * dX, axis=1, keepdims=True)
    dG = qg * dqg - kg * dkg + X * dX + jnp.where(iota(G.shape, 0) == C - 1, dgam, 0.0)
    return dq, dk, dbeta, dG, dL


@final
class PallasWY(AbstractWY, PallasTarget):
    """F3 as a Pallas kernel over (row * head, chunk); with ``G_lo`` (``kdax._hilo``) kg's
    exponent is the difference of the exact sums."""

    tile_safe: ClassVar[bool] = True

    @tuned
    @typecheck
    def __call__(
        self,
        q: ChunkK,
        k: ChunkK,
        v: ChunkV,
        beta: ChunkScalar,
        G: ChunkK,
        Akk: ChunkMat,
        G_lo: Optional[ChunkK] = None,
    ) -> WYOut:
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        self.check_widths(K=K, V=V)
        fp = self.padded
        qf, kf, vf, Gf = fp(q), fp(k), fp(v), fp(G)
        Kp, Vp = qf.shape[-1], vf.shape[-1]
        sk, sv = chunk_spec((C, Kp)), chunk_spec((C, Vp))
        ins, specs = (qf, kf, vf, flat(beta), Gf, flat(Akk)), [sk, sk, sv, chunk_spec((C, 1)), sk, chunk_spec((C, C))]
        if G_lo is not None:
            ins, specs = ins + (fp(G_lo),), specs + [sk]

        def kernel(*refs):
            lo = refs[6][...] if G_lo is not None else None
            outs = wy_body(*(r[...] for r in refs[:6]), lo)
            for ref, val in zip(refs[-4:], outs):
                ref[...] = val

        w, u, qg, kg = self.call(kernel, ins, specs, [(C, Kp), (C, Vp), (C, Kp), (C, Kp)], R * HV, NC, q.dtype)
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        return WYOut(cut(w, K), cut(u, V), cut(qg, K), cut(kg, K))


@final
class PallasWYDqkg(AbstractWYDqkg, PallasValueBlocks):
    """B3 as a Pallas kernel over (row * head, chunk). ``block_v``: value columns read at
    a time on the Triton target (a power of 2; the TPU target reads whole blocks);
    ``G_lo`` as ``PallasWY``."""

    @tuned
    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        v: ChunkV,
        beta: ChunkScalar,
        G: ChunkK,
        Akk: ChunkMat,
        qg: ChunkK,
        kg: ChunkK,
        h: ChunkState,
        dh: ChunkState,
        v_new: ChunkV,
        do: ChunkV,
        dv_new: ChunkV,
        G_lo: Optional[ChunkK] = None,
    ) -> ChunkGrads:
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        self.check_widths(K=K, V=V)
        fp = self.padded
        fp2 = lambda x: self.padded(x, axes=(-2, -1))
        ins = (fp(q), fp(k), fp(v), flat(beta), fp(G), flat(Akk), fp(qg), fp(kg), fp2(h), fp2(dh),
               fp(v_new), fp(do), fp(dv_new))
        Kp, Vp = ins[0].shape[-1], ins[2].shape[-1]
        sk, sv, s1, sc, sh = (chunk_spec(b) for b in ((C, Kp), (C, Vp), (C, 1), (C, C), (Kp, Vp)))
        specs = [sk, sk, sv, s1, sk, sc, sk, sk, sh, sh, sv, sv, sv]
        if G_lo is not None:
            ins, specs = ins + (fp(G_lo),), specs + [sk]
        n_in = len(ins)

        bv = min(self.block_v, Vp) if self.target == "triton" else Vp

        def kernel(*refs):
            q, k, v, b, g, a, qg_, kg_, h_, dh_, vn, do_, dvn = refs[:13]
            lo = refs[13][...] if G_lo is not None else None
            dq_r, dk_r, dv_r, db_r, dG_r, dL_r = refs[n_in:]
            loaded = (r[...] for r in (k, b, g, a, qg_, kg_))  # B3 needs q only through qg
            outs = wy_dqkg_body(scale, *loaded, v, h_, dh_, vn, do_, dvn, dv_r, bv, lo)
            for ref, val in zip((dq_r, dk_r, db_r, dG_r, dL_r), outs):
                ref[...] = val

        dq, dk, dv, db, dG, dL = self.call(
            kernel, ins, specs, [(C, Kp), (C, Kp), (C, Vp), (C, 1), (C, Kp), (C, C)], R * HV, NC, q.dtype)
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        db = unflat(db, R, HV, squeeze=True)
        return ChunkGrads(cut(dq, K), cut(dk, K), cut(dv, V), db, cut(dG, K), unflat(dL, R, HV))
