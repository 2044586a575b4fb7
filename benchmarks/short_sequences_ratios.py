"""Issue 25 item 4's two ratios in one process (interleaved rounds, medians): many short
packed sequences with initial states against the same call without them, and a loss on
the final states against a loss on the outputs. H = 4, K = V = 64, C = 64, float32, T =
1000 tokens in N equal sequences; the initial states are zeros passed as an argument of
the jitted call (as a serving prefill passes its cache's states).

    PYTHONPATH=. python benchmarks/short_sequences_ratios.py [N] [rounds]

Rows: ``fin_*`` (``output_final_state=True``, no initial states; the step's loss reads o),
``ini_*`` (with initial states, final states returned; the loss reads o), ``both`` (loss
on o and the final states), ``only`` (loss on the final states alone, ``sum(ht)``: its
cotangent is a broadcast of ones), ``only_w`` (``sum(ht * w)``, ``w`` an argument: a
cotangent stored in memory, as the next segment's ``dh0`` in truncated backpropagation
through time). Targets: ini_step / fin_step <= 3; both, only and only_w / fin_step <= 2.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kdax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from short_sequences import inputs  # noqa: E402  (the same inputs as the table's)


def main(N: int = 1000, rounds: int = 15, T: int = 1000, H: int = 4, K: int = 64, V: int = 64) -> None:
    x, cu, w = inputs(N, T, H, K, V)
    h0 = jnp.zeros((N, H, K, V), jnp.float32)
    wh = jnp.asarray(np.random.default_rng(1).normal(size=h0.shape), jnp.float32)  # only_w's weights
    fin = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu, output_final_state=True)
    ini = lambda cu, h0, *a: kdax.chunk_kda(*a, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    grad = lambda loss: jax.jit(lambda cu, h0, *a: jax.grad(lambda *a: loss(cu, h0, *a), argnums=(0, 1, 2, 3, 4))(*a))
    rows = dict(
        fin_fwd=jax.jit(fin), ini_fwd=jax.jit(ini),
        fin_step=grad(lambda *a: jnp.sum(fin(*a)[0] * w)), ini_step=grad(lambda *a: jnp.sum(ini(*a)[0] * w)),
        both=grad(lambda *a: sum(jnp.sum(o * y) for o, y in zip(fin(*a), (w, 1.0)))),
        only=grad(lambda *a: jnp.sum(fin(*a)[1])),
        # (the same with a stored cotangent: weights passed in, as the next segment's dh0
        # is in truncated backpropagation through time)
        only_w=jax.jit(lambda cu, h0, *a: jax.grad(lambda *a: jnp.sum(fin(cu, None, *a)[1] * h0),
                                                   argnums=(0, 1, 2, 3, 4))(*a)),
    )
    for fn in rows.values():
        jax.block_until_ready(fn(cu, wh if fn is rows["only_w"] else h0, *x))
    ts = {n: [] for n in rows}
    for _ in range(rounds):
        for n, fn in rows.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(cu, wh if n == "only_w" else h0, *x))
            ts[n].append(time.perf_counter() - t0)
    m = {n: 1e3 * float(np.median(t)) for n, t in ts.items()}
    print(f"N={N} T={T} (H={H}, K=V={K}, C=64, float32), median ms of {rounds} interleaved rounds:")
    print("  " + "  ".join(f"{n} {t:.1f}" for n, t in m.items()))
    print(f"  initial states: forward {m['ini_fwd'] / m['fin_fwd']:.2f}x, step {m['ini_step'] / m['fin_step']:.2f}x "
          f"(target 3x); loss on final states: with o {m['both'] / m['fin_step']:.2f}x, alone "
          f"{m['only'] / m['fin_step']:.2f}x, weighted {m['only_w'] / m['fin_step']:.2f}x (target 2x)")


if __name__ == "__main__":
    main(*[int(s) for s in sys.argv[1:]])
