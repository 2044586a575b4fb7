"""Small array helpers shared by the reference stages and the layouts: transposes,
masks, NaN-confined triangular products, row sums, dependent zeros, and the
shard_map varying-axes casts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import precision as _precision


def mT(x):
    """Transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def ranked(x, like):
    """``x`` with leading unit axes up to ``like``'s rank: jnp's implicit rank promotion made
    explicit (the same program), so that kdax runs under ``jax_numpy_rank_promotion="raise"``."""
    return jax.lax.broadcast_to_rank(jnp.asarray(x), jnp.ndim(like))


def at_least_float32(*dtypes):
    """The widest of the float ``dtypes`` and float32: ``jnp.result_type(*dtypes, float32)``
    without implicit promotion, so that it holds under ``jax_numpy_dtype_promotion="strict"``
    (float64 beside float32 has no implicit path there)."""
    return max((jnp.dtype(d) for d in (*dtypes, jnp.float32)), key=lambda d: d.itemsize)


def tri_mask(n: int, strict: bool):
    """``[n, n]`` mask of j <= i (j < i when strict), i the row. (Masks and ones here are
    numpy values: constants of the program; traced, each was a kernel XLA:CPU compiled.)"""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return j < i if strict else j <= i


def lower_matmul(A, X, mm=jnp.matmul, same=None):
    """``A @ X`` for lower-triangular ``A [..., C, C]`` (``mm``: the product to use), where
    a non-finite entry in row j of ``X`` reaches only rows i >= j, which are NaN from there:
    in a plain product the zeros above A's diagonal meet it as ``0 * inf = NaN`` and carry
    it to every row of the chunk. Rows before the first non-finite one are bit-identical
    to ``A @ X``. ``same [..., C, C]`` (sequences sharing the chunk: ``A`` zero where it is
    False): the rows i >= j it holds only."""
    return _reaching_matmul(A, X, np.tril(np.ones(A.shape[-2:], X.dtype)), mm, same)


def upper_matmul(A, X, same):
    """``A @ X`` for upper-triangular ``A`` (the transpose of a lower one), zero where
    ``same`` is False (sequences sharing the chunk): a non-finite entry in row j of ``X``
    makes rows i <= j of its own sequence NaN, and no other row (``lower_matmul``)."""
    return _reaching_matmul(A, X, np.triu(np.ones(A.shape[-2:], X.dtype)), jnp.matmul, same)


@jax.custom_vjp
@_precision.glue_at_highest
def segment_matmul(A, X, same):
    """``lower_matmul(A, X, same=same)`` whose VJP keeps a sequence's non-finite cotangents
    in it too (``A^T dY`` by ``upper_matmul``, ``dA`` selected by ``same``): for products
    that JAX differentiates between the stages (``kdax._layouts.shared_states``), so in
    float32 (HIGHEST), its VJP too."""
    return lower_matmul(A, X, same=same)


def _segment_matmul_fwd(A, X, same):
    return lower_matmul(A, X, same=same), (A, X, same)


def _segment_matmul_bwd(res, dY):
    A, X, same = res
    return jnp.where(same, dY @ mT(X), 0.0), upper_matmul(mT(A), dY, mT(same)), None


segment_matmul.defvjp(_precision.glue_at_highest(_segment_matmul_fwd), _precision.glue_at_highest(_segment_matmul_bwd))


def _reaching_matmul(A, X, reach, mm, same):
    ok = jnp.abs(X) < jnp.inf
    Y = mm(A, jnp.where(ok, X, 0.0))
    bad = jnp.any(~ok, axis=-1, keepdims=True).astype(X.dtype)
    seen = (reach if same is None else jnp.where(same, reach, 0.0)) @ bad
    return jnp.where(seen > 0, jnp.nan, Y)


def row_cumsum(x, reverse: bool = False, block: int = 4, nan_rows: bool = True):
    """Inclusive sum over the rows (axis -2) of ``x [..., C, D]``, from the end if
    ``reverse``, by additions alone: ``lax.cumsum`` within blocks of ``block`` rows, then
    over the blocks' totals, carried across. A row reads only the rows it sums (causal to
    the bit); a non-finite entry makes its row and every row that sums it NaN in every
    column, and no other row (as ``lower_matmul``; ``nan_rows=False``: in its own column,
    as the additions leave it, one reduction less).

    XLA:CPU runs ``lax.cumsum`` as a reduce-window, quadratic in the summed axis: over a
    chunk's 64 rows 1.3-1.6x the time of the triangular ones-matrix product (itself at
    batched small dots' rate), in blocks of 4 0.35-0.5x, for ~0.03 s more compile a call
    site (running sums as chains of additions: as fast, 0.28 s a site; benchmarks/NOTES.md,
    "Chunk cumsums by additions")."""
    C = x.shape[-2]
    b = block if C % block == 0 else 1
    if nan_rows:
        bad = jnp.any(~(jnp.abs(x) < jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(bad, jnp.nan, x)  # the whole row, inf too (never inf - inf elsewhere)
    xb = x.reshape(*x.shape[:-2], C // b, b, x.shape[-1])
    within = jax.lax.cumsum(xb, axis=xb.ndim - 2, reverse=reverse)  # [..., C/b, b, D]
    totals = within[..., 0 if reverse else b - 1, :]  # [..., C/b, D]
    upto = jax.lax.cumsum(totals, axis=totals.ndim - 2, reverse=reverse)
    zero = jnp.zeros_like(upto[..., :1, :])
    before = jnp.concatenate([upto[..., 1:, :], zero] if reverse else [zero, upto[..., :-1, :]], axis=-2)
    return (within + before[..., None, :]).reshape(x.shape)


def identity_row_terms(src, like, scale) -> list:
    """``[(qg, do)]``: ``ceil(K / C)`` pairs shaped as ``like`` ``[.., C, K]`` and ``src``'s
    rows, whose ``scale qg^T do`` sum to ``src`` ``[.., K, V]`` (``qg`` block j of I_K: ones
    at row i, column j C + i; ``do`` rows [j C, (j + 1) C) of ``src / scale``, zero-padded):
    a B2's start-state cotangent term fed through its ``scale qg^T do``."""
    C, K = like.shape[-2:]
    i, r = jnp.arange(C)[:, None], jnp.arange(K)[None, :]
    terms = []
    for j in range(-(-K // C)):
        rows = src[..., j * C:(j + 1) * C, :]
        if rows.shape[-2] < C:
            rows = jnp.pad(rows, [(0, 0)] * (src.ndim - 2) + [(0, C - rows.shape[-2]), (0, 0)])
        terms.append((jnp.broadcast_to((r == j * C + i).astype(like.dtype), like.shape), rows / scale))
    return terms


def rowsum(x):
    """Sum over the last axis as a matvec: XLA:CPU runs large multiply-reduce fusions an
    order of magnitude slower than a dot. A sum, not a product: never at a half-precision
    policy's rounding (kdax._numerics.precision)."""
    with _precision.float32_products():
        return x @ np.ones((x.shape[-1],), x.dtype)


def last_row(G):
    """``G[..., -1:, :]``, taken outside the chunk-group loops (``over_chunks``): XLA:CPU
    runs a loop-body fusion that slices and broadcasts its own input several times slower
    than one that reads the slice as a separate operand."""
    return G[..., -1:, :]


def zeros_after(shape, dtype, deps, tag: int = 0):
    """Zeros of ``shape`` that depend on an element of every array in ``deps``, so XLA
    can neither create them before those inputs exist nor share them with another
    loop's (``tag`` picks the element). Plain zeros are hoisted to the start of the
    program, one buffer shared by every loop that needs one and copied into each: in
    the training step those copies were half the peak memory, and on CPU every fresh
    page costs a page fault."""
    # One element per leading row and head that the zeros share with ``d`` (up to two
    # axes): an array sharded over rows or heads has that element on every device, where
    # one element of the whole array would be a collective (jit on an Auto mesh).
    L = min(2, len(shape))
    lead = tuple(shape[:L])
    picked = {}  # itemsize -> the picked elements, each broadcast to lead (one bitcast per size)
    for d in deps:
        if not jnp.issubdtype(d.dtype, jnp.floating) or d.size == 0:
            continue
        k = 0
        while k < min(L, d.ndim) and d.shape[k] == shape[k]:
            k += 1
        flat = d.reshape(*d.shape[:k], -1)
        x = flat[..., tag % flat.shape[-1]].reshape(*d.shape[:k], *(1,) * (L - k))
        x = jnp.broadcast_to(x, (*d.shape[:k], *lead[k:]))
        picked.setdefault(x.dtype.itemsize, []).append(x)
    zero = jnp.zeros((1,) * L, dtype)
    for size, xs in picked.items():
        # One bitcast and two shifts per element size for all the picked elements (done
        # per dependency they were ~20% of a training step's traced equations).
        bits = 8 * size
        u = functools.reduce(jnp.maximum, [jax.lax.bitcast_convert_type(a, _UINT[bits]) for a in xs])
        # Two shifts the simplifier keeps: exactly 0 for every value (NaN and inf too).
        zero = zero + ((u >> (bits - 1)) >> 1).astype(dtype)
    return jnp.broadcast_to(zero.reshape(*zero.shape, *(1,) * (len(shape) - L)), shape)


_UINT = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def vary_like(tree, *refs):
    """``tree`` cast to vary over every manual mesh axis that any array of ``refs`` varies
    over. Inside ``jax.shard_map`` a loop's carry must have the type of the body's output,
    which varies like the inputs; a carry made from zeros or from a replicated argument
    does not (outside shard_map this is the identity)."""
    axes = set()
    for r in jax.tree.leaves(refs):
        axes |= varying_axes(r)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def varying_axes(x) -> set:
    """The manual mesh axes ``x`` (an array or its ``jax.typeof``) varies over (empty
    outside shard_map)."""
    t = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return set(mat.varying)
    return set(getattr(t, "vma", ()))
