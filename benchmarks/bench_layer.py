"""Benchmark rows for the layer, ``kdax.nn.KimiDeltaAttention`` (float32):

* ``train``: a training step of the layer, ``jax.value_and_grad`` of ``sum(y * w)`` (w
  fixed random) with respect to every parameter, at B=1, T=4096, hidden 1024, 8 heads x
  128 (K = V = 128, chunk 64), beside a training step of ``chunk_kda`` alone on inputs of
  the same shapes and options (in-kernel gate, l2norm, beta sigmoid; gradients of q, k, v,
  g, beta, A_log, dt_bias): the share of the layer's step spent in ``chunk_kda``;
* ``decode``: one token for a batch of 16 sequences continuing from a ``KDACache`` (the
  recurrent path, the cache donated), beside ``fused_recurrent_kda`` alone on the same
  shapes (its share), and the same step forced through ``chunk_kda``.

Times are medians of ``--reps`` synchronised calls after a warm-up, the layer and its
kernel alternating in rounds so that a slow minute reaches both. ``--base REV``: instead,
the ``train`` row's step of this tree's layer against another revision's (exported as
``benchmarks/stage_ab.py`` does), the same parameters, alternating in one process: best and
median times, their ratio, XLA's temporaries of each program and the largest difference
of the gradients.

    python benchmarks/bench_layer.py [--out benchmarks/results/layer.txt] [--base REV]
"""

import argparse
import functools
import os
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdax
from kdax.nn import KimiDeltaAttention


def _rounds(fs, reps):
    """Median seconds of each zero-argument function, every one once per round."""
    for f in fs:
        jax.block_until_ready(f())
    ts = [[] for _ in fs]
    for _ in range(reps):
        for i, f in enumerate(fs):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in ts]


def _kernel_options(layer):
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=layer.allow_neg_eigval, lower_bound=layer.lower_bound)


def _kernel_inputs(r, B, T, layer):
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    return f(B, T, H, K), f(B, T, H, K), f(B, T, HV, V), f(B, T, HV, K), f(B, T, HV)


def train_row(B=1, T=4096, hidden=1024, heads=8, head_dim=128, chunk_size=64, reps=5, seed=0):
    r = np.random.default_rng(seed)
    layer = KimiDeltaAttention(hidden, heads, head_dim, key=jax.random.key(seed))
    x = jnp.asarray(r.normal(size=(B, T, hidden)), jnp.float32)
    w = jnp.asarray(r.normal(size=(B, T, hidden)), jnp.float32)
    params, static = eqx.partition(layer, eqx.is_array)

    @jax.jit
    def layer_step(params, x, w):
        loss = lambda p: jnp.sum(eqx.combine(p, static)(x, mode="chunk", chunk_size=chunk_size)[0] * w)
        return jax.value_and_grad(loss)(params)

    q, k, v, g, beta = _kernel_inputs(r, B, T, layer)
    wo = jnp.asarray(r.normal(size=v.shape), jnp.float32)
    opts = _kernel_options(layer)
    A_log, dt_bias = opts.pop("A_log"), opts.pop("dt_bias")

    @jax.jit
    def kernel_step(q, k, v, g, beta, A_log, dt_bias, wo):
        def loss(*a):
            o, _ = kdax.chunk_kda(*a[:5], A_log=a[5], dt_bias=a[6], chunk_size=chunk_size, **opts)
            return jnp.sum(o * wo)
        return jax.value_and_grad(loss, argnums=tuple(range(7)))(q, k, v, g, beta, A_log, dt_bias)

    t0 = time.perf_counter()
    jax.block_until_ready(layer_step(params, x, w))
    compile_s = time.perf_counter() - t0
    t_layer, t_kernel = _rounds([lambda: layer_step(params, x, w),
                                 lambda: kernel_step(q, k, v, g, beta, A_log, dt_bias, wo)], reps)
    return dict(row="train", shape=f"B={B} T={T} hidden={hidden} H={heads} K=V={head_dim} chunk={chunk_size}",
                layer_s=t_layer, kernel_s=t_kernel, share=t_kernel / t_layer, compile_s=compile_s,
                tokens_per_s=B * T / t_layer)


def train_ab(base: str, B=1, T=4096, hidden=1024, heads=8, head_dim=128, chunk_size=64, reps=5, seed=0) -> str:
    """``--base``: the layer's training step (``train_row``'s) of this tree against ``base``'s."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stage_ab import export_base, maxdiff, timed

    dest, sha = export_base(base)
    sys.path.insert(0, dest)
    import kdax_base

    r = np.random.default_rng(seed)
    x, w = (jnp.asarray(r.normal(size=(B, T, hidden)), jnp.float32) for _ in range(2))
    steps, grads, temps = [], [], []
    for mod in (kdax_base, kdax):
        params, static = eqx.partition(mod.nn.KimiDeltaAttention(hidden, heads, head_dim, key=jax.random.key(seed)),
                                       eqx.is_array)
        loss = lambda p, static=static: jnp.sum(eqx.combine(p, static)(x, mode="chunk", chunk_size=chunk_size)[0] * w)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        grads.append(jax.tree.leaves(compiled(params)))
        steps.append(functools.partial(compiled, params))
    diff = maxdiff(*grads)
    ts, _ = timed(steps, [(), ()], reps)
    best, med = [min(t) for t in ts], [float(np.median(t)) for t in ts]
    return (f"layer training step, B={B} T={T} hidden={hidden} H={heads} K=V={head_dim} chunk={chunk_size} float32, "
            f"{reps} rounds: base {sha} best {best[0] * 1e3:.1f} median {med[0] * 1e3:.1f} ms ({temps[0]:.1f} MiB "
            f"temporaries); this tree best {best[1] * 1e3:.1f} median {med[1] * 1e3:.1f} ms ({temps[1]:.1f} MiB); "
            f"new/base best {best[1] / best[0]:.3f} median {med[1] / med[0]:.3f}; gradients' largest difference "
            f"{diff:.3g}")


def decode_row(batch=16, hidden=1024, heads=8, head_dim=128, reps=20, seed=0, mode="recurrent"):
    r = np.random.default_rng(seed)
    layer = KimiDeltaAttention(hidden, heads, head_dim, key=jax.random.key(seed))
    cache = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape) * 0.1, a.dtype), layer.init_cache(batch))
    x = jnp.asarray(r.normal(size=(batch, 1, hidden)), jnp.float32)
    params, static = eqx.partition(layer, eqx.is_array)
    step = jax.jit(lambda p, x, c: eqx.combine(p, static)(x, cache=c, mode=mode), donate_argnums=2)
    # the cache is donated: every call consumes the last call's cache
    box = [cache]

    def layer_call():
        y, box[0] = step(params, x, box[0])
        return y

    q, k, v, g, beta = _kernel_inputs(r, batch, 1, layer)
    h0 = jnp.asarray(r.normal(size=cache.state.shape) * 0.1, jnp.float32)
    opts = _kernel_options(layer)
    if mode == "recurrent":
        kern = jax.jit(lambda q, k, v, g, beta, h0: kdax.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, **opts))
    else:
        kern = jax.jit(lambda q, k, v, g, beta, h0: kdax.chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, **opts))
    t_layer, t_kernel = _rounds([layer_call, lambda: kern(q, k, v, g, beta, h0)], reps)
    kname = "fused_recurrent_kda" if mode == "recurrent" else "chunk_kda"
    return dict(row=f"decode[{mode}]", shape=f"batch={batch} 1 token hidden={hidden} H={heads} K=V={head_dim}",
                layer_s=t_layer, kernel_s=t_kernel, share=t_kernel / t_layer, kernel=kname,
                tokens_per_s=batch / t_layer)


def format_rows(rows):
    lines = [f"{'row':18s} {'shape':50s} {'layer':>10s} {'kernel':>10s} {'share':>6s} {'tokens/s':>10s}"]
    for r in rows:
        lines.append(f"{r['row']:18s} {r['shape']:50s} {r['layer_s'] * 1e3:8.2f}ms {r['kernel_s'] * 1e3:8.2f}ms "
                     f"{r['share'] * 100:5.1f}% {r['tokens_per_s']:10.0f}")
    return "\n".join(lines)


def main(argv=None, **shape):
    p = argparse.ArgumentParser(description="kdax.nn layer benchmark rows")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the table here (e.g. benchmarks/results/layer.txt)")
    p.add_argument("--rows", default="train,decode,decode_chunk", help="comma-separated: train, decode (recurrent "
                   "path), decode_chunk (the decode step forced through chunk_kda)")
    p.add_argument("--base", default=None, help="instead: the train row's step against this revision's, one process")
    a = p.parse_args(argv)
    which = set(a.rows.split(","))
    train_kw = {k: v for k, v in shape.items() if k in ("B", "T", "hidden", "heads", "head_dim", "chunk_size")}
    if a.base is not None:
        line = train_ab(a.base, reps=a.reps, **train_kw)
        print(line)
        return line
    dec_kw = {k: v for k, v in shape.items() if k in ("batch", "hidden", "heads", "head_dim")}
    rows = [train_row(reps=a.reps, **train_kw)] if "train" in which else []
    if "decode" in which:
        rows.append(decode_row(reps=4 * a.reps, **dec_kw))
    if "decode_chunk" in which:
        rows.append(decode_row(reps=4 * a.reps, mode="chunk", **dec_kw))
    compile_s = f"{rows[0]['compile_s']:.1f} s" if "train" in which else "-"
    dev = jax.devices()[0]
    head = (f"kdax.nn.KimiDeltaAttention, float32, {platform.machine()} {os.cpu_count()} cores, "
            f"{dev.platform} ({dev.device_kind}), jax {jax.__version__}; medians of {a.reps} (train) / "
            f"{4 * a.reps} (decode) runs; share = time of the kernel alone / time of the layer\n"
            f"train: value_and_grad of sum(y * w) over every parameter (layer) vs value_and_grad of chunk_kda over "
            f"q, k, v, g, beta, A_log, dt_bias (kernel); first call (compile + run) {compile_s}\n"
            f"decode: one token per sequence from a KDACache (donated) vs the kernel alone on one token\n")
    text = head + format_rows(rows) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
