"""How long kdax.testing's checks take (issue 49 item 4): ``check_stage`` on every
reference stage with the default matrix (every dtype, every layout and option) and
``check_pipeline`` on the reference pipeline, float64.

    python benchmarks/check_times.py --out benchmarks/results/check_times.txt

Each measurement runs in a fresh process (``--one FIELD``), so that it pays every compile
it needs, and the load of the machine (1-minute load average, before and after) is
printed beside it: on a shared machine the times scale with it. Beside the wall time, the
process's CPU time (user + system, every thread: the checks compile on two worker
threads while the main one traces), which a shared machine inflates less. A
``check_stage`` records the reference pipeline's arguments for each case up to the stage
it checks (a backward stage: the forward and the backward up to it), kept for every later
``check_stage`` in that process; the "warm" section (``--warm``: every stage in one
process, after a first check of F5) shows what a process that has checked other stages
pays. ``--baseline TREE`` runs each check in another source tree too (the code before a
change), back to back, for a before/after in the same load.
"""

import argparse
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIELDS = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


def _load() -> float:
    return os.getloadavg()[0]


def one(what: str) -> None:
    """Time one check in this process: a stage field, or "pipeline"."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import kdax
    from kdax.testing import check_pipeline, check_stage

    pipe = kdax.KDAPipeline.reference()
    t, c = time.perf_counter(), time.process_time()
    report = check_pipeline(pipe) if what == "pipeline" else check_stage(getattr(pipe, what), what)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    print(f"RESULT {what} {dt:.2f} {int(report.ok)} {len(report.checks)} {dc:.2f}")


def warm() -> None:
    """Every stage once untimed (the recording), then each timed again."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import kdax
    from kdax.testing import check_stage

    pipe = kdax.KDAPipeline.reference()
    t, c = time.perf_counter(), time.process_time()
    check_stage(pipe.output, "output")
    print(f"RECORD {time.perf_counter() - t:.2f} {time.process_time() - c:.2f}")
    for f in FIELDS:
        t, c = time.perf_counter(), time.process_time()
        report = check_stage(getattr(pipe, f), f)
        print(f"RESULT {f} {time.perf_counter() - t:.2f} {int(report.ok)} {len(report.checks)} "
              f"{time.process_time() - c:.2f}")


def _run_one(what: str, tree: str):
    """``(wall s, cpu s, ok, rows, load before, load after)`` of ``what`` in a fresh process
    with ``tree``'s kdax, or ``(error line,)``."""
    l0 = _load()
    out = subprocess.run([sys.executable, __file__, "--one", what, "--tree", tree], capture_output=True, text=True)
    l1 = _load()
    res = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if not res:
        return (f"FAILED: {out.stderr.strip().splitlines()[-1:]}",)
    _, _, dt, ok, n, cpu = res[0].split()
    return float(dt), float(cpu), ok == "1", int(n), l0, l1


def _cells(r) -> str:
    if len(r) == 1:
        return r[0]
    dt, cpu, ok, n, l0, l1 = r
    return f"{dt:>8.1f}{cpu:>8.1f}{f'{l0:.1f} -> {l1:.1f}':>14}{'yes' if ok else 'NO':>4}{n:>6}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--fields", default=",".join(FIELDS))
    ap.add_argument("--out")
    ap.add_argument("--tree", default=ROOT, help="the source tree whose kdax is measured")
    ap.add_argument("--baseline", help="another source tree (the code before a change): each check runs in both, "
                                       "back to back, alternating which goes first (the same load for both)")
    ap.add_argument("--no-warm", action="store_true", help="skip the one-process (warm) measurement")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    if a.one:
        return one(a.one)
    if a.warm:
        return warm()
    import jax

    head = f"{'wall s':>8}{'cpu s':>8}{'load':>14}{'ok':>4}{'rows':>6}"
    lines = [f"kdax.testing check times ({time.strftime('%Y-%m-%d %H:%M')}): {platform.machine()} CPU, "
             f"{os.cpu_count()} cores, python {platform.python_version()}, jax {jax.__version__}",
             "(other work shared the machine: the 1-minute load average before and after each run is given;"
             " on 2 cores a load of L slows a run by about max(1, L / 2); cpu: the process's user + system"
             " time, every thread, less inflated by the load than the wall time)",
             "", f"{'check':<22}" + (f"{'before: ' + head.strip():>40}  |  after:" if a.baseline else head)]
    print("\n".join(lines), flush=True)
    for i, what in enumerate(a.fields.split(",") + ["pipeline"]):
        name = "check_pipeline" if what == "pipeline" else f"check_stage {what}"
        if a.baseline:
            trees = [a.baseline, a.tree] if i % 2 == 0 else [a.tree, a.baseline]
            got = {t: _run_one(what, t) for t in trees}
            line = f"{name:<22}{_cells(got[a.baseline])}  |  {_cells(got[a.tree])}"
        else:
            line = f"{name:<22}{_cells(_run_one(what, a.tree))}"
        lines.append(line)
        print(line, flush=True)
    if not a.no_warm:
        l0 = _load()
        out = subprocess.run([sys.executable, __file__, "--warm", "--tree", a.tree], capture_output=True, text=True)
        l1 = _load()
        lines += ["", f"warm: one process, the output stage checked first (load {l0:.1f} -> {l1:.1f})"]
        for ln in out.stdout.splitlines():
            if ln.startswith("RECORD"):
                _, dt, cpu = ln.split()
                lines.append(f"  first check_stage (output): {float(dt):.1f} s wall, {float(cpu):.1f} s cpu")
            elif ln.startswith("RESULT"):
                _, f, dt, ok, n, cpu = ln.split()
                lines.append(f"  check_stage {f:<12}{float(dt):>6.1f} s wall {float(cpu):>6.1f} s cpu  "
                             f"ok={ok == '1'}  rows={n}")
        print("\n".join(lines[-13:]), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
