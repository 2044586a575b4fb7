"""Same-process A/B of ``kdax.fused_recurrent_kda`` (the token-by-token path: decoding,
varlen inference) against another revision's (``kdax_base``, exported as
``benchmarks/stage_ab.py`` does), float32, H=8 K=V=128, initial and final states: a decode
step (one token for B sequences), a dense scan, packed sequences, and ``jax.grad`` through
it. The two are called alternately ``--rounds`` times; medians and bests, their ratio, and
the largest difference of the outputs relative to their largest value.

    python benchmarks/recurrent_ab.py [--base REV] [--rounds 9] [--cases "16,1 1,4096 1,1024,8 1,1024,8,grad"]

A case is ``B,T[,N][,grad]``: N packed sequences of equal length (B = 1)."""

import argparse
import os
import sys

import numpy as np


def cases(text: str):
    for item in text.split():
        parts = item.split(",")
        grad = parts[-1] == "grad"
        nums = [int(p) for p in parts if p != "grad"]
        yield nums[0], nums[1], (nums[2] if len(nums) > 2 else None), grad


def run_case(mods, B, T, N, grad, rounds, H=8, K=128, seed=0):
    import jax
    import jax.numpy as jnp
    from stage_ab import timed

    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(B, T, H, K) / 8, f(B, T, H, K) / 8, f(B, T, H, K)
    g, beta = -jnp.abs(f(B, T, H, K)) * 0.1, jax.nn.sigmoid(f(B, T, H))
    h0 = f(B if N is None else N, H, K, K) * 0.1
    cu = None if N is None else jnp.asarray(np.linspace(0, T, N + 1).astype(np.int32))
    args = (q, k, v, g, beta, h0)
    calls, outs = [], []
    for m in mods:
        call = lambda q, k, v, g, beta, h0, m=m: m.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        if grad:
            loss = lambda *a, call=call: jnp.sum(call(*a)[0] ** 2)
            fn = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
        else:
            fn = jax.jit(call)
        outs.append(jax.tree.leaves(fn(*args)))
        calls.append(lambda fn=fn: fn(*args))
    diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)) for a, b in zip(*outs))
    ts, _ = timed(calls, [()] * len(calls), rounds)
    med, best = [float(np.median(t)) for t in ts], [min(t) for t in ts]
    name = f"B={B} T={T}" + ("" if N is None else f" N={N}") + (" grad" if grad else "")
    return (f"{name:24s} base {med[0] * 1e3:9.2f} ms  new {med[1] * 1e3:9.2f} ms  new/base median "
            f"{med[1] / med[0]:.3f} best {best[1] / best[0]:.3f}  rel. max diff {diff:.2e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--cases", default="16,1 64,1 1,4096 4,256 1,1024,8 1,1024,1000 1,1024,grad 1,1024,8,grad")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stage_ab import export_base

    dest, sha = export_base(a.base)
    sys.path.insert(0, dest)
    import kdax
    import kdax_base

    lines = [f"fused_recurrent_kda, base {sha} vs this tree, float32 H={a.heads} K=V={a.dim}, initial and final "
             f"states, {a.rounds} rounds"]
    for B, T, N, grad in cases(a.cases):
        lines.append(run_case((kdax_base, kdax), B, T, N, grad, a.rounds, H=a.heads, K=a.dim))
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
