"""Triton kernels compiled for Hopper (sm_90) to a cubin on any machine (no GPU needed,
the ptxas of triton's wheel) use no thread-local memory: a register spill puts part of a
kernel's working set off chip (benchmarks/results/triton_resources.txt lists every
kernel). The state kernels F4 and B2 (B0's F4 is F4) at K = V = 128, chunk 64, under the
``"fast"`` precision policy, at the tunings of the GPU runs' candidates
(benchmarks/NOTES.md, "GPU commands"), hold the state in registers and run their products
as bf16 ``wgmma`` (Hopper's warpgroup tensor-core products); the gate kernels F1 and B5
fit at the default tuning, and the chunk-parallel kernels F2, F3, B3 and B4 at the
candidate's (eight warps, TF32x3 float32 products). Needs the ``triton`` package (the ``test`` extra on Linux
x86_64): skipped without it."""

import pytest

pytest.importorskip("triton")

from ._triton import (  # noqa: E402
    HOPPER_REGISTERS, HOPPER_SHARED_BYTES, chunk_kernels, gate_kernels, resources, state_kernels,
)

TUNINGS = {
    # FLA's shape of the recurrence: the state as 64-row tiles, 64 value columns, 8 warps.
    "w8_s2_k64": dict(num_warps=8, num_stages=2, block_k=64),
    # the cost model's fastest (benchmarks/gpu_candidate_run.py's CANDIDATE_BEST): 32 value columns
    # a program at eight warps
    "w8_s2_k64_v32": dict(num_warps=8, num_stages=2, block_k=64, block_v=32),
    # twice the programs (32 value columns: B = 1, H = 16 gives 64 programs, not 32) and
    # one more chunk's loads in flight
    "w4_s3_k64_v32": dict(num_warps=4, num_stages=3, block_k=64, block_v=32),
}


@pytest.mark.parametrize("tuning,layout", [(t, lay) for t in TUNINGS for lay in ("dense", "packed")]
                         + [("w8_s2_k64", "dense_tokens"), ("w8_s2_k64", "packed_start"),
                            ("w8_s2_k64_v32", "packed_start")])
def test_state_kernels_hold_the_state_on_chip(tuning, layout):
    """``dense_tokens``: B2 reads bf16 ``do`` from the caller's ``[B, T, HV, V]`` array
    (``kdax._layouts.tokens``; 8 warps: 226 registers, against 196 on the chunked copy).
    ``packed_start``: B2 given ``dh_start`` (a loss on packed final states), one more tile
    load a chunk."""
    t = TUNINGS[tuning]
    used = {}
    kernels = state_kernels("fast", t, layout.split("_")[0], tokens=layout.endswith("tokens"),
                            start=layout.endswith("start"))
    for src, text in kernels.items():
        used[src.split(" ")[0]] = r = resources(text, t.get("num_warps", 4), t.get("num_stages", 1))
        assert r.registers <= HOPPER_REGISTERS and 0 < r.shared <= HOPPER_SHARED_BYTES, used
        # Before the operands read only by products were passed as bf16 (kdax.pallas._state),
        # rounding them in registers took these kernels to 255 registers and spilled 48-136
        # bytes a thread (and B2 packed at w4_s3_k64_v32 to 252 KiB of shared memory).
        assert r.local == 0, f"spills: {used}"
        assert any(m.startswith("wgmma.") and m.endswith(".f32.bf16.bf16") for m in r.mma), used
    assert len(used) == 2, used


@pytest.mark.parametrize("num_warps,tokens,reset", [(4, False, False), (4, True, False), (8, False, False), (8, False, True)],
                         ids=["4", "4-tokens", "8", "8-reset"])
def test_gate_kernels_fit_in_registers(num_warps, tokens, reset):
    """F1 and B5 at K = 128 with Kimi Linear's options, at the default four warps and at
    eight, on chunked float32 inputs and reading bf16 ``[B, T, H, K]`` inputs in place
    (``kdax._layouts.tokens``): no thread-local memory. With their cumsums as float32 products (FMA
    loops on Triton) F1 spilled ~15 KiB a thread; with whole [C, K] tiles (scans) 0.8 and
    1.8 KiB; 16 columns at a time (kdax.pallas._gate.GATE_BLOCK), none. (Reading bf16 in
    place, four warps: F1 113 registers, B5 140, against 168 and 176.) With shared chunks'
    reset table (B5's same-sequence product, ``kdax.pallas._gate._segment_sums``), at eight
    warps: B5 249 registers, none spilled (at four: 1176 B a thread spilled, F1 8 B)."""
    kernels = gate_kernels(dict(num_warps=num_warps), tokens=tokens, reset=reset)
    used = {src.split(" ")[0]: resources(text, num_warps) for src, text in kernels.items()}
    assert all(r.local == 0 and r.registers <= HOPPER_REGISTERS and r.shared <= HOPPER_SHARED_BYTES
               for r in used.values()), used


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("policy", ["bfloat16", "fast"])
def test_chunk_kernels_fit_in_registers(policy, packed):
    """F2, F3, B3 and B4 at K = V = 128, chunk 64, with G's low part (but under "fast",
    which keeps G alone: ``precision.keeps_low_part``), at the all-Triton
    candidate's tuning (eight warps, float32 products as TF32x3, two stages), under the
    bf16 inputs' default policy: no thread-local memory; F3 and B3 take bf16 ``wgmma``
    products, B4 (kept float32: kdax._numerics.precision) TF32 tensor-core products. Before they
    took their columns in blocks (kdax.pallas._common.PallasFeatureBlocks) F3 spilled
    112 B a thread, B3 3.2 KiB and B4 1.7 KiB (benchmarks/results/triton_resources.txt
    of session 13). F2 as tile products (``kdax.pallas._intra_levels.intra_levels_kernel``): 238
    registers here at 64 feature columns a step (at 32, 176 B of spills); with its NaN
    rows found by a transposed [C, C] mask kept live across the inverse, 255 and 280 B of
    spills. At the default tuning (four warps, IEEE float32 products as FMA loops) its
    64 x 64 x 64 products of the inverse spill about 3 KiB a thread: not asserted. B4
    (``intra_bwd_levels_kernel``: diagonal offsets inside the 16-token sub-blocks, two
    halving levels of tile products across them, each over half the chunk's tokens): 178
    registers under "fast" with 32 feature columns a
    program (``B4_MAX_BLOCK``); at 64 columns 24 B of spills (six levels: 64 B); with all
    four products in one loop over the levels 72 to 312 B; with Triton's own (chained)
    TF32x3 products 1.2 KiB. Under "fast" (the candidate's policy) F2 and F3
    write and F3 and B3 read Aqk, Akk, w, u, qg, kg, h, v_new and B2's dh as bf16
    (kdax._numerics.precision). ``packed``: each kernel given shared chunks' reset table
    (each token's sequence within its chunk as a column, and for F2, B3 and B4 as a row):
    F3 124 / 70 registers (bfloat16 / fast; 124 / 64 dense), B3 255 / 250 (247 dense), none
    spilled."""
    t = dict(num_warps=8, num_stages=2, f32_dot="tf32x3")
    used = {src.split(" ")[0]: resources(text, 8, 2) for src, text in chunk_kernels(policy, t, packed=packed).items()}
    assert len(used) == 4, used
    for name, r in used.items():
        assert r.local == 0 and r.registers <= HOPPER_REGISTERS and 0 < r.shared <= HOPPER_SHARED_BYTES, used
        bf16 = any(m.startswith("wgmma.") and m.endswith(".f32.bf16.bf16") for m in r.mma)
        tf32 = any(".tf32" in m for m in r.mma)
        assert (tf32 if "IntraBackward" in name else bf16), (name, r.mma)


@pytest.mark.parametrize("stage", ["intra_bwd", "intra"])
def test_intra_kernels_at_sixteen_warps(stage):
    """B4 and F2 at sixteen warps under "fast" (``gpu_vs_fla.py``'s ``+warps.intra_bwd=16``,
    ``+warps.intra=16``: benchmarks/gpu_candidate_run.py's ``CANDIDATE_BEST``): no thread-local
    memory (B4 116-120 registers of the 128 a thread has at 16 warps, F2 124-126, dense and
    packed alike) and TF32 tensor-core products. Their elementwise work is spread over
    twice the threads (the cost model: B4 6.2k -> 3.4k, F2 6.4k -> 4.9k instructions a
    warp, same programs). Both fit only without G's low part (under "bfloat16", packed:
    B4 24 B of spills, F2 480 B); B3 at 16 warps spills 40 B: it stays at eight."""
    t = dict(num_warps=16, num_stages=2, f32_dot="tf32x3")
    for layout in ("dense", "packed"):
        kernels = chunk_kernels("fast", t, only=(stage,), packed=layout == "packed")
        used = {src.split(" ")[0]: resources(text, 16, 2) for src, text in kernels.items()}
        assert len(used) == 1, used
        (r,) = used.values()
        assert r.local == 0 and r.registers <= 128 and 0 < r.shared <= HOPPER_SHARED_BYTES, used
        assert any(".tf32" in m for m in r.mma), used


def test_values_read_in_place_without_spills():
    """F3 reading bf16 ``v`` and B3 reading bf16 ``v`` and ``do`` from the caller's
    ``[B, T, HV, V]`` arrays (``kdax._layouts.tokens``; v cleaned in the kernel as chunk_kda
    cleans it) at the candidate's tuning: as on the chunked copies, no thread-local
    memory and bf16 ``wgmma`` products."""
    t = dict(num_warps=8, num_stages=2, f32_dot="tf32x3")
    kernels = chunk_kernels("bfloat16", t, tokens=True, only=("wy", "wy_dqkg"))
    used = {src.split(" ")[0]: resources(text, 8, 2) for src, text in kernels.items()}
    assert len(used) == 2, used
    for r in used.values():
        assert r.local == 0 and r.registers <= HOPPER_REGISTERS and 0 < r.shared <= HOPPER_SHARED_BYTES, used
        assert any(m.startswith("wgmma.") and m.endswith(".f32.bf16.bf16") for m in r.mma), used


def test_state_kernels_rounding_in_kernel():
    """``round_in_kernel`` (F4 and B2 read their product-only operands in float32 and round
    them in the kernel, no bf16 copies before it) at FLA's shape of the recurrence (8
    warps, 2 stages, 64-row tiles), dense: within Hopper's shared memory and registers,
    bf16 ``wgmma`` products, and the small spills measured in session 15 (F4 64 B, B2 48
    B a thread: rounding whole float32 tiles in registers), not more. Whether they cost
    more than the copies they save is for a GPU run (``gpu_vs_fla.py``'s ``+incast``)."""
    t = dict(TUNINGS["w8_s2_k64"], round_in_kernel=True)
    used = {src.split(" ")[0]: resources(text, 8, 2) for src, text in state_kernels("fast", t, "dense").items()}
    assert len(used) == 2, used
    for r in used.values():
        assert r.registers <= HOPPER_REGISTERS and 0 < r.shared <= HOPPER_SHARED_BYTES and r.local <= 64, used
        assert any(m.startswith("wgmma.") and m.endswith(".f32.bf16.bf16") for m in r.mma), used
