"""Many short packed sequences (issue 18, item 8): ``chunk_kda`` with ``cu_seqlens`` of N
equal sequences packed in T tokens, against the same tokens as one dense sequence and
against ``fused_recurrent_kda``; forward and training step (``jax.grad`` of
``sum(o * w)`` with respect to q, k, v, g, beta); H = 4, K = V = 64, C = 64, float32,
medians of ``reps`` calls after a warm-up.

    PYTHONPATH=. python benchmarks/short_sequences.py [N] [T] [reps]

N = 1000, T = 1000: one token per sequence; N = 100, T = 1000: ten. The "varlen + final
state" row asks for the final states (``output_final_state=True``), which ran the
layout with one sequence per chunk before issue 18 item 8; now it shares chunks and reads
each final state from its sequence's last chunk (docs/stages.md §1). Its forward returns
o and the final states; every training step's loss reads o alone, except the last two
rows (a loss on the final states too, or on them alone). The "+ initial state" row also
returns the final states: compare it with "+ final state", the same call without the
initial states.
"""

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kdax


def inputs(N: int, T: int, H: int, K: int, V: int):
    """``(x = (q, k, v, g, beta), cu_seqlens of N equal sequences, w [1, T, H, V] the
    loss's weights)``, float32."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(1, T, H, K), f(1, T, H, K) / np.sqrt(K), f(1, T, H, V)
    g = jnp.asarray(-r.uniform(0.01, 0.5, (1, T, H, K)), jnp.float32)
    beta = jnp.full((1, T, H), 0.5, jnp.float32)
    cu = jnp.asarray(np.linspace(0, T, N + 1).astype(np.int32))
    return (q, k, v, g, beta), cu, f(1, T, H, V)


def main(N: int = 1000, T: int = 1000, reps: int = 5, H: int = 4, K: int = 64, V: int = 64) -> None:
    x, cu, w = inputs(N, T, H, K, V)

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    def train(fn):  # the loss reads o alone (a training step)
        return jax.jit(lambda cu, h0, *a: jax.grad(lambda *a: jnp.sum(fn(cu, h0, *a)[0] * w),
                                                   argnums=(0, 1, 2, 3, 4))(*a))

    chunk = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu)
    chunk_final = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu, output_final_state=True)  # forward: o and ht
    dense = lambda cu, h0, *a: kdax.chunk_kda(*a)
    rec = lambda cu, h0, *a: kdax.fused_recurrent_kda(*a, cu_seqlens=cu)
    # With initial states (an argument of the jitted call, as a serving prefill passes its
    # cache's states; zeros): they enter the shared chunks (kdax._layouts.shared_states, issue 25
    # item 4; one sequence per chunk before).
    h0 = jnp.zeros((N, H, K, V), jnp.float32)
    chunk_h0 = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    # The same with one sequence per chunk (share_chunks=False: the layout before).
    per_seq = dataclasses.replace(kdax.KDAPipeline.reference(), share_chunks=False)
    chunk_h0_per_seq = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                                         pipeline=per_seq)
    rows = (
        ("chunk_kda varlen", chunk),
        ("chunk_kda varlen + final state", chunk_final),
        ("chunk_kda varlen + initial state", chunk_h0),
        ("  (one sequence per chunk)", chunk_h0_per_seq),
        ("chunk_kda dense (same tokens)", dense),
        ("fused_recurrent varlen", rec),
    )
    print(f"N={N} sequences in T={T} tokens (H={H}, K=V={K}, C=64, float32), median ms of {reps}:")
    print(f"  {'':32}{'forward':>10}{'train step':>12}")
    for name, fn in rows:
        fwd = median_ms(jax.jit(fn), cu, h0, *x)
        step = median_ms(train(fn), cu, h0, *x)
        print(f"  {name:32}{fwd:10.1f}{step:12.1f}", flush=True)
    # A loss on the final states too (kdax._layouts.shared_states: no forward rerun since session 10).
    both = jax.jit(lambda cu, *a: jax.grad(
        lambda *a: sum(jnp.sum(x * y) for x, y in zip(chunk_final(cu, None, *a), (w, 1.0))), argnums=(0, 1, 2, 3, 4))(*a))
    print(f"  {'  (train, loss on o and ht)':32}{'':10}{median_ms(both, cu, *x):12.1f}", flush=True)
    only = jax.jit(lambda cu, *a: jax.grad(lambda *a: jnp.sum(chunk_final(cu, None, *a)[1]), argnums=(0, 1, 2, 3, 4))(*a))
    print(f"  {'  (train, loss on ht alone)':32}{'':10}{median_ms(only, cu, *x):12.1f}", flush=True)


if __name__ == "__main__":
    a = [int(s) for s in sys.argv[1:]]
    main(*a)
