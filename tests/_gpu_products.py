"""``gpu_products()``: lower dot products on CPU as XLA:GPU computes them under a dot
algorithm that rounds operands (``BF16_BF16_F32``, ``F16_F16_F32``): the float32 operands
rounded to the half dtype first, float32 accumulation. XLA:CPU ignores the algorithm and
computes in float32, which would hide the precision policy's rounding of the reference
stages' products from CPU tests; and kdax asks XLA:CPU for float32 products under the
float16 policy (it rejects ``F16_F16_F32``), so within the block kdax chooses its
algorithms as on a GPU (``kdax._numerics.precision._algorithm``)."""

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


def _rule(original, ctx, lhs, rhs, *, precision, **kw):
    half = _HALF.get(precision) if isinstance(precision, jax.lax.DotAlgorithmPreset) else None
    if half is not None:
        lhs = _rounded(lhs, ctx.avals_in[0], half)
        rhs = _rounded(rhs, ctx.avals_in[1], half)
        precision = None  # XLA:CPU rejects F16_F16_F32; the rounding above is the algorithm
    return original(ctx, lhs, rhs, precision=precision, **kw)


@contextlib.contextmanager
def gpu_products():
    """Within: products lowered for CPU round their operands as XLA:GPU's algorithm does."""
    table = mlir._platform_specific_lowerings["cpu"]
    entry = table[lax_internal.dot_general_p]
    mlir.register_lowering(lax_internal.dot_general_p, functools.partial(_rule, entry.rule), platform="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_precision, "_algorithm", _precision._ALGORITHM.__getitem__)  # (the GPU's choice)
        try:
            yield
        finally:
            table[lax_internal.dot_general_p] = entry
