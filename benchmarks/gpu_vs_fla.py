"""kdax beside FLA's ``chunk_kda`` (Triton) on the same GPU.

FLA can run in this process (without ``--no-fla``), but on the first H100 run its first
call here did not return within 200 s (full autotuning, or JAX and PyTorch in one
process); ``gpu_vs_fla.sh`` therefore runs kdax here with ``--no-fla --save-ref`` and FLA
in ``fla_side.py`` on the saved inputs, against the saved float64 reference.

Same inputs for every path: bf16 q, k, v, raw gate g and beta logits, float32 ``A_log``
``[HV]`` and ``dt_bias`` ``[HV*K]``, Kimi Linear's options (l2norm of q and k, softplus gate
and beta sigmoid in the kernel), chunk 64. Two passes per path: the forward, and a
training step (loss ``sum(o * w)``, ``w`` fixed random float32 weights; the loss and the
gradients of q, k, v, g, beta, A_log, dt_bias). Times are medians of ``--reps``
synchronised calls after two warm-up calls (``block_until_ready`` for JAX,
``torch.cuda.synchronize`` for PyTorch). Every output and gradient is checked against a
float64 reference, kdax's reference pipeline run in float64 on the same device on the
same (bf16-exact) values, by relative RMS error with FLA's test tolerances: o 5e-3,
dq/dk/dv 8e-3, dg/dbeta (and dA_log, ddt_bias) 2e-2.

kdax paths (``--pipes``): ``default`` (``kdax.pipeline.default_pipeline()``, what
``chunk_kda(pipeline=None)`` runs), ``reference`` (XLA, the precision policy "auto": bf16
operands where safe), ``reference_highest`` (every product at float32 HIGHEST), ``pallas``
(Triton), ``pallas_highest``, ``mixed`` (``KDAPipeline.mixed()``), ``pallas_xla_gate``
(Pallas but the gate stages, F1/B5, in XLA), each optionally with ``+option`` changes
(``kdax_pipeline``; ``+no_recompute`` calls ``chunk_kda(disable_recompute=True)``: the
forward's h and v_new kept for the backward instead of recomputed in B0). FLA's row is
``fla``; without FLA, PyTorch or a CUDA device it is reported as skipped.

Each path is compiled ahead of its first call (``jit(...).lower(...).compile()``), so
that compile time, XLA's memory figure and the device's memory can be told apart. Memory
per row: ``xla_mib``, XLA's figure for the compiled program (arguments + outputs +
temporaries, less aliased buffers), exact and per path; ``peak_mib``, the device's
``peak_bytes_in_use`` (``memory_stats()``; None where JAX does not report it, e.g. CPU)
after the pass's first call, and ``inputs_mib``, the bytes in use once the inputs are on
the device. JAX cannot reset that peak, so it is the pass's own (``peak_own``) only in a
process's first path, only for the pass run first (the training step), and only where it
exceeds the peak left by compiling (XLA's autotuning allocates on the device).
``gpu_candidate_run.py`` runs each path at the goal shape in a process of its own for that
reason. The float64 reference is computed after the paths, so no path's peak includes it,
or loaded (``--load-ref``, written by an earlier ``--save-ref``).

Results (merged into what ``--out`` already holds, so that one shape per process can
append): ``results.json``, ``results.txt`` (table), ``results.png`` (needs matplotlib).

    python benchmarks/gpu_vs_fla.py --shapes 1x16384x16 --out benchmarks/results/gpu_h100
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for PyTorch

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# float64 only for the reference (``reference64``); kdax and FLA are timed as users run
# them, with JAX's default 32-bit types.

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kdax  # noqa: E402
from kdax import KDAPipeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# FLA's side (no JAX there): the gradients compared, FLA's tolerances (rel-RMS against a
# float64 reference) for half-precision inputs, Kimi Linear's options, FLA's calls.
from fla_side import GRAD_NAMES, OPTIONS, TOL, fla_calls  # noqa: E402
PIPES = ("pallas", "reference", "reference_highest", "mixed", "pallas_highest", "pallas_xla_gate", "default")


def kdax_pipeline(name: str) -> KDAPipeline:
    """A pipeline by name: one of ``PIPES`` (``pallas``: every Triton field at its own
    default, ``tuning="minimal"``, so that a path's options mean what they did), ``triton``
    (``KDAPipeline.pallas("triton")``: the default tuning) or ``triton:<tuning>`` (a name of
    ``kdax.pallas.TUNINGS``), optionally followed by ``+option`` changes:
    ``+xla_gate`` (F1/B5 reference stages), ``+pallas_state`` (Pallas F4 and B2),
    ``+warps=N`` / ``+stages=N`` / ``+f32dot=tf32x3`` (every Pallas stage's Triton tuning),
    ``+warps.FIELD=N`` (the Pallas stage ``FIELD`` alone, e.g. ``+warps.intra_bwd=16``: put
    it after ``+warps=N``), ``+rows.FIELD=N`` (the rows a program of that Pallas stage's
    Triton kernel takes, e.g. ``+rows.intra_bwd=16``: B4 on FLA's grid,
    ``PallasIntraBackward.rows``),
    ``+noviews`` (every Pallas stage takes chunked copies of the inputs, not views of the
    caller's arrays: ``kdax._layouts.tokens``),
    ``+group=N|none`` / ``+unroll=N`` (every reference stage's chunk groups / the
    recurrences' loop unroll), ``+block_k=N`` (the Pallas state kernels hold the state as
    N-row tiles), ``+block_v=N`` (and take N value columns per program), ``+incast`` (and
    round their product-only operands in the kernel: ``round_in_kernel``), ``+cols=N`` (the
chunk-parallel Pallas kernels F2, F3, B3, B4 take N feature columns at a time:
``kdax.pallas._common.PallasFeatureBlocks``), ``+fast`` (precision "fast": bf16 operands in the
    recurrences too, ``kdax._numerics.precision``), ``+segments=S`` (F4 and B2, whichever stages the
    pipeline has by then, split into S segments per row: ``kdax.stages.segmented``; put
    it last), ``+no_recompute`` (the pipeline unchanged; ``call_options`` turns it into
    ``disable_recompute=True``)."""
    base, *opts = name.split("+")
    pipe = _base_pipeline(base)
    for o in opts:
        pipe = _with_option(pipe, o, name)
    return pipe


def call_options(name: str) -> dict:
    """``chunk_kda`` keyword arguments a path name asks for beside its pipeline:
    ``+no_recompute`` gives ``disable_recompute=True`` (issue 26 item 4: h and v_new saved
    by the forward against recomputed in B0)."""
    return {"disable_recompute": True} if "no_recompute" in name.split("+")[1:] else {}


def _with_option(pipe: KDAPipeline, opt: str, name: str) -> KDAPipeline:
    import dataclasses

    from kdax.pallas._common import PallasTarget
    from kdax.stages import ReferenceDhu, ReferenceState

    key, _, val = opt.partition("=")
    if key == "no_recompute":  # a call option (call_options), not a stage change
        return pipe
    stages = {f.name: getattr(pipe, f.name) for f in dataclasses.fields(pipe) if isinstance(getattr(pipe, f.name), eqx.Module)}
    if key == "xla_gate":
        r = KDAPipeline.reference()
        return dataclasses.replace(pipe, gate=r.gate, gate_bwd=r.gate_bwd)
    if key == "pallas_state":
        p = KDAPipeline.pallas(tuning="minimal")
        return dataclasses.replace(pipe, state=p.state, dhu=p.dhu)
    if key.startswith("warps."):  # one stage's warps
        field = key.partition(".")[2]
        if not isinstance(stages.get(field), PallasTarget):
            raise ValueError(f"--pipes: {opt!r} in {name!r}: {field!r} is not a Pallas stage of this pipeline")
        return dataclasses.replace(pipe, **{field: dataclasses.replace(stages[field], num_warps=int(val))})
    if key.startswith("rows."):  # one stage's rows a program (PallasIntraBackward.rows)
        field = key.partition(".")[2]
        if not (isinstance(stages.get(field), PallasTarget) and hasattr(stages[field], "rows")):
            raise ValueError(f"--pipes: {opt!r} in {name!r}: {field!r} is not a Pallas stage with rows in this pipeline")
        return dataclasses.replace(pipe, **{field: dataclasses.replace(stages[field], rows=int(val))})
    if key in ("warps", "stages", "f32dot", "noviews"):
        field = {"warps": "num_warps", "stages": "num_stages", "f32dot": "f32_dot", "noviews": "read_views"}[key]
        value = val if key == "f32dot" else (False if key == "noviews" else int(val))
        return dataclasses.replace(pipe, **{n: dataclasses.replace(s, **{field: value})
                                            for n, s in stages.items() if isinstance(s, PallasTarget)})
    if key == "group":
        g = None if val == "none" else int(val)
        return dataclasses.replace(pipe, **{n: dataclasses.replace(s, group=g) for n, s in stages.items()
                                            if "group" in {f.name for f in dataclasses.fields(s)}})
    if key in ("block_k", "block_v", "incast"):  # the Triton state kernels' row tiles / value columns / rounding
        from kdax.pallas import PallasDhu, PallasState

        change = {"round_in_kernel": True} if key == "incast" else {key: int(val)}
        return dataclasses.replace(pipe, **{n: dataclasses.replace(s, **change) for n, s in stages.items()
                                            if isinstance(s, (PallasState, PallasDhu))})
    if key == "cols":
        from kdax.pallas._common import PallasFeatureBlocks

        return dataclasses.replace(pipe, **{n: dataclasses.replace(s, block_k=int(val)) for n, s in stages.items()
                                            if isinstance(s, PallasFeatureBlocks)})
    if key == "fast":
        return pipe.with_precision("fast")
    if key == "segments":
        from kdax.stages import segmented

        return segmented(pipe, int(val))
    if key == "unroll":
        return dataclasses.replace(pipe, **{n: dataclasses.replace(s, loop_unroll=int(val)) for n, s in stages.items()
                                            if isinstance(s, (ReferenceState, ReferenceDhu))})
    raise ValueError(f"--pipes: unknown option {opt!r} in {name!r}")


def _base_pipeline(name: str) -> KDAPipeline:
    if name == "default":
        from kdax.pipeline import default_pipeline

        return default_pipeline()
    if name == "reference":
        return KDAPipeline.reference()
    if name == "reference_highest":
        return KDAPipeline.reference().with_precision("highest")
    if name == "pallas":  # every Triton field at its own default, whatever KDAPipeline.pallas's default tuning
        return KDAPipeline.pallas(tuning="minimal")
    if name == "pallas_highest":
        return KDAPipeline.pallas(tuning="minimal").with_precision("highest")
    if name == "triton" or name.startswith("triton:"):  # a named tuning (kdax.pallas.TUNINGS)
        return KDAPipeline.pallas("triton", tuning=name.partition(":")[2] or "default")
    if name == "mixed":
        return KDAPipeline.mixed()
    if name == "pallas_xla_gate":
        p, r = KDAPipeline.pallas(tuning="minimal"), KDAPipeline.reference()
        return eqx_replace(p, gate=r.gate, gate_bwd=r.gate_bwd)
    raise ValueError(f"--pipes: unknown pipeline {name!r}; expected some of {PIPES}, 'triton' or "
                     f"'triton:<tuning>' (kdax.pallas.TUNINGS).")


def eqx_replace(pipe, **stages):
    import dataclasses

    return dataclasses.replace(pipe, **stages)


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict:
    """float32 numpy arrays; q, k, v, g, beta hold bf16-exact values (rounded to nearest
    on the host). Drawn in float32: at (4, 4096, 32) float64 draws took seconds per
    array, time the GPU run does not have."""
    import ml_dtypes

    r = np.random.default_rng(seed)
    n = lambda *shape: r.standard_normal(shape, dtype=np.float32)
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return dict(
        q=bf16(n(B, T, H, K)),
        k=bf16(n(B, T, H, K)),
        v=bf16(n(B, T, H, V)),
        g=bf16(n(B, T, H, K)),  # raw gate input (softplus gate in kernel)
        beta=bf16(n(B, T, H)),  # logits (sigmoid in kernel)
        A_log=np.log(r.uniform(1.0, 16.0, size=(H,))).astype(np.float32),
        dt_bias=(0.5 * n(H * K)).astype(np.float32),
        w=n(B, T, H, V),
    )


def rel_rms(x, ref) -> float:
    """On the host in float64 (``ref``: a float64 numpy array)."""
    d = np.asarray(np.asarray(x), np.float64) - ref
    e = float(np.sqrt(np.sum(d * d) / np.sum(ref * ref)))
    return e if math.isfinite(e) else float("inf")


def median_time(fn, sync, reps: int) -> float:
    for _ in range(2):
        sync(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


MIB = 2**20


def device_memory():
    """``(bytes in use, peak bytes in use)`` of the first device, or None where JAX does
    not report them (the CPU backend returns no ``memory_stats``)."""
    try:
        s = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 -- some backends raise instead of returning None
        return None
    if not s or "peak_bytes_in_use" not in s:
        return None
    return int(s.get("bytes_in_use", 0)), int(s["peak_bytes_in_use"])


def xla_memory_mib(compiled):
    """XLA's figure for a compiled program: arguments + outputs + temporaries, less the
    buffers aliased between them (MiB), or None where the backend gives no analysis."""
    try:
        m = compiled.memory_analysis()
        b = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    except Exception:  # noqa: BLE001
        return None
    return float(b) / MIB


def save_ref(path, x: dict, ref) -> None:
    """The inputs and the float64 reference (stored as float32, plenty for errors at the
    1e-3 level) in one npz: what ``fla_side.py`` and ``--load-ref`` read."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"in_{n}": x[n] for n in (*GRAD_NAMES, "w")}
    arrays["ref_o"] = np.asarray(ref[0], np.float32)
    arrays.update({f"ref_{n}": np.asarray(ref[1][n], np.float32) for n in GRAD_NAMES})
    np.savez(Path(path), **arrays)


def load_ref(path):
    """``(inputs, (o, {name: gradient}))`` as ``save_ref`` wrote them (reference values
    widened to float64)."""
    d = np.load(path)
    x = {n: np.array(d["in_" + n]) for n in (*GRAD_NAMES, "w")}
    ref = (np.asarray(d["ref_o"], np.float64), {n: np.asarray(d["ref_" + n], np.float64) for n in GRAD_NAMES})
    return x, ref


# -- kdax ----------------------------------------------------------------------------------
def kdax_fns(pipe: KDAPipeline, chunk: int, **call):
    """``(fwd, step)`` jitted: ``chunk_kda``'s output, and the training step's loss and
    gradients of ``GRAD_NAMES``; ``call``: further ``chunk_kda`` arguments
    (``call_options``)."""
    def fwd(q, k, v, g, beta, A_log, dt_bias):
        return kdax.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk, pipeline=pipe,
                              **OPTIONS, **call)[0]

    def loss(q, k, v, g, beta, A_log, dt_bias, w):
        return jnp.sum(fwd(q, k, v, g, beta, A_log, dt_bias).astype(jnp.float32) * w)

    return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))


def reference64(x: dict, chunk: int):
    """o and every gradient in float64 (kdax's reference pipeline, computed on the
    device with 64-bit types switched on for this call only), as numpy arrays. One
    program: the output rides along the gradient as an auxiliary value."""
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        pipe = KDAPipeline.reference().untiled()
        args = tuple(jnp.asarray(x[n], jnp.float64) for n in GRAD_NAMES)

        def loss(*a):
            w = a[-1]
            o = kdax.chunk_kda(*a[:5], A_log=a[5], dt_bias=a[6], chunk_size=chunk, pipeline=pipe, **OPTIONS)[0]
            return jnp.sum(o * w), o

        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))(
            *args, jnp.asarray(x["w"], jnp.float64))
        return np.asarray(o), {n: np.asarray(gr) for n, gr in zip(GRAD_NAMES, grads)}
    finally:
        jax.config.update("jax_enable_x64", prev)


_PATHS_RUN = []  # kdax paths run in this process so far: a later path's peak includes earlier ones


def run_kdax(name: str, x: dict, chunk: int, reps: int):
    """``(rows, outputs)``: the forward's and training step's rows of path ``name`` (times,
    compile seconds, memory; no errors yet) and its outputs on the host, ``(o, {name:
    gradient})``, for ``errors``. Both programs are compiled before the inputs reach the
    device; the training step runs first, so its peak is the one measured cleanly."""
    fwd, step = kdax_fns(kdax_pipeline(name), chunk, **call_options(name))
    dt = {n: jnp.float32 if n in ("A_log", "dt_bias") else jnp.bfloat16 for n in GRAD_NAMES}
    specs = [jax.ShapeDtypeStruct(x[n].shape, dt[n]) for n in GRAD_NAMES]
    first = not _PATHS_RUN
    _PATHS_RUN.append(name)
    t0 = time.perf_counter()
    c_fwd = fwd.lower(*specs).compile()
    s_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    c_step = step.lower(*specs, jax.ShapeDtypeStruct(x["w"].shape, jnp.float32)).compile()
    s_step = time.perf_counter() - t0
    m_compiled = device_memory()
    args = tuple(jnp.asarray(x[n], dt[n]) for n in GRAD_NAMES)
    w = jnp.asarray(x["w"], jnp.float32)
    m_inputs = device_memory()
    t0 = time.perf_counter()
    _, grads = jax.block_until_ready(c_step(*args, w))
    r_step = time.perf_counter() - t0
    m_step = device_memory()
    t0 = time.perf_counter()
    o = jax.block_until_ready(c_fwd(*args))
    r_fwd = time.perf_counter() - t0
    m_fwd = device_memory()
    outs = (np.asarray(o), {n: np.asarray(gr) for n, gr in zip(GRAD_NAMES, grads)})
    del o, grads
    sync = jax.block_until_ready
    t_fwd = median_time(lambda: c_fwd(*args), sync, reps)
    t_step = median_time(lambda: c_step(*args, w), sync, reps)

    def mem(m_after, clean):
        if m_after is None:
            return dict(peak_mib=None, inputs_mib=None, peak_own=None)
        return dict(peak_mib=m_after[1] / MIB, inputs_mib=m_inputs[0] / MIB,
                    peak_own=bool(first and clean and m_after[1] > m_compiled[1]))

    # the forward's peak is its own only where it rose above the step's
    fwd_clean = m_fwd is not None and m_fwd[1] > m_step[1]
    rows = [dict(path=f"kdax[{name}]", pass_="fwd", time_ms=1e3 * t_fwd, first_call_s=s_fwd + r_fwd, compile_s=s_fwd,
                 xla_mib=xla_memory_mib(c_fwd), **mem(m_fwd, fwd_clean)),
            dict(path=f"kdax[{name}]", pass_="train", time_ms=1e3 * t_step, first_call_s=s_step + r_step,
                 compile_s=s_step, xla_mib=xla_memory_mib(c_step), **mem(m_step, True))]
    return rows, outs


def errors(rows: list, outs, ref) -> list:
    """``rows`` (a forward row and a training-step row) with their rel-RMS errors against
    the float64 reference and their status under FLA's tolerances."""
    o, grads = outs
    for r in rows:
        if r["pass_"] == "fwd":
            r["errors"] = {"o": rel_rms(o, ref[0])}
        else:
            r["errors"] = {n: rel_rms(grads[n], ref[1][n]) for n in GRAD_NAMES}
        r["ok"] = all(err <= TOL[n] for n, err in r["errors"].items())
        r["status"] = "ok" if r["ok"] else "ERRORS OVER FLA'S TOLERANCES"
    return rows


def check_float32(shape, name: str, K: int, V: int, chunk: int, on_row) -> None:
    """``name``'s forward and training step on float32 inputs (precision "highest")
    against the float64 reference: the float32 tolerances of the golden tests, o 1e-5,
    gradients 1e-4 (rel-RMS)."""
    B, T, H = shape
    x = make_inputs(B, T, H, K, V, seed=1)
    ref = reference64(x, chunk)
    fwd, step = kdax_fns(kdax_pipeline(name).with_precision("highest"), chunk, **call_options(name))
    args = tuple(jnp.asarray(x[n], jnp.float32) for n in GRAD_NAMES)
    base = dict(B=B, T=T, H=H, K=K, V=V, chunk=chunk, dtype="float32", path=f"kdax[{name}] float32 check")
    try:
        o = fwd(*args)
        _, grads = step(*args, jnp.asarray(x["w"]))
        errs = {"o": rel_rms(o, ref[0])}
        errs.update({n: rel_rms(gr, ref[1][n]) for n, gr in zip(GRAD_NAMES, grads)})
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        on_row(dict(base, pass_="-", status=f"failed: {type(e).__name__}: {msg[0][:300] if msg else ''}"))
        return
    ok = errs["o"] <= 1e-5 and all(errs[n] <= 1e-4 for n in GRAD_NAMES)
    on_row(dict(base, pass_="train", time_ms=float("nan"), errors=errs, ok=ok,
                status="ok (float32 tolerances)" if ok else "ERRORS OVER float32 tolerances (1e-5 / 1e-4)"))


# -- FLA -----------------------------------------------------------------------------------
def fla_available():
    """(chunk_kda, torch) or the reason FLA cannot run here."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"no PyTorch ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "no CUDA device for PyTorch"
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        return f"no FLA ({type(e).__name__}: {e})"
    return chunk_kda, torch


def run_fla(fla, x: dict, chunk: int, reps: int):
    """FLA in this process (``--no-fla`` not given): ``(rows, outputs)`` as ``run_kdax``."""
    chunk_kda, torch = fla
    if chunk != 64:
        raise ValueError("FLA's chunk_kda has chunk 64 only")
    fwd, step = fla_calls(chunk_kda, torch, x)

    def sync(_):
        torch.cuda.synchronize()

    to_np = lambda a: a.detach().float().cpu().numpy()
    t0 = time.perf_counter()
    o = fwd()
    sync(o)
    c_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, grads = step()
    sync(grads)
    c_step = time.perf_counter() - t0
    outs = (to_np(o), {n: to_np(gr) for n, gr in zip(GRAD_NAMES, grads)})
    del o, grads
    t_fwd = median_time(fwd, sync, reps)
    t_step = median_time(step, sync, reps)
    return [dict(path="fla", pass_="fwd", time_ms=1e3 * t_fwd, first_call_s=c_fwd),
            dict(path="fla", pass_="train", time_ms=1e3 * t_step, first_call_s=c_step)], outs


# -- one shape -----------------------------------------------------------------------------
def bench_shape(shape, pipes, K: int, V: int, chunk: int, reps: int, budget_s: float, fla, on_row,
                save_ref_to=None, load_ref_from=None) -> None:
    """Every path at one shape. The paths run first (a failing one is reported and the
    rest go on); their rows are written at once, marked as waiting for the reference,
    so a process stopped during the float64 reference still leaves their times; then the
    reference (or the one loaded) gives every row its errors."""
    B, T, H = shape
    t_start = time.perf_counter()
    base = dict(B=B, T=T, H=H, K=K, V=V, chunk=chunk, dtype="bfloat16", reps=reps)
    tag = f"{B}x{T}x{H}"
    if load_ref_from:
        x, ref = load_ref(load_ref_from.format(shape=tag))
        if x["q"].shape != (B, T, H, K) or x["v"].shape[-1] != V:
            raise ValueError(f"--load-ref: {load_ref_from.format(shape=tag)} holds q {x['q'].shape} and v "
                             f"{x['v'].shape}, not B, T, H = {shape} with K={K}, V={V}")
    else:
        x, ref = make_inputs(B, T, H, K, V), None
    done = []  # (rows, outputs) waiting for the reference
    for path in ["fla", *pipes]:
        label = path if path == "fla" else f"kdax[{path}]"
        if path == "fla" and isinstance(fla, str):
            on_row(dict(base, path="fla", pass_="-", status=f"skipped: {fla}"))
            continue
        if time.perf_counter() - t_start > budget_s:
            on_row(dict(base, path=label, pass_="-",
                        status=f"skipped: this shape's time budget ({budget_s:.0f} s) was spent"))
            continue
        t0 = time.perf_counter()
        try:
            rows, outs = run_fla(fla, x, chunk, reps) if path == "fla" else run_kdax(path, x, chunk, reps)
        except Exception as e:  # noqa: BLE001 -- a path that fails is reported, the rest go on
            msg = str(e).strip().splitlines()
            on_row(dict(base, path=label, pass_="-",
                        status=f"failed: {type(e).__name__}: {msg[0][:300] if msg else ''}"))
            continue
        rows = [dict(base, **r) for r in rows]
        if ref is None:
            for r in rows:
                on_row(dict(r, errors={}, status="errors pending: the float64 reference did not finish"))
            done.append((rows, outs))
        else:
            for r in errors(rows, outs, ref):
                on_row(r)
        print(f"[{tag}] {path}: {time.perf_counter() - t0:.1f} s", flush=True)
    if ref is None:
        t0 = time.perf_counter()
        ref = reference64(x, chunk)
        print(f"[{tag}] float64 reference: {time.perf_counter() - t0:.1f} s", flush=True)
        for rows, outs in done:
            for r in errors(rows, outs, ref):
                on_row(r)
        if save_ref_to:  # for benchmarks/fla_side.py and later --load-ref runs
            save_ref(save_ref_to.format(shape=tag), x, ref)


# -- report ------------------------------------------------------------------------------
def _key(r):
    return (r["B"], r["T"], r["H"], r["path"], r["pass_"])


def current(rows: list) -> list:
    """``rows`` less the untimed ones ("skipped", "failed": pass "-") of a path that has
    timed rows at the same shape (from a later process or run)."""
    timed = {(r["B"], r["T"], r["H"], r["path"]) for r in rows if "time_ms" in r}
    return [r for r in rows if r["pass_"] != "-" or (r["B"], r["T"], r["H"], r["path"]) not in timed]


def with_ratios(rows: list) -> list:
    fla = {(r["B"], r["T"], r["H"], r["pass_"]): r["time_ms"] for r in rows if r["path"] == "fla" and "time_ms" in r}
    for r in rows:
        f = fla.get((r["B"], r["T"], r["H"], r["pass_"]))
        r["vs_fla"] = None if f is None or "time_ms" not in r else r["time_ms"] / f
    return rows


def _order(rows: list) -> list:
    """Shapes in the order they first appear, FLA first within a shape, then the kdax
    paths in the order they first appear; the forward before the training step."""
    shapes, paths = {}, {}
    for r in rows:
        shapes.setdefault((r["B"], r["T"], r["H"]), len(shapes))
        paths.setdefault(r["path"], len(paths))
    passes = {"-": 0, "fwd": 1, "train": 2}
    return sorted(rows, key=lambda r: (shapes[(r["B"], r["T"], r["H"])], r["path"] != "fla", paths[r["path"]],
                                       passes.get(r["pass_"], 3)))


def _mib(r, key):
    v = r.get(key)
    if v is None:
        return "-"
    return f"{v:.0f}" + ("" if key != "peak_mib" or r.get("peak_own") else "*")


def table(rows: list, header: str) -> str:
    """The text table: one line per row; memory in MiB (``peak``: the device's peak after
    the pass's first call, ``*`` where it may include an earlier path's or compilation's;
    ``xla``: XLA's figure for the compiled program); the error shown is the one nearest
    its tolerance."""
    rows = _order(rows)
    pw = max([26] + [len(r["path"]) for r in rows])
    cols = (f"{'B':>2} {'T':>6} {'H':>3} {'path':<{pw}} {'pass':<6} {'n':>3} {'time ms':>9} {'/FLA':>6} "
            f"{'peak MiB':>9} {'xla MiB':>8}  max rel-RMS err (which)  status")
    out = [header, cols, "-" * len(cols)]
    for r in rows:
        lead = f"{r['B']:>2} {r['T']:>6} {r['H']:>3} {r['path']:<{pw}}"
        if "time_ms" not in r:
            out.append(f"{lead} {'-':<6} {'':>3} {'':>9} {'':>6} {'':>9} {'':>8}  {r['status']}")
            continue
        errs = r.get("errors") or {}
        if errs:
            worst = max(errs, key=lambda n: errs[n] / TOL[n])
            err = f"{errs[worst]:.2e} ({'d' if r['pass_'] == 'train' else ''}{worst})"
        else:
            err = "-"
        ratio = "" if r.get("vs_fla") is None or r["vs_fla"] != r["vs_fla"] else f"{r['vs_fla']:.2f}"
        tms = "-" if r["time_ms"] != r["time_ms"] else f"{r['time_ms']:.2f}"
        out.append(f"{lead} {r['pass_']:<6} {r.get('reps', ''):>3} {tms:>9} {ratio:>6} {_mib(r, 'peak_mib'):>9} "
                   f"{_mib(r, 'xla_mib'):>8}  {err:<23}  {r['status']}")
    return "\n".join(out)


def plot(rows: list, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r.get("dtype") == "bfloat16"]
    shapes = sorted({(r["B"], r["T"], r["H"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, pas in zip(axes, ("fwd", "train")):
        paths = sorted({r["path"] for r in rows if r["pass_"] == pas and "time_ms" in r}, key=lambda p: (p != "fla", p))
        width = 0.8 / max(1, len(paths))
        for i, p in enumerate(paths):
            ys = [next((r["time_ms"] for r in rows if (r["B"], r["T"], r["H"]) == s and r["path"] == p
                        and r["pass_"] == pas and "time_ms" in r), np.nan) for s in shapes]
            ax.bar(np.arange(len(shapes)) + i * width, ys, width, label=p)
        ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
        ax.set_xticklabels([f"B={b} T={t} H={h}" for b, t, h in shapes])
        ax.set_ylabel("ms (median)")
        ax.set_yscale("log")
        ax.set_title(f"{'forward' if pas == 'fwd' else 'training step'}, bf16, K=V=128, chunk 64")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def card_name() -> str:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform).lower()
    for n in ("h100", "h200", "a100", "b200", "l40"):
        if n in kind:
            return n
    return d.platform


def parse_shape(s: str):
    try:
        B, T, H = (int(p) for p in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: expected BxTxH, e.g. 1x16384x16; got {s!r}") from None
    return B, T, H


def parser() -> argparse.ArgumentParser:
    """The command line (``gpu_candidate_run.py``'s tests parse its plan with it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x16384x16,1x4096x16,4x4096x32")
    ap.add_argument("--pipes", default=",".join(PIPES[:4]))
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds per shape before the rest is skipped")
    ap.add_argument("--no-fla", action="store_true", help="report FLA as skipped without trying it")
    ap.add_argument("--check-f32", default=None, metavar="BxTxH",
                    help="also check the first --pipes pipeline on float32 inputs at this shape")
    ap.add_argument("--save-ref", default=None, metavar="PATH",
                    help="write the inputs and the float64 reference to PATH ({shape} -> BxTxH) for fla_side.py")
    ap.add_argument("--load-ref", default=None, metavar="PATH",
                    help="read the inputs and the float64 reference from PATH ({shape} -> BxTxH), written by an "
                         "earlier --save-ref, instead of computing them")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/gpu_<card>)")
    return ap


def main(argv=None) -> dict:
    ap = parser()
    a = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in a.shapes.split(",") if s]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    pipes = [p for p in a.pipes.split(",") if p]
    for p in pipes:
        kdax_pipeline(p)  # unknown names fail before any work
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results" / f"gpu_{card_name()}"
    out.mkdir(parents=True, exist_ok=True)
    fla = "--no-fla given" if a.no_fla else fla_available()
    dev = jax.devices()[0]
    env = dict(device=getattr(dev, "device_kind", dev.platform), jax=jax.__version__,
               fla=None if isinstance(fla, str) else _version("fla-core"),
               torch=None if isinstance(fla, str) else fla[1].__version__, tolerances=TOL)
    jpath = out / "results.json"
    old = json.loads(jpath.read_text()) if jpath.exists() else {}
    env = {**old.get("env", {}), **{k: v for k, v in env.items() if v is not None}}  # fla_side.py's too
    rows = {_key(r): r for r in old.get("rows", [])}

    def on_row(r):
        rows[_key(r)] = r
        save()

    def save():
        rs = with_ratios(current(list(rows.values())))
        jpath.write_text(json.dumps(dict(env=env, rows=rs), indent=1))
        header = (f"kdax vs FLA chunk_kda on {env['device']} (jax {env.get('jax')}, torch {env.get('torch')}, fla-core "
                  f"{env.get('fla')}); bf16 inputs, {_dims(rs, a)}, Kimi options; times: medians of n "
                  f"synchronised calls; errors: rel-RMS vs float64, FLA's tolerances o 5e-3, dq/dk/dv 8e-3, "
                  f"dg/dbeta/dA_log/ddt_bias 2e-2; peak MiB: the device's peak after the pass's first call (* may "
                  f"include an earlier path's or compilation's); xla MiB: XLA's figure for the compiled program")
        (out / "results.txt").write_text(table(rs, header) + "\n")

    if a.check_f32:
        check_float32(parse_shape(a.check_f32), pipes[0], a.K, a.V, a.chunk, on_row)
    for shape in shapes:
        bench_shape(shape, pipes, a.K, a.V, a.chunk, a.reps, a.budget, fla, on_row, a.save_ref, a.load_ref)
    save()
    rs = with_ratios(current(list(rows.values())))
    try:
        plot(rs, out / "results.png")
    except Exception as e:  # noqa: BLE001 -- the table and JSON are written already
        print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print((out / "results.txt").read_text())
    return dict(env=env, rows=rs)


def _dims(rows: list, a) -> str:
    """K, V and chunk as the rows have them (a report step's own defaults may differ)."""
    got = sorted({(r["K"], r["V"], r["chunk"]) for r in rows if "K" in r}) or [(a.K, a.V, a.chunk)]
    return "; ".join(f"K={k} V={v} chunk {c}" for k, v, c in got)


def _version(dist: str):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
