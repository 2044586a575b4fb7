"""Pallas gate family: F1 (activations + chunk cumsum) and B5 (their backward).

The chunk-local cumsum (and its reverse in B5) is a matmul with a triangular matrix of
ones, which both lowerings support; sums over a chunk for dA_log / ddt_bias are written
per block and added up outside the kernel.
"""

from typing import ClassVar, Optional

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._config import KDAConfig
from .._hilo import grid_bits, split_log_decay
from .._typing import ChunkK, ChunkScalar, ChunkValid, typecheck
from ..ref import L2NORM_EPS, log_decay_floor
from ..stages import AbstractGate, AbstractGateBackward, Activated, RawGrads
from .._final import final
from ._common import (
    PallasTarget, chunk_spec, dot, feature_pad, flat, head_spec, iota, lower_dot, tuned, unflat,
)


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


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


def _split_cumsum(g, lower):
    """``(G, G_lo)`` in-kernel, bit for bit ``kdax.stages._gate.split_cumsum``
    (``kdax._hilo``; ``lower`` the chunk's lower-triangular ones): the grid part's cumsum
    is exact in any order, the low parts' is small. (``_round_even`` needs ``|g| 2^bits <
    2^22``: g is clamped at the floor and C >= 4.)"""
    hi, lo = split_log_decay(g, g.shape[0], _round_even)
    G_hi = lower_dot(lower, hi)  # a NaN gate reaches only its own row on
    lo_sum = dot(lower, jnp.where(jnp.abs(lo) < jnp.inf, lo, 0.0))
    G = G_hi + lo_sum
    return G, (G_hi - G) + lo_sum  # G_hi - G exact (Sterbenz): the rounding's remainder


def gate_body(cfg: KDAConfig, q, k, g, beta, valid, a_log, dtb, split: bool = False):
    """F1 for one chunk: ``(q, k, beta, G, q_rstd, k_rstd, G_lo)`` (None where absent);
    ``split``: G as the exact sum ``G + G_lo`` (``kdax._hilo``; float32), else G alone."""
    C = g.shape[0]
    q_rstd = k_rstd = None
    if cfg.use_qk_l2norm_in_kernel:
        q_rstd = 1.0 / jnp.sqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2NORM_EPS)
        k_rstd = 1.0 / jnp.sqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2NORM_EPS)
        q, k = q * q_rstd, k * k_rstd
    if cfg.use_gate_in_kernel:
        x, a = _gate_input(g, a_log, dtb)
        if cfg.lower_bound is None:
            g = -a * _softplus(x)
        elif cfg.lower_bound == -jnp.inf:
            g = jnp.full_like(x, -jnp.inf)
        else:
            g = cfg.lower_bound * _sigmoid(x if a is None else a * x)
    # The floor keeps G small and finite for any gate in [-inf, 0] (see log_decay_floor).
    g = jnp.where(valid > 0, jnp.maximum(g, log_decay_floor(g.dtype)), 0.0)
    lower = (iota((C, C), 1) <= iota((C, C), 0)).astype(g.dtype)
    if split:
        G, G_lo = _split_cumsum(g, lower)
    else:
        G, G_lo = lower_dot(lower, g), None  # a NaN gate reaches only its own row on
    if cfg.use_beta_sigmoid_in_kernel:
        beta = _sigmoid(beta) * (2.0 if cfg.allow_neg_eigval else 1.0)
    return q, k, beta, G, q_rstd, k_rstd, G_lo


def gate_bwd_body(cfg: KDAConfig, q, k, beta, q_rstd, k_rstd, g, valid, a_log, dtb, dq, dk, dbeta, dG):
    C = dG.shape[0]
    upper = (iota((C, C), 1) >= iota((C, C), 0)).astype(dG.dtype)
    dg = jnp.where(valid > 0, dot(upper, dG), 0.0)
    dA = ddt = None
    if cfg.use_gate_in_kernel:
        x, a = _gate_input(g, a_log, dtb)
        if cfg.lower_bound == -jnp.inf:  # g = -inf whatever the input: no gradient
            dx = jnp.zeros_like(dg)
            dA = None if a is None else jnp.zeros((1, dg.shape[1]), dg.dtype)
        elif cfg.lower_bound is None:
            dx = -dg * a * _sigmoid(x)
            dA = -jnp.sum(dg * a * _softplus(x), axis=0, keepdims=True)
        else:
            z = x if a is None else a * x
            s = _sigmoid(z)
            dz = dg * cfg.lower_bound * s * (1.0 - s)
            dx = dz if a is None else dz * a
            dA = None if a is None else jnp.sum(dz * z, axis=0, keepdims=True)
        ddt = None if dtb is None else jnp.sum(dx, axis=0, keepdims=True)
        dg = dx
    if cfg.use_beta_sigmoid_in_kernel:
        c = 2.0 if cfg.allow_neg_eigval else 1.0
        s = beta / c
        dbeta = dbeta * c * s * (1.0 - s)
    if cfg.use_qk_l2norm_in_kernel:
        dq = q_rstd * (dq - q * jnp.sum(dq * q, axis=1, keepdims=True))
        dk = k_rstd * (dk - k * jnp.sum(dk * k, axis=1, keepdims=True))
    return dq, dk, dg, dbeta, dA, ddt


def _params(cfg: KDAConfig, target: str, HV: int, K: int, A_log, dt_bias):
    """Per-head parameter arrays and specs: A_log ``[HV, 1, 1]``, dt_bias ``[HV, 1, Kp]``."""
    arrays, specs = [], []
    if cfg.use_gate_in_kernel and A_log is not None:
        arrays.append(A_log.reshape(HV, 1, 1))
        specs.append(head_spec((1, 1), HV))
    if cfg.use_gate_in_kernel and dt_bias is not None:
        d = feature_pad(target, dt_bias.reshape(HV, 1, K))
        arrays.append(d)
        specs.append(head_spec((1, d.shape[-1]), HV))
    return arrays, specs


def _take_params(cfg, refs, A_log, dt_bias):
    refs = list(refs)
    a = refs.pop(0)[...] if (cfg.use_gate_in_kernel and A_log is not None) else None
    d = refs.pop(0)[...] if (cfg.use_gate_in_kernel and dt_bias is not None) else None
    return a, d


@final
class PallasGate(AbstractGate, PallasTarget):
    """F1 as a Pallas kernel over (row * head, chunk). ``split`` as ``ReferenceGate``'s:
    in float32, G as the exact sum ``G + G_lo`` (``kdax._hilo``), bit for bit the
    reference's; False: G alone."""

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"tile_safe", "standard"})

    split: bool = eqx.field(static=True, default=True)

    @tuned
    @typecheck
    def __call__(
        self,
        config: KDAConfig,
        q: ChunkK,
        k: ChunkK,
        g: ChunkK,
        beta: ChunkScalar,
        A_log: Optional[Float[Array, " HV"]],
        dt_bias: Optional[Float[Array, " HVK"]],
        valid: ChunkValid,
    ) -> Activated:
        cfg = config
        R, HV, NC, C, K = q.shape
        self.check_widths(K=K)
        fp = self.padded
        qf, kf, gf = fp(q), fp(k), fp(g)
        Kp = qf.shape[-1]
        vf = flat(jnp.broadcast_to(valid[:, None], beta.shape).astype(q.dtype))
        p_arrays, p_specs = _params(cfg, self.target, HV, K, A_log, dt_bias)
        l2 = cfg.use_qk_l2norm_in_kernel
        split = self.split and grid_bits(q.dtype, C) is not None  # (float64: G alone)

        def kernel(q_ref, k_ref, g_ref, b_ref, v_ref, *refs):
            n_p = len(p_arrays)
            a, d = _take_params(cfg, refs[:n_p], A_log, dt_bias)
            outs = gate_body(cfg, q_ref[...], k_ref[...], g_ref[...], b_ref[...], v_ref[...], a, d, split)
            vals = [v for v in outs if v is not None]
            for ref, val in zip(refs[n_p:], vals):
                ref[...] = val

        sk, s1 = chunk_spec((C, Kp)), chunk_spec((C, 1))
        blocks = [(C, Kp), (C, Kp), (C, 1), (C, Kp)] + ([(C, 1), (C, 1)] if l2 else []) + ([(C, Kp)] if split else [])
        outs = self.call(kernel, (qf, kf, gf, flat(beta), vf, *p_arrays), [sk, sk, sk, s1, s1, *p_specs],
                         blocks, R * HV, NC, q.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        rstd = (unflat(outs[4], R, HV), unflat(outs[5], R, HV)) if l2 else (None, None)
        G_lo = cut(outs[-1]) if split else None
        return Activated(cut(outs[0]), cut(outs[1]), unflat(outs[2], R, HV, squeeze=True), cut(outs[3]), *rstd, G_lo)


@final
class PallasGateBackward(AbstractGateBackward, PallasTarget):
    """B5 as a Pallas kernel over (row * head, chunk); dA_log / ddt_bias partial sums per
    block are added up outside."""

    @tuned
    @typecheck
    def __call__(
        self,
        config: KDAConfig,
        act: Activated,
        g: Optional[ChunkK],
        A_log: Optional[Float[Array, " HV"]],
        dt_bias: Optional[Float[Array, " HVK"]],
        valid: ChunkValid,
        dq: ChunkK,
        dk: ChunkK,
        dbeta: ChunkScalar,
        dG: ChunkK,
    ) -> RawGrads:
        cfg = config
        R, HV, NC, C, K = dq.shape
        self.check_widths(K=K)
        fp = self.padded
        l2, gate = cfg.use_qk_l2norm_in_kernel, cfg.use_gate_in_kernel
        Kp = fp(dq).shape[-1]
        sk, s1 = chunk_spec((C, Kp)), chunk_spec((C, 1))
        ins, specs = [], []
        if l2:
            ins += [fp(act.q), fp(act.k), flat(act.q_rstd), flat(act.k_rstd)]
            specs += [sk, sk, s1, s1]
        ins.append(flat(act.beta))
        specs.append(s1)
        if gate:
            ins.append(fp(g))
            specs.append(sk)
        ins.append(flat(jnp.broadcast_to(valid[:, None], dbeta.shape).astype(dq.dtype)))
        specs.append(s1)
        p_arrays, p_specs = _params(cfg, self.target, HV, K, A_log, dt_bias)
        ins += p_arrays + [fp(dq), fp(dk), flat(dbeta), fp(dG)]
        specs += p_specs + [sk, sk, s1, sk]
        has_dA = gate and A_log is not None
        has_ddt = gate and dt_bias is not None
        blocks = [(C, Kp), (C, Kp), (C, Kp), (C, 1)] + ([(1, Kp)] if has_dA else []) + ([(1, Kp)] if has_ddt else [])
        n_in = len(ins)

        def kernel(*refs):
            it = iter(refs[:n_in])
            qn, kn, qr, kr = (next(it)[...] for _ in range(4)) if l2 else (None,) * 4
            beta = next(it)[...]
            graw = next(it)[...] if gate else None
            vmask = next(it)[...]
            a, d = _take_params(cfg, [next(it) for _ in p_arrays], A_log, dt_bias)
            dq_, dk_, db_, dG_ = (next(it)[...] for _ in range(4))
            outs = gate_bwd_body(cfg, qn, kn, beta, qr, kr, graw, vmask, a, d, dq_, dk_, db_, dG_)
            vals = [v for v in outs if v is not None]
            for ref, val in zip(refs[n_in:], vals):
                ref[...] = val

        outs = self.call(kernel, ins, specs, blocks, R * HV, NC, dq.dtype)
        cut = lambda x: unflat(x[..., :K], R, HV)
        rest = list(outs[4:])
        dA = ddt = None
        if has_dA:
            dA = jnp.sum(unflat(rest.pop(0)[..., :K], R, HV), axis=(0, 2, 3, 4))
        if has_ddt:
            ddt = jnp.sum(unflat(rest.pop(0)[..., :K], R, HV), axis=(0, 2, 3)).reshape(HV * K)
        return RawGrads(cut(outs[0]), cut(outs[1]), cut(outs[2]), unflat(outs[3], R, HV, squeeze=True), dA, ddt)
