"""What ``jax.jit(jax.grad(...))`` of ``chunk_kda`` and of ``fused_recurrent_kda`` contain and
how long each takes to trace, lower and compile (float32, B=1 T=2048 H=4 K=V=64, l2norm in
kernel, every input differentiated). Op counts are deterministic, so they compare trees
on a noisy machine where compile seconds do not (issue 39 item 7)::

    python benchmarks/compile_size.py            # this tree
    python benchmarks/compile_size.py /tmp/old   # another tree's kdax (git archive <commit> kdax | tar -x -C /tmp/old)

Columns: jaxpr equations (nested jaxprs included), StableHLO ops of the lowered program,
instructions of the compiled (optimised) HLO, and seconds."""

import re
import sys
import time

from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kdax  # noqa: E402


def _eqns(jaxpr) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    n += _eqns(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    n += _eqns(sub)
    return n


def main(B=1, T=2048, H=4, K=64):
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(0.01, 0.5, size=(B, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)
    print(f"B={B} T={T} H={H} K=V={K} float32, jax {jax.__version__}, kdax from {kdax.__file__}")
    for name, fn in (("chunk_kda", kdax.chunk_kda), ("fused_recurrent_kda", kdax.fused_recurrent_kda)):
        loss = lambda *a, fn=fn: fn(*a, use_qk_l2norm_in_kernel=True)[0].sum()
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        t0 = time.perf_counter()
        traced = step.trace(q, k, v, g, beta)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        shlo = len(re.findall(r"= stablehlo\.|^\s*stablehlo\.", lowered.as_text(), re.M))
        hlo = len(re.findall(r"^\s*(ROOT )?%?[\w.\-]+ = ", compiled.as_text(), re.M))
        print(f"{name:20s} jaxpr eqns {_eqns(traced.jaxpr.jaxpr):5d}  stablehlo ops {shlo:5d}  compiled HLO {hlo:5d}  "
              f"trace {t1 - t0:4.1f} s  lower {t2 - t1:4.1f} s  compile {t3 - t2:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
