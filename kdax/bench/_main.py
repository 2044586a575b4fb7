"""``python -m kdax.bench``: the command line."""

import argparse
import dataclasses
import sys
import time

import jax

from .._platform import _backends_created, reuse_freed_memory
from ._baselines import pipelines
from ._profile import format_profiles, profile
from ._results import write_results
from ._run import bench_shape, kdax_paths
from ._shape import Shape, cotangent, make_inputs
from ._stages import bench_glue, bench_stages
from ._tables import STAGE_HEAD, format_stage_row, format_table, with_ratios
from ._timing import Log, chunk_dot_gflops, compiled, machine, matmul_gflops


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a size or a count; 0 or less ended in numpy's errors)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    # The package's docstring (the harness described) is the --help text.
    p = argparse.ArgumentParser(description=sys.modules[__package__].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in dataclasses.asdict(Shape()).items():
        # (--HV follows --H unless given: grouped value heads only when asked for)
        p.add_argument(f"--{name}", type=_positive, default=None if name == "HV" else default,
                       help="default: --H" if name == "HV" else None)
    p.add_argument("--reps", type=_positive, default=5, help="timed runs of each light path (rounds)")
    p.add_argument("--heavy-reps", type=_positive, default=1,
                   help="timed runs of each heavy baseline (the gradients of the scans and of autodiff)")
    p.add_argument("--pipelines", default="reference", help="comma list of: reference, pallas, mixed")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--slow-baselines", action="store_true",
                   help="also the readable oracle's gradient (lax.scan autodiff: 8 s a call, 6 GB at T=4096)")
    p.add_argument("--sweep", action="store_true", help="T in 512..16384 at H=8, K=V=128")
    p.add_argument("--stages", action="store_true",
                   help="time each stage alone per pipeline (arguments from the reference pipeline)")
    p.add_argument("--profile", action="store_true",
                   help="where the forward's and the training step's time goes, by kind of operation (a jax.profiler "
                        "trace of XLA:CPU's events)")
    p.add_argument("--out", default="bench-results", help="folder for results.json/.csv and plots ('' for none)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--host-devices", type=_positive, default=1,
                   help="every path with its inputs' heads split over this many host devices (jax_num_cpu_devices, "
                        "set before JAX's first computation): on a multi-core CPU, batched dots, which XLA:CPU runs "
                        "on one core a program, run on as many")
    p.add_argument("--fresh-memory", action="store_true",
                   help="leave glibc's malloc and JAX's dispatch as they are (by default the run calls "
                        "kdax.reuse_freed_memory() first: XLA:CPU's temporaries then reuse freed memory instead of "
                        "faulting in fresh pages on every call)")
    return p


def _chunk_dims(shape: Shape) -> tuple:
    """``(batch, C, K, V)`` of a run's chunk products ``[C, K] @ [K, V]``, one per chunk and
    head (``chunk_dot_gflops``' arguments)."""
    return shape.B * shape.HV * -(-shape.T // shape.chunk_size), shape.chunk_size, shape.K, shape.V


def _stages_main(shape: Shape, reps: int, pipes: dict, memory: str) -> int:
    """``--stages``: the stage table, a line as each stage is timed."""
    print(f"kdax stages alone on {machine()}, {memory}; B={shape.B} T={shape.T} H={shape.H} HV={shape.HV} K={shape.K} "
          f"V={shape.V} chunk={shape.chunk_size} float32 (/first: against the first pipeline named)")
    mm = matmul_gflops()
    print(f"large float32 matmul: {mm:.1f} GFLOP/s (%mm: a stage's FLOP rate against it; FLOPs: the FLOP model's "
          f"matmul work as in the main table, XLA's count for gate and gate_bwd; bytes: XLA's count; XLA counts a "
          f"loop's body once)")
    dims = _chunk_dims(shape)
    print(f"the chunks' products as one batched dot ({dims[0]} of [{dims[1]},{dims[2]}]@[{dims[2]},{dims[3]}]; XLA:CPU "
          f"runs it on one core): {chunk_dot_gflops(*dims):.1f} GFLOP/s (a stage's GFLOP/s over it: the per-core reading "
          f"of %mm)")
    print(STAGE_HEAD, flush=True)
    first = {}
    rows = bench_stages(shape, reps, pipes, lambda r: print(format_stage_row(r, first, mm), flush=True))
    if "reference" in pipes:
        for r in bench_glue(shape, reps, rows):
            print(format_stage_row(r, first, mm), flush=True)
    return 1 if any(r["time_s"] is None for r in rows) else 0


def _profile_main(shape: Shape, reps: int, pipes: dict, memory: str) -> int:
    """``--profile``: each pipeline's forward and training step (the main table's programs)
    traced over ``reps`` calls, their operations summed by kind (``kdax.bench._profile``)."""
    print(f"kdax profile on {machine()}, {memory}; B={shape.B} T={shape.T} H={shape.H} HV={shape.HV} K={shape.K} "
          f"V={shape.V} chunk={shape.chunk_size} float32: XLA's operations in a jax.profiler trace of {reps} calls, "
          f"per call (ms, operations)", flush=True)
    args, w = make_inputs(shape), cotangent(shape)
    profiles = {}
    for pname, pipe in pipes.items():
        for kind, f in zip(("fwd", "fwd+bwd"), kdax_paths(shape, pipe, w)):
            profiles[f"{pname} {kind}"] = profile(compiled(f, args)[0], args, reps)
    print(format_profiles(profiles))
    return 0


def main(argv=None) -> int:
    """``python -m kdax.bench [options]`` (``--help`` lists them); returns the exit status:
    1 when a path failed or disagrees with the float64 reference."""
    p = _parser()
    a = p.parse_args(argv)
    a.HV = a.H if a.HV is None else a.HV
    if a.HV % a.H:
        p.error(f"--HV {a.HV} must be a multiple of --H {a.H} (grouped value heads).")
    if a.chunk_size not in (16, 32, 64, 128):
        p.error(f"--chunk_size: expected 16, 32, 64 or 128, got {a.chunk_size}.")
    if a.host_devices > 1:
        if a.stages or a.profile:
            p.error("--host-devices: the main table and --sweep only (--stages and --profile run on one device).")
        if a.H % a.host_devices or a.HV % a.host_devices:
            p.error(f"--host-devices {a.host_devices} must divide --H {a.H} and --HV {a.HV} (heads are split).")
        if not _backends_created():
            jax.config.update("jax_num_cpu_devices", a.host_devices)
        elif len(jax.devices("cpu")) < a.host_devices:
            p.error(f"--host-devices {a.host_devices}: JAX's CPU backend exists already in this process with "
                    f"{len(jax.devices('cpu'))} device(s); run python -m kdax.bench in a fresh process.")
    avail = pipelines()  # (after the devices are set: building a pipeline may start JAX's backend)
    if unknown := [n for n in a.pipelines.split(",") if n not in avail]:
        p.error(f"--pipelines: unknown {unknown}; expected a comma list of {', '.join(avail)}.")
    # A process setting, as a careful user makes it (kdax._platform): every path alike,
    # made before JAX's first computation (it sets how XLA:CPU dispatches programs).
    reused = not a.fresh_memory and reuse_freed_memory()
    memory = "freed memory reused, programs run on the calling thread" if reused else "fresh memory each call"
    if a.host_devices > 1:
        memory += f", heads split over {a.host_devices} host devices"
    log = Log(not a.quiet)
    pipes = {n: avail[n] for n in a.pipelines.split(",")}
    shape = Shape(**{k: getattr(a, k) for k in dataclasses.asdict(Shape())})
    if a.stages:
        return _stages_main(shape, a.reps, pipes, memory)
    if a.profile:
        return _profile_main(shape, a.reps, pipes, memory)
    log("timing a large float32 matmul (the FLOP-rate yardstick)")
    mm = matmul_gflops()
    meta = dict(machine=machine(), matmul_gflops=mm, reps=a.reps, heavy_reps=a.heavy_reps,
                date=time.strftime("%Y-%m-%d"), memory=memory)
    print(f"kdax benchmark on {meta['machine']}, {memory}; large float32 matmul: {mm:.1f} GFLOP/s (measured again after the "
          "runs; the best counts)", flush=True)
    opts = dict(baselines=not a.no_baselines, log=log, slow_baselines=a.slow_baselines, heavy_reps=a.heavy_reps,
                devices=a.host_devices)
    if a.sweep:
        rows = []
        for T in [512, 1024, 2048, 4096, 8192, 16384]:
            rows += bench_shape(dataclasses.replace(shape, T=T), a.reps, pipes, check=False, **opts)
    else:
        rows = bench_shape(shape, a.reps, pipes, check=True, **opts)
    rows = with_ratios(rows)
    # The machine's matmul speed drifts; the better of two measurements keeps %mm conservative.
    log("timing the matmul again")
    mm = meta["matmul_gflops"] = max(mm, matmul_gflops())
    dims = _chunk_dims(shape)
    bd = meta["chunk_dot_gflops"] = max(chunk_dot_gflops(*dims) for _ in range(2))
    meta["wall_s"] = round(time.perf_counter() - log.t0, 1)
    print(f"large float32 matmul, best of before and after: {mm:.1f} GFLOP/s; the chunks' products as one batched dot "
          f"({dims[0]} of [{dims[1]},{dims[2]}]@[{dims[2]},{dims[3]}], as the stages run them; XLA:CPU runs it on one "
          f"core): {bd:.1f} GFLOP/s (GFLOP/s over it: the per-core reading of %mm)")
    print(f"B={shape.B} H={shape.H} HV={shape.HV} K={shape.K} V={shape.V} chunk={shape.chunk_size} float32; "
          "max err: against the float64 recurrence (outputs; all input gradients of sum(o * w), w random); "
          "reps: timed runs (median)")
    print(format_table(rows, mm))
    if a.out:
        written = write_results(rows, meta, a.out)
        print("written: " + ", ".join(written))
    print(f"done in {meta['wall_s']:.1f} s")
    bad = [r for r in rows if r["max_err"] is not None and not (r["max_err"] < 1e-2)]
    if bad:
        print("ERROR: chunk_kda disagrees with the float64 reference", file=sys.stderr)
    failed = [r for r in rows if r["time_s"] is None]
    return 1 if bad or failed else 0
