"""Intra-chunk family: F2 (Aqk, Akk = (I + L)^-1) and B4 (their backward).

Every product here has the form ``sum_d a_id b_jd exp(G_id - G_jd)`` for j <= i. Forming
the pairwise ``[C, C, K]`` decay is slow, and factoring it as ``exp(G_i) exp(-G_j)``
overflows. Instead the chunk is halved recursively: at the level of blocks of ``2s``
rows, the pairs (i in the upper half, j in the lower half) split the decay at the
anchor ``a`` = first row of the upper half, ``exp(G_i - G_a) * exp(G_a - G_j)``, both
exponents non-positive (G is non-increasing), and their sum over d is a matmul. Every
pair j < i is covered by exactly one level, the diagonal needs no decay; each level costs
one exponential per entry of ``[C, K]`` (``log2 C`` in all) and no masked-out work.
With ``G_lo`` (float32; ``kdax._numerics.hilo``) each exponent is the difference of G plus that
of G_lo, at the cost of a few adds per exponential and the anchors of G_lo.
"""

import abc
import functools
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._layouts.resets import per_head, same_segment, segments
from .._numerics import precision as _precision
from .._numerics.arrays import rowsum
from .._numerics.chunk_loops import ChunkGroup, over_chunks
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Maybe, Specs
from .._annotations import ChunkK, ChunkMat, ChunkScalar, ChunkValid
from ._intra_levels import (
    intra_scores,
    inverse_vjp,
    level_anchor_list,
    level_anchors,
    level_blocks,
    pair_sums,
    split_rest,
    unit_lower_inverse_of_blocks,
)
from ._types import KDA, AbstractBackwardStage, AbstractForwardStage, ChunkGrads, IntraOut


class AbstractIntra(AbstractForwardStage):
    """F2: ``Aqk`` and ``Akk`` from the activated q, k, beta and G.

    Arguments: ``scale``; activated ``q``, ``k`` ``[R, HV, NC, C, K]``; ``beta``
    ``[R, HV, NC, C]``; ``G`` ``[R, HV, NC, C, K]`` (F1); ``G_lo`` its low part or None
    (an implementation may leave the parameter out and use ``G`` alone: ``kdax._numerics.hilo``).

    Returns ``IntraOut``: ``Aqk[i, j] = scale sum_d q_id k_jd exp(G_id - G_jd)`` for
    j <= i, zero above the diagonal (already scaled); ``Akk = (I + L)^-1`` with the strictly
    lower ``L[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)``; both ``[R, HV, NC, C, C]``.

    ``reset`` ``[R, NC, C]`` or None (shared chunks, ``kdax._layouts.resets``): both are zero,
    exactly, where i and j belong to different sequences. A stage not declaring it (``accepts``)
    cannot run shared chunks (the pipeline falls back)."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        G_lo: Optional[ChunkK] = None,
        reset: Optional[ChunkValid] = None,
    ) -> IntraOut:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> IntraOut:
        """What F2 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        q = kw["q"]
        mat = s.like(q, q.shape[:-1] + (q.shape[-2],), stored=True)
        return IntraOut(mat, mat)


@final
class ReferenceIntra(AbstractIntra):
    """F2 in jnp by recursive halving, ``group`` chunks at a time (None: all at once; see
    ``over_chunks``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None, *, precision: str = "highest"):
        C = G.shape[-2]

        def chunk(q, k, beta, G, *rest):
            seg, rest = (rest[0], rest[1:]) if reset is not None else (None, rest)
            return _intra(scale, q, k, beta, G, seg, *split_rest(rest, C, packed=True))

        seg = () if reset is None else (per_head(segments(reset), G.shape[1]),)
        lo = () if G_lo is None else (G_lo, level_anchors(G_lo))
        return IntraOut(*over_chunks(chunk, self.group, q, k, beta, G, *seg, level_anchors(G), *lo,
                                       loops=self.chunk_loops))


class AbstractIntraBackward(AbstractBackwardStage):
    """B4: the VJP of F2. The intra-chunk parts of dq, dk, dbeta, dG from ``dAqk``
    (``[R, HV, NC, C, C]``, gradient of the scaled ``Aqk``) and ``grads.dL`` (gradient of
    the strictly lower ``L``), added to the inter-chunk gradients ``grads`` from B3.

    Arguments: ``scale``, activated ``q``, ``k``, ``beta``, ``G`` as F2; ``dAqk``;
    ``grads`` (``ChunkGrads`` from B3, ``dL`` set); ``G_lo`` as F2 (optional parameter).

    Returns ``ChunkGrads``: B3's dq, dk, dbeta, dG plus the intra parts; ``dv`` passed
    through; ``dL`` may be None (it is consumed here). ``reset`` as F2's (pairs across
    sequences contribute exact zeros)."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        dAqk: ChunkMat,
        grads: ChunkGrads,
        G_lo: Optional[ChunkK] = None,
        reset: Optional[ChunkValid] = None,
    ) -> ChunkGrads:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> ChunkGrads:
        """What B4 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        return ChunkGrads(s.like(kw["q"]), s.like(kw["k"]), s.like(kw["grads"].dv), s.like(kw["beta"]),
                          s.like(kw["G"]), Maybe(s.like(kw["dAqk"])))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _intra(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors):
    """F2 for a group of chunks: the scaled ``Aqk`` and ``(I + L)^-1``, zero across sequences
    (``seg``, or None). ``L`` is inverted from its blocks as ``intra_scores`` forms them,
    never joined into a matrix. Differentiated by JAX (a derived backward), its VJP is the
    inverse's (``inverse_vjp``), then B4's formula (``_score_grads``): JAX's VJP of the
    halving took about 3x longer than B4."""
    qk, kk = intra_scores(q, k, G, anchors, G_lo, lo_anchors)
    blocks = []
    for B in kk:  # L = beta_i (k_i . k_j decayed), block by block
        s = B.shape[-1]
        b, _ = level_blocks(beta, s)
        if seg is not None:  # pairs across sequences: exact zeros (L block-diagonal)
            rows, cols = level_blocks(seg, s)
            B = jnp.where(rows == cols, B, 0.0)
        blocks.append(b * B)
    if seg is not None:
        qk = jnp.where(same_segment(seg), qk, 0.0)
    return scale * qk, unit_lower_inverse_of_blocks(blocks, seg)


def _intra_fwd(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors):
    out = _intra(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors)
    return out, (q, k, beta, G, seg, anchors, G_lo, lo_anchors, out[1])


def _intra_bwd(scale, res, g):
    q, k, beta, G, seg, anchors, G_lo, lo_anchors, Akk = res
    dAqk, dAkk = g
    dL = inverse_vjp(Akk, dAkk)
    # (dL strictly lower; pair sums read dAqk on and below the diagonal only, where Aqk
    # depends on the inputs. The anchors only shift exponents that cancel: no gradient.
    # G_lo enters every exponent as G does.)
    with _precision.float32_products():  # B4's precision (its sums cancel: kdax._numerics.precision)
        dq, dk, dbeta, dG = _score_grads(scale, q, k, beta, G, dAqk, dL, seg, anchors, G_lo, lo_anchors)
    nothing = lambda xs: None if xs is None else tuple(None for _ in xs)
    return dq, dk, dbeta, dG, None, nothing(anchors), None if G_lo is None else dG, nothing(lo_anchors)


_intra.defvjp(_intra_fwd, _intra_bwd)


def _score_grads(scale, q, k, beta, G, dAqk, dL, seg, anchors, G_lo, lo_anchors):
    """B4's formula for a group of chunks: ``(dq, dk, dbeta, dG)`` from ``dAqk`` (of the
    scaled ``Aqk``) and ``dL`` (of the strictly lower ``L``)."""
    if seg is not None:  # F2's pairs across sequences are constant zeros
        same = same_segment(seg)
        dAqk, dL = jnp.where(same, dAqk, 0.0), jnp.where(same, dL, 0.0)
    # Aqk = scale * sum_d q_i k_j e^(G_i - G_j); L = beta_i * sum_d k_i k_j e^(G_i - G_j):
    # both products at once, the row side of L carrying beta_i.
    b = beta[..., None]
    S = jnp.stack([dAqk, dL], axis=-3)
    R, Cs, Rd, Cd = pair_sums(G, anchors, S, k[..., None, :, :], jnp.stack([q, b * k], axis=-3), G_lo, lo_anchors)
    (dq_a, r), (dk_a, c) = (R[..., 0, :, :], R[..., 1, :, :]), (Cs[..., 0, :, :], Cs[..., 1, :, :])
    # dG from the pairs i != j alone: a diagonal term adds to dG_i and takes from it alike
    dG = scale * (q * dq_a - k * dk_a) + b * k * r - k * c
    dq_a, r = dq_a + Rd[..., 0, :, :], r + Rd[..., 1, :, :]
    dk_a, c = dk_a + Cd[..., 0, :, :], c + Cd[..., 1, :, :]
    dk = scale * dk_a + b * r + c
    dbeta = rowsum(k * r)
    return scale * dq_a, dk, dbeta, dG


@final
class ReferenceIntraBackward(AbstractIntraBackward):
    """B4 in jnp with the same recursive halving as ``ReferenceIntra``, ``group`` chunks at
    a time (None: all at once)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"intra": KDA})
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(self, scale, q, k, beta, G, dAqk, grads, G_lo=None, reset=None, *, precision: str = "highest"):
        C = G.shape[-2]

        def chunk_grads(q, k, beta, G, dAqk, dL, *rest):
            seg, rest = (rest[0], rest[1:]) if reset is not None else (None, rest)
            return _score_grads(scale, q, k, beta, G, dAqk, dL, seg, *split_rest(rest, C, packed=False))

        anchors = level_anchor_list(G, after=(dAqk, grads.dL))
        lo = () if G_lo is None else (G_lo, *level_anchor_list(G_lo, after=(dAqk, grads.dL)))
        into = (grads.dq, grads.dk, grads.dbeta, grads.dG)
        seg = () if reset is None else (per_head(segments(reset), G.shape[1]),)
        dq, dk, dbeta, dG = over_chunks(chunk_grads, self.group, q, k, beta, G, dAqk, grads.dL, *seg, *anchors, *lo,
                                        into=into, loops=self.chunk_loops)
        return ChunkGrads(dq, dk, grads.dv, dbeta, dG, None)
