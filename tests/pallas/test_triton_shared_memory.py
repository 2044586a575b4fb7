"""Every Triton kernel of a forward and backward, compiled for Hopper (sm_90) up to LLVM IR
on any machine (no GPU needed), fits in the 227 KiB of shared memory a Hopper program may
use. Needs the ``triton`` package (in the ``test`` extra on Linux x86_64, not a kdax
dependency): skipped without it. The whole training step's kernels are slow (minutes);
the state kernels (F4, B2) alone take seconds and run by default."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import kdax

triton = pytest.importorskip("triton")

from ._triton import (  # noqa: E402
    HOPPER_SHARED_BYTES, captured as _captured, shared_bytes as _shared_bytes, state_kernels,
)


def _triton_modules(K: int, C: int, dtype, options=None, tuning=None) -> dict:
    """TTIR text of each distinct Pallas kernel at B=1, T=1024, H=2, K=V, chunk C (a
    kernel's blocks depend on K, V, C and the dtypes, not on B, T, H: those set the grid)."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 1024, 2, K), dtype),) * 4 + (s((1, 1024, 2), dtype),)
    pipe = kdax.KDAPipeline.pallas("triton", interpret=False, tuning="minimal")  # every field its own default
    if tuning:  # every stage's Triton tuning (kdax.pallas._common.PallasTarget)
        pipe = dataclasses.replace(pipe, **{f.name: dataclasses.replace(getattr(pipe, f.name), **tuning)
                                            for f in dataclasses.fields(pipe) if f.name in kdax.pipeline.STAGES})

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, output_final_state=True, **(options or {}))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    with _captured() as mods:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    return mods


# The standard shape, and chunk 128 in float64 (where the device first failed: B4 asked for
# 1040 KiB before its row-block loop; B3 256 KiB before it took dL by row blocks there,
# kdax.pallas._wy.dl_rows: 192 KiB). Chunk 128 at K = 128 in float32 is left out: B3 did
# not finish compiling in 15 minutes (full-precision float32 products are FMA loops that
# Triton unrolls, likely the cause).
#
# gpu_vs_fla.py's configuration: bf16 inputs, K = V = 128, chunk 64, Kimi Linear's options
# (A_log and dt_bias are closed over: constants of the trace), the default precision policy
# (bf16 operands in the F2, F3, F5, B1 and B3 kernels' products).
KIMI = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


KIMI_PARAMS = dict(KIMI, A_log=jnp.zeros(2, jnp.float32), dt_bias=jnp.zeros(256, jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("K,C,dtype,options,tuning", [
    (128, 64, jnp.float32, None, None),
    (16, 128, jnp.float64, None, None),
    (128, 64, jnp.bfloat16, KIMI_PARAMS, None),
    # tensor-core float32 products and 8 warps (gpu_vs_fla's fastest Pallas state stages)
    (128, 64, jnp.bfloat16, KIMI_PARAMS, dict(f32_dot="tf32x3", num_warps=8)),
], ids=["f32_K128_C64", "f64_K16_C128", "bf16_K128_C64_kimi", "bf16_K128_C64_kimi_tf32x3_w8"])
def test_kernels_fit_hopper_shared_memory(K, C, dtype, options, tuning, tmp_path):
    mods = _triton_modules(K, C, dtype, options, tuning)
    assert len(mods) == 10, list(mods)
    warps = (tuning or {}).get("num_warps", 4)
    used = {src.split("/")[-1]: _shared_bytes(text, tmp_path, warps) for src, text in mods.items()}
    over = {k: v for k, v in used.items() if v > HOPPER_SHARED_BYTES}
    assert not over, f"over {HOPPER_SHARED_BYTES} B: {over} (all: {used})"


# Measured with this test's method (KiB, F4 / B2 dense): float32 "ieee" 64 / 112 at one stage,
# 112 / 144 at two; "tf32x3" 64 / 64, 144 / 192 at two, 224 / 320 at three (over: B2 cannot
# prefetch two chunks ahead at 64 value columns); "fast" (bf16 operands) 32 / 32, 112 / 144
# at two stages, 104 / 136 with 64-row state tiles (packed: 144 / 176, 136 / 168).
@pytest.mark.parametrize("policy,tuning", [
    # float32 products at full precision are FMA loops that take Triton a minute or more
    pytest.param("highest", {}, marks=pytest.mark.slow),
    ("highest", dict(f32_dot="tf32x3", num_warps=8, num_stages=2)),
    ("fast", dict(num_warps=8, num_stages=2)),
    # the state as 64-row tiles, as FLA holds it
    ("fast", dict(num_warps=8, num_stages=2, block_k=64)),
], ids=["f32", "f32_tf32x3_w8_s2", "fast_w8_s2", "fast_w8_s2_k64"])
def test_state_kernels_fit_hopper_shared_memory(policy, tuning, tmp_path):
    """F4 and B2 (the recurrences, B0's F4 included) alone at K = V = 128, chunk 64, dense
    and packed (per-chunk resets), under the float32 and the "fast" precision policy, each
    compiled for sm_90 with its own warps and stages (software pipelining keeps later
    chunks' loads in shared memory)."""
    used = {}
    for name in ("dense", "packed"):
        for src, text in state_kernels(policy, tuning, name).items():
            used[f"{name}:{src.split(' ')[0]}"] = _shared_bytes(text, tmp_path, tuning.get("num_warps", 4),
                                                                tuning.get("num_stages", 1))
    over = {k: v for k, v in used.items() if v > HOPPER_SHARED_BYTES}
    assert not over, f"over {HOPPER_SHARED_BYTES} B: {over} (all: {used})"
    assert all(v > 0 for v in used.values()), used


# The kernels that take G's low part (kdax._numerics.hilo): F1 (which makes it), F2, F3, B3, B4, each
# alone at K = V = 128, chunk 64, under the policy bf16 inputs get ("bfloat16": bf16
# operands in F2, F3 and B3; F1 and B4 at float32), with G_lo.
@pytest.mark.parametrize("stage", ["gate", "intra", "wy", "wy_dqkg", "intra_bwd"])
def test_G_lo_kernels_fit_hopper_shared_memory(stage, tmp_path):
    from kdax import KDAConfig
    from kdax import pallas as P
    from kdax.stages import ChunkGrads

    R, HV, NC, C, K = 1, 2, 4, 64, 128
    s = jax.ShapeDtypeStruct
    ck, cs, cm = s((R, HV, NC, C, K), jnp.float32), s((R, HV, NC, C), jnp.float32), s((R, HV, NC, C, C), jnp.float32)
    st = s((R, HV, NC, K, K), jnp.float32)
    kw = dict(target="triton", interpret=False)
    p = dict(precision="bfloat16")  # (the policy bf16 inputs get)
    calls = {
        "gate": (lambda q, k, g, b: P.PallasGate(**kw)(KDAConfig(scale=0.1, **KIMI), q, k, g, b, jnp.zeros(HV, jnp.float32),
                                                        jnp.zeros(HV * K, jnp.float32), jnp.ones((R, NC, C), bool), **p),
                 (ck, ck, ck, cs)),
        "intra": (lambda q, k, b, G, lo: P.PallasIntra(**kw)(0.1, q, k, b, G, G_lo=lo, **p), (ck, ck, cs, ck, ck)),
        "wy": (lambda q, k, v, b, G, A, lo: P.PallasWY(**kw)(q, k, v, b, G, A, G_lo=lo, **p), (ck, ck, ck, cs, ck, cm, ck)),
        "wy_dqkg": (lambda q, k, v, b, G, A, qg, kg, h, dh, vn, do, dvn, lo: P.PallasWYDqkg(**kw)(
            0.1, q, k, v, b, G, A, qg, kg, h, dh, vn, do, dvn, G_lo=lo, **p), (ck, ck, ck, cs, ck, cm, ck, ck, st, st, ck, ck, ck, ck)),
        "intra_bwd": (lambda q, k, b, G, dA, dq, dk, db, dG, dL, lo: P.PallasIntraBackward(**kw)(
            0.1, q, k, b, G, dA, ChunkGrads(dq, dk, None, db, dG, dL), G_lo=lo, **p), (ck, ck, cs, ck, cm, ck, ck, cs, ck, cm, ck)),
    }
    fn, args = calls[stage]

    with _captured() as mods:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(mods) == 1, list(mods)
    used = _shared_bytes(next(iter(mods.values())), tmp_path)
    assert 0 < used <= HOPPER_SHARED_BYTES, used
