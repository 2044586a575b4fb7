"""What ``jax.jit(jax.grad(...))`` of ``chunk_kda`` and of ``fused_recurrent_kda`` contain and
how long each takes to trace, lower and compile (float32, B=1 T=2048 H=4 K=V=64, l2norm in
kernel, every input differentiated). Op counts are deterministic, so they compare trees
on a noisy machine where compile seconds do not (issue 39 item 7)::

    python benchmarks/compile_size.py                 # this tree, 3 compiles each
    python benchmarks/compile_size.py --tree /tmp/old # another tree's kdax (git archive <commit> kdax | tar -x -C /tmp/old)
    python benchmarks/compile_size.py --write         # and add the row to benchmarks/results/compile_size.txt
    python benchmarks/compile_size.py --llvm 20       # LLVM's compile time by stage, the 20 slowest kernels

Columns: jaxpr equations (nested jaxprs included), StableHLO ops of the lowered program,
instructions of the compiled (optimised) HLO, kernels (the compiled HLO's instructions
outside fused computations that run as their own kernel: fusions, dots, copies, ...;
XLA:CPU's compile time is mostly their code generation, ~30 ms each), and seconds: the
fastest of ``--repeat`` compiles (each re-lowered after ``jax.clear_caches``), wall and
CPU (process time, all threads: less disturbed by other jobs on a shared machine)."""

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compile_size.txt"
_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call"}


def _eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    n += _eqns(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    n += _eqns(sub)
    return n


def kernel_instructions(hlo_text: str):
    """The instructions of a compiled HLO module that are kernels of their own (those of the
    entry and control-flow computations, not of fused ones, less bookkeeping ops), as
    ``(name, shape, opcode, op_name)`` (op_name "" where the metadata has none)."""
    comp = ""
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            comp = head.group(2)
            continue
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if m and "fused" not in comp and not comp.startswith("wrapped") and m.group(4) not in _NOT_KERNELS:
            op = re.search(r'op_name="([^"]*)"', line)
            yield m.group(2), m.group(3), m.group(4), op.group(1) if op else ""


def kernels(hlo_text: str) -> int:
    """How many ``kernel_instructions`` a compiled HLO module has."""
    return sum(1 for _ in kernel_instructions(hlo_text))


def inputs(B: int = 1, T: int = 2048, H: int = 4, K: int = 64):
    """``(q, k, v, g, beta)`` float32 at the measured shape (seeded)."""
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(0.01, 0.5, size=(B, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
    return q, k, v, g, beta


def measure(repeat: int, B=1, T=2048, H=4, K=64):
    """``{name: row}`` for chunk_kda and fused_recurrent_kda's gradients."""
    import jax

    import kdax

    q, k, v, g, beta = inputs(B, T, H, K)
    print(f"B={B} T={T} H={H} K=V={K} float32, jax {jax.__version__}, kdax from {kdax.__file__}")
    rows = {}
    for name, fn in (("chunk_kda", kdax.chunk_kda), ("fused_recurrent_kda", kdax.fused_recurrent_kda)):
        loss = lambda *a, fn=fn: fn(*a, use_qk_l2norm_in_kernel=True)[0].sum()
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        t0 = time.perf_counter()
        traced = step.trace(q, k, v, g, beta)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        wall, cpu = [], []
        for _ in range(repeat):
            jax.clear_caches()
            lowered = traced.lower()
            w0, c0 = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        shlo = len(re.findall(r"= stablehlo\.|^\s*stablehlo\.", lowered.as_text(), re.M))
        text = compiled.as_text()
        hlo = len(re.findall(r"^\s*(ROOT )?%?[\w.\-]+ = ", text, re.M))
        row = dict(eqns=_eqns(traced.jaxpr.jaxpr), shlo=shlo, hlo=hlo, kernels=kernels(text), trace=t1 - t0,
                   lower=t2 - t1, wall=min(wall), cpu=min(cpu))
        rows[name] = row
        print(f"{name:20s} jaxpr eqns {row['eqns']:5d}  stablehlo ops {shlo:5d}  compiled HLO {hlo:5d}  kernels "
              f"{row['kernels']:4d}  trace {row['trace']:4.1f} s  lower {row['lower']:4.1f} s  compile (best of "
              f"{repeat}) {row['wall']:5.1f} s wall, {row['cpu']:5.1f} s CPU   (all wall: "
              f"{', '.join(f'{w:.1f}' for w in wall)})", flush=True)
    return rows


def write_row(rows, note: str, tree: str):
    """Append one line to ``RESULTS`` (header first if new); the commit column is this
    checkout's HEAD, or "--tree" for another tree (say which in the note)."""
    c, f = rows["chunk_kda"], rows["fused_recurrent_kda"]
    commit = "--tree" if Path(tree).resolve() != ROOT else subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    dirty = commit != "--tree" and subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kdax"],
                                                  capture_output=True, text=True).stdout.strip()
    load = open("/proc/loadavg").read().split()[0] if Path("/proc/loadavg").exists() else "?"
    if not RESULTS.exists():
        RESULTS.write_text(
            "Compile time of jax.jit(jax.grad(chunk_kda)) (benchmarks/compile_size.py --write): B=1 T=2048 H=4 K=V=64\n"
            "float32, l2norm in kernel, every input differentiated, 2-core x86_64 CPU. Seconds: the best of the\n"
            "repeated compiles, wall and CPU (process time of all threads; wall is inflated by other jobs: see\n"
            "the load), and chunk_kda's over fused_recurrent_kda's gradient compiled in the same run.\n\n"
            f"{'date (UTC)':16s} {'commit':11s} {'eqns':>5s} {'shlo':>5s} {'hlo':>5s} {'kernels':>7s} {'wall s':>6s} "
            f"{'CPU s':>6s} {'/recurrent':>10s} {'load':>5s}  note\n")
    ratio = c["wall"] / f["wall"]
    with RESULTS.open("a") as out:
        out.write(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} {commit + ('+' if dirty else ''):11s} {c['eqns']:5d} "
                  f"{c['shlo']:5d} {c['hlo']:5d} {c['kernels']:7d} {c['wall']:6.1f} {c['cpu']:6.1f} "
                  f"{ratio:9.1f}x {load:>5s}  {note}\n")
    print(f"row added to {RESULTS}")


_LLVM_LINE = re.compile(r"Compiled LLVM module: __compute_module_(\S+?)_kernel_module time: ([\d.]+) (us|ms|s) ")


def llvm_by_kernel(log: str, hlo_text: str):
    """``[(ms, kernel, stage, shape)]``, slowest first: the LLVM compile time XLA:CPU logs for
    each kernel (``TF_CPP_VMODULE=ir_compiler=1``) of the program ``hlo_text``, each kernel
    named after its HLO instruction, ``stage`` the innermost ``kdax_<stage>`` scope of its
    metadata ("glue" outside every stage, "?" for a kernel the HLO does not name)."""
    where = {}
    for name, shape, _, op in kernel_instructions(hlo_text):
        scopes = re.findall(r"kdax_([a-z0-9_]+)", op)
        where[name] = (scopes[-1] if scopes else "glue", shape)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    rows = [(float(t) * scale[u], k, *where.get(k, ("?", ""))) for k, t, u in _LLVM_LINE.findall(log)]
    return sorted(rows, reverse=True)


def llvm_report(tree: str, top: int) -> None:
    """``--llvm``: chunk_kda's gradient (compile_size's program) compiled once in a child
    process that logs XLA:CPU's LLVM time per kernel; the time by stage and the ``top``
    slowest kernels. (LLVM is most of XLA:CPU's compile: the kernels compile on two
    threads, so their CPU time adds up to more than the compile's wall time. With
    ``--xla_cpu_parallel_codegen_split_count=1`` in ``XLA_FLAGS``, as the test suite sets it,
    every kernel is one LLVM module and the report one row.)"""
    code = ("import sys, jax; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]); import kdax; "
            "from compile_size import inputs; a = inputs(); "
            "loss = lambda *x: kdax.chunk_kda(*x, use_qk_l2norm_in_kernel=True)[0].sum(); "
            "c = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*a).compile(); "
            "open(sys.argv[3], 'w').write(c.as_text())")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="ir_compiler=1")
    with tempfile.NamedTemporaryFile("r", suffix=".hlo") as out:
        run = subprocess.run([sys.executable, "-c", code, tree, str(Path(__file__).parent), out.name], env=env,
                             capture_output=True, text=True, check=True)
        rows = llvm_by_kernel(run.stderr, out.read())
    total = sum(r[0] for r in rows)
    by = {}
    for ms, _, stage, _ in rows:
        n, t = by.get(stage, (0, 0.0))
        by[stage] = (n + 1, t + ms)
    print(f"LLVM compile of jax.jit(jax.grad(chunk_kda)) at B=1 T=2048 H=4 K=V=64: {total / 1e3:.2f} s CPU over "
          f"{len(rows)} kernels (XLA:CPU's own timer)")
    for stage, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {stage:12s} {t:7.0f} ms  {100 * t / total:4.1f}%  {n:4d} kernels")
    print(f"the {top} slowest kernels:")
    for ms, kernel, stage, shape in rows[:top]:
        print(f"  {ms:6.1f} ms  {stage:10s} {kernel:42s} {shape}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(ROOT), help="a tree holding the kdax package to measure")
    ap.add_argument("--repeat", type=int, default=3, help="compiles of each program (the fastest counts)")
    ap.add_argument("--write", action="store_true", help=f"append the row to {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--note", default="", help="text for the row's note column")
    ap.add_argument("--llvm", type=int, metavar="N", default=0,
                    help="instead: LLVM's compile time by stage and the N slowest kernels (one compile, logged)")
    args = ap.parse_args()
    if args.llvm:
        return llvm_report(args.tree, args.llvm)
    sys.path.insert(0, args.tree)
    rows = measure(args.repeat)
    if args.write:
        write_row(rows, args.note, args.tree)


if __name__ == "__main__":
    main()
