"""Same-process A/B of compile times: ``jax.jit(jax.grad(chunk_kda))`` and the forward at
compile_size.py's shape (B=1 T=2048 H=4 K=V=64 float32, l2norm in kernel), this tree's
kdax against another revision's (``kdax_base``, exported as benchmarks/stage_ab.py does),
compiled alternately (each after ``jax.clear_caches``); best CPU seconds (process time) and
wall. ``python benchmarks/compile_ab.py [--base REV] [--repeat 3]``."""
import argparse
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="main")
    p.add_argument("--repeat", type=int, default=3)
    o = p.parse_args()
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from compile_size import inputs
    from stage_ab import export_base

    dest, sha = export_base(o.base)
    sys.path.insert(0, dest)
    import jax
    import kdax
    import kdax_base

    args = inputs()
    progs = {}
    for tag, mod in (("base", kdax_base), ("new", kdax)):
        loss = lambda *a, m=mod: m.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0].sum()
        progs[("step", tag)] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args)
        progs[("forward", tag)] = jax.jit(lambda *a, m=mod: m.chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0]).trace(*args)
    best = {}
    for _ in range(o.repeat):
        for key, traced in progs.items():
            jax.clear_caches()
            lowered = traced.lower()
            w0, c0 = time.perf_counter(), time.process_time()
            lowered.compile()
            w, c = time.perf_counter() - w0, time.process_time() - c0
            bw, bc = best.get(key, (1e9, 1e9))
            best[key] = (min(bw, w), min(bc, c))
    print(f"base {sha} vs this tree; best of {o.repeat} compiles, CPU s (wall s)")
    for prog in ("step", "forward"):
        (bw, bc), (nw, nc) = best[(prog, "base")], best[(prog, "new")]
        print(f"{prog:8s} base {bc:5.2f} ({bw:5.2f})  new {nc:5.2f} ({nw:5.2f})  new/base CPU {nc / bc:.3f}", flush=True)


if __name__ == "__main__":
    main()
