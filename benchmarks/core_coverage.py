"""What moving tests out of the default run (to ``-m slow``) would cost the fast core: the
kdax lines that only those tests execute, and the worker-seconds they take. Session 43's
cut of the core (``tests/conftest.py``, ``CORE_CASES``) was chosen with it: no line lost.

    pip install pytest-cov   # (coverage.py's contexts through xdist's workers)
    COVERAGE_FILE=/tmp/core.cov pytest --cov=kdax --cov-context=test --cov-report= \
        --durations=0 > /tmp/core.log   # the default run, a context per test (~1.3x its time)
    python benchmarks/core_coverage.py /tmp/core.cov /tmp/core.log moved.txt

``moved.txt``: one test id a line. A line with ``[`` is a prefix of case ids
(``tests/test_x.py::test_y[float32`` names every float32 case); one without it names a
test function, all its cases. Lines starting with ``#`` are ignored.

Line coverage is a floor, not the whole check: two cases that trace the same lines can
check different numbers (a dtype, a kernel's data), so a case still moves only when it
repeats a check the core keeps. A test that runs a subprocess shows no kdax lines here."""

import collections
import linecache
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lines_per_test(path: str) -> dict:
    """``{test id: {(file under kdax/, line)}}`` from a coverage file with test contexts."""
    import coverage  # (not a kdax dependency: only this script reads its files)

    data = coverage.CoverageData(basename=path)
    data.read()
    out = collections.defaultdict(set)
    for f in data.measured_files():
        short = f.split("/kdax/", 1)[-1]
        for line, contexts in data.contexts_by_lineno(f).items():
            for c in contexts:
                if c:  # ("" is code run outside any test: imports, collection)
                    out[c.rsplit("|", 1)[0]].add((short, line))
    return out


def durations(log: str) -> dict:
    """``{test id: seconds}`` (setup, call and teardown) from pytest's ``--durations=0``."""
    out = collections.Counter()
    for line in Path(log).read_text().splitlines():
        m = re.match(r"^([0-9.]+)s (?:call|setup|teardown) +(\S.*)$", line.strip())
        if m:
            out[m.group(2)] += float(m.group(1))
    return out


def moves(test: str, pattern: str) -> bool:
    return test.startswith(pattern) if "[" in pattern else test.split("[")[0] == pattern


def report(lines: dict, secs: dict, patterns: list) -> list:
    """The report's lines: what moving the tests ``patterns`` name costs the core."""
    tests = set(lines) | set(secs)
    out = [f"no test matches {p!r}" for p in patterns if not any(moves(t, p) for t in tests)]
    moved = {t for t in tests if any(moves(t, p) for p in patterns)}
    kept = set().union(*(lines[t] for t in tests - moved if t in lines))
    lost = collections.defaultdict(set)
    for t in moved:
        for at in lines.get(t, ()):
            if at not in kept:
                lost[at].add(t)
    out.append(f"{len(moved)} tests move: {sum(secs.get(t, 0) for t in moved):.0f} of {sum(secs.values()):.0f} "
               f"worker-seconds; {len(lost)} kdax lines only they execute")
    for (f, n), ts in sorted(lost.items()):
        src = linecache.getline(str(ROOT / "kdax" / f), n).strip()
        out.append(f"  kdax/{f}:{n}  {src[:80]}  <- {min(ts)}" + (f" (+{len(ts) - 1})" if len(ts) > 1 else ""))
    return out


def main(cov: str, log: str, moved_file: str):
    patterns = [p for p in Path(moved_file).read_text().splitlines() if p.strip() and p[0] != "#"]
    print("\n".join(report(lines_per_test(cov), durations(log), patterns)))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
