"""The Triton state kernels hold the state on chip: F4 and B2 (B0's F4 is F4) at
K = V = 128, chunk 64, compiled for Hopper (sm_90) to a cubin on any machine (no GPU
needed) under the ``"fast"`` precision policy, use no thread-local memory (a register
spill would put part of the state, or of a chunk's operands, off chip at every chunk) and
run their products as bf16 ``wgmma`` (Hopper's warpgroup tensor-core products). The
tunings are the candidates of the GPU runs (benchmarks/NOTES.md, "GPU commands"). Needs
the ``triton`` package (the ``test`` extra on Linux x86_64): skipped without it."""

import pytest

pytest.importorskip("triton")

from ._triton import HOPPER_REGISTERS, HOPPER_SHARED_BYTES, resources, state_kernels  # noqa: E402

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
