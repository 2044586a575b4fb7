"""kdax's layer beside FLA's on one GPU: ``kdax.nn.KimiDeltaAttention`` and FLA's
``fla.layers.KimiDeltaAttention`` (flash-linear-attention 0.6.0) on the same weights.

Shape (FLA's ``KDAConfig`` defaults, the goal shape's 16 heads): B=1, T=4096, hidden 2048,
16 heads x 128 (K = V = 128), short convolutions of width 4 without bias, the output
gate's bias, ``norm_eps`` 1e-6; chunk 64. (Kimi-Linear-48B-A3B's layers are wider, hidden
2304; ``--hidden`` and ``--heads`` choose another layer.) Both layers hold bf16
parameters and compute in bf16 (``module.to(torch.bfloat16)``; kdax's
``param_dtype=bfloat16``); the weights are random in FLA's initialisation scheme,
rounded to bf16, so both read the same values. Two passes per layer: the forward, and a training step (loss
``sum(y * w)`` in float32, ``w`` fixed random; gradients of x and of every parameter).
Times: medians of ``--reps`` synchronised calls after two warm-ups. Errors (relative
RMS): each layer against the same layer computed by kdax in float64 on the same values
(kdax's layer equals an independent float64 transcription of FLA's to 1e-12 in
tests/nn), and kdax's outputs against FLA's.

Three roles, each its own process (FLA and JAX are kept apart as in ``gpu_vs_fla.py``):

    python benchmarks/layer_vs_fla.py --work /tmp/kdax_gpu26 --out OUT     # kdax's side
    python benchmarks/fla_side.py --layer /tmp/kdax_gpu26/layer_in.npz --out OUT   # FLA's
    python benchmarks/layer_vs_fla.py --report --work /tmp/kdax_gpu26 --out OUT

kdax's side writes ``layer_in.npz`` (config, weights under FLA's names, x, w: what FLA's
side reads), ``layer_kdax.npz`` (its outputs and gradients) and ``layer_ref.npz`` (float64
values stored as float32) in ``--work``, and its rows to ``OUT/layer.json``; FLA's side
adds ``layer_fla.npz`` and its rows. The report (numpy only) computes every error from
those files into ``layer.json`` and writes ``layer.txt``. Memory as in ``gpu_vs_fla.py``
(kdax: XLA's figure and the device's peak; FLA: PyTorch's allocator peak).
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fla_side import LAYER_PATH, MIB, merge_rows  # noqa: E402  (numpy only)

KDAX_PATH = "kdax.nn"  # kdax's rows in layer.json
CONFIG = dict(B=1, T=4096, hidden=2048, heads=16, head_dim=128, conv_size=4, norm_eps=1e-6, chunk=64)


# -- kdax's side ----------------------------------------------------------------------------
def make_inputs(cfg: dict, seed: int = 0):
    """``(state dict under FLA's names, x, w)``, float32 numpy; the weights and x hold
    bf16-exact values. The weights follow FLA's (and kdax's) initialisation: linear and
    convolution weights uniform in ±1/sqrt(fan in), the output gate's bias likewise,
    ``A_log = log U(1, 16)``, ``dt_bias`` the inverse softplus of a log-uniform step in
    [1e-3, 0.1], ``o_norm`` ones (drawn here with numpy: fast at any size)."""
    import ml_dtypes

    from kdax.nn import weight_shapes

    r = np.random.default_rng(seed)
    bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    shapes = weight_shapes("fla", num_heads=cfg["heads"], head_dim=cfg["head_dim"], hidden_size=cfg["hidden"],
                           conv_size=cfg["conv_size"])
    sd = {}
    for name, shape in shapes.items():
        if name == "A_log":
            a = np.log(r.uniform(1.0, 16.0, shape))
        elif name == "dt_bias":
            step = np.maximum(np.exp(r.uniform(math.log(1e-3), math.log(0.1), shape)), 1e-4)
            a = step + np.log(-np.expm1(-step))
        elif name == "o_norm.weight":
            a = np.ones(shape)
        else:  # [out, in] or [channels, 1, W]; a bias: bounded by its layer's fan in (head_v_dim)
            fan_in = shape[-1] if len(shape) > 1 else cfg["head_dim"]
            a = r.uniform(-1.0, 1.0, shape) / math.sqrt(fan_in)
        sd[name] = bf16(a)
    x = bf16(r.standard_normal((cfg["B"], cfg["T"], cfg["hidden"]), dtype=np.float32))
    w = r.standard_normal(x.shape, dtype=np.float32)
    return sd, x, w


def save_inputs(cfg: dict, work: Path, seed: int = 0):
    """``make_inputs`` written to ``work/layer_in.npz``, what FLA's side reads: ``cfg``
    (JSON), ``x``, ``w`` and ``p.<name>`` for every weight under FLA's names."""
    work.mkdir(parents=True, exist_ok=True)
    sd, x, w = make_inputs(cfg, seed)
    np.savez(work / "layer_in.npz", cfg=np.array(json.dumps(cfg)), x=x, w=w, **{"p." + k: v for k, v in sd.items()})
    return sd, x, w


def kdax_layer(sd: dict, cfg: dict, dtype):
    from kdax.nn import KimiDeltaAttention

    return KimiDeltaAttention.from_state_dict(sd, num_heads=cfg["heads"], head_dim=cfg["head_dim"], naming="fla",
                                              norm_eps=cfg["norm_eps"], allow_neg_eigval=False, lower_bound=None,
                                              param_dtype=dtype)


def layer_fns(layer, chunk: int, pipeline=None):
    """``(params, fwd, step)``: the layer's arrays, and jitted ``fwd(params, x) -> y`` and
    ``step(params, x, w) -> ((loss, y), (d params, dx))``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    params, static = eqx.partition(layer, eqx.is_array)

    def fwd(p, x):
        return eqx.combine(p, static)(x, mode="chunk", chunk_size=chunk, pipeline=pipeline)[0]

    def loss(p, x, w):
        y = fwd(p, x)
        return jnp.sum(y.astype(w.dtype) * w), y

    return params, static, jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _outputs(static, y, dparams, dx) -> dict:
    """``{"y", "d.x", "d.<FLA name>"}`` as float32 numpy: the gradient module's arrays under
    FLA's names and shapes (``state_dict`` of the gradient)."""
    import equinox as eqx

    out = {"y": np.asarray(y, np.float32), "d.x": np.asarray(dx, np.float32)}
    out.update({"d." + n: np.asarray(a, np.float32) for n, a in eqx.combine(dparams, static).state_dict("fla").items()})
    return out


def run_kdax(cfg: dict, work: Path, out: Path, reps: int, seed: int = 0, ref: bool = True) -> list:
    """kdax's side: inputs saved, kdax's layer timed (both programs compiled before the
    inputs reach the device, the training step run first: its peak is the clean one),
    outputs saved, rows merged into ``out/layer.json``; then the float64 reference."""
    import jax
    import jax.numpy as jnp

    from gpu_vs_fla import device_memory, median_time, xla_memory_mib

    sd, x_np, w_np = save_inputs(cfg, work, seed)
    layer = kdax_layer(sd, cfg, jnp.bfloat16)
    params, static, fwd, step = layer_fns(layer, cfg["chunk"])
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    p_spec = jax.tree.map(spec, params)
    x_spec, w_spec = jax.ShapeDtypeStruct(x_np.shape, jnp.bfloat16), jax.ShapeDtypeStruct(w_np.shape, jnp.float32)
    t0 = time.perf_counter()
    c_fwd = fwd.lower(p_spec, x_spec).compile()
    s_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    c_step = step.lower(p_spec, x_spec, w_spec).compile()
    s_step = time.perf_counter() - t0
    m_compiled = device_memory()
    x, w = jnp.asarray(x_np, jnp.bfloat16), jnp.asarray(w_np)
    params = jax.device_put(params)
    m_inputs = device_memory()
    t0 = time.perf_counter()
    (_, _), (dp, dx) = jax.block_until_ready(c_step(params, x, w))
    r_step = time.perf_counter() - t0
    m_step = device_memory()
    t0 = time.perf_counter()
    y = jax.block_until_ready(c_fwd(params, x))
    r_fwd = time.perf_counter() - t0
    m_fwd = device_memory()
    np.savez(work / "layer_kdax.npz", **_outputs(static, y, dp, dx))
    del y, dp, dx
    t_fwd = median_time(lambda: c_fwd(params, x), jax.block_until_ready, reps)
    t_step = median_time(lambda: c_step(params, x, w), jax.block_until_ready, reps)

    def mem(m_after, clean):
        if m_after is None:
            return dict(peak_mib=None, inputs_mib=None, peak_own=None)
        return dict(peak_mib=m_after[1] / MIB, inputs_mib=m_inputs[0] / MIB, peak_own=bool(clean and m_after[1] >
                                                                                             m_compiled[1]))

    dev = jax.devices()[0]
    rows = [dict(path=KDAX_PATH, pass_="fwd", reps=reps, time_ms=1e3 * t_fwd, first_call_s=s_fwd + r_fwd,
                 compile_s=s_fwd, xla_mib=xla_memory_mib(c_fwd),
                 **mem(m_fwd, m_fwd is not None and m_fwd[1] > m_step[1])),
            dict(path=KDAX_PATH, pass_="train", reps=reps, time_ms=1e3 * t_step, first_call_s=s_step + r_step,
                 compile_s=s_step, xla_mib=xla_memory_mib(c_step), **mem(m_step, True))]
    env = dict(device=getattr(dev, "device_kind", dev.platform), jax=jax.__version__, config=cfg)
    merge_rows(out / "layer.json", rows, env, key=("path", "pass_"))
    for r in rows:
        print(f"kdax layer {r['pass_']}: {r['time_ms']:.2f} ms (compile {r['compile_s']:.1f} s)", flush=True)
    if ref:
        t0 = time.perf_counter()
        np.savez(work / "layer_ref.npz", **reference64(sd, x_np, w_np, cfg))
        print(f"float64 reference: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def reference64(sd: dict, x, w, cfg: dict) -> dict:
    """The layer's outputs and gradients in float64 (kdax's layer on the same values,
    the reference pipeline untiled; 64-bit types on for this call only), as float32
    numpy under ``_outputs``' names."""
    import jax
    import jax.numpy as jnp

    from kdax import KDAPipeline

    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        layer = kdax_layer(sd, cfg, jnp.float64)
        params, static, _, step = layer_fns(layer, cfg["chunk"], KDAPipeline.reference().untiled())
        (_, y), (dp, dx) = step(params, jnp.asarray(x, jnp.float64), jnp.asarray(w, jnp.float64))
        return _outputs(static, y, dp, dx)
    finally:
        jax.config.update("jax_enable_x64", prev)


# -- the report (numpy only) ------------------------------------------------------------------
def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: {x.shape} against {ref.shape}")
    e = float(np.sqrt(np.sum((x - ref) ** 2) / np.sum(ref * ref)))
    return e if math.isfinite(e) else float("inf")


def compare(outs, ref) -> dict:
    """``{name: rel-RMS of outs[name] against ref[name]}``; the two must hold the same
    names (the same parameters), else ValueError naming the difference."""
    if set(outs) != set(ref):
        raise ValueError(f"names differ: only in the outputs {sorted(set(outs) - set(ref))}, only in the "
                         f"reference {sorted(set(ref) - set(outs))}")
    return {n: rel_rms(outs[n], ref[n]) for n in sorted(ref)}


def _load(path: Path):
    if not path.exists():
        return None
    with np.load(path) as d:
        return {k: np.array(d[k]) for k in d.files}


def _split(errs: dict, pas: str) -> dict:
    return {"y": errs["y"]} if pas == "fwd" else {k[2:]: v for k, v in errs.items() if k.startswith("d.")}


def report(work: Path, out: Path) -> dict:
    """Errors from the npz files in ``work`` into ``out/layer.json`` (each row against the
    float64 reference; ``kdax_vs_fla``: kdax's outputs against FLA's), times relative to
    FLA's, and ``out/layer.txt``. A side whose files are missing is reported as such."""
    path = out / "layer.json"
    res = json.loads(path.read_text()) if path.exists() else {"env": {}, "rows": []}
    files = {KDAX_PATH: _load(work / "layer_kdax.npz"), LAYER_PATH: _load(work / "layer_fla.npz")}
    ref = _load(work / "layer_ref.npz")
    res["problems"] = []

    def checked(outs, against, what):
        try:
            return compare(outs, against)
        except ValueError as e:  # e.g. a parameter one layer has and the other lacks
            res["problems"].append(f"{what}: {e}")
            return None

    against64 = {p: checked(o, ref, f"{p} against float64") for p, o in files.items()
                 if o is not None and ref is not None}
    for r in res["rows"]:
        errs = against64.get(r["path"])
        r["errors"] = _split(errs, r["pass_"]) if errs else {}
    kd, fl = files[KDAX_PATH], files[LAYER_PATH]
    res["kdax_vs_fla"] = checked(kd, fl, "kdax against FLA") if kd is not None and fl is not None else None
    times = {(r["path"], r["pass_"]): r for r in res["rows"]}
    for r in res["rows"]:
        f = times.get((LAYER_PATH, r["pass_"]))
        r["vs_fla"] = r["time_ms"] / f["time_ms"] if f and r["path"] != LAYER_PATH else None
        r["mem_vs_fla"] = (r["peak_mib"] / f["peak_mib"] if f and r["path"] != LAYER_PATH and r.get("peak_mib")
                           and f.get("peak_mib") else None)
    res["missing"] = [n for n, v in (("kdax's outputs (layer_kdax.npz)", kd), ("FLA's outputs (layer_fla.npz)", fl),
                                     ("the float64 reference (layer_ref.npz)", ref)) if v is None]
    path.write_text(json.dumps(res, indent=1))
    (out / "layer.txt").write_text(layer_table(res) + "\n")
    return res


def _worst(errs: dict, skip=("y", "x", "d.x", "d.y")) -> str:
    """The largest error among the parameters' gradients, with its name."""
    ps = {k: v for k, v in errs.items() if k not in skip}
    if not ps:
        return "-"
    n = max(ps, key=ps.get)
    return f"{ps[n]:.2e} (d {n[2:] if n.startswith('d.') else n})"


def layer_table(res: dict) -> str:
    env, cfg = res.get("env", {}), res.get("env", {}).get("config", {})
    head = (f"kdax.nn.KimiDeltaAttention vs fla.layers.KimiDeltaAttention on {env.get('device')} "
            f"(jax {env.get('jax')}, torch {env.get('torch')}, flash-linear-attention {env.get('fla_layers')}, "
            f"FLA autotuning {env.get('fla_autotune')}); B={cfg.get('B')} T={cfg.get('T')} hidden {cfg.get('hidden')}, "
            f"{cfg.get('heads')} heads x {cfg.get('head_dim')}, conv {cfg.get('conv_size')}, chunk {cfg.get('chunk')}; "
            f"bf16 parameters and activations; train: loss sum(y*w), gradients of x and every parameter; times: "
            f"medians of n synchronised calls; errors: rel-RMS against kdax's layer in float64 on the same values; "
            f"peak MiB: the device's peak after the pass's first call (FLA: PyTorch's allocator; * may include "
            f"compilation's); xla MiB: XLA's figure for kdax's compiled program")
    cols = (f"{'path':<12} {'pass':<6} {'n':>3} {'time ms':>9} {'/FLA':>6} {'peak MiB':>9} {'/FLA':>6} {'xla MiB':>8}"
            f"  {'y':>8} {'dx':>8}  worst parameter gradient")
    lines = [head, cols, "-" * len(cols)]
    order = {LAYER_PATH: 0, KDAX_PATH: 1}
    for r in sorted(res["rows"], key=lambda r: (order.get(r["path"], 2), r["pass_"] != "fwd")):
        e = r.get("errors") or {}
        f = lambda v, fmt: "-" if v is None else format(v, fmt)
        peak = f(r.get("peak_mib"), ".0f") + ("" if r.get("peak_own") or r.get("peak_mib") is None else "*")
        if r["pass_"] == "fwd":
            errs = f"{f(e.get('y'), '.2e'):>8} {'':>8}"
            worst = ""
        else:
            errs = f"{'':>8} {f(e.get('x'), '.2e'):>8}"
            worst = _worst({"d." + k: v for k, v in e.items()}) if e else "-"
        lines.append(f"{r['path']:<12} {r['pass_']:<6} {r.get('reps', ''):>3} {r['time_ms']:>9.2f} "
                     f"{f(r.get('vs_fla'), '.2f'):>6} {peak:>9} {f(r.get('mem_vs_fla'), '.2f'):>6} "
                     f"{f(r.get('xla_mib'), '.0f'):>8}  {errs}  {worst}")
    kv = res.get("kdax_vs_fla")
    if kv:
        lines.append(f"kdax against FLA (rel-RMS, FLA's as reference): y {kv['y']:.2e}, dx {kv['d.x']:.2e}, "
                     f"worst parameter gradient {_worst(kv)}; every gradient in layer.json")
    lines += [f"missing: {m}" for m in res.get("missing", [])]
    lines += [f"not compared: {m}" for m in res.get("problems", [])]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="folder for the npz files (inputs, outputs, reference)")
    ap.add_argument("--out", required=True, help="folder of layer.json / layer.txt")
    ap.add_argument("--report", action="store_true", help="compute the errors and write the table, nothing else")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-ref", action="store_true", help="skip the float64 reference")
    for k, v in CONFIG.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.report:
        res = report(work, out)
        print((out / "layer.txt").read_text())
        return res
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cfg = {k: getattr(a, k) for k in CONFIG}
    return run_kdax(cfg, work, out, a.reps, ref=not a.no_ref)


if __name__ == "__main__":
    main()
