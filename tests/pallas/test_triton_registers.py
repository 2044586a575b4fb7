"""Triton kernels compiled for Hopper (sm_90) to a cubin on any machine (no GPU needed,
the ptxas of triton's wheel) use no thread-local memory: a register spill puts part of a
kernel's working set off chip (benchmarks/results/triton_resources.txt lists every
kernel). The state kernels F4 and B2 (B0's F4 is F4) at K = V = 128, chunk 64, under the
``"fast"`` precision policy, at the tunings of the GPU runs' candidates
(benchmarks/NOTES.md, "GPU commands"), hold the state in registers and run their products
as bf16 ``wgmma`` (Hopper's warpgroup tensor-core products); the gate kernels F1 and B5
fit at the default tuning. Needs the ``triton`` package (the ``test`` extra on Linux
x86_64): skipped without it."""

import pytest

pytest.importorskip("triton")

from ._triton import HOPPER_REGISTERS, HOPPER_SHARED_BYTES, gate_kernels, resources, state_kernels  # noqa: E402

TUNINGS = {
    # FLA's shape of the recurrence: the state as 64-row tiles, 64 value columns, 8 warps.
    "w8_s2_k64": dict(num_warps=8, num_stages=2, block_k=64),
    # twice the programs (32 value columns: B = 1, H = 16 gives 64 programs, not 32) and
    # one more chunk's loads in flight
    "w4_s3_k64_v32": dict(num_warps=4, num_stages=3, block_k=64, block_v=32),
}


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("tuning", list(TUNINGS))
def test_state_kernels_hold_the_state_on_chip(tuning, layout):
    t = TUNINGS[tuning]
    used = {}
    for src, text in state_kernels("fast", t, layout).items():
        used[src.split(" ")[0]] = r = resources(text, t.get("num_warps", 4), t.get("num_stages", 1))
        assert r.registers <= HOPPER_REGISTERS and 0 < r.shared <= HOPPER_SHARED_BYTES, used
        # Before the operands read only by products were passed as bf16 (kdax.pallas._state),
        # rounding them in registers took these kernels to 255 registers and spilled 48-136
        # bytes a thread (and B2 packed at w4_s3_k64_v32 to 252 KiB of shared memory).
        assert r.local == 0, f"spills: {used}"
        assert any(m.startswith("wgmma.") and m.endswith(".f32.bf16.bf16") for m in r.mma), used
    assert len(used) == 2, used


@pytest.mark.parametrize("num_warps", [4, 8])
def test_gate_kernels_fit_in_registers(num_warps):
    """F1 and B5 at K = 128 with Kimi Linear's options, at the default four warps and at
    eight: no thread-local memory. With their cumsums as float32 products (FMA loops on
    Triton) F1 spilled ~15 KiB a thread; with whole [C, K] tiles (scans) 0.8 and 1.8 KiB;
    16 columns at a time (kdax.pallas._gate.column_blocks), none."""
    used = {src.split(" ")[0]: resources(text, num_warps) for src, text in gate_kernels(dict(num_warps=num_warps)).items()}
    assert all(r.local == 0 and r.registers <= HOPPER_REGISTERS and r.shared <= HOPPER_SHARED_BYTES
               for r in used.values()), used
