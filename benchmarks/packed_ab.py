"""Same-process A/B of ``kdax.chunk_kda``'s forward on packed sequences (the shared-chunk
layout: a serving prefill, a packed batch) against another revision's (``kdax_base``,
exported as ``benchmarks/stage_ab.py`` does): float32, the main job's shape by default
(B=1 T=4096 H=8 K=V=128), N sequences cut at random, with and without initial and final
states. The two are called alternately ``--rounds`` times; medians and bests, their
ratio, and the largest difference of the outputs and final states. ``--step``: the
training step instead (the gradients of q, k, v, g, beta and the initial states of
``sum(o w) + sum(ht W)``, the second term where the case has final states, fixed random
``w``, ``W``), and the largest difference of the gradients.

    python benchmarks/packed_ab.py [--base REV] [--n 16] [--rounds 7] [--fresh] [--step]

``--fresh`` leaves ``kdax.reuse_freed_memory`` off (a program's temporaries in fresh pages
every call, as in a process that does not set it); by default it is on, as in
``python -m kdax.bench``."""

import argparse
import os
import sys

import numpy as np

CASES = (("no states", False, False), ("final states", False, True), ("initial states", True, False),
         ("initial and final", True, True))


def run_case(mods, name, h0, fs, inputs, rounds, step=False):
    import jax
    import jax.numpy as jnp
    from stage_ab import maxdiff, timed

    q, k, v, g, beta, cu, states = inputs
    kw = dict(cu_seqlens=cu, output_final_state=fs)
    calls = [lambda *a, m=m: m.chunk_kda(*a[:5], initial_state=a[5] if h0 else None, **kw) for m in mods]
    fns = [jax.jit(c) for c in calls]
    if step:
        w, W = jnp.cos(v), jnp.sin(states)  # (fixed weights of the loss)

        def loss(call, *a):
            o, ht = call(*a)
            return jnp.sum(o * w) + (jnp.sum(ht * W) if fs else 0.0)

        fns = [jax.jit(jax.grad(lambda *a, c=c: loss(c, *a), argnums=tuple(range(5 + h0)))) for c in calls]
    args = (q, k, v, g, beta, states)
    diff = maxdiff(*(fn(*args) for fn in fns))
    ts, _ = timed(fns, [args] * len(fns), rounds)
    med, best = [float(np.median(t)) for t in ts], [min(t) for t in ts]
    return (f"{name:18s} base {med[0] * 1e3:9.2f} ms  new {med[1] * 1e3:9.2f} ms  new/base median "
            f"{med[1] / med[0]:.3f} best {best[1] / best[0]:.3f}  max diff {diff:.2e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main")
    p.add_argument("--n", type=int, default=16, help="sequences")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--step", action="store_true", help="the training step instead of the forward")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stage_ab import export_base

    dest, sha = export_base(a.base)
    sys.path.insert(0, dest)
    import kdax
    import kdax_base

    if not a.fresh:
        kdax.reuse_freed_memory()
    import jax
    import jax.numpy as jnp

    r = np.random.default_rng(0)
    T, H, K = a.T, a.heads, a.dim
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(1, T, H, K) / K**0.5, f(1, T, H, K) / K**0.5, f(1, T, H, K)
    g, beta = -jax.nn.softplus(f(1, T, H, K) - 3), jax.nn.sigmoid(f(1, T, H))
    cu = jnp.asarray([0] + sorted(r.choice(np.arange(1, T), a.n - 1, replace=False).tolist()) + [T], jnp.int32)
    inputs = (q, k, v, g, beta, cu, f(a.n, H, K, K) * 0.1)
    lines = [f"chunk_kda {'training step' if a.step else 'forward'}, packed: base {sha} vs this tree, float32 T={T} H={H} K=V={K}, {a.n} sequences, "
             f"{'fresh memory' if a.fresh else 'reuse_freed_memory'}, {a.rounds} rounds"]
    print(lines[0], flush=True)
    for name, h0, fs in CASES:
        lines.append(run_case((kdax_base, kdax), name, h0, fs, inputs, a.rounds, a.step))
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
