"""Eager calls against jitted calls (issue 50): ``kdax.fused_recurrent_kda`` and the
layer's decode step called without ``jax.jit``, after their first call, against the same
call under ``jax.jit``. An eager call runs its checks on the caller's values (shapes,
options, g/beta's domain, cu_seqlens), then one compiled program cached by shapes, dtypes
and options; the ratio is what those checks and the dispatch add.

Rows (float32):

* ``recurrent decode [layer opts]``: one token for 16 sequences, H = HV = 8, K = V = 128,
  with the layer's in-kernel options (l2norm, softplus gate with A_log/dt_bias, beta
  sigmoid), from an initial state, final state returned;
* ``recurrent decode [plain]``: the same shape with an activated g and beta (the eager
  domain check reads them on the host at every call);
* ``recurrent decode small``: B = 8, H = 4, K = V = 64 (plain): the smallest step, where
  the fixed cost of an eager call weighs most;
* ``recurrent T=512``: B = 1, T = 512, H = 8, K = V = 128 (plain);
* ``recurrent T=512 grad``: ``jax.grad`` of ``sum(o * w)`` with respect to q, k, v, g,
  beta, eagerly against ``jax.jit(jax.grad(...))``;
* ``layer decode``: ``KimiDeltaAttention(1024, 8, 128)`` (bench_layer.py's decode shape),
  one token for 16 sequences from a ``KDACache``, against the step jitted over the
  layer's arrays (``eqx.partition``).

``--op-by-op`` times the eager calls as they ran before issue 50 (each operation
dispatched on its own, the path traced calls still take), for comparison in the same run.

Times are medians of ``--reps`` synchronised calls, the eager and jitted calls alternating
in rounds so that a slow minute reaches both; ``first`` is the first eager call (compile
and run). Speed is measured here, never asserted in the tests.

    python benchmarks/eager_calls.py [--out benchmarks/results/eager_calls.txt]
"""

import argparse
import contextlib
import os
import platform
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdax
import kdax.nn._layer
import kdax.recurrent
from kdax.nn import KimiDeltaAttention

ROWS = ("decode_layer_opts", "decode_plain", "decode_small", "t512", "t512_grad", "layer_decode")


def _timed(f) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - t0


def _rounds(fs, reps: int) -> list:
    """Median seconds of each zero-argument function, every one once per round."""
    for f in fs:
        jax.block_until_ready(f())
    ts = [[] for _ in fs]
    for _ in range(reps):
        for i, f in enumerate(fs):
            ts[i].append(_timed(f))
    return [float(np.median(t)) for t in ts]


def _inputs(r, B, T, H, K, V, layer_opts: bool):
    """q, k, v, g, beta, h0 and the keyword options of one call."""
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(B, T, H, K), f(B, T, H, K) / np.sqrt(K), f(B, T, H, V)
    h0 = f(B, H, K, V) * 0.1
    if layer_opts:
        g, beta = f(B, T, H, K), f(B, T, H)
        opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=f(H) * 0.5,
                    dt_bias=f(H * K) * 0.5, use_beta_sigmoid_in_kernel=True)
    else:
        g = jax.nn.log_sigmoid(f(B, T, H, K) + 3.0)
        beta = jax.nn.sigmoid(f(B, T, H))
        opts = dict(use_qk_l2norm_in_kernel=True)
    return (q, k, v, g, beta, h0), opts


def recurrent_row(row: str, B: int, T: int, H: int, K: int, V: int, layer_opts: bool, reps: int, seed: int = 0):
    arrays, opts = _inputs(np.random.default_rng(seed), B, T, H, K, V, layer_opts)
    extra = {n: opts.pop(n) for n in ("A_log", "dt_bias") if n in opts}

    def call(q, k, v, g, beta, h0, extra):
        return kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **extra, **opts)

    jitted = jax.jit(call)
    first = _timed(lambda: call(*arrays, extra))
    t_eager, t_jit = _rounds([lambda: call(*arrays, extra), lambda: jitted(*arrays, extra)], reps)
    name = "layer opts" if layer_opts else "plain"
    return dict(row=row, shape=f"B={B} T={T} H=HV={H} K={K} V={V} ({name})", eager_s=t_eager, jit_s=t_jit,
                first_s=first)


def grad_row(row: str, B: int, T: int, H: int, K: int, V: int, reps: int, seed: int = 0):
    r = np.random.default_rng(seed)
    arrays, opts = _inputs(r, B, T, H, K, V, False)
    w = jnp.asarray(r.normal(size=arrays[2].shape), jnp.float32)

    def loss(q, k, v, g, beta, h0):
        return jnp.sum(kdax.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, **opts)[0] * w)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    jitted = jax.jit(grad)
    first = _timed(lambda: grad(*arrays))
    t_eager, t_jit = _rounds([lambda: grad(*arrays), lambda: jitted(*arrays)], reps)
    return dict(row=row, shape=f"B={B} T={T} H=HV={H} K={K} V={V} (plain; dq..dbeta)", eager_s=t_eager,
                jit_s=t_jit, first_s=first)


def layer_row(row: str, batch: int, hidden: int, heads: int, head_dim: int, reps: int, seed: int = 0):
    r = np.random.default_rng(seed)
    layer = KimiDeltaAttention(hidden, heads, head_dim, key=jax.random.key(seed))
    cache = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape) * 0.1, a.dtype), layer.init_cache(batch))
    x = jnp.asarray(r.normal(size=(batch, 1, hidden)), jnp.float32)
    params, static = eqx.partition(layer, eqx.is_array)
    # Not donated: the eager call does not donate either, so both steps copy the cache.
    step = jax.jit(lambda p, x, c: eqx.combine(p, static)(x, cache=c))
    # Each call continues from the last one's cache (a decode loop), eager and jitted apart.
    box = [cache, cache]

    def eager():
        y, box[0] = layer(x, cache=box[0])
        return y

    def jitted():
        y, box[1] = step(params, x, box[1])
        return y

    first = _timed(eager)
    t_eager, t_jit = _rounds([eager, jitted], reps)
    return dict(row=row, shape=f"batch={batch} 1 token hidden={hidden} H={heads} K=V={head_dim}", eager_s=t_eager,
                jit_s=t_jit, first_s=first)


@contextlib.contextmanager
def op_by_op():
    """Eager calls as before issue 50: the switch to the compiled program turned off."""
    saved = kdax.recurrent.concrete_call
    kdax.recurrent.concrete_call = kdax.nn._layer.concrete_call = lambda *trees: False
    try:
        yield
    finally:
        kdax.recurrent.concrete_call = kdax.nn._layer.concrete_call = saved


def run_rows(which, reps: int, decode=(16, 8, 128), small=(8, 4, 64), long=(1, 512, 8, 128),
             layer=(16, 1024, 8, 128)) -> list:
    """The rows in ``which`` (names in ``ROWS``) at the given shapes: ``decode`` and
    ``small`` ``(B, H, K = V)``, ``long`` ``(B, T, H, K = V)``, ``layer`` ``(batch, hidden,
    heads, head_dim)``."""
    B, H, K = decode
    rows = []
    if "decode_layer_opts" in which:
        rows.append(recurrent_row("recurrent decode", B, 1, H, K, K, True, reps))
    if "decode_plain" in which:
        rows.append(recurrent_row("recurrent decode", B, 1, H, K, K, False, reps))
    if "decode_small" in which:
        Bs, Hs, Ks = small
        rows.append(recurrent_row("recurrent small", Bs, 1, Hs, Ks, Ks, False, reps))
    if "t512" in which:
        Bl, Tl, Hl, Kl = long
        rows.append(recurrent_row(f"recurrent T={Tl}", Bl, Tl, Hl, Kl, Kl, False, reps))
    if "t512_grad" in which:
        Bl, Tl, Hl, Kl = long
        rows.append(grad_row(f"recurrent T={Tl} grad", Bl, Tl, Hl, Kl, Kl, reps))
    if "layer_decode" in which:
        rows.append(layer_row("layer decode", *layer, reps=reps))
    for r in rows:
        r["ratio"] = r["eager_s"] / r["jit_s"]
    return rows


def format_rows(rows) -> str:
    lines = [f"{'row':22s} {'shape':48s} {'eager':>10s} {'jitted':>10s} {'ratio':>6s} {'first':>9s}"]
    for r in rows:
        lines.append(f"{r['row']:22s} {r['shape']:48s} {r['eager_s'] * 1e3:8.3f}ms {r['jit_s'] * 1e3:8.3f}ms "
                     f"{r['ratio']:5.2f}x {r['first_s']:8.2f}s")
    return "\n".join(lines)


def main(argv=None, **shapes):
    p = argparse.ArgumentParser(description="eager vs jitted calls of fused_recurrent_kda and the layer's decode step")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    p.add_argument("--machine", default=f"{platform.machine()} {os.cpu_count()}-core CPU",
                   help="the machine, in words, for the results' header")
    p.add_argument("--op-by-op", action="store_true", help="also time the eager calls op by op (before issue 50)")
    p.add_argument("--out", default=None, help="write the table here (e.g. benchmarks/results/eager_calls.txt)")
    a = p.parse_args(argv)
    which = set(a.rows.split(","))
    unknown = which - set(ROWS)
    if unknown:
        p.error(f"unknown rows: {', '.join(sorted(unknown))}")
    rows = run_rows(which, a.reps, **shapes)
    dev = jax.devices()[0]
    head = (f"eager vs jitted calls (issue 50), float32, {a.machine}, {dev.platform} ({dev.device_kind}), "
            f"jax {jax.__version__}; medians of {a.reps} calls after the first, eager and jitted alternating\n"
            f"eager: the call without jax.jit (checks on the caller's values, then the cached compiled program); "
            f"jitted: the same call under jax.jit; ratio = eager / jitted; first = the first eager call "
            f"(compile + run)\n")
    text = head + format_rows(rows) + "\n"
    if a.op_by_op:
        with op_by_op():
            before = run_rows(which, max(1, a.reps // 10), **shapes)
        text += (f"\nbefore issue 50 (same run): the eager call op by op, medians of {max(1, a.reps // 10)}\n"
                 + format_rows(before) + "\n")
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
