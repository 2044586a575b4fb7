"""How long kdax.testing's checks take (issue 49 item 4): ``check_stage`` on every
reference stage with the default matrix (every dtype, every layout and option) and
``check_pipeline`` on the reference pipeline, float64.

    python benchmarks/check_times.py --out benchmarks/results/check_times.txt

Each measurement runs in a fresh process (``--one FIELD``), so that it pays every compile
it needs, and the load of the machine (1-minute load average, before and after) is
printed beside it: on a shared machine the times scale with it. A process's first
``check_stage`` records the reference pipeline's arguments for the whole matrix (one
jitted forward and backward per case), which every later ``check_stage`` in that process
reuses; the "cold" column is a fresh process's first check of that stage, recording
included, and "warm" the same check again in a process that has already recorded
(``--warm``: every stage in one process after a first, untimed check).
"""

import argparse
import os
import platform
import subprocess
import sys
import time

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
    t = time.perf_counter()
    report = check_pipeline(pipe) if what == "pipeline" else check_stage(getattr(pipe, what), what)
    dt = time.perf_counter() - t
    print(f"RESULT {what} {dt:.2f} {int(report.ok)} {len(report.checks)}")


def warm() -> None:
    """Every stage once untimed (the recording), then each timed again."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import kdax
    from kdax.testing import check_stage

    pipe = kdax.KDAPipeline.reference()
    t = time.perf_counter()
    check_stage(pipe.output, "output")
    print(f"RECORD {time.perf_counter() - t:.2f}")
    for f in FIELDS:
        t = time.perf_counter()
        report = check_stage(getattr(pipe, f), f)
        print(f"RESULT {f} {time.perf_counter() - t:.2f} {int(report.ok)} {len(report.checks)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--fields", default=",".join(FIELDS))
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        return one(a.one)
    if a.warm:
        return warm()
    import jax

    lines = [f"kdax.testing check times ({time.strftime('%Y-%m-%d %H:%M')}): {platform.machine()} CPU, "
             f"{os.cpu_count()} cores, python {platform.python_version()}, jax {jax.__version__}",
             "(other work shared the machine: the 1-minute load average before and after each run is given;"
             " on 2 cores a load of L slows a run by about max(1, L / 2))",
             "", f"{'check':<22}{'cold s':>8}{'load':>14}{'ok':>4}{'rows':>6}"]
    print("\n".join(lines), flush=True)
    for what in a.fields.split(",") + ["pipeline"]:
        l0 = _load()
        out = subprocess.run([sys.executable, __file__, "--one", what], capture_output=True, text=True)
        l1 = _load()
        res = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
        if not res:
            line = f"{what:<22}FAILED: {out.stderr.strip().splitlines()[-1:]}"
        else:
            _, _, dt, ok, n = res[0].split()
            name = "check_pipeline" if what == "pipeline" else f"check_stage {what}"
            line = f"{name:<22}{float(dt):>8.1f}{f'{l0:.1f} -> {l1:.1f}':>14}{'yes' if ok == '1' else 'NO':>4}{n:>6}"
        lines.append(line)
        print(line, flush=True)
    l0 = _load()
    out = subprocess.run([sys.executable, __file__, "--warm"], capture_output=True, text=True)
    l1 = _load()
    lines += ["", f"warm: one process, the matrix recorded first (load {l0:.1f} -> {l1:.1f})"]
    for ln in out.stdout.splitlines():
        if ln.startswith("RECORD"):
            lines.append(f"  first check_stage (output), recording included: {float(ln.split()[1]):.1f} s")
        elif ln.startswith("RESULT"):
            _, f, dt, ok, n = ln.split()
            lines.append(f"  check_stage {f:<12}{float(dt):>6.1f} s  ok={ok == '1'}  rows={n}")
    print("\n".join(lines[-13:]), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
