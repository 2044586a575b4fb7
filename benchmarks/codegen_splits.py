"""Why two XLA:CPU programs that compute the same fusion can round it differently: the test
suite's ``--xla_backend_optimization_level=0`` and the LLVM module split (issue 51).

XLA:CPU cuts a program's kernels into ``xla_cpu_parallel_codegen_split_count`` LLVM modules
(32 by default) and compiles each alone. At optimization level 0 the modules are not
treated alike: in the dumps, modules that hold an inlined helper (the ``to_apply`` of a
reduction, an ``internal alwaysinline`` function) came out of LLVM's O0 pipeline with their
kernels' values promoted to registers, the others with them in stack slots; the machine code
then differs, and XLA:CPU lets LLVM contract ``a * b + c`` into one FMA (its TargetOptions:
``AllowFPOpFusion = Fast``, "always allow FMA fusion") in some of those forms and not in
others. Which module a kernel lands in depends on every other kernel of the program, so a
change anywhere (a stage's form, an input check) moves unrelated kernels between modules
and changes their rounding by an ulp. At XLA's default optimization level every module
runs the full pipeline, and one split module (``--xla_cpu_parallel_codegen_split_count=1``)
treats every kernel of a program alike.

    PYTHONPATH=. python benchmarks/codegen_splits.py [--pair bench|decode|both]

For each pair of programs a test compares bit for bit (``bench``: tests/test_bench.py's
checked and unchecked ``chunk_kda`` training steps, T=40; ``decode``:
tests/nn/test_decode_eager.py's eager and jitted packed layer calls), one child process per
flag set: the max abs difference between the two programs' outputs (0: bitwise equal).
Under the suite's flags the programs are dumped and compared kernel by kernel: the fused
computations the two programs share (canonical HLO text) and, for the kernels of the
same name, the FMA instructions in their machine code and the module part they landed in.
Needs ``objdump``."""

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

SUITE = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
FLAG_SETS = [
    ("suite (tests/conftest.py)", SUITE),
    ("suite + split_count=1", SUITE + " --xla_cpu_parallel_codegen_split_count=1"),
    ("XLA defaults", "--xla_force_host_platform_device_count=8"),
]
MODULES = {"bench": "jit_loss", "decode": "jit__call|jit__jitted"}


def child(pair: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kdax  # noqa: F401  (kdax._platform before any computation)

    jax.config.update("jax_enable_x64", True)  # as tests/conftest.py
    if pair == "bench":
        from kdax import bench
        from kdax._chunk_kda import chunk_kda
        from kdax.bench._baselines import _TrainStep
        from kdax.bench._shape import cotangent, make_inputs

        s = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
        pipe = bench.pipelines()["reference"]
        args, w = make_inputs(s), cotangent(s)
        a, b = (_TrainStep(lambda *x, c=c: chunk_kda(*x, chunk_size=16, pipeline=pipe, check_inputs=c), w)(*args)
                for c in (True, False))
    else:
        import equinox as eqx

        from kdax.nn import KimiDeltaAttention

        layer = KimiDeltaAttention(20, 2, 6, num_v_heads=4, key=jax.random.key(2), param_dtype=jnp.float32)
        x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 7, 20)), jnp.float32)
        cu = jnp.asarray([0, 3, 7], jnp.int32)
        def _jitted(layer, x, cu):  # (the name XLA's dump goes by)
            return layer(x, cu_seqlens=cu)

        a = layer(x, cu_seqlens=cu)
        b = eqx.filter_jit(_jitted)(layer, x, cu)
    diffs = [float(jnp.max(jnp.abs(u.astype(jnp.float64) - v.astype(jnp.float64))))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    print("max abs difference per output:", " ".join(f"{d:.3g}" for d in diffs))


def _computations(path: str) -> dict:
    text = re.sub(r", metadata=\{[^}]*\}|stack_frame_id=\d+", "", open(path).read())
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%(\S+) \(", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line.strip())
    return comps


def _canonical(lines) -> str:
    names = {}

    def rename(m):
        return "%" + names.setdefault(m.group(1), f"v{len(names)}")

    out = []
    for line in lines:
        line = re.sub(r"(calls|condition|body|to_apply)=%[\w.\-]+", r"\1=X", line)
        out.append(re.sub(r"%([\w.\-]+)", rename, line))
    return "\n".join(out)


def _fmas(prefix: str) -> dict:
    """``{kernel: (FMA instructions, module part)}`` from the dumped object files."""
    out = {}
    for path in sorted(glob.glob(prefix + ".obj-file.part_*.o")):
        part = path.split("part_")[1].split(".")[0]
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True).stdout
        cur = None
        for line in text.splitlines():
            m = re.match(r"^[0-9a-f]+ <([^>]+)>:", line)
            if m:
                cur = m.group(1)
                out[cur] = [0, part]
            elif cur and re.search(r"\tvfn?m(add|sub)", line):
                out[cur][0] += 1
    return out


def compare_dumps(dump: str, pair: str) -> None:
    hlo = sorted(p for p in glob.glob(os.path.join(dump, "module_*.cpu_after_optimizations.txt"))
                 if re.search(MODULES[pair], p))
    if len(hlo) != 2:
        print(f"  (expected two dumped programs, found {len(hlo)})")
        return
    a, b = (_computations(p) for p in hlo)
    ca = collections.Counter(_canonical(v) for k, v in a.items() if not k.startswith("main"))
    cb = collections.Counter(_canonical(v) for k, v in b.items() if not k.startswith("main"))
    print(f"  computations (besides the entry): {sum(ca.values())} and {sum(cb.values())}, "
          f"{sum((ca & cb).values())} identical in both")
    fa, fb = (_fmas(p[: -len(".cpu_after_optimizations.txt")]) for p in hlo)
    both = sorted(set(fa) & set(fb))
    moved = sum(fa[k][1] != fb[k][1] for k in both)
    print(f"  kernels of the same name in both: {len(both)}, {moved} of them in another module part")
    calls = [_callees(c) for c in (a, b)]
    for k in both:
        if fa[k][0] != fb[k][0]:
            ka, kb = (c.get(k) for c in calls)
            same = ka and kb and _canonical(a[ka]) == _canonical(b[kb])
            print(f"  {k}: {fa[k][0]} FMA (part {fa[k][1]}) vs {fb[k][0]} FMA (part {fb[k][1]}); "
                  f"fused computation {'identical' if same else 'different'} in the two programs")


def _callees(comps: dict) -> dict:
    """``{fusion instruction: the computation it calls}``."""
    out = {}
    for lines in comps.values():
        for line in lines:
            m = re.match(r"(?:ROOT )?%([\w.\-]+) = .*? fusion\(.*calls=%([\w.\-]+)", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pair", default="both", choices=("bench", "decode", "both"))
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pair in (("bench", "decode") if args.pair == "both" else (args.pair,)):
        print(f"== {pair}: " + ("tests/test_bench.py, checked vs unchecked training step (T=40)" if pair == "bench"
                                else "tests/nn/test_decode_eager.py, eager vs jitted packed call"), flush=True)
        for name, flags in FLAG_SETS:
            with tempfile.TemporaryDirectory() as dump:
                extra = f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={MODULES[pair]}" \
                    if name.startswith("suite (") else ""
                env = dict(os.environ, XLA_FLAGS=flags + extra, PYTHONPATH=root)
                r = subprocess.run([sys.executable, __file__, "--child", pair], env=env, capture_output=True, text=True)
                out = r.stdout.strip() or r.stderr.strip().splitlines()[-1]
                print(f"{name:28s} {out}", flush=True)
                if extra:
                    compare_dumps(dump, pair)


if __name__ == "__main__":
    main()
