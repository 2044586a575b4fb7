"""F2's and B4's products over halving levels, and ``(I + L)^-1`` by blocks (the
reference intra-chunk stages, ``kdax.stages._intra``, whose module docstring gives the
scheme: each pair j < i of a chunk is covered by exactly one level, its decay split at that
level's anchor row so that both exponents are non-positive)."""

import jax
import jax.numpy as jnp
import numpy as np

from .._layouts.resets import select_zero
from .._numerics import precision as _precision
from .._numerics.hilo import exponent
from .._numerics.arrays import lower_matmul, mT, rowsum, zeros_after


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


def split_rest(rest, C: int, packed: bool):
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
    """Both products F2 needs: ``sum_d q_id k_jd e^(G_id - G_jd)`` for j <= i, ``[..., C, C]``
    (zeros above the diagonal), and ``sum_d k_id k_jd e^(G_id - G_jd)`` for j < i as its
    blocks, one ``[..., C/2s, s, s]`` per level s = 1, 2, ..., C/2: the lower-left block of
    every diagonal ``2s`` block, which ``unit_lower_inverse_of_blocks`` reads (the matrix
    itself is never formed). ``G_lo``, ``lo_anchors``: the low parts (or None)."""
    C = G.shape[-2]
    Sq = rowsum(q * k)[..., :, None, None]
    kk = []
    lo_anchors = (None,) * len(anchors) if lo_anchors is None else lo_anchors
    for s, a, a_lo in zip(_levels(C), anchors, lo_anchors):
        rows, cols = _decays(G, a, s, G_lo, a_lo)
        _, qu = _halves(q, s)
        kl, ku = _halves(k, s)
        kc = kl * cols
        Sq = _join_square(Sq, _cross(qu * rows, kc, s))
        kk.append(_cross(ku * rows, kc, s))
    return Sq[..., 0, :, :], kk


def level_blocks(x, s: int):
    """``x [..., C]`` per row -> ``(rows, cols)``: its entries at the rows ``[..., C/2s, s, 1]``
    and columns ``[..., C/2s, 1, s]`` of level s's blocks (``intra_scores``)."""
    lo, up = _halves(x[..., None], s)
    return up, mT(lo)


def pair_sums(G, anchors, S, b, a, G_lo=None, lo_anchors=None):
    """Both sides of lower-triangular pair sums for a stack of X matrices, sharing the
    decays: ``R_xid = sum_{j <= i} S_xij b_xjd e^(G_id - G_jd)`` and
    ``C_xjd = sum_{i >= j} S_xij a_xid e^(G_id - G_jd)``; ``S [..., X, C, C]``, ``a, b``
    ``[..., X, C, K]`` (or broadcastable to it), ``G [..., C, K]``; ``G_lo``,
    ``lo_anchors``: the low parts (or None). Returns ``(R, C, Rd, Cd)``: ``R`` and ``C``
    without the diagonal (i = j) terms, and those terms, ``S_xii b_xid`` and ``S_xii a_xid``,
    apart (B4's dG, ``a R - b C``, then leaves out the diagonal terms, which cancel there
    exactly: float32 rounding of them in both sums was noise in every row of dG)."""
    C = S.shape[-1]  # (the diagonal as a strided slice: jnp.diagonal is a gather with its own index kernel)
    d = S.reshape(S.shape[:-2] + (C * C,))[..., :: C + 1, None]
    R_parts, C_parts = [], []
    lo_anchors = (None,) * len(anchors) if lo_anchors is None else lo_anchors
    for s, anc, a_lo, off in zip(reversed(_levels(G.shape[-2])), anchors[::-1], lo_anchors[::-1], _diagonal_splits(S)):
        rows, cols = (f[..., None, :, :, :] for f in _decays(G, anc, s, G_lo, a_lo))
        R_parts.append(rows * _apply(off, _halves(b, s)[0] * cols, s, False))
        C_parts.append(cols * _apply(off, _halves(a, s)[1] * rows, s, True))
    zeros = jnp.zeros_like(d * b)
    return _join_rows(zeros, R_parts[::-1], True), _join_rows(zeros, C_parts[::-1], False), d * b, d * a


def _diagonal_splits(S):
    """The lower-left block of every diagonal ``2s`` block of ``S [..., C, C]``, for
    s = C/2, C/4, ..., 1 (top level first): ``[..., C/2s, s, s]`` each, every level read
    from ``S`` itself (halving the diagonal blocks level by level took XLA:CPU a stack per
    level: a training step's compile 1.08x the CPU time, the run the same)."""
    return [_diagonal_blocks(S, 2 * s)[..., s:, :s] for s in reversed(_levels(S.shape[-1]))]


def _diagonal_blocks(S, m: int):
    """The ``m x m`` blocks on the diagonal of ``S [..., C, C]``, ``[..., C/m, m, m]``: in
    ``S`` flat, block b's entry (i, j) is at b (m C + m) + i C + j, so rows of ``m C + m``
    entries (``C`` of padding at the end) start at each block."""
    *lead, C, _ = S.shape
    n = C // m
    flat = jnp.pad(S.reshape(*lead, C * C), [(0, 0)] * len(lead) + [(0, C)])
    return flat.reshape(*lead, n, m * C + m)[..., : m * C].reshape(*lead, n, m, C)[..., :m]


def unit_lower_inverse(L):
    """``(I + L)^-1`` for strictly lower ``L [..., C, C]`` (``unit_lower_inverse_of_blocks`` on
    the blocks of its diagonal), differentiable by JAX through the recursion; F2 uses the
    blocks directly and ``inverse_vjp``."""
    return unit_lower_inverse_of_blocks(_diagonal_splits(L)[::-1])


def inverse_vjp(X, dX):
    """The inverse's VJP at ``X = (I + L)^-1``: ``dL = -X^T dX X^T`` below the diagonal, zero
    elsewhere (only those entries of ``L`` are read; JAX's VJP of the recursion took
    several times longer)."""
    hi = jax.lax.Precision.HIGHEST
    C = X.shape[-1]
    d = -jnp.matmul(jnp.matmul(mT(X), dX, precision=hi), mT(X), precision=hi)
    return jnp.where(np.tril(np.ones((C, C), bool), -1), d, 0.0).astype(X.dtype)


@_precision.keep_float32
def unit_lower_inverse_of_blocks(blocks, seg=None):
    """``(I + L)^-1`` for strictly lower ``L`` from the blocks its recursion reads, by 2 x 2
    blocks: ``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]`` (matmuls only:
    XLA:CPU's triangular solve forces a column-major layout on its operand). ``blocks``:
    for s = 1, 2, ..., C/2, the lower-left block of every diagonal ``2s`` block of ``L``,
    ``[..., C/2s, s, s]`` (``intra_scores``' form). ``seg [..., C]`` (sequences sharing the
    chunk, ``L`` zero between them): the inverse's entries between them are exact zeros,
    whatever the others hold."""
    C = 2 * blocks[-1].shape[-1]
    inv = jnp.ones(blocks[0].shape[:-3] + (C, 1, 1), blocks[0].dtype)
    for s, B in zip(_levels(C), blocks):
        pair = inv.reshape(*inv.shape[:-3], inv.shape[-3] // 2, 2, s, s)
        mm = jnp.matmul if s >= _SMALL else _small_matmul  # (dots from 4 on: F2 1.04-1.10x the time)
        # D^-1 is lower triangular: a NaN row of B A^-1 must not reach the rows above it.
        if seg is None:
            low = -lower_matmul(pair[..., 1, :, :], mm(B, pair[..., 0, :, :]), mm)
        else:  # (each product's 0 * inf across sequences selected away; a NaN row reaches its own sequence only)
            rows, cols = level_blocks(seg, s)
            same = rows == cols
            BA = select_zero(same, mm(B, pair[..., 0, :, :]))
            low = select_zero(same, -lower_matmul(pair[..., 1, :, :], BA, mm, rows == mT(rows)))
        inv = _join_square(inv, low)
    return inv[..., 0, :, :]
