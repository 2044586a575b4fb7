"""Many short packed sequences (issue 18, item 8): ``chunk_kda`` with ``cu_seqlens`` of N
equal sequences packed in T = 1000 tokens against the same tokens as one dense sequence
and against ``fused_recurrent_kda``; H = 4, K = V = 64, C = 64, float32, medians of 5.

    python benchmarks/short_sequences.py [N]      (N = 1000: one token per sequence)
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kdax


def main(N: int = 1000, H: int = 4, K: int = 64, V: int = 64, T: int = 1000) -> None:
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(1, T, H, K), f(1, T, H, K) / np.sqrt(K), f(1, T, H, V)
    g = jnp.asarray(-r.uniform(0.01, 0.5, (1, T, H, K)), jnp.float32)
    beta = jnp.full((1, T, H), 0.5, jnp.float32)
    cu = jnp.asarray(np.linspace(0, T, N + 1).astype(np.int32))
    w = f(1, T, H, V)

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    fwd_varlen = jax.jit(lambda cu, *a: kdax.chunk_kda(*a, cu_seqlens=cu, output_final_state=True)[0])
    fwd_dense = jax.jit(lambda *a: kdax.chunk_kda(*a)[0])
    fwd_rec = jax.jit(lambda cu, *a: kdax.fused_recurrent_kda(*a, cu_seqlens=cu, output_final_state=True)[0])
    loss = lambda cu: lambda *a: jnp.sum(kdax.chunk_kda(*a, cu_seqlens=cu)[0] * w)
    train_varlen = jax.jit(lambda cu, *a: jax.grad(loss(cu), argnums=(0, 1, 2, 3, 4))(*a))
    train_dense = jax.jit(jax.grad(lambda *a: jnp.sum(kdax.chunk_kda(*a)[0] * w), argnums=(0, 1, 2, 3, 4)))
    x = (q, k, v, g, beta)
    print(f"N={N} sequences in T={T} (H={H}, K=V={K}, C=64, float32), median ms:")
    print(f"  chunk_kda varlen fwd   {median_ms(fwd_varlen, cu, *x):9.1f}")
    print(f"  chunk_kda dense fwd    {median_ms(fwd_dense, *x):9.1f}")
    print(f"  fused_recurrent varlen {median_ms(fwd_rec, cu, *x):9.1f}")
    print(f"  chunk_kda varlen train {median_ms(train_varlen, cu, *x):9.1f}")
    print(f"  chunk_kda dense train  {median_ms(train_dense, *x):9.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
