"""In-kernel arithmetic of the Pallas stages (2-D values only, both targets): products
(``Products``: ``dot`` under the precision policy and the stage's ``f32_dot``, passed to
each kernel builder; TF32x3 as three unchained products, ``scaled_dot``; ``lower_dot`` with
a non-finite row reaching only the rows after it), exponentials (``decay`` masked in the exponent; ``exp_by_exp2`` and
``fast_decay`` for the GPU's ``ex2``) and the rows or columns a non-finite value reaches
(``from_first``, ``within_sequence``, ``reached_down``, ``reached_up``)."""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .._numerics.hilo import exponent


def iota(shape, axis: int):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


# The dot algorithm of a float32 product under each ``f32_dot`` that is one product.
_TF32_ALGORITHM = {"tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                   "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32}


class Products(NamedTuple):
    """The products of one kernel: how a float32 product at full precision runs there
    (``f32_dot``, a ``kdax.pallas.PallasTarget`` field, "ieee" where no Triton tuning
    applies: TPU, interpret mode), and ``operand``, the dtype a half-precision policy
    rounds float32 operands to whatever ``f32_dot`` says (``kdax._numerics.precision.operand``;
    None: full precision), passed to the kernel builders as an argument."""

    f32_dot: str = "ieee"
    operand: Optional[jnp.dtype] = None

    @property
    def splits(self) -> bool:
        """Whether float32 products run as three TF32 products of split operands."""
        return self.f32_dot in ("tf32x3", "tf32x3_split") and self.operand is None

    def float32(self) -> "Products":
        """These products with float32 operands whatever the policy (the solve)."""
        return self._replace(operand=None)

    def exp(self, x):
        """``exp(x)`` for ``x <= 0`` as this kernel's precision needs it: where its products
        round their operands to half precision (``"fast"``, bf16: 4e-3), ``exp_by_exp2``
        (relative error about ``7e-8 |x|`` on the GPU, ``1e-7 |x|`` through XLA:CPU's exp2;
        under 1e-5 above float32's underflow); else ``jnp.exp``."""
        return jnp.exp(x) if self.operand is None else exp_by_exp2(x)

    def dot(self, a, b, ta: bool = False, tb: bool = False):
        """``op(a) @ op(b)`` with float32 (or float64) accumulation at full precision;
        under a half-precision policy float32 operands rounded to the policy's dtype first
        (tensor cores, float32 accumulation). ``"tf32x3_split"``: as ``scaled_dot``, the
        three TF32 products summed outside the accumulator."""
        dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
        if a.dtype != b.dtype:  # (a bf16-stored operand, kdax._numerics.precision.STORED: widened, exact)
            a, b = (x.astype(jnp.result_type(a.dtype, b.dtype)) for x in (a, b))
        half = self.operand
        if half is not None and (a.dtype == jnp.float32 or a.dtype == half):  # (half: read so, exact)
            default = jax.lax.Precision.DEFAULT  # explicit: not the scope's algorithm
            return jax.lax.dot_general(a.astype(half), b.astype(half), dims, precision=(default, default),
                                       preferred_element_type=jnp.float32)
        if self.f32_dot == "tf32x3_split" and a.dtype == jnp.float32:
            return self.scaled_dot(None, a, b.T if tb else b, ta=ta)
        if self.f32_dot != "ieee" and a.dtype == jnp.float32:
            return jax.lax.dot_general(a, b, dims, precision=_TF32_ALGORITHM[self.f32_dot],
                                       preferred_element_type=jnp.float32)
        return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=a.dtype)

    def lower_dot(self, A, X, seg=None):
        """``A @ X`` for lower-triangular ``A [C, C]`` where a non-finite row j of ``X``
        reaches only rows i >= j (NaN there): in a plain product the zeros above A's diagonal
        meet it as ``0 * inf = NaN`` and carry it to the rows above. Rows before it are
        bit-identical to ``A @ X``. The rows reached are found without a second product (whose
        C x C operand did not fit Hopper's shared memory at C = 128 in float64). ``seg``
        (shared chunks: each token's sequence as a ``[C, 1]`` column and a ``[1, C]`` row,
        ``A`` zero between sequences): the rows i >= j of row j's sequence only."""
        ok = jnp.abs(X) < jnp.inf
        bad = nonfinite_rows(X)
        reached = from_first(bad) if seg is None else within_sequence(bad, seg)
        return jnp.where(reached, jnp.nan, self.dot(A, jnp.where(ok, X, 0.0)))

    def mask_dot(self, m, x):
        """``m @ x`` for a 0/1 matrix ``m`` (exact in TF32): where float32 products split,
        two TF32 products with the parts of ``x`` alone (``m``'s low part is zero), each
        product exact, summed in float32; else ``dot``."""
        if not self.splits or x.dtype != jnp.float32:
            return self.dot(m, x)
        hi, lo = self.split(x)
        return tf32_product(m, hi) + tf32_product(m, lo)

    def split(self, x):
        """``(hi(x), lo(x))`` with ``x = hi + lo`` exactly (``hi``: x's top 19 bits, exact in
        TF32) when float32 products run as three TF32 products (``splits``); else ``x``
        itself. ``scaled_dot`` takes either: an operand of several products is split once."""
        if not self.splits or x.dtype != jnp.float32:
            return x
        bits = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-8192)  # the low 13 mantissa bits cleared
        hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
        return hi, x - hi

    def scaled_dot(self, f, a, b, ta: bool = False):
        """``f * (op(a) @ b)`` (``dot``; ``f`` None: 1). Where float32 products split
        (``"tf32x3"``, ``"tf32x3_split"``), as the three TF32 products of the split
        ``x = hi(x) + lo(x)`` (``split``; ``a`` and ``b`` may come split), each scaled by
        ``f`` before the sum: Triton's own TF32x3 chains its three products through the
        accumulator, and a product that feeds another one gets its warps laid along the rows
        (``warpsPerCTA = [8, 1]``), which at 64 rows and eight warps holds every accumulator
        twice (B4 at 255 registers and 1.2 KiB of spills); unchained, each product is laid
        as a lone one, and its split takes fewer instructions (F2's inverse: -31% a step).
        Under ``"tf32"``: one TF32 product (``dot``)."""
        a = a if isinstance(a, tuple) else self.split(a)
        if not isinstance(a, tuple):
            out = self.dot(a, b, ta=ta)
            return out if f is None else f * out

        def tf32(x, y):
            out = tf32_product(x, y, ta)
            return out if f is None else f * out

        (ah, al), (bh, bl) = a, (b if isinstance(b, tuple) else self.split(b))
        return tf32(ah, bh) + tf32(ah, bl) + tf32(al, bh)  # (hi(a) dead before lo(a))


def from_first(bad):
    """``[C, 1]`` bool: row i at or after the first row where ``bad [C, 1]`` (0/1 in a
    float dtype) is nonzero: one reduction over C rows, where a ``[C, C]`` masked maximum
    took the most of F3's instructions on sm_90 (its shuffles and barriers)."""
    rows = iota(bad.shape, 0).astype(bad.dtype)
    return rows >= jnp.min(jnp.where(bad > 0, rows, bad.shape[0]), axis=0, keepdims=True)


def within_sequence(bad, seg):
    """``[C, 1]`` bool: row i at or after a row j of its own sequence where ``bad [C, 1]``
    is nonzero (``lower_dot``'s rows reached in a shared chunk); ``seg``: the sequences as
    a ``[C, 1]`` column and a ``[1, C]`` row. (``bad`` as a row by a masked reduction:
    every value stays 2-D on both targets.)"""
    C = bad.shape[0]
    j, i = iota((C, C), 1), iota((C, C), 0)
    bad_row = jnp.max(jnp.where(i == j, bad, 0.0), axis=0, keepdims=True)
    hit = (j <= i) & (seg[1] == seg[0]) & (bad_row > 0)
    return jnp.max(hit.astype(bad.dtype), axis=1, keepdims=True) > 0


def segment_masks(seg):
    """The masks of ``kdax._layouts.resets`` for one shared chunk, from ``seg`` ``[C, 1]``
    (each token's sequence within the chunk, ``segments``): ``(from_start, to_end)``
    ``[C, 1]`` and whether the chunk's start state reaches its end ``[1, 1]``; all None
    without ``seg``. (``seg`` never decreases down the chunk: its last row is its maximum,
    one reduction on both targets.)"""
    if seg is None:
        return None, None, None
    last = jnp.max(seg, axis=0, keepdims=True)
    return seg == 0, seg == last, last == 0


def nonfinite_rows(X):
    """``[C, 1]``: 1 where row i of ``X [C, D]`` holds a NaN or inf, else 0 (X's dtype)."""
    return jnp.max(nonfinite(X).astype(X.dtype), axis=1, keepdims=True)


def masked_exp(mask, diff):
    """``exp(diff)`` where ``mask``, else 0: the mask sits in the exponent."""
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def decay(mask, x, y, x_lo=None, y_lo=None):
    """``exp(x - y)`` where ``mask`` (None: everywhere), else 0, in the exponent
    (``masked_exp``); with the low parts of G (``kdax._numerics.hilo``: ``x_lo``, ``y_lo``, both or
    neither) the exponent is the difference of the exact sums, clamped at 0
    (``kdax._numerics.hilo.exponent``)."""
    e = exponent(x, y, x_lo, y_lo)
    return jnp.exp(e) if mask is None else masked_exp(mask, e)


def nonfinite(x):
    """``x``'s NaN and infinite entries (bool)."""
    return ~(jnp.abs(x) < jnp.inf)


def reached_down(bad):
    """``[C, D]`` bool: entry (i, d) has a true ``bad`` at some row t <= i of column d
    (rows from the column's first bad row on: one reduction, no scan)."""
    rows = iota(bad.shape, 0)
    return rows >= jnp.min(jnp.where(bad, rows, bad.shape[0]), axis=0, keepdims=True)


def reached_up(bad):
    """``[C, D]`` bool: entry (j, d) has a true ``bad`` at some row t >= j of column d
    (rows up to the column's last bad row)."""
    rows = iota(bad.shape, 0)
    return rows <= jnp.max(jnp.where(bad, rows, -1), axis=0, keepdims=True)


def exp_by_exp2(x):
    """``exp(x)`` as ``2^(log2(e) x)``: on the GPU an ``ex2`` and a multiply
    (``__nv_exp2f``) where ``exp`` takes a range reduction of several instructions (B4's
    instructions -11%); the product's rounding adds a relative error of about
    ``eps |x|`` (7e-8 |x| in float32)."""
    return jnp.exp2(x * 1.4426950408889634)


def fast_decay(x, y, x_lo=None, y_lo=None):
    """``decay`` (no mask) by ``exp_by_exp2`` (exponents here are differences inside one
    chunk, non-positive)."""
    return exp_by_exp2(exponent(x, y, x_lo, y_lo))


def tf32_product(x, y, ta: bool = False):
    """One TF32 tensor-core product ``op(x) @ y`` with float32 accumulation."""
    return jax.lax.dot_general(x, y, (((0 if ta else 1,), (0,)), ((), ())),
                               precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32, preferred_element_type=jnp.float32)
