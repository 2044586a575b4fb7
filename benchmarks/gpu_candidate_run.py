"""The GPU run of kdax's Triton candidates in one command: kdax's default, the all-Triton
candidate, the cost model's fastest tuning and the Triton pipeline's default tuning beside
FLA at the three shapes and the layer (first written for issue 26; the candidates of
issue 53).

Writes, under ``--out`` (``$OUT/gpu`` on the device machine; copy it to
``benchmarks/results/gpu_<card>/triton_candidates/``):

* ``results.json`` / ``results.txt`` / ``results.png``: ``chunk_kda`` at (B, T, H) =
  (1, 16384, 16) (the goal shape), (1, 4096, 16) and (4, 4096, 32), K = V = 128, bf16,
  chunk 64, Kimi Linear's options: kdax's default pipeline, the same with
  ``disable_recompute=True`` (issue 26 item 4: h and v_new saved by the forward against
  recomputed in B0), any ``--extra-pipes``, and FLA's ``chunk_kda``; forward and
  training step, errors against a float64 reference under FLA's tolerances, memory
  (``gpu_vs_fla.py``'s docstring says how each figure is measured);
* ``layer.json`` / ``layer.txt``: ``kdax.nn.KimiDeltaAttention`` beside FLA's layer
  (``layer_vs_fla.py``);
* ``run.json`` (every step: status, exit code, seconds, limit) and ``logs.txt`` (every
  step's output): 7 files, within what a device call brings back (8).

Each step is a process of its own under its own time limit, so one that hangs leaves
the others their time; FLA runs in processes without JAX (``fla_side.py``). At the goal
shape every kdax path has its own process, so each path's peak memory is its own (JAX
cannot reset the device's peak); at the other shapes both paths share one process (the
second path's peak is marked). The whole run keeps to ``--total`` seconds (default 420):
a step starts only if its expected time fits in what is left (less ``REPORT_S`` kept for
the two report steps, which always run), and its limit is cut to what is left. The
first call's order puts the goal shape first (kdax's default, the all-Triton
``CANDIDATE``, the cost model's fastest ``CANDIDATE_BEST`` and the Triton pipeline's
default tuning ``TRITON_DEFAULT``), then (1, 4096, 16) with FLA at both,
then the layer; the largest shape is the second call's (``--second``); steps skipped for
time are listed in ``run.json`` and can be run by a later call with ``--only``. A step whose inputs an earlier step did not write is
skipped; a kdax step finding its shape's reference already written (an earlier call on
the same machine) loads it instead of recomputing it.

Budget (seconds; "expect" is an estimate for a bare H100/H200 with cold compile caches,
from the H200 run of session 7: kdax's reference path 13 s of compiling (forward 5.6,
step 7.6) and 16 s in all per path at the goal shape, its float64 reference 16.5 s as
two programs (one now), FLA's first calls 60 s with autotuning cut to 4 configs; plus
~5 s to start each process. XLA's programs are kept in a compilation cache under
``--work``, so the no_recompute path's forward, the same program as the default's, is
compiled once per shape)::

    step                                  expect  limit
    kdax 1x16384x16 default + reference       40     90
    kdax 1x16384x16 CANDIDATE (all Triton)    60    100   (compiling ten Triton kernels)
    kdax 1x16384x16 CANDIDATE_BEST            45     80
    kdax 1x16384x16 TRITON_DEFAULT            45     80
    each --extra-pipes path at the goal       20     50
    kdax 1x4096x16 both paths + reference     35     70
    FLA at 1x16384x16 and 1x4096x16           80    110
    layer, kdax's side + float64 reference    45     80
    layer, FLA's side                         50     80
    reports (chunk table, layer table)         8     25   (kept aside: REPORT_S)
    total                                    408    715   (cut to --total 420)

    second call (--second), right after:
    kdax 4x4096x32 both paths + reference     65    110
    FLA at 4x4096x32                          25     60
    kdax 1x16384x16 default+no_recompute      20     50
    each --extra-pipes path at the goal       25     60
    reports                                    8     25

So a first run takes about 7 minutes and stops itself by 7; if the estimates are low,
the last steps (the layer) are the ones left for the second call (``--only layer``).

The orchestrator itself needs the standard library only (it holds no GPU).

    python benchmarks/gpu_candidate_run.py --dry-run          # the plan, nothing run
    python benchmarks/gpu_candidate_run.py --rehearse         # every step at tiny sizes, here (FLA's fail without torch)
    bash benchmarks/gpu_candidate_run.sh                      # on the GPU machine (see its header)
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOAL = (1, 16384, 16)
SHAPES = (GOAL, (1, 4096, 16), (4, 4096, 32))
PIPES = ("default", "default+no_recompute")
# Every stage a Triton kernel, bf16 operands in the recurrences, tensor-core float32
# products, the state kernels as FLA holds its state (64-row tiles) with the next chunk's
# loads in flight: the candidate whose kernels compile for sm_90 without spills in the
# state and gate kernels (benchmarks/results/triton_resources.txt), timed at the goal shape.
CANDIDATE = "pallas+warps=8+f32dot=tf32x3+fast+stages=2+block_k=64"
# The candidate as the cost model finds it fastest (results/gpu_cost_model.txt): F2 and
# B4 at sixteen warps (no spills under "fast"; their instructions a warp 6.4k -> 4.9k and
# 7.8k -> 3.9k) and the state kernels F4 and B2 at 32 value columns a program (64 programs
# at the goal shape, not 32, on 132 SMs; FLA's fwd_h and bwd_dhu autotune 32 or 64):
# timed and profiled beside it by ``--kernels``.
CANDIDATE_BEST = CANDIDATE + "+warps.intra=16+warps.intra_bwd=16+block_v=32"
# What KDAPipeline.pallas("triton") gives: the default tuning (kdax.pallas.TUNINGS["default"]),
# precision "auto" (gpu_vs_fla.py's path name "triton").
TRITON_DEFAULT = "triton"
# The first call times these at the goal shape after kdax's default, each in its own process.
GOAL_PIPES = (CANDIDATE, CANDIDATE_BEST, TRITON_DEFAULT)
TOTAL_S = 420
# --tests: the files whose ``device`` cases compile kdax's Pallas kernels for the GPU present
DEVICE_TESTS = ("tests/pallas/test_stages.py", "tests/pallas/test_pipeline.py")
REPORT_S = 25  # kept for the report steps, which always run
FLA_CONFIGS = 4  # FLA's autotuning cut to this many configs per kernel, as in every earlier run
# --rehearse: the same steps at tiny sizes, on any machine (the plumbing, not the numbers)
TINY_SHAPES = ((1, 64, 2), (1, 32, 2), (2, 32, 2))
TINY_KDAX = ("--K", "32", "--V", "32")
TINY_LAYER = ("--T", "32", "--hidden", "16", "--heads", "2", "--head-dim", "8", "--chunk", "16")


def tag(shape) -> str:
    return "x".join(str(n) for n in shape)


@dataclasses.dataclass
class Step:
    """One process of the run: ``argv`` under ``limit_s`` seconds (cut to the time left);
    ``expect_s``, what it is expected to take (it starts only if that fits);
    ``report``: a report step, run from the time kept aside whatever is left."""

    name: str
    argv: list
    limit_s: int
    expect_s: int
    shapes: tuple = ()
    pipes: tuple = ()
    fla: bool = False
    report: bool = False
    needs: tuple = ()  # files of which at least one must exist for the step to start


def plan(work: Path, out: Path, py: str = sys.executable, extra_pipes=(), reps: int = 20,
         reps_other: int = 10, shapes=SHAPES, kdax_args=(), layer_args=(), slack: int = 1,
         second: bool = False, kernels: bool = False, tests: bool = False, profile_args=()) -> list:
    """The steps in the order they run (see the module docstring for the budget);
    ``second``: the second call's steps (the largest shape), else the first call's;
    ``kernels``: the candidate and ``CANDIDATE_BEST`` at the goal shape, FLA with its
    per-kernel profile, the two candidates' per-kernel profiles (``--kernels``, ~4.5 minutes);
    ``shapes`` (the goal shape first), ``kdax_args``, ``layer_args`` and ``slack`` (every
    limit multiplied: a CPU is slower to compile) change only for a rehearsal;
    ``tests``: the suite's ``device`` cases, every Pallas stage and the all-Pallas pipeline
    on every golden case compiled for the GPU (``DEVICE_TESTS``), the evidence behind
    ``default_pipeline()``'s Triton kernels on a GPU (``--tests``; passed in session 66; the
    tunings', ``segmented``'s and ``shard_map``'s cases in session 67)."""
    work, out = Path(work), Path(out)
    if tests:  # (addopts off: no xdist on the GPU machine; the slow sweeps left out as in CI)
        argv = [py, "-m", "pytest", *(str(HERE.parent / f) for f in DEVICE_TESTS), "-k", "device", "-m", "not slow",
                "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={out / 'device_tests.xml'}"]
        # (session 66, an H200: the 26 stage cases 90 s, the 22 pipeline cases and 3 stage cases 126 s;
        # session 67: the tunings', segmented's and shard_map's 16 cases and 15 stage cases 114 s. About
        # 67 cases since, ~300 s: the limit holds them, with little room)
        return [Step("device-tests", argv, 390 * slack, 300)]
    goal, small, large = shapes

    gvf, fla, lay = str(HERE / "gpu_vs_fla.py"), str(HERE / "fla_side.py"), str(HERE / "layer_vs_fla.py")
    ref = lambda s: str(work / f"ref_{tag(s)}.npz")

    def kdax(shape, pipes, n, limit, expect, load=False):  # load: the reference an earlier step saved
        argv = [py, gvf, "--shapes", tag(shape), "--pipes", ",".join(pipes), "--no-fla", "--reps", str(n),
                "--budget", str(limit * slack), "--out", str(out), *kdax_args]
        argv += ["--load-ref", ref(shape)] if load else ["--save-ref", ref(shape)]
        name = f"kdax-{tag(shape)}" + (f"-{pipes[0]}" if shape == goal else "")
        return Step(name, argv, limit, expect, (shape,), tuple(pipes))

    def fla_step(shapes, limit, expect):
        argv = [py, fla, "--out", str(out), "--reps", str(reps if goal in shapes else reps_other),
                "--max-configs", str(FLA_CONFIGS)]
        for s in shapes:
            argv += ["--ref", ref(s)]
        return Step("fla-" + "-".join(tag(s) for s in shapes), argv, limit, expect, tuple(shapes), ("fla",), fla=True,
                    needs=tuple(ref(s) for s in shapes))

    reports = [Step("report-chunk", [py, gvf, "--shapes", "", "--no-fla", "--out", str(out)], 15, 6, report=True),
               Step("report-layer", [py, lay, "--report", "--work", str(work), "--out", str(out)], 10, 2, report=True)]
    if kernels:  # the candidate's kernels beside FLA's, each profiled (issue 36)
        prof = str(HERE / "gpu_profile.py")
        fla = fla_step((goal,), 130, 85)
        fla.argv += ["--profile", "5"]
        both = (CANDIDATE, CANDIDATE_BEST)
        steps = [kdax(goal, list(both), reps, 150, 80), fla,
                 Step("profile-" + CANDIDATE, [py, prof, "--shape", tag(goal), "--pipes", ",".join(both), "--reps", "5",
                                               "--out", str(out / "profile.txt"), *profile_args], 130, 60,
                      (goal,), both),
                 reports[0]]
        return [dataclasses.replace(s, limit_s=s.limit_s * slack) for s in steps]
    if second:  # (with the default's disable_recompute row at the goal shape)
        steps = [kdax(large, PIPES, reps_other, 110, 65), fla_step((large,), 60, 25),
                 kdax(goal, [PIPES[1]], reps, 50, 20, load=True)]
        steps += [kdax(goal, [p], reps, 60, 25, load=True) for p in extra_pipes]
        return [dataclasses.replace(s, limit_s=s.limit_s * slack) for s in steps + reports]
    steps = [kdax(goal, [PIPES[0]], reps, 90, 40)]
    # Triton compiles ten kernels for the candidate (~30 s on the CPU here, to cubins); the
    # fastest tuning and the default tuning compile theirs after it (the rest cached)
    steps += [kdax(goal, [p], reps, *((100, 60) if p == CANDIDATE else (80, 45)), load=True) for p in GOAL_PIPES]
    steps += [kdax(goal, [p], reps, 50, 20, load=True) for p in extra_pipes]
    steps += [kdax(small, PIPES, reps_other, 70, 35),
              fla_step((goal, small), 110, 80),
              Step("layer-kdax", [py, lay, "--work", str(work), "--out", str(out), "--reps", str(reps_other),
                                  *layer_args], 80, 45),
              Step("layer-fla", [py, fla, "--layer", str(work / "layer_in.npz"), "--out", str(out), "--reps",
                                 str(reps_other), "--max-configs", str(FLA_CONFIGS)], 80, 50, fla=True,
                   needs=(str(work / "layer_in.npz"),)),
              *reports]
    return [dataclasses.replace(s, limit_s=s.limit_s * slack) for s in steps]


def describe(steps: list, total_s: int) -> str:
    """The plan as text (``--dry-run``)."""
    lines = [f"{'step':<38} {'expect s':>8} {'limit s':>8}  shapes / paths"]
    for s in steps:
        what = ", ".join(tag(x) for x in s.shapes) + (f": {', '.join(s.pipes)}" if s.pipes else "")
        lines.append(f"{s.name:<38} {s.expect_s:>8} {s.limit_s:>8}  {what or '-'}")
    work = [s for s in steps if not s.report]
    lines.append(f"expected {sum(s.expect_s for s in steps)} s in all; the run keeps to {total_s} s, "
                 f"{REPORT_S} s of it for the reports (limits sum to {sum(s.limit_s for s in work)} s "
                 f"+ {sum(s.limit_s for s in steps if s.report)} s)")
    lines += ["", "commands:"] + [f"  [{s.name}] {' '.join(s.argv)}" for s in steps]
    return "\n".join(lines)


def run_step(argv, limit_s: float, log: Path, env: dict):
    """``(exit code or None if stopped at its limit, seconds)``: ``argv`` in a process
    group of its own (so a step's children end with it), output to ``log``."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)  # the group this call started, by its id
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = None
    return rc, time.monotonic() - t0


def run(steps: list, total_s: float, results: Path, logs: Path, env: dict, runner=run_step, clock=time.monotonic,
        sync=None) -> list:
    """Run ``steps`` in order within ``total_s`` seconds; returns (and writes to
    ``results/run.json``) one record per step. ``runner`` and ``clock`` are replaceable
    (the tests run the deadline logic without processes)."""
    t0 = clock()
    done = []
    logs.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    for s in steps:
        left = total_s - (clock() - t0)
        if s.report:
            limit = s.limit_s
        else:
            left -= REPORT_S
            why = None
            if s.needs and not any(Path(n).exists() for n in s.needs):
                why = f"skipped: needs {' or '.join(s.needs)}, which an earlier step did not write"
            elif left < s.expect_s:
                why = (f"skipped: {max(0, left):.0f} s left of the run's {total_s:.0f} s (less {REPORT_S} s kept "
                       f"for the reports), expected {s.expect_s} s")
            if why:
                rec = dict(name=s.name, status=why, rc=None, seconds=0.0, limit_s=0)
                done.append(rec)
                _record(rec, results, done, logs, None)
                continue
            limit = min(s.limit_s, left)
        log = logs / f"{s.name}.log"
        rc, secs = runner(s.argv, limit, log, env)
        status = "ok" if rc == 0 else (f"stopped at its limit ({limit:.0f} s)" if rc is None else f"failed (exit {rc})")
        rec = dict(name=s.name, status=status, rc=rc, seconds=round(secs, 1), limit_s=round(limit))
        done.append(rec)
        _record(rec, results, done, logs, log)
        if sync:
            sync()
    return done


def _record(rec: dict, results: Path, done: list, logs: Path, log) -> None:
    """Print the step's outcome and the end of its log; append the log to ``logs.txt``;
    rewrite ``run.json``."""
    print(f"== {rec['name']}: {rec['status']} in {rec['seconds']} s", flush=True)
    text = Path(log).read_text(errors="replace") if log and Path(log).exists() else ""
    tail = [ln for ln in text.splitlines() if ln.strip() and "arning" not in ln and "warn(" not in ln][-12:]
    if tail:
        print("\n".join(tail), flush=True)
    with open(results / "logs.txt", "a") as f:
        f.write(f"\n===== {rec['name']}: {rec['status']} in {rec['seconds']} s =====\n{text}")
    (results / "run.json").write_text(json.dumps(dict(steps=done), indent=1))


def with_ref_found(argv: list) -> list:
    """``argv`` with ``--save-ref P`` turned into ``--load-ref P`` where P exists (written
    by an earlier call on this machine: not recomputed), and ``--load-ref P`` into
    ``--save-ref P`` where it does not (the step that should have written it failed)."""
    argv = list(argv)
    for i, a in enumerate(argv[:-1]):
        if a in ("--save-ref", "--load-ref"):
            argv[i] = "--load-ref" if Path(argv[i + 1]).exists() else "--save-ref"
    return argv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "device_out"), "gpu"),
                    help="where the results are copied after every step (default $OUT/gpu)")
    ap.add_argument("--work", default="/tmp/kdax_gpu26",
                    help="inputs, references, outputs and the results being built; kept on a warm machine, so "
                         "a second call adds to the first one's results")
    ap.add_argument("--total", type=float, default=None, help=f"seconds for the whole run (default {TOTAL_S}; "
                    f"three times that with --rehearse)")
    ap.add_argument("--extra-pipes", default="", help="more kdax paths at the goal shape, comma-separated "
                    "(gpu_vs_fla.py's names, e.g. default+fast,reference+pallas_state+warps=8)")
    ap.add_argument("--only", default="", help="run only the steps whose names contain one of these "
                    "comma-separated words (the report steps always run), e.g. layer,4x4096x32")
    ap.add_argument("--fla-layers", default=os.environ.get("FLA_LAYERS_PATH", ""),
                    help="a folder added to PYTHONPATH for the layer's FLA step only (flash-linear-attention: "
                         "fla.layers, which imports transformers; kept away from the chunk_kda steps)")
    ap.add_argument("--second", action="store_true", help="the second call's steps: the largest shape "
                    "(kdax's two paths, FLA) and any --extra-pipes at the goal shape")
    ap.add_argument("--kernels", action="store_true", help="the per-kernel call (issue 36): the all-Triton "
                    "candidate at the goal shape with its float64 check, FLA's chunk_kda beside it with FLA's "
                    "per-kernel profile (fla_profile_<shape>.txt), the candidate's per-kernel profile (profile.txt)")
    ap.add_argument("--tests", action="store_true", help="the suite's device cases (DEVICE_TESTS -k device): "
                    "every Pallas stage and the all-Pallas pipeline on every golden case, compiled for the GPU; "
                    "needs pytest (carried as wheels by --prepare); ~4-6 minutes")
    ap.add_argument("--fresh", action="store_true", help="forget what an earlier call left in --work")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--rehearse", action="store_true", help="the same steps at tiny sizes (K = V = 32, a layer of "
                    "hidden 16), to check the plumbing on any machine; the numbers mean nothing")
    a = ap.parse_args(argv)
    a.total = a.total or TOTAL_S * (3 if a.rehearse else 1)
    work, out = Path(a.work), Path(a.out)
    results = work / "gpu"
    extra = tuple(p for p in a.extra_pipes.split(",") if p)
    tiny = dict(shapes=TINY_SHAPES, kdax_args=TINY_KDAX, layer_args=TINY_LAYER, reps=2, reps_other=2, slack=3,
                profile_args=("--reps", "1"))
    steps = plan(work, results, extra_pipes=extra, second=a.second, kernels=a.kernels, tests=a.tests, **(tiny if a.rehearse else {}))
    if a.only:
        words = [w for w in a.only.split(",") if w]
        steps = [s for s in steps if s.report or any(w in s.name for w in words)]
    if a.dry_run:
        print(describe(steps, a.total))
        return steps
    if a.fresh and work.exists():
        shutil.rmtree(work)
    results.mkdir(parents=True, exist_ok=True)
    (results / "logs.txt").unlink(missing_ok=True)  # this call's logs only
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    # XLA's compiled programs kept on disk: a second call on the same machine skips recompiling
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax_cache"))

    def sync():
        out.mkdir(parents=True, exist_ok=True)
        for f in results.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)

    def runner(argv, limit, log, env):
        argv, e = with_ref_found(argv), dict(env)
        if argv[1].endswith("fla_side.py"):
            e["TRITON_PRINT_AUTOTUNING"] = "1"
            if "--layer" in argv and a.fla_layers:
                e["PYTHONPATH"] = os.pathsep.join((a.fla_layers, e["PYTHONPATH"]))
        return run_step(argv, limit, log, e)

    done = run(steps, a.total, results, work / "logs", env, runner=runner, sync=sync)
    sync()
    for name in ("results.txt", "layer.txt"):
        if (results / name).exists():
            print((results / name).read_text())
    return done


if __name__ == "__main__":
    main()
