"""XLA:CPU's YNNPACK fusion types against kdax's own setting (issue 51), each setting in
fresh processes, alternating, float32.

``import kdax`` sets ``--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot`` on jaxlib
0.10 (``kdax._platform``: the elementwise and reduction fusions corrupt memory there), and
keeps a value the user's ``XLA_FLAGS`` gives. With ``individual_dot`` every dot becomes a
YNNPACK call of its own, before fusion; without it, YNNPACK's ``dot`` fusions take a dot
together with the slices and elementwise work around it (F4's ``u - w h``, B2's
``decay dh + ... - w^T dv``), and a dot left alone runs on XLA's own emitter.
Speed only: ``dot`` alone is faster at K=V=128 and unsound on jaxlib 0.10.2 (garbage
gradients in both runs of the test suite under it; ``results/ynn_fusions.txt``).

Per process: the main job's forward and training step (``kdax.bench``'s programs, with
``kdax.reuse_freed_memory()``, medians of ``--reps`` rounds), the large float32 matmul
before and after, and their compile times; ``--dots`` also bare dots of a few shapes
(GFLOP/s, best of 9).

    python benchmarks/ynn_fusions.py [--settings individual_dot,dot:dot] [--pairs 4]
        [--shape '{"T": 2048, "H": 4, "HV": 4, "K": 64, "V": 64}'] [--dots] [--write]

``--write`` appends the report to ``benchmarks/results/ynn_fusions.txt``."""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from kdax import _platform

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ynn_fusions.txt"

WORKER = r"""
import json, sys
import kdax
kdax.reuse_freed_memory()
import jax, jax.numpy as jnp, numpy as np
from kdax.bench._main import pipelines
from kdax.bench._run import kdax_paths
from kdax.bench._shape import Shape, cotangent, make_inputs
from kdax.bench._timing import best_call, compiled, machine, matmul_gflops, time_rounds

shape, reps, dots = Shape(**json.loads(sys.argv[1])), int(sys.argv[2]), sys.argv[3] == "1"
args, w = make_inputs(shape), cotangent(shape)
fwd, step = kdax_paths(shape, pipelines()["reference"], w)
(f, cf, _), (g, cg, _) = compiled(fwd, args), compiled(step, args)
mm = matmul_gflops()
tf, tg = time_rounds([f, g], args, reps)
out = dict(machine=machine(), fwd_ms=tf * 1e3, step_ms=tg * 1e3, mm=max(mm, matmul_gflops()),
           compile_fwd=cf, compile_step=cg)
if dots:
    r = np.random.default_rng(0)
    for name, sa, sb in (("2048^3", (2048, 2048), (2048, 2048)), ("4096x1024x1024", (4096, 1024), (1024, 1024)),
                         ("512x128x128", (512, 128), (128, 128)), ("64x64x64", (64, 64), (64, 64)),
                         ("512 x 64x128x128", (512, 64, 128), (512, 128, 128)),
                         ("16 x 64x128x128", (16, 64, 128), (16, 128, 128))):
        a, b = (jnp.asarray(r.normal(size=s), jnp.float32) for s in (sa, sb))
        out["dot " + name] = 2 * np.prod(sa) * sb[-1] / best_call(jax.jit(jnp.matmul), (a, b), 9)[0] / 1e9
print("RESULT " + json.dumps(out))
"""

OPTION = "--" + _platform.OPTION  # (kdax keeps a setting it finds in XLA_FLAGS)


def run(setting: str, shape: dict, reps: int, dots: bool) -> dict:
    """One fresh process with ``setting`` as the YNNPACK fusion types (the user's other XLA
    flags kept)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(OPTION))
    env = dict(os.environ, XLA_FLAGS=f"{flags} {OPTION}={setting}".strip(), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(shape), str(reps), "1" if dots else "0"],
                         env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{setting}: the worker failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="individual_dot,dot:dot", help="colon-separated fusion-type lists")
    p.add_argument("--pairs", type=int, default=4, help="rounds, each setting once per round")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shape", default="{}", help="kdax.bench.Shape fields as JSON (default: the main job's)")
    p.add_argument("--dots", action="store_true")
    p.add_argument("--write", action="store_true")
    a = p.parse_args(argv)
    settings, shape = a.settings.split(":"), json.loads(a.shape)
    rows = {s: [] for s in settings}
    lines = []
    for i in range(a.pairs):
        for s in settings:
            r = run(s, shape, a.reps, a.dots)
            rows[s].append(r)
            extra = "".join(f"  {k[4:]} {v:.1f}" for k, v in r.items() if k.startswith("dot "))
            lines.append(f"round {i + 1} {s:22s} forward {r['fwd_ms']:7.1f} ms  step {r['step_ms']:7.1f} ms  "
                         f"matmul {r['mm']:6.1f} GFLOP/s  compile {r['compile_fwd']:4.1f} / {r['compile_step']:4.1f} s"
                         + (f"  dots (GFLOP/s):{extra}" if extra else ""))
            print(lines[-1], flush=True)
    base = settings[0]
    lines.append(f"medians ({a.pairs} processes each; ratio: against {base} in the same round, median of rounds):")
    for s in settings:
        med = lambda k: statistics.median(r[k] for r in rows[s])  # noqa: E731
        ratio = lambda k: statistics.median(r[k] / b[k] for r, b in zip(rows[s], rows[base]))  # noqa: E731
        lines.append(f"  {s:22s} forward {med('fwd_ms'):7.1f} ms ({ratio('fwd_ms'):.2f}x)  step {med('step_ms'):7.1f} ms "
                     f"({ratio('step_ms'):.2f}x)  compile {med('compile_fwd'):4.1f} / {med('compile_step'):4.1f} s")
    print("\n".join(lines[-len(settings) - 1:]))
    if a.write:
        head = f"{rows[base][0]['machine']}; shape {json.dumps(shape) if shape else 'the main job'}; reps {a.reps}"
        with open(RESULTS, "a") as f:
            f.write("\n".join([head] + lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
