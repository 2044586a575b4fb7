"""What each Pallas Triton kernel of a training step holds per program on Hopper, without
a GPU: every kernel of ``jax.grad`` of ``chunk_kda`` (bf16 inputs, K = V = 128, chunk 64,
Kimi Linear's options: the GPU benchmark's configuration) lowered for CUDA, compiled by
Triton's passes and the ptxas of triton's wheel for sm_90, and read back: registers per
thread, thread-local bytes (spills: off chip), shared memory, the tensor-core
instructions. A kernel with local bytes or without tensor-core products is slow on the
GPU whatever else it does (PallasGate took 7.2 ms on an H200 at 15 KiB of spills a
thread, against 0.28 ms for XLA's gate).

    python benchmarks/triton_resources.py                 # the paths below, to stdout
    python benchmarks/triton_resources.py --pipes pallas+fast --out results/triton_resources.txt
    python benchmarks/triton_resources.py --shape 1,16384,16     # B,T,H (default 1,1024,2)

Paths are ``gpu_vs_fla.py``'s names. Needs ``triton`` (the ``test`` extra)."""

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PIPES = ("pallas", "pallas+warps=8+f32dot=tf32x3+fast+stages=2+block_k=64")


@dataclasses.dataclass
class Row:
    path: str
    kernel: str
    registers: int
    local: int
    shared: int
    mma: str


def training_step(path: str, B: int = 1, T: int = 1024, H: int = 2, K: int = 128, C: int = 64):
    """``(fn, args, pipeline)``: ``jax.grad`` of a loss on ``chunk_kda`` along ``path`` (bf16 inputs
    ``[B, T, H, K]``, Kimi Linear's options), every Pallas stage compiled for Triton (not
    interpreted), ready to ``jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))``."""
    import jax
    import jax.numpy as jnp

    import kdax
    from gpu_vs_fla import call_options, kdax_pipeline

    # (off a GPU, KDAPipeline.pallas() picks the TPU target: compiled Triton kernels here)
    pipe = kdax_pipeline(path)
    pipe = dataclasses.replace(pipe, **{n: dataclasses.replace(getattr(pipe, n), target="triton", interpret=False)
                                        for n in kdax.pipeline.STAGES if hasattr(getattr(pipe, n), "interpret")})
    s = jax.ShapeDtypeStruct
    args = (s((B, T, H, K), jnp.bfloat16),) * 4 + (s((B, T, H), jnp.bfloat16),)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=jnp.zeros(H, jnp.float32), dt_bias=jnp.zeros(H * K, jnp.float32), **call_options(path))

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, output_final_state=True, **opts)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args, pipe


def kernels(path: str, T: int = 1024, H: int = 2, K: int = 128, C: int = 64, B: int = 1) -> list:
    import jax

    from tests.pallas._triton import captured, resources, triton_calls

    fn, args, _ = training_step(path, B, T, H, K, C)
    records = []
    with captured(records):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    calls = triton_calls(lowered.as_text())
    assert len(calls) == len(records), (len(calls), len(records))
    rows, seen = [], set()
    # Each kernel compiled with the warps and stages of its custom call: a stage's own fields
    # are not those where its f32_tuning applied (kdax.pallas.PallasTarget.for_operands).
    for (jaxpr, _, text), (name, warps, stages) in zip(records, calls):
        name = jaxpr.debug_info.func_src_info.split(" ")[0]
        if name in seen:
            continue
        seen.add(name)
        r = resources(text, warps, stages)
        rows.append(Row(path, name, r.registers, r.local, r.shared, " ".join(sorted(r.mma)) or "-"))
        print(f"  {name}: {r.registers} registers, {r.local} B local, {r.shared} B shared", file=sys.stderr, flush=True)
    return rows


def parse_shape(text: str) -> tuple:
    """``"B,T,H"`` -> ``(B, T, H)``."""
    B, T, H = (int(x) for x in text.split(","))
    return B, T, H


def table(rows: list) -> str:
    out = [f"{'path':<56} {'kernel':<34} {'regs':>4} {'local B':>7} {'shared B':>8}  tensor-core products"]
    for r in rows:
        out.append(f"{r.path:<56} {r.kernel:<34} {r.registers:>4} {r.local:>7} {r.shared:>8}  {r.mma}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipes", default=",".join(PIPES))
    ap.add_argument("--shape", default="1,1024,2", help="B,T,H of the bf16 inputs (K = V = 128, chunk 64)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    B, T, H = parse_shape(a.shape)
    warnings.filterwarnings("ignore", module="triton")
    import triton

    rows = []
    for path in a.pipes.split(","):
        print(f"{path}:", file=sys.stderr, flush=True)
        rows += kernels(path, T, H, B=B)
    text = (f"Triton kernels of a training step compiled for sm_90 without a GPU (triton {triton.__version__}): "
            f"bf16 inputs, B={B} T={T} H={H} K=V=128, chunk 64, Kimi Linear's options; registers per thread, local "
            "(spilled) bytes per thread, shared bytes per program\n" + table(rows))
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
