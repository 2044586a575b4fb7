"""Same-process A/B of `python -m kdax.bench`'s chunk_kda forward and training step against
another tree's `kdax`, copied as the package `kdax_base` under `/tmp/ab`
(`cp -r <tree>/kdax /tmp/ab/kdax_base`): both jitted, timed in interleaved rounds.

    PYTHONPATH=. python benchmarks/bench_ab.py [rounds]
"""
import sys, jax, jax.numpy as jnp
sys.path.insert(0, "/tmp/ab")
import kdax, kdax_base
from kdax import bench as b
s = b.Shape(); x = b.make_inputs(s); w = b.cotangent(s)
fs = [jax.jit(lambda *a: kdax_base.chunk_kda(*a)[0]), jax.jit(lambda *a: kdax.chunk_kda(*a)[0])]
ss = [b._TrainStep(kdax_base.chunk_kda, w), b._TrainStep(kdax.chunk_kda, w)]
print("maxdiff", float(jnp.max(jnp.abs(fs[0](*x) - fs[1](*x)))))
R = int(sys.argv[1]) if len(sys.argv) > 1 else 9
for rep in range(2):
    print("fwd base/main ms", [round(1e3*t,1) for t in b.time_rounds(fs, x, R)], flush=True)
    print("step base/main ms", [round(1e3*t,1) for t in b.time_rounds(ss, x, R)], flush=True)
