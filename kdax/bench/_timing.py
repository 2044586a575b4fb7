"""Timing: medians of synchronised calls, in rounds; compiling once; the matmul yardstick;
progress lines."""

import os
import platform
import resource
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._baselines import _TrainStep


def time_fn(f: Callable, args, reps: int) -> float:
    """Median seconds of ``reps`` synchronised calls after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def best_call(f: Callable, args, reps: int) -> tuple:
    """``(wall s, CPU s of all threads, minor page faults)`` of the fastest of ``reps``
    synchronised calls, after two warm-up calls (a process's own resource usage: for
    measurements in fresh processes)."""
    for _ in range(2):
        jax.block_until_ready(f(*args))
    best = None
    for _ in range(reps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        jax.block_until_ready(f(*args))
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        row = (t1 - t0, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)
        best = row if best is None or row[0] < best[0] else best
    return best


def time_rounds(fs: list, args, reps: int) -> list:
    """Median seconds of each function over ``reps`` rounds, each round calling every
    function once (synchronised), after one warm-up call each."""
    for f in fs:
        jax.block_until_ready(f(*args))
    ts = [[] for _ in fs]
    for _ in range(reps):
        for i, f in enumerate(fs):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in ts]


def compiled(f: Callable, args):
    """``(callable, compile seconds, peak bytes)``: ``f`` (a ``jax.jit`` function or a
    ``_TrainStep``) compiled once for ``args``; the callable runs that executable."""
    t0 = time.perf_counter()
    c = f.lower(*args).compile()
    secs = time.perf_counter() - t0
    try:
        m = c.memory_analysis()
        peak = int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # some backends do not report it
        peak = None
    run = (lambda *a: c(*a, f.w)) if isinstance(f, _TrainStep) else c
    return run, secs, peak


def error_line(e: Exception) -> str:
    """An exception as one line for a table: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / time_fn(f, (a,), reps) / 1e9


def machine() -> str:
    dev = jax.devices()[0]
    return f"{platform.machine()} {os.cpu_count()} cores, {dev.platform} ({dev.device_kind}), jax {jax.__version__}"


class Log:
    """Progress lines ``[  12.3 s] what`` on stderr (seconds since the log began), so a run
    that compiles and times for a minute says what it is doing; ``enabled=False``: silent."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled, self.stream, self.t0 = enabled, stream, time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.enabled:
            stream = sys.stderr if self.stream is None else self.stream
            stream.write(f"[{time.perf_counter() - self.t0:6.1f} s] {what}\n")
            stream.flush()


quiet = Log(False)
