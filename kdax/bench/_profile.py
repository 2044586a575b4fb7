"""Where a compiled program's time goes, by kind of operation (``--profile``): XLA:CPU's own
events in a ``jax.profiler`` trace of a few calls, summed per call.

XLA:CPU records one event per operation it runs (a fusion, a dot, a copy: named after
the HLO instruction, which its ``hlo_op`` argument names) among the runtime's own events
(``ThunkExecutor::...``, ``end: ...`` markers), and a loop (``while``) as an event that
contains its body's. The leaf operations are
grouped by what their names say they compute (``KINDS``: a fusion is named after its
root operations, so ``add_concatenate_fusion`` is a concatenation). Under kdax's
YNNPACK setting on jaxlib 0.10 (``kdax._platform``) a ``ynn_fusion`` is a dot. ``busy``:
the leaf operations' time added up. An operation XLA splits over threads (a fusion given
parallel partitions, inside a loop too) is one event at its own wall time, so ``busy``
over ``wall`` counts operations that overlap, not cores: ``cores`` is the process's CPU
time (all threads, from ``getrusage``, idle spinning of XLA's pool included) over the wall
time of the traced calls. ``outside`` loops: the leaf operations that ran once a call."""

import collections
import glob
import gzip
import json
import os
import resource
import tempfile
import time
from typing import Callable

import jax

# (kind, substrings of the operation's name), the first that matches
KINDS = (
    ("dot", ("ynn_fusion", "dot", "convolution")),
    ("loop slices and updates", ("dynamic-update-slice", "dynamic-slice")),
    ("exponential", ("exponential",)),
    ("concatenate", ("concatenate",)),
    ("copy, transpose", ("copy", "transpose")),
    ("reduce", ("reduce",)),
    ("other elementwise", ("",)),
)
_CONTAINERS = ("while", "conditional", "call")


def kind(name: str) -> str:
    """The kind (``KINDS``) of an operation named ``name`` by XLA."""
    return next(k for k, parts in KINDS if any(p in name for p in parts))


def _leaf(event: dict) -> bool:
    """An operation's own event (it names its HLO instruction; not a loop, not a marker)."""
    return bool(event.get("args", {}).get("hlo_op")) and event["name"].split(".")[0] not in _CONTAINERS


def profile(fn: Callable, args, calls: int = 5) -> dict:
    """``fn(*args)`` (compiled; warmed up here) traced over ``calls`` calls: per call, ``wall``
    ms (the runtime's execute events), ``busy`` ms and ``ops`` (leaf operations),
    ``outside`` ms (those that ran once a call), ``cores`` (CPU time over wall time) and
    ``kinds`` ``{kind: (ms, ops)}``."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            raise RuntimeError("jax.profiler wrote no trace (*.trace.json.gz): nothing to summarise")
        with gzip.open(files[0]) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    per_name, count = collections.Counter(), collections.Counter()
    wall = 0.0
    for e in events:
        if e["name"].startswith("CommonPjRtLoadedExecutable::ExecuteHelper"):
            wall += e["dur"]
        elif _leaf(e):
            per_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
    kinds = collections.defaultdict(lambda: [0.0, 0])
    for name, us in per_name.items():
        kinds[kind(name)][0] += us / calls / 1e3
        kinds[kind(name)][1] += count[name] // calls
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return dict(wall=wall / calls / 1e3, busy=sum(per_name.values()) / calls / 1e3, cores=cpu / (t1 - t0),
                ops=sum(count.values()) // calls,
                outside=sum(us for n, us in per_name.items() if count[n] == calls) / calls / 1e3,
                kinds={k: tuple(kinds[k]) for k, _ in KINDS if k in kinds})


def format_profiles(profiles: dict) -> str:
    """A table of ``profile`` results ``{path name: profile}``, one column pair per path."""
    names = list(profiles)
    head = f"{'':<24}" + "".join(f"{n:>20}" for n in names)
    unit = f"{'kind':<24}" + "".join(f"{'ms':>12}{'ops':>8}" for _ in names)
    rows = [head, unit, "-" * len(unit)]
    for k, _ in KINDS:
        cells = [profiles[n]["kinds"].get(k, (0.0, 0)) for n in names]
        rows.append(f"{k:<24}" + "".join(f"{ms:12.1f}{ops:8d}" for ms, ops in cells))
    rows.append("-" * len(unit))
    for label, key in (("busy (leaf operations)", "busy"), ("outside loops", "outside"), ("wall (a call)", "wall")):
        rows.append(f"{label:<24}" + "".join(f"{profiles[n][key]:12.1f}" + (
            f"{profiles[n]['ops']:8d}" if key == "busy" else " " * 8) for n in names))
    rows.append(f"{'overlap (busy / wall)':<24}" + "".join(f"{profiles[n]['busy'] / profiles[n]['wall']:12.2f}"
                                                          + " " * 8 for n in names))
    rows.append(f"{'cores (CPU time / wall)':<24}" + "".join(f"{profiles[n]['cores']:12.2f}" + " " * 8 for n in names))
    return "\n".join(rows)
