"""Kernels per stage in the compiled ``jax.jit(jax.grad(chunk_kda))`` (and the forward) at
compile_size.py's shape (B=1 T=2048 H=4 K=V=64 float32, l2norm in kernel): XLA:CPU spends
~30 ms of code generation a kernel, so these counts say where the compile time goes
(issue 51 item 3). ``python benchmarks/compile_kernels.py [--forward]``."""
import collections
import re
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compile_size import _NOT_KERNELS  # noqa: E402


def per_stage(text: str):
    by = collections.Counter()
    comp = ""
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            comp = head.group(2)
            continue
        m = re.match(r"\s*(ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(.*?(op_name=\"([^\"]*)\")?", line)
        if m and "fused" not in comp and not comp.startswith("wrapped") and m.group(2) not in _NOT_KERNELS:
            op = re.search(r'op_name="([^"]*)"', line)
            found = re.findall(r"kdax_(\w+)", op.group(1)) if op else []
            by[found[-1] if found else "glue"] += 1
    return by


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import kdax

    B, T, H, K = 1, 2048, 4, 64
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(0.01, 0.5, size=(B, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
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
    """The kernels of one stage in the compiled step (or forward): name and op_name tail."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import kdax

    B, T, H, K = 1, 2048, 4, 64
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(0.01, 0.5, size=(B, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
    f = jax.jit(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0]) if forward else \
        jax.jit(jax.grad(lambda *a: kdax.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0].sum(), argnums=(0, 1, 2, 3, 4)))
    text = f.trace(q, k, v, g, beta).lower().compile().as_text()
    comp = ""
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            comp = head.group(2)
            continue
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if m and "fused" not in comp and not comp.startswith("wrapped") and m.group(4) not in _NOT_KERNELS:
            op = re.search(r'op_name="([^"]*)"', line)
            if op and f"kdax_{stage})" in op.group(1) + ")" or (op and re.findall(r"kdax_(\w+)", op.group(1))[-1:] == [stage]):
                print(f"  {m.group(2):40s} {m.group(3)[:40]:40s} {op.group(1)[-70:]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--forward":
        dump(sys.argv[1], "--forward" in sys.argv)
    else:
        main()
