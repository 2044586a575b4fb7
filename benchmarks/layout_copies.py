"""The layout copies XLA must make around the Pallas kernels of a step, without a GPU: the
transposes of at least 1 MiB in ``chunk_kda``'s forward and training step lowered for
CUDA (StableHLO; each a pass over HBM on the device that XLA cannot fuse into a Pallas
kernel), and the bytes they write. Shape: the GPU benchmark's goal shape (bf16, B=1
T=16384 H=16 K=V=128, chunk 64, Kimi Linear's options).

    python benchmarks/layout_copies.py                       # the candidate path
    python benchmarks/layout_copies.py --pipes pallas,reference

Paths are ``gpu_vs_fla.py``'s names; their Pallas stages are lowered as compiled Triton
kernels."""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CANDIDATE = "pallas+warps=8+f32dot=tf32x3+fast+stages=2+block_k=64"
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i32": 4}


def transposes(text: str, at_least: int = 1 << 20) -> list:
    """Bytes written by each ``stablehlo.transpose`` in ``text`` of at least ``at_least``."""
    out = []
    for m in re.finditer(r"stablehlo\.transpose .*?-> tensor<([0-9x]+)x(\w+)>", text):
        size = BYTES.get(m.group(2), 4)
        for d in m.group(1).split("x"):
            size *= int(d)
        if size >= at_least:
            out.append(size)
    return out


def lowered(path: str, B=1, T=16384, H=16, K=128, C=64) -> dict:
    import jax
    import jax.numpy as jnp

    import kdax
    from gpu_vs_fla import kdax_pipeline

    pipe = kdax_pipeline(path)
    pipe = dataclasses.replace(pipe, **{n: dataclasses.replace(getattr(pipe, n), target="triton", interpret=False)
                                        for n in kdax.pipeline.STAGES if hasattr(getattr(pipe, n), "interpret")})
    s = jax.ShapeDtypeStruct
    args = (s((B, T, H, K), jnp.bfloat16),) * 4 + (s((B, T, H), jnp.bfloat16),)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=jnp.zeros(H, jnp.float32), dt_bias=jnp.zeros(H * K, jnp.float32))

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, output_final_state=True, **opts)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    fns = {"forward": loss, "training step": jax.grad(loss, argnums=(0, 1, 2, 3, 4))}
    return {n: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text() for n, f in fns.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipes", default=CANDIDATE)
    a = ap.parse_args()
    for path in a.pipes.split(","):
        for name, text in lowered(path).items():
            t = transposes(text)
            print(f"{path:<56} {name:<14} {len(t):>2} transposes >= 1 MiB, {sum(t) / 2**20:>6.0f} MiB written")


if __name__ == "__main__":
    main()
