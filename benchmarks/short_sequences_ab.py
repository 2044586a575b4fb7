"""Same-process A/B of the no-state varlen rows of ``short_sequences.py`` against another
tree's ``kdax``, copied as the package ``kdax_base`` under ``/tmp/ab`` (e.g.
``cp -r <tree>/kdax /tmp/ab/kdax_base``): both jitted, timed in interleaved rounds.

    PYTHONPATH=. python benchmarks/short_sequences_ab.py N
"""

import sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "/tmp/ab")
import kdax, kdax_base
N, T, H, K, V = int(sys.argv[1]), 1000, 4, 64, 64
r = np.random.default_rng(0)
f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
q, k, v = f(1, T, H, K), f(1, T, H, K) / np.sqrt(K), f(1, T, H, V)
g = jnp.asarray(-r.uniform(0.01, 0.5, (1, T, H, K)), jnp.float32)
beta = jnp.full((1, T, H), 0.5, jnp.float32)
cu = jnp.asarray(np.linspace(0, T, N + 1).astype(np.int32)); w = f(1, T, H, V); x = (q, k, v, g, beta)
def fns(m):
    fwd = jax.jit(lambda cu, *a: m.chunk_kda(*a, cu_seqlens=cu)[0])
    tr = jax.jit(lambda cu, *a: jax.grad(lambda *a: jnp.sum(m.chunk_kda(*a, cu_seqlens=cu)[0] * w), argnums=(0, 1, 2, 3, 4))(*a))
    return fwd, tr
def rounds(fs, R=9):
    for f_ in fs: jax.block_until_ready(f_(cu, *x))
    ts = [[] for _ in fs]
    for _ in range(R):
        for i, f_ in enumerate(fs):
            t0 = time.perf_counter(); jax.block_until_ready(f_(cu, *x)); ts[i].append(time.perf_counter() - t0)
    return [round(1e3 * float(np.median(t)), 1) for t in ts]
(fb, tb), (fm, tm) = fns(kdax_base), fns(kdax)
print(f"N={N} varlen fwd base/main", rounds([fb, fm]), "train base/main", rounds([tb, tm]))
