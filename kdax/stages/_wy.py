"""WY family: F3 (w, u, qg, kg) and B3 (inter-chunk dq/dk/dG and the WY backward)."""

import abc
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._layouts.resets import from_start, mask_exponent, per_head, same_segment, segments, select_zero, to_end
from .._numerics.hilo import exponent
from .._numerics.arrays import last_row, lower_matmul, mT, ranked, rowsum, tri_mask, upper_matmul
from .._numerics.chunk_loops import ChunkGroup, over_chunks
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Specs
from .._annotations import ChunkK, ChunkMat, ChunkScalar, ChunkState, ChunkV, ChunkValid
from ._types import KDA, AbstractBackwardStage, AbstractForwardStage, ChunkGrads, WYOut


class AbstractWY(AbstractForwardStage):
    """F3: the WY form of a chunk's writes, and the decayed q and k.

    Arguments: activated ``q``, ``k`` ``[R, HV, NC, C, K]``; ``v`` ``[R, HV, NC, C, V]``;
    ``beta`` ``[R, HV, NC, C]``; ``G`` (F1); ``Akk`` ``[R, HV, NC, C, C]`` (F2).

    Returns ``WYOut``: ``w = Akk (beta k e^G)`` ``[.., K]`` and ``u = Akk (beta v)``
    ``[.., V]`` (the corrected writes are ``u - w h``, h the chunk's start state);
    ``qg = q e^G`` and ``kg = k e^(Γ - G)`` ``[.., K]`` (Γ = G at the chunk's last row).

    ``G_lo``: G's low part or None (``kdax._numerics.hilo``; an implementation may leave the
    parameter out and use ``G`` alone). ``reset`` ``[R, NC, C]`` or None (shared chunks,
    ``kdax._layouts.resets``): ``e^G`` is exactly zero at tokens of a sequence that starts
    inside the chunk, ``e^(Γ - G)`` at tokens of one that ends inside it. A stage not
    declaring it (``accepts``) cannot run shared chunks (the pipeline falls back)."""

    @abc.abstractmethod
    def __call__(
        self,
        q: ChunkK,
        k: ChunkK,
        v: ChunkV,
        beta: ChunkScalar,
        G: ChunkK,
        Akk: ChunkMat,
        G_lo: Optional[ChunkK] = None,
        reset: Optional[ChunkValid] = None,
    ) -> WYOut:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> WYOut:
        """What F3 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        k = s.like(kw["k"], stored=True)
        return WYOut(k, s.like(kw["v"], stored=True), s.like(kw["q"], stored=True), k)


def _masks(seg):
    """``(from_start, to_end)`` masks of ``kdax._layouts.resets``, or (None, None)."""
    return (None, None) if seg is None else (from_start(seg), to_end(seg))


def _wy_chunk(q, k, v, beta, G, Akk, G_last, G_lo=None, lo_last=None, seg=None):
    start, end = _masks(seg)
    eG = jnp.exp(mask_exponent(start, G))
    b = beta[..., None]
    K = k.shape[-1]
    same = None if seg is None else same_segment(seg)
    wu = lower_matmul(Akk, jnp.concatenate([b * k * eG, b * v], axis=-1), same=same)  # one matmul for w and u
    kg = k * jnp.exp(mask_exponent(end, exponent(G_last, G, lo_last, G_lo)))
    return wu[..., :K], wu[..., K:], q * eG, kg


def _chunk_args(G, G_lo, reset):
    """The trailing ``over_chunks`` arguments ``(G_last, G_lo, lo_last, seg)`` (absent
    ones left out) and a function that puts them back in place as keywords."""
    xs = [last_row(G)]
    names = ["G_last"]
    if G_lo is not None:
        xs += [G_lo, last_row(G_lo)]
        names += ["G_lo", "lo_last"]
    if reset is not None:
        xs.append(per_head(segments(reset), G.shape[1]))
        names.append("seg")
    return tuple(xs), lambda rest: dict(zip(names, rest))


@final
class ReferenceWY(AbstractWY):
    """F3 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None, *, precision: str = "highest"):
        tail, named = _chunk_args(G, G_lo, reset)
        chunk = lambda q, k, v, beta, G, Akk, *rest: _wy_chunk(q, k, v, beta, G, Akk, **named(rest))
        return WYOut(*over_chunks(chunk, self.group, q, k, v, beta, G, Akk, *tail, loops=self.chunk_loops))


class AbstractWYDqkg(AbstractBackwardStage):
    """B3: inter-chunk dq (``o ⊃ scale qg h``), dk/dG (``h_next ⊃ e^Γ h + kg^T v_new``),
    and the WY backward (``v_new = u - w h``; w, u from Akk): dv, dbeta, and
    ``dL = -Akk^T dAkk Akk^T`` (strictly lower).

    Arguments: ``scale``, ``q``, ``k``, ``v``, ``beta``, ``G``, ``Akk`` as F3; ``qg``,
    ``kg`` (F3); ``h`` ``[R, HV, NC, K, V]`` the state at each chunk's start (F4);
    ``dh`` ``[R, HV, NC, K, V]`` the gradient of the state at each chunk's *end* (B2);
    ``v_new``; ``do`` ``[R, HV, NC, C, V]``; ``dv_new`` the full one from B2; ``G_lo`` as
    F3 (optional parameter).

    Returns ``ChunkGrads`` (dq, dk ``[.., K]``, dv ``[.., V]``, dbeta, dG ``[.., K]``, dL
    ``[.., C, C]``): everything but F2's part, which B4 adds. ``reset`` as F3's (and the
    state's decay through a chunk in which a sequence starts is zero, as in F4)."""

    @abc.abstractmethod
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
        reset: Optional[ChunkValid] = None,
    ) -> ChunkGrads:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> ChunkGrads:
        """What B3 returns for the arguments ``kw`` (the pipeline checks it at every call):
        ``dL`` in the compute dtype (``Akk`` may arrive stored in bf16)."""
        return ChunkGrads(s.like(kw["q"]), s.like(kw["k"]), s.like(kw["v"]), s.like(kw["beta"]), s.like(kw["G"]),
                          s.like(kw["q"], kw["Akk"].shape))


def _wy_dqkg_chunk(scale, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, G_last, G_lo=None, lo_last=None,
                   seg=None):
    start, end = _masks(seg)
    eG = jnp.exp(mask_exponent(start, G))
    b = beta[..., None]
    keep = (lambda m, x: x) if seg is None else select_zero  # (shared chunks: never 0 * inf)
    # o = scale qg h + ...
    dqg = keep(start, scale * do @ mT(h))
    # h_next = e^Γ h + kg^T v_new (e^Γ = 0 where a sequence starts inside the chunk)
    dkg = keep(end, v_new @ mT(dh))
    # dG's last row is -kg dkg + dgam, whose sum holds that row's kg dkg (O(1): kg there is
    # k): the sum leaves it out, so that at strong decays its e^G-small terms are not lost
    # beside it (a loss on the final states alone: float32 dg 0.98 off at g = -20).
    C = Akk.shape[-1]
    last = (np.arange(C) == C - 1)[:, None]
    kd = jnp.where(last, 0.0, kg * dkg)
    if seg is None:
        dgam = jnp.sum(kd, axis=-2) + jnp.exp(G_last[..., 0, :]) * rowsum(h * dh)
    else:
        passes = seg[..., -1:] == 0
        dgam = jnp.sum(kd, axis=-2) + select_zero(passes, jnp.exp(G_last[..., 0, :]) * rowsum(h * dh))
    # v_new = u - w h, w = Akk X, u = Akk Y
    dw = keep(start, -dv_new @ mT(h))
    X = b * k * eG
    # (Akk^T made once behind an optimization_barrier: CPU time 0.97-0.99x under load, but
    # wall 1.10-1.14x on a quiet machine, where XLA:CPU runs this loop on two threads.)
    if seg is None:
        dX, dY = mT(Akk) @ dw, mT(Akk) @ dv_new
    else:  # (a non-finite row reaches its own sequence only)
        same = same_segment(seg)
        dX, dY = upper_matmul(mT(Akk), dw, same), upper_matmul(mT(Akk), dv_new, same)
    # dL = -Akk^T dAkk Akk^T with dAkk = dw X^T + dv_new (beta v)^T; Akk^T dw and
    # Akk^T dv_new are dX and dY already.
    if seg is None:
        dL = jnp.where(tri_mask(C, strict=True), -(dX @ mT(X) + dY @ mT(b * v)) @ mT(Akk), 0.0)
    else:  # (dAkk's entries across sequences, inf beside an overflow, never meet Akk's zeros)
        dAkk = select_zero(same, dX @ mT(X) + dY @ mT(b * v))
        dL = jnp.where(ranked(tri_mask(C, strict=True), same) & same, -dAkk @ mT(Akk), 0.0)
    dq = dqg * eG
    dk = dkg * jnp.exp(mask_exponent(end, exponent(G_last, G, lo_last, G_lo))) + b * eG * dX
    dv = b * dY
    dbeta = rowsum(v * dY) + rowsum(k * eG * dX)
    dG = qg * dqg - kd + X * dX + jnp.where(last, dgam[..., None, :], 0.0)
    return dq, dk, dv, dbeta, dG, dL


@final
class ReferenceWYDqkg(AbstractWYDqkg):
    """B3 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"wy": KDA, "state": KDA, "output": KDA})
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(
        self, scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, G_lo=None, reset=None, *,
        precision: str = "highest"
    ):
        tail, named = _chunk_args(G, G_lo, reset)
        chunk = lambda *a: _wy_dqkg_chunk(scale, *a[:12], **named(a[12:]))
        xs = (k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, *tail)  # q enters through qg
        return ChunkGrads(*over_chunks(chunk, self.group, *xs, loops=self.chunk_loops))
