"""Pallas WY family: F3 (w, u, qg, kg) and B3 (wy_dqkg), one (p, chunk) block per program."""

import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkScalar, ChunkState, ChunkV, typecheck
from ..stages._types import ChunkGrads, WYOut
from ..stages._wy import AbstractWY, AbstractWYDqkg
from ._common import PallasTarget, chunk_call, chunk_spec, dot, feature_pad, flat, iota, row_of, unflat


def wy_body(q, k, v, beta, G, Akk):
    eG = jnp.exp(G)
    C = G.shape[0]
    w = dot(Akk, beta * k * eG)
    u = dot(Akk, beta * v)
    kg = k * jnp.exp(row_of(G, C - 1) - G)
    return w, u, q * eG, kg


def wy_dqkg_body(scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new):
    C = G.shape[0]
    eG = jnp.exp(G)
    gam = row_of(G, C - 1)
    dqg = scale * dot(do, h, tb=True)
    dkg = dot(v_new, dh, tb=True)
    # e^Γ * sum_v h dh, as a [1, K] row (a transpose keeps everything 2-D)
    dgam = jnp.sum(kg * dkg, axis=0, keepdims=True) + jnp.exp(gam) * jnp.sum((h * dh).T, axis=0, keepdims=True)
    dw = -dot(dv_new, h, tb=True)
    X = beta * k * eG
    dAkk = dot(dw, X, tb=True) + dot(dv_new, beta * v, tb=True)
    dX = dot(Akk, dw, ta=True)
    dY = dot(Akk, dv_new, ta=True)
    row, col = iota((C, C), 0), iota((C, C), 1)
    dL = jnp.where(col < row, -dot(dot(Akk, dAkk, ta=True), Akk, tb=True), 0.0)
    dq = dqg * eG
    dk = dkg * jnp.exp(gam - G) + beta * eG * dX
    dv = beta * dY
    dbeta = jnp.sum(v * dY, axis=1, keepdims=True) + jnp.sum(k * eG * dX, axis=1, keepdims=True)
    dG = qg * dqg - kg * dkg + X * dX + jnp.where(iota(G.shape, 0) == C - 1, dgam, 0.0)
    return dq, dk, dv, dbeta, dG, dL


class PallasWY(AbstractWY, PallasTarget):
    """F3 as a Pallas kernel over (row * head, chunk)."""

    @typecheck
    def __call__(
        self,
        q: ChunkK,
        k: ChunkK,
        v: ChunkV,
        beta: ChunkScalar,
        G: ChunkK,
        Akk: ChunkMat,
    ) -> WYOut:
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        fp = lambda x: feature_pad(self.target, flat(x))
        qf, kf, vf, Gf = fp(q), fp(k), fp(v), fp(G)
        Kp, Vp = qf.shape[-1], vf.shape[-1]

        def kernel(q_ref, k_ref, v_ref, b_ref, g_ref, a_ref, w_ref, u_ref, qg_ref, kg_ref):
            outs = wy_body(q_ref[...], k_ref[...], v_ref[...], b_ref[...], g_ref[...], a_ref[...])
            for ref, val in zip((w_ref, u_ref, qg_ref, kg_ref), outs):
                ref[...] = val

        sk, sv = chunk_spec((C, Kp)), chunk_spec((C, Vp))
        w, u, qg, kg = chunk_call(
            kernel, (qf, kf, vf, flat(beta), Gf, flat(Akk)),
            [sk, sk, sv, chunk_spec((C, 1)), sk, chunk_spec((C, C))],
            [(C, Kp), (C, Vp), (C, Kp), (C, Kp)], R * HV, NC, q.dtype, self.target,
            self.run_interpreted,
        )
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        return WYOut(cut(w, K), cut(u, V), cut(qg, K), cut(kg, K))


class PallasWYDqkg(AbstractWYDqkg, PallasTarget):
    """B3 as a Pallas kernel over (row * head, chunk)."""

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
    ) -> ChunkGrads:
        R, HV, NC, C, K = q.shape
        V = v.shape[-1]
        fp = lambda x: feature_pad(self.target, flat(x))
        fp2 = lambda x: feature_pad(self.target, flat(x), axes=(-2, -1))
        ins = (fp(q), fp(k), fp(v), flat(beta), fp(G), flat(Akk), fp(qg), fp(kg), fp2(h), fp2(dh),
               fp(v_new), fp(do), fp(dv_new))
        Kp, Vp = ins[0].shape[-1], ins[2].shape[-1]
        sk, sv, s1, sc, sh = (chunk_spec(b) for b in ((C, Kp), (C, Vp), (C, 1), (C, C), (Kp, Vp)))

        def kernel(*refs):
            outs = wy_dqkg_body(scale, *(r[...] for r in refs[:13]))
            for ref, val in zip(refs[13:], outs):
                ref[...] = val

        dq, dk, dv, db, dG, dL = chunk_call(
            kernel, ins, [sk, sk, sv, s1, sk, sc, sk, sk, sh, sh, sv, sv, sv],
            [(C, Kp), (C, Kp), (C, Vp), (C, 1), (C, Kp), (C, C)], R * HV, NC, q.dtype, self.target,
            self.run_interpreted,
        )
        cut = lambda x, n: unflat(x[..., :n], R, HV)
        return ChunkGrads(cut(dq, K), cut(dk, K), cut(dv, V), unflat(db, R, HV, squeeze=True), cut(dG, K), unflat(dL, R, HV))
