"""What ``kdax.reuse_freed_memory()`` changes: the main job's forward and training step
(B=1 T=4096 H=8 K=V=128 chunk 64 float32, the reference pipeline) with glibc's malloc as
it is and with freed memory reused, in alternating fresh processes (the setting is a
process's), each path timed best of ``--reps`` calls: wall, CPU (all threads) and minor
page faults a call. ``unchecked``: the step with ``check_inputs=False``, a program XLA:CPU
dispatches to its own threads unless the setting runs it on the caller's. ``--write`` appends the table to results/freed_memory.txt.

    python benchmarks/freed_memory.py [--pairs 3] [--reps 7] [--T 4096] [--write]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

WORKER = r"""
import json, sys
import jax, kdax
from kdax.bench._shape import Shape, make_inputs, cotangent
from kdax.bench._timing import best_call
mode, T, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
applied = kdax.reuse_freed_memory() if mode == "reused" else False
s = Shape(B=1, T=T, H=8, HV=8, K=128, V=128, chunk_size=64)
args, w = make_inputs(s), cotangent(s)
fwd = jax.jit(lambda *a: kdax.chunk_kda(*a)[0])
grad = lambda check: jax.jit(jax.grad(lambda *a: (kdax.chunk_kda(*a, check_inputs=check)[0] * w).sum(),
                                     argnums=(0, 1, 2, 3, 4)))
out = dict(applied=applied)
for name, fn in (("forward", fwd), ("step", grad(True)), ("unchecked", grad(False))):
    out[name] = best_call(fn, args, reps)
print(json.dumps(out))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    runs = {"as it is": [], "reused": []}
    for _ in range(a.pairs):
        for mode in runs:
            res = subprocess.run([sys.executable, "-c", WORKER, mode, str(a.T), str(a.reps)], capture_output=True,
                                 text=True, check=True)
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    lines = [f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} cores, load {load:.1f}, "
             f"T={a.T} H=8 K=V=128, {a.pairs} process pairs alternating, best of {a.reps} calls a process:",
             f"{'path':<10}{'malloc':<11}{'wall ms':>9}{'CPU ms':>9}{'faults':>9}{'/as it is':>11}"]
    for path in ("forward", "step", "unchecked"):
        best = {m: min(r[path][0] for r in rs) for m, rs in runs.items()}
        for m, rs in runs.items():
            wall, cpu, faults = min((r[path] for r in rs), key=lambda x: x[0])
            lines.append(f"{path:<10}{m:<11}{wall * 1e3:9.1f}{cpu * 1e3:9.1f}{faults:9d}"
                         f"{best[m] / best['as it is']:11.3f}")
    text = "\n".join(lines)
    print(text)
    if a.write:
        out = pathlib.Path(__file__).parent / "results" / "freed_memory.txt"
        with out.open("a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
