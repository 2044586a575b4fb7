"""``gpu_products()``: lower dot products on CPU as a GPU computes them under a dot
algorithm that rounds operands, float32 accumulation:

* ``BF16_BF16_F32``, ``F16_F16_F32`` (XLA:GPU): the float32 operands rounded to the half
  dtype first. kdax asks XLA:CPU for float32 products under the float16 policy (it rejects
  ``F16_F16_F32``), so within the block kdax chooses its algorithms as on a GPU
  (``kdax._numerics.precision._algorithm``);
* ``TF32_TF32_F32`` (a Pallas Triton kernel's float32 ``tl.dot`` with ``input_precision
  = "tf32"``, ``f32_dot="tf32"``): Triton converts nothing, its sm_90 PTX hands the
  float32 registers to ``wgmma ... .tf32.tf32`` as they are (no ``cvt``:
  ``tests/pallas/test_common.py::test_tf32_operands_as_the_emulation_takes_them``), and
  the tensor cores read their top 10 mantissa
  bits: the operands truncated (toward zero), as in triton-lang/triton#4574, where
  plain TF32 matched cuBLAS (which rounds) only after an explicit ``cvt.rna.tf32.f32``.
  ``tf32="rna"`` rounds to nearest, ties away from zero, instead (``cvt.rna``);
* ``TF32_TF32_F32_X3`` (``f32_dot="tf32x3"``, Triton's F32DotTC pass): ``big =
  cvt.rna.tf32.f32(x)``, ``small = x - big`` (exact), ``small_a big_b + big_a small_b``
  then ``+ big_a big_b``, each product's operands taken as above.

XLA:CPU ignores the algorithm and computes in float32, which would hide the rounding from
CPU tests. The Pallas kernels ask for the TF32 algorithms only when traced with their
Triton tuning (compiled, or in interpret mode under
``PallasTarget.tuned_interpret``)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from kdax._numerics import precision as _precision

_HALF = {
    jax.lax.DotAlgorithmPreset.BF16_BF16_F32: ir.BF16Type.get,
    jax.lax.DotAlgorithmPreset.F16_F16_F32: ir.F16Type.get,
}


def _rounded(x, aval, half):
    if aval.dtype != jnp.float32:
        return x
    shape = list(aval.shape)
    return hlo.convert(ir.RankedTensorType.get(shape, ir.F32Type.get()),
                       hlo.convert(ir.RankedTensorType.get(shape, half()), x))


_TF32_DROPPED = 0x1FFF  # the 13 low mantissa bits a TF32 operand does not have


def tf32_truncated(x):
    """``x`` (float32) with its 13 low mantissa bits cleared: the TF32 value the tensor
    cores read from a float32 register (toward zero; inf and NaN kept)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(~_TF32_DROPPED & 0xFFFFFFFF)
    return jnp.where(jnp.isnan(x), x, jax.lax.bitcast_convert_type(bits, jnp.float32))


def tf32_rna(x):
    """``cvt.rna.tf32.f32``: ``x`` rounded to TF32, to nearest, ties away from zero (the
    magnitude's bits plus half a TF32 ulp, truncated; a carry into the exponent is the
    rounding up; inf and NaN kept)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) + jnp.uint32(0x1000)
    r = jax.lax.bitcast_convert_type(bits & jnp.uint32(~_TF32_DROPPED & 0xFFFFFFFF), jnp.float32)
    return jnp.where(jnp.abs(x) < jnp.inf, r, x)


_TF32_OPERAND = {"truncate": tf32_truncated, "rna": tf32_rna}


def _lowered(ctx, fn, x, aval):
    """``fn(x)`` lowered in place (an elementwise jnp function of one float32 operand)."""
    sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=[aval])
    return mlir.lower_fun(fn, multiple_results=False)(sub, x)[0]


def _tf32_products(original, ctx, lhs, rhs, x3: bool, operand, **kw):
    """The TF32 product(s) of float32 ``lhs``, ``rhs`` (``TF32_TF32_F32``, or with ``x3``
    ``TF32_TF32_F32_X3``), each product at float32 on rounded operands."""
    la, ra = ctx.avals_in
    dot = lambda a, b: original(ctx, _lowered(ctx, operand, a, la), _lowered(ctx, operand, b, ra),  # noqa: E731
                                precision=None, **kw)[0]
    if not x3:
        return [dot(lhs, rhs)]
    lb, rb = _lowered(ctx, tf32_rna, lhs, la), _lowered(ctx, tf32_rna, rhs, ra)
    ls, rs = hlo.subtract(lhs, lb), hlo.subtract(rhs, rb)
    return [hlo.add(hlo.add(dot(ls, rb), dot(lb, rs)), dot(lb, rb))]


def _rule(original, tf32, ctx, lhs, rhs, *, precision, **kw):
    algorithm = precision if isinstance(precision, jax.lax.DotAlgorithmPreset) else None
    tf32s = (jax.lax.DotAlgorithmPreset.TF32_TF32_F32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    if algorithm in tf32s and all(a.dtype == jnp.float32 for a in ctx.avals_in):
        x3 = algorithm == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
        return _tf32_products(original, ctx, lhs, rhs, x3, _TF32_OPERAND[tf32], **kw)
    half = _HALF.get(algorithm)
    if half is not None:
        lhs = _rounded(lhs, ctx.avals_in[0], half)
        rhs = _rounded(rhs, ctx.avals_in[1], half)
        precision = None  # XLA:CPU rejects F16_F16_F32; the rounding above is the algorithm
    return original(ctx, lhs, rhs, precision=precision, **kw)


@contextlib.contextmanager
def gpu_products(tf32: str = "truncate"):
    """Within: products lowered for CPU round their operands as the GPU's algorithm does
    (``tf32``: how a plain TF32 product takes its float32 operands, ``"truncate"`` as
    Triton's on sm_90, or ``"rna"``)."""
    if tf32 not in _TF32_OPERAND:
        raise ValueError(f"tf32: expected one of {tuple(_TF32_OPERAND)}, got {tf32!r}.")
    table = mlir._platform_specific_lowerings["cpu"]
    entry = table[lax_internal.dot_general_p]
    mlir.register_lowering(lax_internal.dot_general_p, functools.partial(_rule, entry.rule, tf32), platform="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_precision, "_algorithm", _precision._ALGORITHM.__getitem__)  # (the GPU's choice)
        try:
            yield
        finally:
            table[lax_internal.dot_general_p] = entry
