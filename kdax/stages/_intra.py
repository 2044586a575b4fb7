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
from .._numerics.hilo import exponent
from .._numerics.arrays import lower_matmul, mT, rowsum, zeros_after
from .._numerics.chunk_loops import ChunkGroup, over_chunks
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Maybe, Specs
from .._annotations import ChunkK, ChunkMat, ChunkScalar, ChunkValid, typecheck
from ._types import ChunkGrads, IntraOut, KDA


def _levels(C: int):
    """Half-block sizes s = 1, 2, 4, ..., C/2."""
    return [1 << e for e in range(C.bit_length() - 1)]


def _halves(x, s: int):
    """``[..., C, D]`` -> lower and upper halves of every ``2s``-row block, ``[..., C/2s, s, D]``."""
    x = x.reshape(*x.shape[:-2], x.shape[-2] // (2 * s), 2, s, x.shape[-1])
    return x[..., 0, :, :], x[..., 1, :, :]


def level_anchors(G, after=()):
    """The anchor rows of every level s = 1, 2, ..., C/2, packed in one array
    ``[..., C - 1, K]`` (level s's C/2s rows after those of the levels below it;
    ``unpack_anchors`` gives them back as ``[..., C/2s, 1, K]`` each). Taken outside the
    chunk-group loops: XLA:CPU runs a loop-body fusion that slices and broadcasts its own
    input about 5x slower than one that reads the anchors as a separate operand; packed,
    one kernel makes them (XLA:CPU compiles ~30 ms a kernel). ``after``: arrays the anchors
    are made to depend on (an exact zero added), so that B4 builds its own when it runs
    instead of XLA keeping F2's alive through the whole training step."""
    C, K = G.shape[-2:]
    anchors = jnp.concatenate([_halves(G, s)[1][..., 0, :] for s in _levels(C)], axis=-2)
    if not after:
        return anchors
    zero = zeros_after(G.shape[:2] + (1,) * (G.ndim - 2), G.dtype, after)  # per row and head: no collective
    return anchors + zero


def level_anchor_list(G, after=()):
    """The anchor rows of every level as separate arrays, ``[..., C/2s, 1, K]`` for s = 1,
    2, ..., C/2 (B4's: it ran 0-6% slower on the packed ones, F2 4-6% faster; see
    ``level_anchors``)."""
    anchors = tuple(_halves(G, s)[1][..., :1, :] for s in _levels(G.shape[-2]))
    if not after:
        return anchors
    zero = zeros_after(G.shape[:2] + (1,) * (G.ndim - 1), G.dtype, after)  # per row and head: no collective
    return tuple(a + zero for a in anchors)


def unpack_anchors(anchors, C: int):
    """``level_anchors``' packed array -> one ``[..., C/2s, 1, K]`` array per level s."""
    out, at = [], 0
    for s in _levels(C):
        n = C // (2 * s)
        out.append(anchors[..., at:at + n, None, :])
        at += n
    return tuple(out)


def _decays(G, a, s: int, G_lo=None, a_lo=None):
    """``(exp(G_i - G_a) for upper rows i, exp(G_a - G_j) for lower rows j)``, ``a`` the
    anchors of level s (``level_anchors``); with the low parts ``G_lo`` and their anchors
    ``a_lo``, the exponents of the sums (``kdax._numerics.hilo.exponent``)."""
    lo, up = _halves(G, s)
    if G_lo is None:
        return jnp.exp(up - a), jnp.exp(a - lo)
    lo_l, lo_u = _halves(G_lo, s)
    return jnp.exp(exponent(up, a, lo_u, a_lo)), jnp.exp(exponent(a, lo, a_lo, lo_l))


# Below this block size, products are formed elementwise: XLA:CPU runs batched dots of
# blocks this small several times slower than their FLOPs suggest (F2 -22% at C = 64).
_SMALL = 8
_LARGE = 32  # and from this block size, as one transposed product (see _apply)


def _cross_dots_from() -> int:
    """The block size from which F2's cross products ``a @ b^T`` are dots. On CPU from 4:
    their K-long rows make ``[4, K] @ [K, 4]`` blocks worth a dot where the elementwise
    product and its row sum were two passes over ``[.., 4, 4, K]`` (F2 alone 0.85-0.87x
    the time with 8, same process, B=1 T=4096 H=8 K=V=128; 2: the same, 1: 0.88-0.90x).
    Elsewhere ``_SMALL`` (not measured there). (Its revert in session 27 answered a test
    artifact: benchmarks/results/codegen_splits.txt.)"""
    return 4 if jax.default_backend() == "cpu" else _SMALL


def _cross(a, b, s: int):
    """``a @ b^T`` per block (``[..., n, s, K]`` each -> ``[..., n, s, s]``)."""
    if s >= _cross_dots_from():
        return jnp.einsum("...ik,...jk->...ij", a, b)
    return rowsum(a[..., :, None, :] * b[..., None, :, :])  # the sum over K as a matvec


def _small_matmul(a, b):
    """``a @ b`` for ``a [..., s, s]`` with s small: one fusion instead of a batched dot."""
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


def _apply(S, b, s: int, transpose: bool):
    """``S @ b`` (``S^T @ b`` if transpose) per block: ``S [..., n, s, s]``, ``b [..., n, s, K]``."""
    if transpose:
        S = mT(S)
        if _SMALL // 2 <= s < _LARGE:
            # The transposed blocks made once: XLA:CPU's dot of these shapes reads a transposed
            # lhs 1.4-2.7x slower than a plain one (s = 16, 8, 4; bitwise equal).
            S = jax.lax.optimization_barrier(S)
    if s >= 4:
        return S @ b
    rows = [sum(S[..., i, j, None] * b[..., j, :] for j in range(s)) for i in range(s)]
    return jnp.stack(rows, -2)


def _join_square(S, off):
    """Diagonal blocks ``S [..., 2n, s, s]`` and lower-left blocks ``off [..., n, s, s]``
    -> ``[..., n, 2s, 2s]`` (zeros above the diagonal)."""
    s = off.shape[-1]
    S = S.reshape(*off.shape[:-3], off.shape[-3], 2, s, s)
    top = jnp.concatenate([S[..., 0, :, :], jnp.zeros_like(off)], axis=-1)
    bottom = jnp.concatenate([off, S[..., 1, :, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _join_rows(diag, parts, upper: bool):
    """``[..., C, K]`` from the diagonal term and one ``[..., C/2s, s, K]`` part per level,
    added to the upper (else lower) half of each ``2s`` block; one fused pass."""
    acc = diag
    for s, part in zip(_levels(diag.shape[-2]), parts):
        lo, up = _halves(acc, s)
        lo, up = (lo, up + part) if upper else (lo + part, up)
        acc = jnp.concatenate([lo, up], axis=-2).reshape(diag.shape)
    return acc


def _split_rest(rest, C: int, packed: bool):
    """``(anchors, G_lo, lo_anchors)`` from a chunk function's trailing arguments: the
    anchors of G, then, when the low part is used, ``G_lo`` and its anchors; the anchors
    ``packed`` (``level_anchors``, unpacked here) or one array per level
    (``level_anchor_list``)."""
    if packed:
        if len(rest) == 1:
            return unpack_anchors(rest[0], C), None, None
        return unpack_anchors(rest[0], C), rest[1], unpack_anchors(rest[2], C)
    n = len(_levels(C))
    if len(rest) == n:
        return rest, None, None
    return rest[:n], rest[n], rest[n + 1:]


def intra_scores(q, k, G, anchors, G_lo=None, lo_anchors=None):
    """Both products F2 needs: ``sum_d q_id k_jd e^(G_id - G_jd)`` for j <= i and
    ``sum_d k_id k_jd e^(G_id - G_jd)`` for j < i, zeros elsewhere; ``[..., C, C]``.
    ``G_lo``, ``lo_anchors``: the low parts (or None)."""
    C = G.shape[-2]
    Sq = rowsum(q * k)[..., :, None, None]
    Sk = jnp.zeros_like(Sq)
    lo_anchors = (None,) * len(anchors) if lo_anchors is None else lo_anchors
    for s, a, a_lo in zip(_levels(C), anchors, lo_anchors):
        rows, cols = _decays(G, a, s, G_lo, a_lo)
        _, qu = _halves(q, s)
        kl, ku = _halves(k, s)
        kc = kl * cols
        Sq = _join_square(Sq, _cross(qu * rows, kc, s))
        Sk = _join_square(Sk, _cross(ku * rows, kc, s))
    return Sq[..., 0, :, :], Sk[..., 0, :, :]


def pair_sums(G, anchors, S, b, a, G_lo=None, lo_anchors=None):
    """Both sides of lower-triangular pair sums for a stack of X matrices, sharing the
    decays: ``R_xid = sum_{j <= i} S_xij b_xjd e^(G_id - G_jd)`` and
    ``C_xjd = sum_{i >= j} S_xij a_xid e^(G_id - G_jd)``; ``S [..., X, C, C]``, ``a, b``
    ``[..., X, C, K]`` (or broadcastable to it), ``G [..., C, K]``; ``G_lo``,
    ``lo_anchors``: the low parts (or None). Returns ``(R, C)``."""
    d = jnp.diagonal(S, axis1=-2, axis2=-1)[..., None]
    R_parts, C_parts = [], []
    lo_anchors = (None,) * len(anchors) if lo_anchors is None else lo_anchors
    for s, anc, a_lo, off in zip(reversed(_levels(G.shape[-2])), anchors[::-1], lo_anchors[::-1], _diagonal_splits(S)):
        rows, cols = (f[..., None, :, :, :] for f in _decays(G, anc, s, G_lo, a_lo))
        R_parts.append(rows * _apply(off, _halves(b, s)[0] * cols, s, False))
        C_parts.append(cols * _apply(off, _halves(a, s)[1] * rows, s, True))
    return _join_rows(d * b, R_parts[::-1], True), _join_rows(d * a, C_parts[::-1], False)


def _diagonal_splits(S):
    """The lower-left block of every diagonal ``2s`` block of ``S [..., C, C]``, for
    s = C/2, C/4, ..., 1 (top level first): ``[..., C/2s, s, s]`` each."""
    offs = []
    blocks = S[..., None, :, :]  # the diagonal 2s-blocks: [..., n, 2s, 2s]
    for s in reversed(_levels(S.shape[-1])):
        offs.append(blocks[..., s:, :s])
        n = blocks.shape[-3]
        blocks = jnp.stack([blocks[..., :s, :s], blocks[..., s:, s:]], axis=-3).reshape(*blocks.shape[:-3], 2 * n, s, s)
    return offs


@jax.custom_vjp
def unit_lower_inverse(L):
    """``(I + L)^-1`` for strictly lower ``L [..., C, C]``, by recursive 2 x 2 blocks:
    ``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]`` (matmuls only: XLA:CPU's
    triangular solve forces a column-major layout on its operand). Differentiated by JAX
    (a derived backward), its VJP is the inverse's: ``dL = -X^T dX X^T`` below the
    diagonal, ``X`` the inverse (JAX's VJP of the recursion took several times longer)."""
    return _blocks_inverse(L)


def _inverse_fwd(L):
    X = _blocks_inverse(L)
    return X, X


def _inverse_bwd(X, dX):
    hi = jax.lax.Precision.HIGHEST
    C = X.shape[-1]
    d = -jnp.matmul(jnp.matmul(mT(X), dX, precision=hi), mT(X), precision=hi)
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), d, 0.0).astype(X.dtype),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


@_precision.keep_float32
def _blocks_inverse(L):
    C = L.shape[-1]
    inv = jnp.ones(L.shape[:-2] + (C, 1, 1), L.dtype)
    for s, B in zip(_levels(C), _diagonal_splits(L)[::-1]):
        pair = inv.reshape(*inv.shape[:-3], inv.shape[-3] // 2, 2, s, s)
        mm = jnp.matmul if s >= _SMALL else _small_matmul  # (dots from 4 on: F2 1.04-1.10x the time)
        # D^-1 is lower triangular: a NaN row of B A^-1 must not reach the rows above it.
        low = -lower_matmul(pair[..., 1, :, :], mm(B, pair[..., 0, :, :]), mm)
        inv = _join_square(inv, low)
    return inv[..., 0, :, :]


class AbstractIntra(eqx.Module):
    """F2: ``Aqk`` and ``Akk`` from the activated q, k, beta and G.

    Arguments: ``scale``; activated ``q``, ``k`` ``[R, HV, NC, C, K]``; ``beta``
    ``[R, HV, NC, C]``; ``G`` ``[R, HV, NC, C, K]`` (F1); ``G_lo`` its low part or None
    (an implementation may leave the parameter out and use ``G`` alone: ``kdax._numerics.hilo``).

    Returns ``IntraOut``: ``Aqk[i, j] = scale sum_d q_id k_jd exp(G_id - G_jd)`` for
    j <= i, zero above the diagonal (already scaled); ``Akk = (I + L)^-1`` with the strictly
    lower ``L[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)``; both ``[R, HV, NC, C, C]``.

    ``reset`` ``[R, NC, C]`` or None (shared chunks, ``kdax._layouts.resets``): both are zero,
    exactly, where i and j belong to different sequences. A stage without the parameter
    cannot run shared chunks (the pipeline falls back)."""

    # What the stage accepts beyond the required arguments (docs/stages.md,
    # "Capabilities"): a subset of {"G_lo", "reset", "tile_safe", "tokens"}.
    accepts: ClassVar[frozenset] = frozenset()

    # Which formula the stage computes: ``KDA`` (the family's formula above, exactly as
    # the reference stage computes it), or None (any other math: the backward stages do
    # not transpose it, and the pipeline derives its backward, ``kdax._runner.routes``).
    math: ClassVar[Optional[str]] = None

    # Whether the stage may be called on a tile (a few chunks at a time, the state carried
    # in h0): see docs/stages.md. A pipeline runs its forward whole if any stage is not.
    tile_safe: ClassVar[bool] = False

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

    @typecheck
    def __call__(
        self,
        scale: float,
        q: ChunkK,
        k: ChunkK,
        beta: ChunkScalar,
        G: ChunkK,
        G_lo: Optional[ChunkK] = None,
        reset: Optional[ChunkValid] = None,
        *,
        precision: str = "highest",
    ) -> IntraOut:
        C = G.shape[-2]

        def chunk(q, k, beta, G, *rest):
            seg, rest = (rest[0], rest[1:]) if reset is not None else (None, rest)
            Aqk, L = _scores(scale, q, k, beta, G, seg, *_split_rest(rest, C, packed=True))
            return Aqk, unit_lower_inverse(L)

        seg = () if reset is None else (per_head(segments(reset), G.shape[1]),)
        lo = () if G_lo is None else (G_lo, level_anchors(G_lo))
        return IntraOut(*over_chunks(chunk, self.group, q, k, beta, G, *seg, level_anchors(G), *lo,
                                       loops=self.chunk_loops))


class AbstractIntraBackward(eqx.Module):
    """B4: the VJP of F2. The intra-chunk parts of dq, dk, dbeta, dG from ``dAqk``
    (``[R, HV, NC, C, C]``, gradient of the scaled ``Aqk``) and ``grads.dL`` (gradient of
    the strictly lower ``L``), added to the inter-chunk gradients ``grads`` from B3.

    Arguments: ``scale``, activated ``q``, ``k``, ``beta``, ``G`` as F2; ``dAqk``;
    ``grads`` (``ChunkGrads`` from B3, ``dL`` set); ``G_lo`` as F2 (optional parameter).

    Returns ``ChunkGrads``: B3's dq, dk, dbeta, dG plus the intra parts; ``dv`` passed
    through; ``dL`` may be None (it is consumed here). ``reset`` as F2's (pairs across
    sequences contribute exact zeros)."""

    # What the stage accepts beyond the required arguments (docs/stages.md,
    # "Capabilities"): a subset of {"G_lo", "reset", "tile_safe", "tokens"}.
    accepts: ClassVar[frozenset] = frozenset()

    # The forward math this stage is the transpose of, per forward field it transposes
    # (``{"output": KDA}``): empty declares nothing, and a pipeline with this stage
    # derives its backward from the forward stages (``kdax._runner.routes``).
    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({})

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
def _scores(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors):
    """F2's two products for a group of chunks: the scaled ``Aqk`` and ``L`` (which F2
    inverts), zero across sequences (``seg``, or None). Differentiated by JAX (a derived
    backward), its VJP is B4's formula (``_score_grads``): JAX's VJP of the halving took
    about 3x longer than B4."""
    qk, kk = intra_scores(q, k, G, anchors, G_lo, lo_anchors)
    if seg is not None:  # pairs across sequences: exact zeros (L block-diagonal)
        same = same_segment(seg)
        qk, kk = jnp.where(same, qk, 0.0), jnp.where(same, kk, 0.0)
    return scale * qk, beta[..., :, None] * kk


def _scores_fwd(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors):
    return _scores(scale, q, k, beta, G, seg, anchors, G_lo, lo_anchors), (q, k, beta, G, seg, anchors, G_lo, lo_anchors)


def _scores_bwd(scale, res, g):
    q, k, beta, G, seg, anchors, G_lo, lo_anchors = res
    dAqk, dL = g
    # (dL comes from the inverse's VJP, strictly lower; pair sums read dAqk on and below
    # the diagonal only, where Aqk depends on the inputs. The anchors only shift exponents
    # that cancel: no gradient. G_lo enters every exponent as G does.)
    with _precision.float32_products():  # B4's precision (its sums cancel: kdax._numerics.precision)
        dq, dk, dbeta, dG = _score_grads(scale, q, k, beta, G, dAqk, dL, seg, anchors, G_lo, lo_anchors)
    nothing = lambda xs: None if xs is None else tuple(None for _ in xs)
    return dq, dk, dbeta, dG, None, nothing(anchors), None if G_lo is None else dG, nothing(lo_anchors)


_scores.defvjp(_scores_fwd, _scores_bwd)


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
    R, Cs = pair_sums(G, anchors, S, k[..., None, :, :], jnp.stack([q, b * k], axis=-3), G_lo, lo_anchors)
    (dq_a, r), (dk_a, c) = (R[..., 0, :, :], R[..., 1, :, :]), (Cs[..., 0, :, :], Cs[..., 1, :, :])
    dk = scale * dk_a + b * r + c
    dbeta = rowsum(k * r)
    dG = scale * (q * dq_a - k * dk_a) + b * k * r - k * c
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

    @typecheck
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
        *,
        precision: str = "highest",
    ) -> ChunkGrads:
        C = G.shape[-2]

        def chunk_grads(q, k, beta, G, dAqk, dL, *rest):
            seg, rest = (rest[0], rest[1:]) if reset is not None else (None, rest)
            return _score_grads(scale, q, k, beta, G, dAqk, dL, seg, *_split_rest(rest, C, packed=False))

        anchors = level_anchor_list(G, after=(dAqk, grads.dL))
        lo = () if G_lo is None else (G_lo, *level_anchor_list(G_lo, after=(dAqk, grads.dL)))
        into = (grads.dq, grads.dk, grads.dbeta, grads.dG)
        seg = () if reset is None else (per_head(segments(reset), G.shape[1]),)
        dq, dk, dbeta, dG = over_chunks(chunk_grads, self.group, q, k, beta, G, dAqk, grads.dL, *seg, *anchors, *lo,
                                        into=into, loops=self.chunk_loops)
        return ChunkGrads(dq, dk, grads.dv, dbeta, dG, None)
