"""Gate family: F1 (input activations + chunk-local cumsum) and B5 (their backward)."""

import abc
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._config import KDAConfig
from .._numerics import precision as _precision
from .._numerics.hilo import grid_bits, split_log_decay
from .._numerics.arrays import mT, ranked, row_cumsum
from .._numerics.chunk_loops import ChunkGroup, over_chunks
from .._stage_protocol.capabilities import told
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Maybe, Specs
from .._annotations import ChunkK, ChunkScalar, ChunkValid
from ..ref import L2NORM_EPS, activated_gate, beta_activation, log_decay_floor
from ._types import KDA, AbstractBackwardStage, AbstractForwardStage, Activated, RawGrads


def _rstd(x):
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


class AbstractGate(AbstractForwardStage):
    """F1: in-kernel activations (l2norm of q/k, gate, beta sigmoid) and ``G``.

    Arguments (chunked layout, compute dtype; docs/stages.md §1): ``config`` the call's
    static options; ``q``, ``k`` ``[R, HV, NC, C, K]`` raw (q/k heads already repeated to
    HV); ``g`` ``[R, HV, NC, C, K]`` the per-token log decay, or the raw gate input when
    ``config.use_gate_in_kernel``; ``beta`` ``[R, HV, NC, C]`` raw; ``A_log`` ``[HV]`` or
    None; ``dt_bias`` ``[HV * K]`` or None; ``valid`` ``[R, NC, C]`` real tokens;
    ``reset`` ``[R, NC, C]`` or None: tokens that start a sequence inside a chunk shared
    with the one before (packed short sequences), whose log decay must be
    ``reset_log_decay`` (the other stages mask the terms across it to exact zeros). The pipeline passes ``reset`` only to a stage that
    declares ``"reset"`` in ``accepts`` (its signature is not read); one that does not
    cannot run shared chunks (the pipeline falls back or keeps one sequence per chunk).

    Returns ``Activated``: q, k (l2-normalised if asked), beta (sigmoid / 2 sigmoid if
    asked), ``G`` the chunk-local inclusive cumsum of the activated log decay (natural
    log, 0 at padding, non-increasing), ``q_rstd``/``k_rstd`` ``[R, HV, NC, C, 1]`` with
    in-kernel l2norm, else None; optionally ``G_lo`` ``[R, HV, NC, C, K]``, the low part
    (``G + G_lo`` the cumsum to ~1e-9; see ``kdax._numerics.hilo``), else None."""

    @abc.abstractmethod
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
        reset: Optional[ChunkValid] = None,
    ) -> Activated:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config: KDAConfig, s: Specs) -> Activated:
        """What F1 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        q = kw["q"]
        rstd = s.like(q, q.shape[:-1] + (1,)) if config.use_qk_l2norm_in_kernel else None
        return Activated(s.like(q), s.like(kw["k"]), s.like(kw["beta"]), s.like(kw["g"]), rstd, rstd,
                         Maybe(s.like(kw["g"])))


@final
class ReferenceGate(AbstractGate):
    """F1 in plain jnp; the chunk cumsum ``group`` chunks at a time (see ``over_chunks``).
    ``split``: in float32, give G as the exact sum ``G + G_lo`` (``kdax._numerics.hilo``;
    not under the ``"fast"`` policy: ``kdax._numerics.precision.keeps_low_part``); False:
    G alone (``G_lo`` None), a few percent faster and ``eps |G|`` less accurate."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")
    split: bool = eqx.field(static=True, default=True)

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None, *, precision: str = "highest"):
        q_rstd = k_rstd = None
        if config.use_qk_l2norm_in_kernel:
            q_rstd, k_rstd = _rstd(q), _rstd(k)
            q, k = q * q_rstd, k * k_rstd
        g = activated_gate(config, g, A_log, dt_bias, valid, reset)
        split = self.split and _precision.keeps_low_part(precision)
        loops = self.chunk_loops
        G, G_lo = split_cumsum(g, self.group, loops) if split else (chunk_cumsum(g, group=self.group, loops=loops), None)
        beta = beta_activation(beta, config.use_beta_sigmoid_in_kernel, config.allow_neg_eigval)
        return Activated(q, k, beta, G, q_rstd, k_rstd, G_lo)


def chunk_cumsum(x, reverse: bool = False, group: ChunkGroup = None, loops: str = "auto"):
    """Cumulative sum over the chunk's rows of ``x [R, HV, NC, C, K]`` (from the end if
    ``reverse``) by additions (``row_cumsum``), ``group`` chunks at a time: XLA:CPU runs
    ``cumsum`` as a quadratic reduce-window behind a transpose. A NaN or inf gate makes G
    NaN from its own row on, in every column; the backward's (``reverse``) leaves a
    non-finite ``dG`` in its own column."""
    return over_chunks(lambda x: row_cumsum(x, reverse, nan_rows=not reverse), group, x, loops=loops)


def segment_cumsum(dG, reset, group: ChunkGroup = None, loops: str = "auto"):
    """Reverse chunk cumsum of ``dG [R, HV, NC, C, K]`` within each sequence: row t sums
    rows s >= t of the chunk up to the next ``reset [R, NC, C]`` token. A later sequence's
    ``dG`` sums to ~0 (its terms depend on G through differences within it), so leaving it
    out is exact and avoids summing large terms that cancel."""
    C = dG.shape[-2]
    seg = jnp.cumsum(reset.astype(jnp.int32), axis=-1)  # sequence index within the chunk
    s, t = np.arange(C)[:, None], np.arange(C)[None, :]
    same = seg[..., :, None] == seg[..., None, :]
    same = ranked(s >= t, same) & same  # [R, NC, C(s), C(t)]
    M = jnp.where(same, 1.0, 0.0).astype(dG.dtype)[:, None]  # [R, 1, NC, C, C]
    M = jnp.broadcast_to(M, dG.shape[:3] + (C, C))

    def sums(M, x):  # (a non-finite dG reaches its own sequence's rows only, never 0 * inf)
        bad = ~(jnp.abs(x) < jnp.inf)
        y = mT(M) @ jnp.where(bad, 0.0, x)
        return jnp.where(mT(M) @ bad.astype(x.dtype) > 0, jnp.nan, y)

    return over_chunks(sums, group, M, dG, loops=loops)


def split_cumsum(g, group: ChunkGroup = None, loops: str = "auto"):
    """``(G, G_lo)``: the chunk cumsum of the clamped log decays ``g [R, HV, NC, C, K]`` as
    the rounded ``G`` and its remainder ``G_lo`` (``kdax._numerics.hilo``); ``(G, None)`` in
    float64."""
    C = g.shape[-2]
    if grid_bits(g.dtype, C) is None:
        return chunk_cumsum(g, group=group, loops=loops), None

    def split(g):  # per group of chunks: no full-size temporaries besides G and G_lo
        hi, lo = split_log_decay(g, C)
        hi = row_cumsum(hi)  # exact: every partial sum is on the grid
        # A NaN or inf gate reaches G through hi alone (its own row on).
        lo = row_cumsum(jnp.where(jnp.abs(lo) < jnp.inf, lo, 0.0), nan_rows=False)
        G = hi + lo
        return G, (hi - G) + lo  # hi - G exact (Sterbenz): the remainder of the rounding

    return over_chunks(split, group, g, loops=loops)


class AbstractGateBackward(AbstractBackwardStage):
    """B5: the VJP of F1. Reverse chunk-local cumsum of ``dG``, then the backward of the
    gate activation (with dA_log, ddt_bias), of the beta sigmoid and of the q/k l2norm.

    Arguments: ``config``; ``act`` F1's output; ``g`` ``[R, HV, NC, C, K]`` F1's ``g``: the
    raw gate input with ``use_gate_in_kernel``, else the log decays as given (dg is 0 where
    F1 clamped them at the floor), or None (a caller with no gate input); ``A_log``
    ``[HV]``/``dt_bias`` ``[HV * K]`` or None; ``valid`` ``[R, NC, C]``; ``dq``, ``dk``,
    ``dbeta``, ``dG``: the gradients with respect to F1's outputs (B4's); ``reset``
    ``[R, NC, C]`` or None (as F1's): the gate gradient is zero at those tokens, and a
    token's ``dg`` sums ``dG`` over the rest of its own sequence in the chunk only (passed
    as in F1).

    Returns ``RawGrads``: dq, dk, dg ``[R, HV, NC, C, K]`` and dbeta ``[R, HV, NC, C]``
    with respect to the raw inputs (zero at padding); ``dA_log`` ``[HV]`` and
    ``ddt_bias`` ``[HV * K]`` when the in-kernel gate uses them, else None."""

    @abc.abstractmethod
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
        reset: Optional[ChunkValid] = None,
    ) -> RawGrads:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config: KDAConfig, s: Specs) -> RawGrads:
        """What B5 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        gate = config.use_gate_in_kernel
        A_log, dt_bias = kw["A_log"], kw["dt_bias"]
        return RawGrads(s.like(kw["dq"]), s.like(kw["dk"]), s.like(kw["dG"]), s.like(kw["dbeta"]),
                        s.like(A_log) if gate and A_log is not None else None,
                        s.like(dt_bias) if gate and dt_bias is not None else None)


def gate_param_backward(config: KDAConfig, g, A_log, dt_bias, dg):
    """Backward of the in-kernel gate for ``dg`` on the activated decay: returns
    (dg_raw, dA_log, ddt_bias). Layout ``[R, HV, NC, C, K]``."""
    HV, K = g.shape[1], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.reshape(1, HV, 1, 1, K)
    a = None if A_log is None else jnp.exp(A_log).reshape(1, HV, 1, 1, 1)
    if config.lower_bound == -jnp.inf:  # g = -inf whatever the input: no gradient
        return jnp.zeros_like(dg), (None if a is None else jnp.zeros_like(A_log)), (None if dt_bias is None else jnp.zeros_like(dt_bias))
    # F1 clamps the activated decay at the floor: below it the decay does not depend on the
    # input (and the recurrence's gradient is below e^floor), so dg is 0 there, not the
    # rounding noise B5's reverse cumsum leaves where the true dg is ~0.
    floor = log_decay_floor(dg.dtype)
    if config.lower_bound is None:
        sp = jax.nn.softplus(x)
        dg = jnp.where(-(a * sp) < floor, 0.0, dg)
        dx = -dg * a * jax.nn.sigmoid(x)
        dA = -jnp.sum(dg * a * sp, axis=(0, 2, 3, 4))
    else:
        z = x if a is None else a * x
        s = jax.nn.sigmoid(z)
        dg = jnp.where(config.lower_bound * s < floor, 0.0, dg)
        dz = dg * config.lower_bound * s * (1.0 - s)
        dx = dz if a is None else dz * a
        dA = None if a is None else jnp.sum(dz * z, axis=(0, 2, 3, 4))
    ddt = None if dt_bias is None else jnp.sum(dx, axis=(0, 2, 3)).reshape(HV * K)
    return dx, dA, ddt


def l2norm_backward(y, rstd, dy):
    """``y = x * rstd`` with ``rstd = (|x|^2 + eps)^-1/2``: ``dx = rstd (dy - y <dy, y>)``."""
    return rstd * (dy - y * jnp.sum(dy * y, axis=-1, keepdims=True))


@final
class ReferenceGateBackward(AbstractGateBackward):
    """B5 in plain jnp; the reverse chunk cumsum ``group`` chunks at a time."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"gate": KDA})
    accepts: ClassVar[frozenset] = frozenset({"reset"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(
        self, config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG, reset=None, *, precision: str = "highest"
    ):
        if reset is None:
            dg = jnp.where(valid[:, None, :, :, None], chunk_cumsum(dG, reverse=True, group=self.group, loops=self.chunk_loops), 0.0)
        else:
            # The first token's decay meets a zero state: its gradient is 0, exactly.
            keep = valid & ~reset
            dg = jnp.where(keep[:, None, :, :, None], segment_cumsum(dG, reset, group=self.group, loops=self.chunk_loops), 0.0)
        dA = ddt = None
        if config.use_gate_in_kernel:
            dg, dA, ddt = gate_param_backward(config, g, A_log, dt_bias, dg)
        elif g is not None:  # log decays as given: F1 clamps those below the floor (as gate_param_backward)
            dg = jnp.where(g < log_decay_floor(dg.dtype), 0.0, dg)
        if config.use_beta_sigmoid_in_kernel:
            c = 2.0 if config.allow_neg_eigval else 1.0
            s = act.beta / c
            dbeta = dbeta * c * s * (1.0 - s)
        if config.use_qk_l2norm_in_kernel:
            dq = l2norm_backward(act.q, act.q_rstd, dq)
            dk = l2norm_backward(act.k, act.k_rstd, dk)
        return RawGrads(dq, dk, dg, dbeta, dA, ddt)


@final
class GateVjpBackward(AbstractGateBackward):
    """B5 as the VJP of an F1 stage by JAX (``jax.vjp`` of ``gate`` at the chunked raw
    inputs it was called with), at B4's ``dq, dk, dbeta, dG``: the exact transpose of any
    differentiable F1, whatever its math. A pipeline whose F1 alone is of other math (a
    new gate or activation) keeps the hand-written B0-B4 and gets B5 this way, chunk by
    chunk as F1 runs (``kdax._runner.routes.gate_vjp_pipeline``), instead of deriving the
    whole backward.

    ``q, k, g, beta``: F1's inputs ``[R, HV, NC, C, ...]`` (the pipeline builds the stage
    in the backward, from its residuals); the ``g`` argument of ``__call__`` is unused."""

    gate: AbstractGate
    q: ChunkK
    k: ChunkK
    g: ChunkK
    beta: ChunkScalar

    @property
    def transposes(self):  # (the transpose of whatever its F1 computes)
        return MappingProxyType({"gate": self.gate.math})

    @property
    def vjp_of(self):  # (kdax._runner.routes: the forward stage it is the VJP of)
        return self.gate

    def __call__(self, config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG, *, precision: str = "highest"):
        del g  # (no reset: a pipeline with an F1 of other math keeps one sequence per chunk)
        extra = told(self.gate, precision)

        def f1(q, k, g_, beta, A_log_, dt_bias_):
            return self.gate(config, q, k, g_, beta, A_log_, dt_bias_, valid, **extra)

        out, vjp = jax.vjp(f1, self.q, self.k, self.g, self.beta, A_log, dt_bias)
        zero = lambda x: None if x is None else jnp.zeros_like(x)
        # (G_lo carries the low part of the same cumsum: later stages read G + G_lo.)
        ct = Activated(q=dq.astype(out.q.dtype), k=dk.astype(out.k.dtype), beta=dbeta.astype(out.beta.dtype),
                       G=dG.astype(out.G.dtype), q_rstd=zero(out.q_rstd), k_rstd=zero(out.k_rstd),
                       G_lo=None if out.G_lo is None else dG.astype(out.G_lo.dtype))
        dq_, dk_, dg_, dbeta_, dA, ddt = vjp(ct)
        return RawGrads(dq_, dk_, dg_, dbeta_, dA, ddt)
