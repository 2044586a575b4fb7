"""FLA's half of the GPU comparisons, in a process of its own (PyTorch only, no JAX):

* ``--ref NPZ`` (repeatable: several shapes in one process, one autotuning): FLA's
  ``chunk_kda`` forward and training step on the inputs ``gpu_vs_fla.py --save-ref``
  wrote, checked against the float64 reference saved with them; rows merged into
  ``results.json`` (``gpu_vs_fla.py`` writes the table from it). A missing file is
  reported and skipped (its shape's kdax step did not finish).
* ``--layer NPZ``: FLA's layer, ``fla.layers.KimiDeltaAttention`` (the
  flash-linear-attention package), on the weights and inputs ``layer_vs_fla.py`` wrote:
  times and memory merged into ``layer.json``, outputs and gradients written beside NPZ
  as ``layer_fla.npz`` for ``layer_vs_fla.py --report``.

On the first H100 run (2026-11-26), FLA's first call in the process that also held JAX
did not return within 200 s; this split keeps the two runtimes (and FLA's autotuning)
apart and each under its own time limit. Memory: PyTorch's allocator peak
(``max_memory_allocated``), reset before each pass's first call, so each row's peak is
its own; ``inputs_mib`` is what was allocated just before.

Importing this module needs numpy only (``gpu_vs_fla.py`` and ``layer_vs_fla.py`` share
its constants and merge helpers); torch and fla are imported when it runs.

    python benchmarks/fla_side.py --ref /tmp/ref_1x16384x16.npz --out benchmarks/results/gpu_h100
    python benchmarks/fla_side.py --layer /tmp/kdax_gpu26/layer_in.npz --out /tmp/kdax_gpu26/gpu
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
TOL = {"o": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
MIB = 2**20
LAYER_PATH = "fla.layers"  # FLA's rows in layer.json


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", action="append", default=[], help="npz from gpu_vs_fla.py --save-ref (repeatable)")
    ap.add_argument("--layer", default=None, help="layer_in.npz from layer_vs_fla.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0,
                    help="after timing each --ref shape, profile this many training steps and forwards with "
                         "torch.profiler and write FLA's per-kernel device times to fla_profile_<shape>.txt in --out")
    ap.add_argument("--max-configs", type=int, default=0,
                    help="autotune each FLA kernel over at most this many of its configs, spread over its list "
                         "(0: all). FLA's full autotuning compiles hundreds of kernels on first call.")
    return ap


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if not a.ref and not a.layer:
        ap.error("give --ref (chunk_kda) or --layer (the layer), or both")
    import torch

    if a.max_configs:
        prune_autotuning(a.max_configs)
    env = dict(fla=_version("fla-core"), torch=torch.__version__,
               fla_autotune=f"at most {a.max_configs} configs per kernel" if a.max_configs else "full")
    for ref in a.ref:
        if not Path(ref).exists():
            print(f"FLA: {ref} is missing (its kdax step did not finish); skipped", flush=True)
            continue
        run_chunk(torch, ref, Path(a.out), a.reps, env, profile=a.profile)
    if a.layer:
        run_layer(torch, Path(a.layer), Path(a.out), a.reps, env)


# -- chunk_kda -------------------------------------------------------------------------------
def run_chunk(torch, ref: str, out: Path, reps: int, env: dict, profile: int = 0) -> list:
    from fla.ops.kda import chunk_kda

    d = np.load(ref)
    B, T, H, K = d["in_q"].shape
    V = d["in_v"].shape[-1]
    base = dict(B=int(B), T=int(T), H=int(H), K=int(K), V=int(V), chunk=64, dtype="bfloat16", path="fla", reps=reps)
    dev = "cuda"
    fwd, step = fla_calls(chunk_kda, torch, {n: np.array(d["in_" + n]) for n in (*GRAD_NAMES, "w")}, dev)

    def rel_rms(x, name):
        ref = torch.from_numpy(np.array(d["ref_" + name])).to(dev).double()
        e = float(torch.sqrt(((x.double() - ref) ** 2).sum() / (ref**2).sum()))
        return e if e == e else float("inf")

    tag = f"{B}x{T}x{H}"
    (_, grads), c_step, m_step = first_call(torch, step)
    print(f"FLA [{tag}] training step, first call: {c_step:.1f} s", flush=True)
    errs = {n: rel_rms(gr, n) for n, gr in zip(GRAD_NAMES, grads)}
    del grads
    o, c_fwd, m_fwd = first_call(torch, fwd)
    print(f"FLA [{tag}] forward, first call: {c_fwd:.1f} s", flush=True)
    e_o = rel_rms(o, "o")
    del o
    rows = [dict(base, pass_="fwd", time_ms=1e3 * timed(torch, fwd, reps), first_call_s=c_fwd, errors={"o": e_o},
                 **m_fwd),
            dict(base, pass_="train", time_ms=1e3 * timed(torch, step, reps), first_call_s=c_step, errors=errs,
                 **m_step)]
    for r in rows:
        r["ok"] = all(e <= TOL[n] for n, e in r["errors"].items())
        r["status"] = "ok" if r["ok"] else "ERRORS OVER FLA'S TOLERANCES"
    # FLA's rows at this shape replace every earlier one (a "skipped" row included)
    merge_rows(out / "results.json", rows, env, key=("B", "T", "H", "path"))
    for r in rows:
        print(f"fla [{tag}] {r['pass_']}: {r['time_ms']:.2f} ms, peak {r['peak_mib']:.0f} MiB, errors {r['errors']}",
              flush=True)
    if profile:
        text = "\n\n".join(kernel_profile(torch, fn, profile, f"FLA chunk_kda [{tag}] {name}")
                            for name, fn in (("training step", step), ("forward", fwd)))
        (out / f"fla_profile_{tag}.txt").write_text(text + "\n")
        print(text, flush=True)
    return rows


def kernel_profile(torch, fn, calls: int, title: str) -> str:
    """Per-kernel device time of ``fn`` (already warm) over ``calls`` calls, under
    ``torch.profiler`` (CUDA activity only): a table of ms per call and launches per call,
    largest first, and the sum (the device's busy time per call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = getattr(e, "cuda_time_total", 0.0) if us is None else us
        if us > 0:
            rows.append((us / calls / 1e3, e.count / calls, e.key))
    rows.sort(reverse=True)
    lines = [f"{title}: {len(rows)} kernels, device busy {sum(r[0] for r in rows):.3f} ms per call (of {calls})",
             f"{'ms/call':>9} {'n/call':>7}  kernel"]
    lines += [f"{ms:9.3f} {n:7.1f}  {name[:110]}" for ms, n, name in rows]
    return "\n".join(lines)


def fla_calls(chunk_kda, torch, arrays: dict, dev: str = "cuda"):
    """``(fwd, step)``: FLA's forward (no autograd) and training step (loss ``sum(o * w)``,
    gradients of ``GRAD_NAMES``) on ``arrays`` (numpy, float32: q, k, v, g, beta cast to
    bf16, A_log and dt_bias kept float32, and the loss weights ``w``). Shared with
    ``gpu_vs_fla.py``'s in-process FLA path."""
    t = {n: torch.from_numpy(arrays[n]).to(dev) for n in (*GRAD_NAMES, "w")}
    ins = {n: t[n].to(torch.bfloat16) if n not in ("A_log", "dt_bias") else t[n] for n in GRAD_NAMES}
    w = t["w"]

    def fwd():
        with torch.no_grad():
            return chunk_kda(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], A_log=ins["A_log"],
                             dt_bias=ins["dt_bias"], **OPTIONS)[0]

    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in ins.items()}

    def step():
        o = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                      dt_bias=leaves["dt_bias"], **OPTIONS)[0]
        loss = (o.float() * w).sum()
        return loss, torch.autograd.grad(loss, [leaves[n] for n in GRAD_NAMES])

    return fwd, step


# -- the layer -------------------------------------------------------------------------------
def run_layer(torch, npz: Path, out: Path, reps: int, env: dict) -> list:
    """FLA's layer on ``layer_in.npz`` (config, weights under FLA's names, x, w): bf16
    parameters and activations (``module.to(torch.bfloat16)``), the forward without
    autograd and the training step (loss ``sum(y.float() * w)``, gradients of x and of
    every parameter); outputs to ``layer_fla.npz`` beside ``npz``, rows to
    ``out/layer.json``."""
    from fla.layers.kda import KimiDeltaAttention

    d = np.load(npz)
    cfg = json.loads(str(d["cfg"]))
    dev = "cuda"
    layer = KimiDeltaAttention(hidden_size=cfg["hidden"], head_dim=cfg["head_dim"], num_heads=cfg["heads"],
                               conv_size=cfg["conv_size"], norm_eps=cfg["norm_eps"], mode="chunk")
    layer = layer.to(dev, torch.bfloat16)
    sd = {n[2:]: torch.from_numpy(np.array(d[n])).to(dev, torch.bfloat16) for n in d.files if n.startswith("p.")}
    layer.load_state_dict(sd, strict=True)
    params = dict(layer.named_parameters())
    x = torch.from_numpy(np.array(d["x"])).to(dev, torch.bfloat16)
    w = torch.from_numpy(np.array(d["w"])).to(dev)

    def fwd():
        with torch.no_grad():
            return layer(x)[0]

    xg = x.detach().clone().requires_grad_(True)

    def step():
        y = layer(xg)[0]
        loss = (y.float() * w).sum()
        return loss, torch.autograd.grad(loss, [xg, *params.values()])

    base = dict(path=LAYER_PATH, reps=reps)
    (_, grads), c_step, m_step = first_call(torch, step)
    print(f"FLA layer: training step, first call {c_step:.1f} s", flush=True)
    outs = {"d.x": grads[0]}
    outs.update({"d." + n: gr for n, gr in zip(params, grads[1:])})
    del grads
    y, c_fwd, m_fwd = first_call(torch, fwd)
    print(f"FLA layer: forward, first call {c_fwd:.1f} s", flush=True)
    outs["y"] = y
    np.savez(npz.with_name("layer_fla.npz"), **{k: v.detach().float().cpu().numpy() for k, v in outs.items()})
    del outs, y
    rows = [dict(base, pass_="fwd", time_ms=1e3 * timed(torch, fwd, reps), first_call_s=c_fwd, **m_fwd),
            dict(base, pass_="train", time_ms=1e3 * timed(torch, step, reps), first_call_s=c_step, **m_step)]
    merge_rows(out / "layer.json", rows, dict(env, fla_layers=_version("flash-linear-attention")),
               key=("path", "pass_"))
    for r in rows:
        print(f"fla layer {r['pass_']}: {r['time_ms']:.2f} ms, peak {r['peak_mib']:.0f} MiB", flush=True)
    return rows


# -- shared ----------------------------------------------------------------------------------
def first_call(torch, fn):
    """``(result, seconds, memory)``: ``fn``'s first call with PyTorch's allocator peak
    reset just before it; memory as the kdax rows have it (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    mem = dict(peak_mib=torch.cuda.max_memory_allocated() / MIB, inputs_mib=before / MIB, peak_own=True, xla_mib=None)
    return r, secs, mem


def timed(torch, fn, reps):
    """Median seconds of ``reps`` synchronised calls after two warm-up calls."""
    for _ in range(2):
        fn()
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def merge_rows(path: Path, rows: list, env: dict, key: tuple) -> dict:
    """Merge ``rows`` into the JSON results file at ``path`` (``{"env": ..., "rows":
    [...]}``, created if missing): a row replaces the one with the same ``key`` fields,
    new rows go last, ``env`` updates the file's. Returns what was written."""
    path = Path(path)
    res = json.loads(path.read_text()) if path.exists() else {}
    res.setdefault("env", {}).update({k: v for k, v in env.items() if v is not None})
    new = {tuple(r[k] for k in key) for r in rows}
    res["rows"] = [r for r in res.get("rows", []) if tuple(r.get(k) for k in key) not in new] + list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return res


def prune_autotuning(n: int) -> None:
    """Every Triton autotuner made from now on keeps at most ``n`` of its configs, spread
    evenly over its list (first and last included)."""
    from triton.runtime import autotuner

    init = autotuner.Autotuner.__init__

    def pruned(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if len(self.configs) > n:
            idx = sorted({int(round(i)) for i in np.linspace(0, len(self.configs) - 1, n)})
            self.configs = [self.configs[i] for i in idx]

    autotuner.Autotuner.__init__ = pruned


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
