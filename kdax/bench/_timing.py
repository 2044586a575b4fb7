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
from .._platform import ynn_fusion_types


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


def chunk_dot_gflops(batch: int, C: int, K: int, V: int, reps: int = 5) -> float:
    """GFLOP/s of ``batch`` float32 products ``[C, K] @ [K, V]`` as one batched dot: a chunk's
    ``qg h`` for every chunk and head, the form every per-chunk product of the stages takes.
    The second yardstick beside the large matmul: XLA:CPU runs a batched dot on one core
    (benchmarks/NOTES.md, "Batched dots run on one core")."""
    r = np.random.default_rng(0)
    a, b = (jnp.asarray(r.normal(size=(batch,) + s), jnp.float32) for s in ((C, K), (K, V)))
    f = jax.jit(lambda a, b: a @ b)
    return 2 * batch * C * K * V / time_fn(f, (a, b), reps) / 1e9


def machine() -> str:
    """The machine a table's numbers come from: ``x86_64 AMD EPYC (AVX2) 2 cores, cpu (cpu),
    jax 0.10.2``. The CPU's model and widest vector extension tell apart hosts that share a
    name: the same 2-core "AMD EPYC" ran a large float32 matmul at ~480 GFLOP/s with AVX-512
    and ~150 with AVX2 (benchmarks/NOTES.md). On a CPU, the YNNPACK fusion types set in
    XLA_FLAGS follow (``, YNNPACK fusions individual_dot,dot``: kdax's own on jaxlib 0.10, or
    the user's), which move the time of the same program by 10-25% in either direction
    (benchmarks/ynn_fusions.py)."""
    dev = jax.devices()[0]
    cpu = " ".join(p for p in _cpu() if p)
    ynn = ynn_fusion_types() if dev.platform == "cpu" else None
    return (f"{platform.machine()}{' ' + cpu if cpu else ''} {os.cpu_count()} cores, {dev.platform} "
            f"({dev.device_kind}), jax {jax.__version__}" + ("" if ynn is None else f", YNNPACK fusions {ynn or 'none'}"))


_VECTOR_EXTENSIONS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE"), ("asimd", "NEON"))


def _cpu(cpuinfo: str = "/proc/cpuinfo") -> tuple:
    """``(model, "(widest vector extension)")`` from Linux's ``cpuinfo``; empty strings
    where a field is missing or the file is not there."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return "", ""
    field = lambda *names: next((ln.split(":", 1)[1].strip() for ln in lines  # noqa: E731
                                 if ":" in ln and ln.split(":", 1)[0].strip() in names), "")
    flags = set(field("flags", "Features").split())
    isa = next((name for flag, name in _VECTOR_EXTENSIONS if flag in flags), "")
    return field("model name"), f"({isa})" if isa else ""


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
