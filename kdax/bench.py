"""kdax's benchmark harness and main job: ``python -m kdax.bench``.

Runs chunk_kda on a realistic shape, checks it against the float64 reference, and times
it against baselines run in the same process:

* ``scan``: the ``lax.scan`` recurrence (``kdax.ref.naive_recurrent_kda``), forward and
  ``jax.grad``;
* ``plain_scan``: the fastest plain ``lax.scan`` recurrence a careful user would write
  (``plain_scan_kda``: einsums, no checks), forward and ``jax.grad``: the honest baseline
  (the ``/plain`` column);
* ``autodiff``: ``jax.grad`` through the same chunked forward by XLA autodiff (the stages'
  jnp code differentiated by JAX instead of the six-stage backward);
* ``fused_recurrent``: ``kdax.fused_recurrent_kda``.

Every path is compiled once (``jit(...).lower().compile()``: its compile time, XLA's peak
memory figure and the executable that is timed). Times are medians of ``--reps``
device-synchronised runs after a warm-up; the light paths (chunk_kda, the scan forward,
fused_recurrent) are timed in rounds, every path once per round, so that the machine's
drift reaches them alike; the heavy baselines (the plain scan's and autodiff's gradients,
GBs of memory, seconds a call) one at a time after them, at ``--heavy-reps`` runs (1 by
default; the table's ``reps`` column says which). The readable oracle's gradient (8 s a
call, 6 GB at T=4096) runs only with ``--slow-baselines``. Every ratio compares numbers
from this one run. GFLOP/s use the FLOP model below and are set against a large float32
matmul timed in the same run. Peak memory is XLA's own figure for the compiled program
(``memory_analysis()``: temporaries + outputs), deterministic.

The float64 reference (outputs and gradients, for the max-error column) runs in a thread
beside the baselines' compiles, after kdax's own compiles (whose times are reported alone)
and before anything is timed. Progress lines (what runs, seconds since the start) go to
stderr as it compiles and times. Results (JSON, CSV) and plots (PNG, with matplotlib: ``pip install -e ".[test]"``
installs it) are written to ``--out`` (default ``bench-results/`` in the working
directory). ``--sweep`` runs T over 512..16384 (H=8, K=V=128).
"""

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import sys
import threading
import time
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._front import chunk_kda  # noqa: E402
from ._runner.capabilities import capabilities  # noqa: E402
from .pipeline import KDAPipeline, _prepare, stage_inputs  # noqa: E402
from .recurrent import fused_recurrent_kda  # noqa: E402
from .ref import naive_recurrent_kda  # noqa: E402


def plain_scan_kda(q, k, v, g, beta):
    """KDA as a careful user writes it in plain JAX (the honest baseline; kdax.ref keeps the
    readable oracle): one ``lax.scan`` over time with einsums for the decay, ``k^T S``, the
    rank-1 update and ``q^T S``; H == HV, default scale. Returns ``(o, final state)``."""
    scale = q.shape[-1] ** -0.5
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q * scale, k, v, jnp.exp(g), beta))

    def step(S, x):
        q_t, k_t, v_t, a_t, b_t = x
        S = S * a_t[..., None]
        u = b_t[..., None] * (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, u)
        return S, jnp.einsum("bhk,bhkv->bhv", q_t, S)

    B, _, H, K = q.shape
    S, o = jax.lax.scan(step, jnp.zeros((B, H, K, v.shape[-1]), q.dtype), xs)
    return jnp.moveaxis(o, 0, 1), S


# -- FLOP model --------------------------------------------------------------------------
def flops_per_token_head(C: int, K: int, V: int) -> dict:
    """Multiply-add FLOPs (2 per MAC) per token and value head, per stage.

    Forward: F2 ``Aqk`` and ``L`` (2 x 2CK, counted dense), ``(I+L)^-1`` (C^2/3);
    F3 ``w`` (2CK), ``u`` (2CV); F4 ``w h`` and ``kg^T v_new`` (2 x 2KV); F5 ``qg h`` (2KV)
    and ``Aqk v_new`` (2CV). Backward: B0 = F3 + F4; B1 ``do v_new^T``, ``Aqk^T do``
    (2 x 2CV); B2 ``kg dh``, ``qg^T do``, ``w^T dv`` (3 x 2KV); B3 ``do h^T``,
    ``v_new dh^T``, ``dv h^T`` (3 x 2KV), ``dAkk`` and ``Akk^T [dw, du]`` (2 x (2CK + 2CV)),
    ``dL`` (2 x 2C^2); B4 four anchored products (4 x 2CK). Elementwise work is not counted.
    """
    f = {
        "F2_intra": 4 * C * K + C * C / 3,
        "F3_wy": 2 * C * K + 2 * C * V,
        "F4_state": 4 * K * V,
        "F5_output": 2 * K * V + 2 * C * V,
        "B0_recompute": 2 * C * K + 2 * C * V + 4 * K * V,
        "B1_dAv": 4 * C * V,
        "B2_dhu": 6 * K * V,
        "B3_wy_dqkg": 6 * K * V + 4 * C * K + 4 * C * V + 4 * C * C,
        "B4_intra": 8 * C * K,
    }
    f["forward"] = sum(v for k, v in f.items() if k.startswith("F"))
    f["backward"] = sum(v for k, v in f.items() if k.startswith("B"))
    return f


# -- timing helpers ------------------------------------------------------------------------
def time_fn(f: Callable, args, reps: int) -> float:
    """Median seconds of ``reps`` synchronised calls after one warm-up call."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


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


def _error_line(e: Exception) -> str:
    """An exception as one line for a table: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / time_fn(f, (a,), reps) / 1e9


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


_quiet = Log(False)


# -- one shape -----------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    B: int = 1
    T: int = 4096
    H: int = 8
    HV: int = 8
    K: int = 128
    V: int = 128
    chunk_size: int = 64


def make_inputs(s: Shape, seed: int = 0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    x = dict(
        q=r.normal(size=(s.B, s.T, s.H, s.K)),
        k=r.normal(size=(s.B, s.T, s.H, s.K)) / math.sqrt(s.K),
        v=r.normal(size=(s.B, s.T, s.HV, s.V)),
        g=-r.uniform(0.005, 0.1, size=(s.B, s.T, s.HV, s.K)),
        beta=r.uniform(0.1, 0.9, size=(s.B, s.T, s.HV)),
    )
    return tuple(jnp.asarray(x[n], dtype) for n in ("q", "k", "v", "g", "beta"))


def cotangent(s: Shape, seed: int = 1, dtype=jnp.float32):
    """The weights ``w`` of the benchmark loss ``sum(o * w)``, ``[B, T, HV, V]``."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=(s.B, s.T, s.HV, s.V)), dtype)


class _TrainStep:
    """A training step: the loss ``sum(o * w)`` and every input gradient, called with the
    five inputs. ``w`` (``cotangent``) is an argument of the compiled program, as a real
    loss's cotangent is: with ``sum(o)`` XLA would see a constant ``do`` of ones, which it
    can fold into each path differently. Returning the loss keeps the whole forward in the
    program (``jax.grad`` alone would let XLA drop the parts of a custom VJP's forward that
    only produce ``o``)."""

    def __init__(self, fn, w):
        def loss(q, k, v, g, beta, w):
            return jnp.sum(fn(q, k, v, g, beta)[0].astype(w.dtype) * w)

        self.step, self.w = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))), w

    def __call__(self, *args):
        return self.step(*args, self.w)

    def lower(self, *args):
        return self.step.lower(*args, self.w)


def _autodiff_chunk(pipeline: KDAPipeline, chunk_size: int):
    def fwd(q, k, v, g, beta):
        config, args = _prepare(q, k, v, g, beta, chunk_size=chunk_size)
        o, final, _ = pipeline.run_forward(config, *args)
        return o, final

    return fwd


def pipelines():
    pipes = {"reference": KDAPipeline.reference()}
    if hasattr(KDAPipeline, "pallas"):
        pipes["pallas"] = KDAPipeline.pallas()
        pipes["mixed"] = KDAPipeline.mixed()
    return pipes


def _max_abs(x, ref) -> float:
    """Max-abs error against a float64 numpy reference, on the host in float64."""
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


def _compiled(f: Callable, args):
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


def baseline_paths(s: Shape, w, slow_baselines: bool = False) -> list:
    """The baselines at shape ``s``: ``(name, kind, function, heavy)``; heavy ones (GBs,
    seconds a call) are timed alone. The scan's gradient (the readable oracle's, the
    slowest) only with ``slow_baselines``; no scan gradient above T=4096 (autodiff of a
    scan keeps every step's state: 6 GB at T=4096)."""
    # The stages whole, as chunk_kda's own training step runs its forward.
    whole = KDAPipeline.reference().untiled()
    paths = [("scan", "fwd", jax.jit(lambda *a: naive_recurrent_kda(*a)[0]), False)]
    if slow_baselines and s.T <= 4096:
        paths.append(("scan", "fwd+bwd", _TrainStep(naive_recurrent_kda, w), True))
    paths += [("autodiff_chunk", "fwd+bwd", _TrainStep(_autodiff_chunk(whole, s.chunk_size), w), True),
              ("fused_recurrent", "fwd", jax.jit(lambda *a: fused_recurrent_kda(*a)[0]), False),
              ("plain_scan", "fwd", jax.jit(lambda *a: plain_scan_kda(*a)[0]), False)]
    if s.T <= 4096:
        paths.append(("plain_scan", "fwd+bwd", _TrainStep(plain_scan_kda, w), True))
    return paths


def bench_shape(s: Shape, reps: int, pipes: dict, baselines: bool, check: bool, log: Callable = _quiet,
                slow_baselines: bool = False, heavy_reps: int = 1) -> list:
    """Rows of results for one shape: each pipeline's forward and forward+backward, and
    the baselines (the scan's gradient only with ``slow_baselines``; the heavy baselines
    timed ``heavy_reps`` times). ``log(line)`` hears what runs."""
    args, w = make_inputs(s), cotangent(s)
    ff = flops_per_token_head(s.chunk_size, s.K, s.V)
    tokens = s.B * s.T * s.HV
    at = f"T={s.T}"
    rows = []

    # Paths to time: (name, kind, compiled callable, FLOPs per token-head, max error, alone, compile s, peak).
    todo = []
    checked = []  # (index in todo, forward, training step) of each pipeline that compiled

    def add(name, kind, f, flops=None, err=None, alone=False):
        log(f"{at} compiling {name} {kind}")
        run, secs, peak = _compiled(f, args)
        todo.append((name, kind, run, flops, err, alone, secs, peak))
        return run

    for pname, pipe in pipes.items():
        fwd = jax.jit(lambda *a, pipe=pipe: chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe)[0])
        grad = _TrainStep(lambda *a, pipe=pipe: chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe), w)
        n = len(todo)
        try:
            f = add(f"chunk_kda[{pname}]", "fwd", fwd, ff["forward"])
            g = add(f"chunk_kda[{pname}]", "fwd+bwd", grad, ff["forward"] + ff["backward"])
            jax.block_until_ready((f(*args), g(*args)))  # run once before anything is timed
            checked.append((n, f, g))
        except Exception as e:  # a kernel the backend cannot compile: report it, go on with the rest
            del todo[n:]
            rows.append(dict(T=s.T, name=f"chunk_kda[{pname}]", kind="failed", time_s=None, peak_bytes=None,
                             gflops=None, max_err=None, error=_error_line(e)))
            log(f"{at} chunk_kda[{pname}] failed: {rows[-1]['error']}")
    # The float64 reference in a thread of its own, beside the baselines' compiles (kdax's
    # compiles above ran alone: their times are reported). jax.enable_x64 is thread-local:
    # every timed path runs with JAX's default 32-bit types.
    ref, ref_thread = {}, None
    if check and checked:
        # The plain scan (checked against kdax.ref's oracle in the tests) when it applies: its
        # gradient takes about half the oracle's time.
        ref_fn = plain_scan_kda if s.H == s.HV else naive_recurrent_kda

        def reference():
            try:
                with jax.enable_x64(True):
                    a64 = tuple(a.astype(jnp.float64) for a in args)
                    ref["o"] = np.asarray(jax.jit(lambda *a: ref_fn(*a)[0])(*a64))
                    ref["g"] = jax.tree.map(np.asarray, _TrainStep(ref_fn, w.astype(jnp.float64))(*a64)[1])
            except BaseException as e:  # raised again in the main thread
                ref["error"] = e

        log(f"{at} float64 reference (the recurrence, {ref_fn.__name__}: outputs and gradients), in the background")
        ref_thread = threading.Thread(target=reference, daemon=True)
        ref_thread.start()
    if baselines:
        for name, kind, f, alone in baseline_paths(s, w, slow_baselines):
            add(name, kind, f, alone=alone)
    if ref_thread is not None:
        if ref_thread.is_alive():
            log(f"{at} waiting for the float64 reference")
        ref_thread.join()
        if "error" in ref:
            raise ref["error"]
        for n, f, g in checked:
            e_o = _max_abs(f(*args), ref["o"])
            e_g = max(_max_abs(a, b) for a, b in zip(g(*args)[1], ref["g"]))
            todo[n] = todo[n][:4] + (e_o,) + todo[n][5:]
            todo[n + 1] = todo[n + 1][:4] + (e_g,) + todo[n + 1][5:]

    # The light paths in rounds (every path once per round), so that the machine's drift
    # reaches them alike and their ratios hold; the heavy baselines (GBs of memory that
    # would slow whatever runs next) one at a time after them.
    together = [i for i, t in enumerate(todo) if not t[5]]
    log(f"{at} timing {len(together)} paths in {reps} rounds: " + ", ".join(f"{todo[i][0]} {todo[i][1]}"
                                                                           for i in together))
    times = dict(zip(together, time_rounds([todo[i][2] for i in together], args, reps)))
    n_reps = {i: reps for i in together}
    for i, t in enumerate(todo):
        if t[5]:
            log(f"{at} timing {t[0]} {t[1]} ({heavy_reps} run{'s' if heavy_reps > 1 else ''} after a warm-up)")
            times[i], n_reps[i] = time_fn(t[2], args, heavy_reps), heavy_reps
    for i, (name, kind, f, flops, err, _, secs, peak) in enumerate(todo):
        t = times[i]
        rows.append(dict(T=s.T, name=name, kind=kind, time_s=t, peak_bytes=peak, reps=n_reps[i],
                         gflops=None if flops is None else flops * tokens / t / 1e9, max_err=err,
                         compile_s=secs if kind == "fwd+bwd" else None))
    return rows


STAGES = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


def bench_stages(s: Shape, reps: int, pipes: dict, on_row: Optional[Callable] = None) -> list:
    """Each stage alone, per pipeline, on the arguments the reference pipeline gives it in
    one forward and backward at shape ``s``: rows of (stage, pipeline, time or error).
    A stage that fails (a kernel the backend cannot compile) gives a row with its error.
    ``on_row(row)`` is called as each row is done (long compiles: results as they come)."""
    args = make_inputs(s)
    ref = KDAPipeline.reference()
    taps = stage_inputs(ref, *args, chunk_size=s.chunk_size)
    rows = []
    for name in STAGES:
        for pname, pipe in pipes.items():
            stage = getattr(pipe, name)
            row = dict(T=s.T, stage=name, pipeline=pname, impl=type(stage).__name__, time_s=None, error=None)
            # G_lo (kdax._numerics.hilo), the last of the reference's arguments: only for stages that take it
            cut = capabilities(type(getattr(ref, name))).G_lo and not capabilities(type(stage)).G_lo
            try:
                row["time_s"] = time_fn(eqx.filter_jit(stage), taps[name][:-1] if cut else taps[name], reps)
            except Exception as e:
                row["error"] = _error_line(e)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


_STAGE_COLS = f"{'stage':<10} {'pipeline':<10} {'implementation':<24} {'time ms':>9} {'/first':>7}"
STAGE_HEAD = _STAGE_COLS + "\n" + "-" * len(_STAGE_COLS)


def format_stage_row(r: dict, first: dict) -> str:
    """One line of the stage table; ``first`` maps stage -> the first pipeline's time."""
    if r["time_s"] is None:
        return f"{r['stage']:<10} {r['pipeline']:<10} {r['impl']:<24} FAILED: {r['error'][:110]}"
    base = first.setdefault(r["stage"], r["time_s"])
    return f"{r['stage']:<10} {r['pipeline']:<10} {r['impl']:<24} {1e3 * r['time_s']:>9.2f} {r['time_s'] / base:>7.2f}"


def format_stage_table(rows: list) -> str:
    first = {}
    return "\n".join([STAGE_HEAD] + [format_stage_row(r, first) for r in rows])


def with_ratios(rows: list) -> list:
    by = {(r["T"], r["name"], r["kind"]): r for r in rows}
    for r in rows:
        for base, kind in (("scan", r["kind"]), ("autodiff_chunk", "fwd+bwd"), ("plain_scan", r["kind"])):
            b = by.get((r["T"], base, kind))
            if b is not None and r["kind"] == kind and r["name"] != base:
                r[f"vs_{base}"] = r["time_s"] / b["time_s"]
                if r["peak_bytes"] and b["peak_bytes"]:
                    r[f"mem_vs_{base}"] = r["peak_bytes"] / b["peak_bytes"]
    return rows


def format_table(rows: list, matmul: float) -> str:
    head = (f"{'T':>6} {'path':<22} {'pass':<8} {'time ms':>9} {'reps':>4} {'/scan':>7} {'/plain':>7} "
            f"{'/autodiff':>9} {'GFLOP/s':>8} {'%mm':>5} {'peak MiB':>9} {'max err':>9} {'compile s':>9}")
    out = [head, "-" * len(head)]
    fmt = lambda v, f: ("-" if v is None else format(v, f))
    for r in rows:
        if r["time_s"] is None:
            out.append(f"{r['T']:>6} {r['name']:<22} FAILED: {r['error'][:120]}")
            continue
        pct = None if r["gflops"] is None else 100 * r["gflops"] / matmul
        mem = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        out.append(
            f"{r['T']:>6} {r['name']:<22} {r['kind']:<8} {1e3 * r['time_s']:>9.1f} {fmt(r.get('reps'), '4d'):>4} "
            f"{fmt(r.get('vs_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_plain_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_autodiff_chunk'), '9.3f'):>9} {fmt(r['gflops'], '8.1f'):>8} {fmt(pct, '5.1f'):>5} "
            f"{fmt(mem, '9.1f'):>9} {fmt(r['max_err'], '9.2e'):>9} {fmt(r.get('compile_s'), '9.1f'):>9}"
        )
    kinds = {(r["name"], r["kind"]) for r in rows}
    if ("scan", "fwd") in kinds and ("scan", "fwd+bwd") not in kinds:
        out.append("(scan fwd+bwd, the readable oracle's gradient, 8 s a call at T=4096: run with --slow-baselines; "
                   "/plain is the honest baseline)")
    return "\n".join(out)


def machine() -> str:
    dev = jax.devices()[0]
    return f"{platform.machine()} {os.cpu_count()} cores, {dev.platform} ({dev.device_kind}), jax {jax.__version__}"


def write_results(rows: list, meta: dict, out: str) -> list:
    """results.json, results.csv and PNG plots (with matplotlib, headless Agg backend) in
    ``out``; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    written = [os.path.join(out, "results.json"), os.path.join(out, "results.csv")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plots skipped (pip install matplotlib, or pip install -e \".[test]\")")
        return written
    timed = [r for r in rows if r["time_s"]]
    if len({r["T"] for r in timed}) > 1:  # a sweep: each path against T
        series = sorted({(r["name"], r["kind"]) for r in timed})
        for metric, fname, ylabel in (("time_s", "time_vs_T.png", "seconds"),
                                      ("peak_bytes", "memory_vs_T.png", "peak bytes")):
            fig, ax = plt.subplots(figsize=(7, 5))
            for name, kind in series:
                pts = [(r["T"], r[metric]) for r in timed if r["name"] == name and r["kind"] == kind and r[metric]]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=f"{name} {kind}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_ylabel(ylabel)
            ax.set_title(f"KDA {ylabel} vs T (H=8, K=V=128) — {meta['machine']}", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(os.path.join(out, fname), dpi=110)
            written.append(os.path.join(out, fname))
            plt.close(fig)
    for kind, fname in (("fwd", "time_fwd.png"), ("fwd+bwd", "time_fwd_bwd.png")):  # one shape: a bar per path
        bars = [r for r in timed if r["kind"] == kind and r["T"] == max(x["T"] for x in timed)]
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(bars) + 1.5))
        ax.barh([r["name"] for r in bars], [1e3 * r["time_s"] for r in bars],
                color=["tab:blue" if r["name"].startswith("chunk_kda") else "tab:gray" for r in bars])
        for i, r in enumerate(bars):
            ax.text(1e3 * r["time_s"], i, f" {1e3 * r['time_s']:.0f} ms", va="center", fontsize=8)
        ax.set_xlabel("ms (median; linear scale)")
        ax.set_title(f"KDA {kind}, T={bars[0]['T']} — {meta['machine']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        written.append(os.path.join(out, fname))
        plt.close(fig)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in dataclasses.asdict(Shape()).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--reps", type=int, default=5, help="timed runs of each light path (rounds)")
    p.add_argument("--heavy-reps", type=int, default=1,
                   help="timed runs of each heavy baseline (the gradients of the scans and of autodiff)")
    p.add_argument("--pipelines", default="reference", help="comma list of: reference, pallas, mixed")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--slow-baselines", action="store_true",
                   help="also the readable oracle's gradient (lax.scan autodiff: 8 s a call, 6 GB at T=4096)")
    p.add_argument("--sweep", action="store_true", help="T in 512..16384 at H=8, K=V=128")
    p.add_argument("--stages", action="store_true",
                   help="time each stage alone per pipeline (arguments from the reference pipeline)")
    p.add_argument("--out", default="bench-results", help="folder for results.json/.csv and plots ('' for none)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    log = Log(not a.quiet)
    avail = pipelines()
    pipes = {n: avail[n] for n in a.pipelines.split(",")}
    shape = Shape(**{k: getattr(a, k) for k in dataclasses.asdict(Shape())})
    if a.stages:
        print(f"kdax stages alone on {machine()}; B={shape.B} T={shape.T} H={shape.H} HV={shape.HV} K={shape.K} "
              f"V={shape.V} chunk={shape.chunk_size} float32 (/first: against the first pipeline named)")
        print(STAGE_HEAD, flush=True)
        first = {}
        rows = bench_stages(shape, a.reps, pipes, lambda r: print(format_stage_row(r, first), flush=True))
        return 1 if any(r["time_s"] is None for r in rows) else 0
    log("timing a large float32 matmul (the FLOP-rate yardstick)")
    mm = matmul_gflops()
    meta = dict(machine=machine(), matmul_gflops=mm, reps=a.reps, heavy_reps=a.heavy_reps,
                date=time.strftime("%Y-%m-%d"))
    print(f"kdax benchmark on {meta['machine']}; large float32 matmul: {mm:.1f} GFLOP/s (measured again after the "
          "runs; the best counts)", flush=True)
    opts = dict(baselines=not a.no_baselines, log=log, slow_baselines=a.slow_baselines, heavy_reps=a.heavy_reps)
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
    meta["wall_s"] = round(time.perf_counter() - log.t0, 1)
    print(f"large float32 matmul, best of before and after: {mm:.1f} GFLOP/s")
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


if __name__ == "__main__":
    sys.exit(main())
