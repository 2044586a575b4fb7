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

Times are medians of ``--reps`` device-synchronised runs after a warm-up; the light paths
(chunk_kda, the scan forward, fused_recurrent) are timed in rounds, every path once per
round, so that the machine's drift reaches them alike; the heavy baselines (the scan's and
autodiff's gradients, GBs of memory) one at a time after them. Every ratio compares numbers
from this one run. GFLOP/s use the FLOP model below and are set against
a large float32 matmul timed in the same run. Peak memory is XLA's own figure for the
compiled program (``memory_analysis()``: temporaries + outputs), deterministic.

``--sweep`` runs T over 512..16384 (H=8, K=V=128) and writes JSON, CSV and PNG plots
(needs matplotlib) to ``--out``.
"""

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._front import chunk_kda  # noqa: E402
from .pipeline import KDAPipeline, _prepare, stage_inputs  # noqa: E402
from ._capabilities import capabilities  # noqa: E402
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


def peak_bytes(f: Callable, args) -> Optional[int]:
    try:
        m = f.lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # some backends do not report it
        return None


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / time_fn(f, (a,), reps) / 1e9


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, label: str):
        self.n += 1
        if self.enabled:
            w = 30
            done = int(w * self.n / self.total)
            el = time.perf_counter() - self.t0
            sys.stderr.write(f"\r[{'#' * done}{'.' * (w - done)}] {self.n}/{self.total} {el:6.1f}s {label:<40}")
            if self.n == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


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


def bench_shape(s: Shape, reps: int, pipes: dict, baselines: bool, check: bool, progress=None) -> list:
    """Rows of results for one shape: each pipeline's forward and forward+backward, and
    the baselines."""
    args, w = make_inputs(s), cotangent(s)
    ff = flops_per_token_head(s.chunk_size, s.K, s.V)
    tokens = s.B * s.T * s.HV
    rows = []

    # Paths to time: (name, kind, function, FLOPs per token-head, max error, alone).
    todo = []

    def add(name, kind, f, flops=None, err=None, alone=False):
        todo.append((name, kind, f, flops, err, alone))

    ref_o = ref_g = None
    compile_s = {}  # the training step's compile time, by path
    if check:  # float64 for this call only: every timed path runs with JAX's default 32-bit types
        with jax.enable_x64(True):
            a64 = tuple(a.astype(jnp.float64) for a in args)
            ref_o = np.asarray(jax.jit(lambda *a: naive_recurrent_kda(*a)[0])(*a64))
            ref_g = jax.tree.map(np.asarray, _TrainStep(naive_recurrent_kda, w.astype(jnp.float64))(*a64))
    for pname, pipe in pipes.items():
        fwd = jax.jit(lambda *a, pipe=pipe: chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe)[0])
        grad = _TrainStep(lambda *a, pipe=pipe: chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe), w)
        try:
            e_o = e_g = None
            t0 = time.perf_counter()
            grad.lower(*args).compile()  # jit(grad(chunk_kda))'s compile time, on its own
            compile_s[f"chunk_kda[{pname}]"] = time.perf_counter() - t0
            jax.block_until_ready((fwd(*args), grad(*args)))  # compile (and run) before anything is timed
            if check:
                e_o = _max_abs(fwd(*args), ref_o)
                e_g = max(_max_abs(a, b) for a, b in zip(grad(*args)[1], ref_g[1]))
            add(f"chunk_kda[{pname}]", "fwd", fwd, ff["forward"], e_o)
            add(f"chunk_kda[{pname}]", "fwd+bwd", grad, ff["forward"] + ff["backward"], e_g)
        except Exception as e:  # a kernel the backend cannot compile: report it, go on with the rest
            rows.append(dict(T=s.T, name=f"chunk_kda[{pname}]", kind="failed", time_s=None, peak_bytes=None,
                             gflops=None, max_err=None, error=_error_line(e)))
            print(f"chunk_kda[{pname}] failed at T={s.T}: {rows[-1]['error']}", file=sys.stderr)
    if baselines:
        add("scan", "fwd", jax.jit(lambda *a: naive_recurrent_kda(*a)[0]))
        if s.T <= 4096:  # autodiff of the scan keeps every step's state: 6 GB at T=4096
            add("scan", "fwd+bwd", _TrainStep(naive_recurrent_kda, w), alone=True)
        # The stages whole, as chunk_kda's own training step runs its forward.
        whole = KDAPipeline.reference().untiled()
        add("autodiff_chunk", "fwd+bwd", _TrainStep(_autodiff_chunk(whole, s.chunk_size), w), alone=True)
        add("fused_recurrent", "fwd", jax.jit(lambda *a: fused_recurrent_kda(*a)[0]))
        add("plain_scan", "fwd", jax.jit(lambda *a: plain_scan_kda(*a)[0]))
        if s.T <= 4096:
            plain = _TrainStep(plain_scan_kda, w)
            t0 = time.perf_counter()
            plain.lower(*args).compile()
            compile_s["plain_scan"] = time.perf_counter() - t0
            add("plain_scan", "fwd+bwd", plain, alone=True)

    # The light paths in rounds (every path once per round), so that the machine's drift
    # reaches them alike and their ratios hold; the heavy baselines (GBs of memory that
    # would slow whatever runs next) one at a time after them.
    together = [i for i, t in enumerate(todo) if not t[5]]
    times = dict(zip(together, time_rounds([todo[i][2] for i in together], args, reps)))
    times.update({i: time_fn(t[2], args, reps) for i, t in enumerate(todo) if t[5]})
    for i, (name, kind, f, flops, err, _) in enumerate(todo):
        t = times[i]
        rows.append(dict(T=s.T, name=name, kind=kind, time_s=t, peak_bytes=peak_bytes(f, args),
                         gflops=None if flops is None else flops * tokens / t / 1e9, max_err=err,
                         compile_s=compile_s.get(name) if kind == "fwd+bwd" else None))
        if progress:
            progress.step(f"T={s.T} {name} {kind}")
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
            # G_lo (kdax._hilo), the last of the reference's arguments: only for stages that take it
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
    head = (f"{'T':>6} {'path':<22} {'pass':<8} {'time ms':>9} {'/scan':>7} {'/plain':>7} {'/autodiff':>9} "
            f"{'GFLOP/s':>8} {'%mm':>5} {'peak MiB':>9} {'max err':>9} {'compile s':>9}")
    out = [head, "-" * len(head)]
    fmt = lambda v, f: ("-" if v is None else format(v, f))
    for r in rows:
        if r["time_s"] is None:
            out.append(f"{r['T']:>6} {r['name']:<22} FAILED: {r['error'][:120]}")
            continue
        pct = None if r["gflops"] is None else 100 * r["gflops"] / matmul
        mem = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        out.append(
            f"{r['T']:>6} {r['name']:<22} {r['kind']:<8} {1e3 * r['time_s']:>9.1f} {fmt(r.get('vs_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_plain_scan'), '7.3f'):>7} "
            f"{fmt(r.get('vs_autodiff_chunk'), '9.3f'):>9} {fmt(r['gflops'], '8.1f'):>8} {fmt(pct, '5.1f'):>5} "
            f"{fmt(mem, '9.1f'):>9} {fmt(r['max_err'], '9.2e'):>9} {fmt(r.get('compile_s'), '9.1f'):>9}"
        )
    return "\n".join(out)


def machine() -> str:
    dev = jax.devices()[0]
    return f"{platform.machine()} {os.cpu_count()} cores, {dev.platform} ({dev.device_kind}), jax {jax.__version__}"


def write_results(rows: list, meta: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: plots skipped (pip install matplotlib)")
        return
    series = sorted({(r["name"], r["kind"]) for r in rows})
    for metric, fname, ylabel in (("time_s", "time_vs_T.png", "seconds"), ("peak_bytes", "memory_vs_T.png", "peak bytes")):
        fig, ax = plt.subplots(figsize=(7, 5))
        for name, kind in series:
            pts = [(r["T"], r[metric]) for r in rows if r["name"] == name and r["kind"] == kind and r[metric]]
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
        plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in dataclasses.asdict(Shape()).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pipelines", default="reference", help="comma list of: reference, pallas, mixed")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--sweep", action="store_true", help="T in 512..16384 at H=8, K=V=128")
    p.add_argument("--stages", action="store_true",
                   help="time each stage alone per pipeline (arguments from the reference pipeline)")
    p.add_argument("--out", default=None, help="folder for results.json/.csv and plots")
    a = p.parse_args(argv)
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
    mm = matmul_gflops()
    meta = dict(machine=machine(), matmul_gflops=mm, reps=a.reps, date=time.strftime("%Y-%m-%d"))
    print(f"kdax benchmark on {meta['machine']}; large float32 matmul: {mm:.1f} GFLOP/s (measured again after the runs; the best counts)")
    if a.sweep:
        Ts = [512, 1024, 2048, 4096, 8192, 16384]
        per = lambda T: 2 * len(pipes) + (0 if a.no_baselines else (6 if T <= 4096 else 4))
        prog = _Progress(sum(per(T) for T in Ts), True)
        rows = []
        for T in Ts:
            rows += bench_shape(dataclasses.replace(shape, T=T), a.reps, pipes, not a.no_baselines, False, prog)
    else:
        rows = bench_shape(shape, a.reps, pipes, not a.no_baselines, True)
    rows = with_ratios(rows)
    # The machine's matmul speed drifts; the better of two measurements keeps %mm conservative.
    mm = meta["matmul_gflops"] = max(mm, matmul_gflops())
    print(f"large float32 matmul, best of before and after: {mm:.1f} GFLOP/s")
    print(f"B={shape.B} H={shape.H} HV={shape.HV} K={shape.K} V={shape.V} chunk={shape.chunk_size} float32; "
          "max err: against the float64 recurrence (outputs; all input gradients of sum(o * w), w random)")
    print(format_table(rows, mm))
    if a.out:
        write_results(rows, meta, a.out)
        print(f"results written to {a.out}")
    bad = [r for r in rows if r["max_err"] is not None and not (r["max_err"] < 1e-2)]
    if bad:
        print("ERROR: chunk_kda disagrees with the float64 reference", file=sys.stderr)
    failed = [r for r in rows if r["time_s"] is None]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
