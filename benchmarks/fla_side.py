"""FLA's half of ``gpu_vs_fla.py``, in a process of its own (PyTorch only, no JAX): times
FLA's ``chunk_kda`` forward and training step on the inputs ``gpu_vs_fla.py --save-ref``
wrote, checks them against the float64 reference saved with them, and merges its rows
into ``results.json`` / ``results.txt``.

On the first H100 run (2026-11-26), FLA's first call in the process that also held JAX
did not return within 200 s; this split keeps the two runtimes (and FLA's autotuning)
apart and each under its own time limit.

    python benchmarks/fla_side.py --ref /tmp/ref_1x16384x16.npz --out benchmarks/results/gpu_h100
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="npz from gpu_vs_fla.py --save-ref")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-configs", type=int, default=0,
                    help="autotune each FLA kernel over at most this many of its configs, spread over its list "
                         "(0: all). FLA's full autotuning compiles hundreds of kernels on first call.")
    a = ap.parse_args(argv)
    import torch

    if a.max_configs:
        prune_autotuning(a.max_configs)
    from fla.ops.kda import chunk_kda

    d = np.load(a.ref)
    B, T, H, K = d["in_q"].shape
    V = d["in_v"].shape[-1]
    base = dict(B=int(B), T=int(T), H=int(H), K=int(K), V=int(V), chunk=64, dtype="bfloat16", path="fla")
    dev = "cuda"
    fwd, step = fla_calls(chunk_kda, torch, {n: np.array(d["in_" + n]) for n in (*GRAD_NAMES, "w")}, dev)

    def rel_rms(x, name):
        ref = torch.from_numpy(np.array(d["ref_" + name])).to(dev).double()
        e = float(torch.sqrt(((x.double() - ref) ** 2).sum() / (ref**2).sum()))
        return e if e == e else float("inf")

    def timed(fn, reps):
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

    t0 = time.perf_counter()
    o = fwd()
    torch.cuda.synchronize()
    c_fwd = time.perf_counter() - t0
    print(f"FLA forward, first call: {c_fwd:.1f} s", flush=True)
    e_o = rel_rms(o, "o")
    del o
    t0 = time.perf_counter()
    _, grads = step()
    torch.cuda.synchronize()
    c_step = time.perf_counter() - t0
    print(f"FLA training step, first call: {c_step:.1f} s", flush=True)
    errs = {n: rel_rms(gr, n) for n, gr in zip(GRAD_NAMES, grads)}
    del grads
    rows = [dict(base, pass_="fwd", time_ms=1e3 * timed(fwd, a.reps), first_call_s=c_fwd, errors={"o": e_o}),
            dict(base, pass_="train", time_ms=1e3 * timed(step, a.reps), first_call_s=c_step, errors=errs)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = Path(a.out)
    jpath = out / "results.json"
    res = json.loads(jpath.read_text()) if jpath.exists() else dict(env={}, rows=[])
    res["env"].update(fla=_version("fla-core"), torch=torch.__version__,
                      fla_autotune=f"at most {a.max_configs} configs per kernel" if a.max_configs else "full")
    keep = [r for r in res["rows"] if not (r["path"] == "fla" and (r["B"], r["T"], r["H"]) == (B, T, H))]
    for r in rows:
        r["ok"] = all(e <= TOL[n] for n, e in r["errors"].items())
        r["status"] = "ok" if r["ok"] else "ERRORS OVER FLA'S TOLERANCES"
    res["rows"] = keep + rows
    jpath.write_text(json.dumps(res, indent=1))
    for r in rows:
        print(f"fla {r['pass_']}: {r['time_ms']:.2f} ms, errors {r['errors']}", flush=True)


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
    main()
