"""The Triton tuning fields every Pallas stage has (``num_warps``, ``f32_dot``): checked
when a stage is built, passed to the compiled kernels (lowered for a GPU on any machine),
and without effect in interpret mode (unless a test asks for them there:
``PallasTarget.tuned_interpret``); the TF32 products' PTX as
``tests/_gpu_products.py`` emulates it."""

import jax
import jax.numpy as jnp
import pytest

from kdax import pallas as P
from kdax import stages as S

from .._util import assert_close
from ..stages._chunked import chunked, intra_chunk, wy_chunk


def _state_args(dtype=jnp.float32):
    x = chunked(0, R=1, HV=2, NC=3, C=16, K=16, V=16)
    x = {n: (a.astype(dtype) if hasattr(a, "dtype") and a.dtype.kind == "f" else a) for n, a in x.items()}
    _, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, _, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    return w, u, kg, x["G"], x["h0"], x["layout"]


@pytest.mark.parametrize("stage", [P.PallasState, P.PallasGate, P.PallasIntraBackward])
def test_tuning_checked_when_built(stage):
    with pytest.raises(ValueError, match="num_warps"):
        stage(target="triton", num_warps=3)
    with pytest.raises(ValueError, match="f32_dot"):
        stage(target="triton", f32_dot="bf16")
    with pytest.raises(ValueError, match="num_stages"):
        stage(target="triton", num_stages=0)


def _triton_ir(stage, args) -> list:
    """The Triton IR of each kernel ``stage(*args)`` runs, lowered for a GPU here."""
    from jax._src.pallas.triton import lowering

    mods, orig = [], lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        res = orig(*a, **kw)
        mods.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        text = jax.jit(lambda *a: stage(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = orig
    return mods, text


def test_tuning_reaches_the_compiled_kernel():
    args = _state_args()
    plain, text = _triton_ir(P.PallasState(target="triton", interpret=False), args)
    assert plain and "tf32x3" not in plain[0] and "num_warps = 4" in text
    fast, text = _triton_ir(P.PallasState(target="triton", interpret=False, f32_dot="tf32x3", num_warps=8,
                                          num_stages=3), args)
    assert "inputPrecision = tf32x3" in fast[0] and "num_warps = 8" in text and "num_stages = 3" in text


def test_tuning_ignored_in_interpret_mode():
    """Interpret mode (and float64) keep exact products: the same numbers with or without."""
    for dtype in (jnp.float32, jnp.float64):
        args = _state_args(dtype)
        want = P.PallasState(target="triton", interpret=True)(*args)
        got = P.PallasState(target="triton", interpret=True, f32_dot="tf32x3", num_warps=8)(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert jnp.array_equal(a, b)
        ref = S.ReferenceState()(*args)
        assert_close(got.h, ref.h, 1e-5 if dtype == jnp.float32 else 1e-12, "h")


@pytest.mark.parametrize("algorithm", ["TF32_TF32_F32", "TF32_TF32_F32_X3"])
def test_tf32_operands_as_the_emulation_takes_them(algorithm):
    """What ``tests/_gpu_products.py`` emulates, from a float32 product's sm_90 PTX (Triton's
    passes and ptxas, no GPU): a plain TF32 product (``f32_dot="tf32"``) hands the float32
    registers to ``wgmma ... .tf32.tf32`` with no conversion, so the tensor cores read the
    top 10 mantissa bits (the emulation truncates); TF32x3 rounds its big parts with
    ``cvt.rna.tf32.f32`` (Triton's F32DotTC)."""
    pytest.importorskip("triton")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    from ._triton import captured, resources, skip_reason

    if skip_reason():
        pytest.skip(skip_reason())
    preset = getattr(jax.lax.DotAlgorithmPreset, algorithm)

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (0,)), ((), ())), precision=preset,
                                         preferred_element_type=jnp.float32)

    s = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    f = pl.pallas_call(kernel, out_shape=s, compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))
    with captured() as mods:
        jax.jit(f).trace(s, s).lower(lowering_platforms=("cuda",))
    keep = {}
    r = resources(next(iter(mods.values())), 4, 1, keep)
    assert any(m.endswith(".f32.tf32.tf32") for m in r.mma), r.mma
    assert ("cvt.rna.tf32.f32" in keep["ptx"]) == (algorithm == "TF32_TF32_F32_X3")
    assert "tf32.f32" not in keep["ptx"].replace("cvt.rna.tf32.f32", "")  # (no other conversion)
