"""Shared test helpers: metrics, input factories, golden cases, the float64 oracle."""

import json
import os
import pathlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from kdax.ref import beta_activation, kda_gate, l2norm, naive_recurrent_kda

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
GOLDEN_CASES = sorted(p.stem for p in GOLDEN_DIR.glob("*.npz"))
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
# An accelerator the Pallas kernels compile for (their "device" test cases run only there).
ON_DEVICE = jax.default_backend() in ("gpu", "tpu")


def jitted(fn):
    """``fn`` (a stage, or a function of arrays and static values) under ``eqx.filter_jit``:
    one program per function and argument shapes. Called eagerly, each of its operations is
    compiled alone, about 60 ms each to lower and compile on a 2-core machine, hundreds a
    test: tests/pallas/test_stages.py took 335 s so and 158 s jitted (4,592 -> 1,041 compiles)."""
    return eqx.filter_jit(fn)


def rel_rms(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.sqrt(np.mean(ref**2))
    return float(np.sqrt(np.mean((x - ref) ** 2)) / (den if den > 0 else 1.0))


def assert_close(x, ref, tol, name=""):
    """Relative RMS within ``tol``; NaN/Inf never passes. Reports max-abs too."""
    x = np.asarray(x, np.float64)
    assert x.shape == np.shape(ref), f"{name}: shape {x.shape} != {np.shape(ref)}"
    assert np.all(np.isfinite(x)), f"{name}: non-finite values"
    err = rel_rms(x, ref)
    mx = float(np.max(np.abs(x - np.asarray(ref)))) if x.size else 0.0
    assert err <= tol, f"{name}: rel-RMS {err:.3e} > {tol:.1e} (max-abs {mx:.3e})"
    return err


def make_inputs(seed=0, B=2, T=70, H=2, HV=None, K=16, V=16, dtype=jnp.float64, N=None,
                gate="log", strong=False, h0=True, A_log=False, dt_bias=False, beta_raw=False):
    """Random KDA inputs. gate='log': g <= 0 given directly; gate='raw': raw gate input."""
    HV = HV or H
    r = np.random.default_rng(seed)
    f = lambda *s: r.normal(size=s)
    x = dict(
        q=f(B, T, H, K),
        k=f(B, T, H, K) / np.sqrt(K),
        v=f(B, T, HV, V),
        beta=f(B, T, HV) if beta_raw else r.uniform(0.05, 0.95, size=(B, T, HV)),
    )
    if gate == "log":
        g = -r.uniform(0.01, 0.5, size=(B, T, HV, K))
        if strong:
            g[r.uniform(size=g.shape) < 0.05] = -1000.0
        x["g"] = g
    else:
        x["g"] = f(B, T, HV, K)
    N = B if N is None else N
    if h0:
        x["initial_state"] = f(N, HV, K, V) * 0.3
    if A_log:
        x["A_log"] = r.uniform(-1.0, 0.5, size=(HV,))
    if dt_bias:
        x["dt_bias"] = f(HV * K) * 0.5
    return {n: jnp.asarray(a, dtype) for n, a in x.items()}


def split_args(inputs):
    """(positional q, k, v, g, beta; keyword array options)."""
    pos = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta"))
    kw = {n: inputs[n] for n in ("initial_state", "A_log", "dt_bias") if n in inputs}
    return pos, kw


def oracle_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
               lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
               cu_seqlens=None, state_v_first=False, **_):
    """The float64 oracle for every option: kdax.ref activations + naive_recurrent_kda,
    one call per sequence for varlen."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    beta = beta_activation(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = jnp.swapaxes(h0, -1, -2)
    if cu_seqlens is None:
        o, ht = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    else:
        cu = [int(c) for c in np.asarray(cu_seqlens)]
        N = len(cu) - 1
        K, V, HV = q.shape[-1], v.shape[-1], v.shape[2]
        if h0 is None:
            h0 = jnp.zeros((N, HV, K, V), ht_dtype(q))
        outs, hts = [], []
        for i in range(N):
            s, e = cu[i], cu[i + 1]
            if e == s:
                hts.append(h0[i])
                continue
            sl = lambda x: x[:, s:e]
            o_i, h_i = naive_recurrent_kda(sl(q), sl(k), sl(v), sl(g), sl(beta), scale=scale,
                                           initial_state=h0[i : i + 1], output_final_state=True)
            outs.append(o_i)
            hts.append(h_i[0])
        o = jnp.concatenate(outs, axis=1) if outs else jnp.zeros(v.shape, v.dtype)
        ht = jnp.stack(hts)
    if state_v_first:
        ht = jnp.swapaxes(ht, -1, -2)
    return o, (ht if output_final_state else None)


def ht_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _loss(fn, names, options, do, dht):
    """``sum(o*do) + sum(ht*dht)`` as a function of the arrays ``names``, with ``(o, ht)``."""
    def loss(*xs):
        pos, kw = split_args(dict(zip(names, xs)))
        o, ht = fn(*pos, **kw, **options)
        val = jnp.sum(o.astype(jnp.float64 if do.dtype == jnp.float64 else jnp.float32) * do)
        if ht is not None and dht is not None:
            val = val + jnp.sum(ht * dht)
        return val, (o, ht)

    return loss


def loss_grads(fn, inputs, options, do, dht):
    """Gradients of ``sum(o*do) + sum(ht*dht)`` with respect to every array in ``inputs``."""
    return outputs_and_grads(fn, inputs, options, do, dht)[2]


def output_shapes(fn, inputs, options):
    """``(o, ht)``'s shapes and dtypes from a trace of ``fn`` (nothing compiled or run)."""
    return jax.eval_shape(lambda x: run(fn, x, options), inputs)


def outputs_and_grads(fn, inputs, options, do, dht):
    """``(o, ht, grads)``: ``run``'s outputs, as the gradient's forward computes them, and
    ``loss_grads``' gradients, from one program (one trace and one compile, where ``run``
    and ``loss_grads`` take two: a quarter to a third of an option sweep's time)."""
    names = [n for n in GRAD_NAMES if n in inputs]
    grad = jax.grad(_loss(fn, names, options, do, dht), argnums=tuple(range(len(names))), has_aux=True)
    grads, (o, ht) = jax.jit(grad)(*(inputs[n] for n in names))
    return o, ht, dict(zip(names, grads))


def run(fn, inputs, options):
    """``fn(q, k, v, g, beta, **inputs, **options)`` under one jit; the inputs are traced,
    the options (cu_seqlens included) are constants of the trace."""

    @jax.jit
    def f(arrays):
        pos, kw = split_args(arrays)
        return fn(*pos, **kw, **options)

    return f(dict(inputs))


def load_golden(name):
    """(inputs by kdax argument name, options, outputs by name) of one golden case."""
    d = np.load(GOLDEN_DIR / f"{name}.npz")
    meta = json.loads(str(d["meta"]))
    rename = {"h0": "initial_state"}
    inputs = {rename.get(k[3:], k[3:]): d[k] for k in d.files if k.startswith("in_")}
    outs = {k[4:]: d[k] for k in d.files if k.startswith("out_")}
    options = dict(output_final_state=True)
    for key in ("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound",
                "use_beta_sigmoid_in_kernel", "allow_neg_eigval"):
        if meta.get(key) not in (None, False):
            options[key] = meta[key]
    if "cu_seqlens" in inputs:
        options["cu_seqlens"] = jnp.asarray(inputs.pop("cu_seqlens"))
    do, dht = inputs.pop("do"), inputs.pop("dht")
    return inputs, options, outs, do, dht


def check_golden(fn, name, dtype, tol_o, tol_g):
    inputs, options, outs, do, dht = load_golden(name)
    x = {n: jnp.asarray(a, dtype) for n, a in inputs.items()}
    o, ht = run(fn, x, options)
    assert o.dtype == dtype
    assert_close(o, outs["o"], tol_o, "o")
    assert_close(ht, outs["ht"], tol_o, "ht")
    grads = loss_grads(fn, x, options, jnp.asarray(do, dtype), jnp.asarray(dht, ht.dtype))
    golden_name = {"initial_state": "dh0"}
    for n, gr in grads.items():
        assert gr.dtype == dtype, n
        assert_close(gr, outs[golden_name.get(n, "d" + n)], tol_g, "d" + n)


def load_example(name: str):
    """``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kdax_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dot_eqns(jaxpr):
    """Every dot_general equation of a jaxpr, sub-jaxprs (loops, custom rules) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    out += dot_eqns(sub)
    return out


def python_blocks(text: str) -> list:
    """The contents of every ```python fence of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


_BLOCKS_RUNNER = '''
import sys, time, traceback
blocks = {blocks!r}
ns = {{"__name__": "__main__"}}
for i, src in enumerate(blocks):
    t, c = time.perf_counter(), time.process_time()
    try:
        exec(compile(src, f"{name} block {{i}}", "exec"), ns)
    except BaseException:
        print(f"{name} block {{i}} failed:\\n{{src}}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    print(f"{name} block {{i}} ran in {{time.perf_counter() - t:.1f}} s ({{time.process_time() - c:.1f}} s CPU)",
          flush=True)
'''


def one_device_env(**extra) -> dict:
    """The environment of a fresh process on one CPU device, as a user's CPU program runs:
    the suite's simulated devices taken out of XLA_FLAGS (its other flags kept), JAX's
    64-bit mode not set from the environment, ``JAX_PLATFORMS=cpu``; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return dict(env, JAX_PLATFORMS="cpu", **extra)


def run_python_blocks(blocks: list, name: str, tmp_path) -> str:
    """Run ``blocks`` top to bottom in one fresh Python process as a new user has it
    (JAX's defaults: no x64, one CPU device, the suite's simulated devices taken out of
    XLA_FLAGS; the empty folder ``tmp_path`` as working directory); assert that every
    block ran and return the process's output (one line per block with its time)."""
    script = pathlib.Path(tmp_path) / "blocks.py"
    script.write_text(_BLOCKS_RUNNER.format(blocks=blocks, name=name))
    root = pathlib.Path(__file__).resolve().parents[1]
    env = one_device_env(PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert run.stdout.count(" ran in ") == len(blocks), run.stdout
    return run.stdout
