"""Kernels per stage in the compiled ``jax.jit(jax.grad(chunk_kda))`` (and the forward) at
compile_size.py's shape (B=1 T=2048 H=4 K=V=64 float32, l2norm in kernel): XLA:CPU spends
~30 ms of code generation a kernel, so these counts say where the compile time goes
(issue 51 item 3). ``python benchmarks/compile_kernels.py [--forward]``."""
import collections
import re
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compile_size import inputs, kernel_instructions  # noqa: E402


def _stage(op_name: str) -> str:
    """The innermost stage scope (``kdax_<stage>``) of an op, or "glue"."""
    found = re.findall(r"kdax_(\w+)", op_name)
    return found[-1] if found else "glue"


def per_stage(text: str):
    return collections.Counter(_stage(op) for *_, op in kernel_instructions(text))


def main():
    import jax
    import kdax

    q, k, v, g, beta = inputs()
    loss = lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0].sum()
    fns = {"step": jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))),
           "forward": jax.jit(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0])}
    for name, f in fns.items():
        lowered = f.trace(q, k, v, g, beta).lower()
        c0, w0 = time.process_time(), time.perf_counter()
        text = lowered.compile().as_text()
        c1, w1 = time.process_time(), time.perf_counter()
        by = per_stage(text)
        print(f"{name}: {sum(by.values())} kernels, compile {w1 - w0:.1f} s wall {c1 - c0:.1f} s CPU:",
              ", ".join(f"{k} {n}" for k, n in by.most_common()), flush=True)



def dump(stage: str, forward: bool = False):
    """The kernels of one stage in the compiled step (or forward): name, shape, op_name tail."""
    import jax
    import kdax

    q, k, v, g, beta = inputs()
    f = jax.jit(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0]) if forward else \
        jax.jit(jax.grad(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0].sum(), argnums=(0, 1, 2, 3, 4)))
    for name, shape, _, op in kernel_instructions(f.trace(q, k, v, g, beta).lower().compile().as_text()):
        if _stage(op) == stage:
            print(f"  {name:40s} {shape[:40]:40s} {op[-70:]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--forward":
        dump(sys.argv[1], "--forward" in sys.argv)
    else:
        main()
