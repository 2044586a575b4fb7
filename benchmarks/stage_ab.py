"""Same-process A/B of reference stages (and the whole forward / training step) against
another revision's ``kdax``, copied as the package ``kdax_base`` (issue 51).

    PYTHONPATH=. python benchmarks/stage_ab.py [--base REV] [--stages intra_bwd,wy_dqkg]
        [--rounds 15] [--whole] [--T 4096 --H 8 --K 128 --V 128] [--packed N]

``--base``: a git revision (default ``main``), exported with ``git archive`` to
``/tmp/stage_ab/<rev>/kdax_base``. Each stage runs on the arguments its own package's
reference pipeline gives it (``stage_inputs``, the same inputs), compiled ahead; the two
are called alternately ``--rounds`` times and the best and median of each are printed,
wall time and the process's CPU time (all threads), with the ratio new/base. Outputs are
compared (max abs difference; 0 means bitwise equal). ``--packed N``: the same tokens as N
packed sequences of random lengths (``cu_seqlens``: shared chunks, exact resets)."""

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def export_base(rev: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sha = subprocess.check_output(["git", "-C", root, "rev-parse", "--short", rev], text=True).strip()
    dest = f"/tmp/stage_ab/{sha}"
    if not os.path.isdir(os.path.join(dest, "kdax_base")):
        os.makedirs(dest, exist_ok=True)
        tar = subprocess.check_output(["git", "-C", root, "archive", sha, "kdax"])
        subprocess.run(["tar", "-x", "-C", dest], input=tar, check=True)
        os.rename(os.path.join(dest, "kdax"), os.path.join(dest, "kdax_base"))
        # (the one absolute import, in a docstring example, is harmless)
    return dest, sha


def timed(fs, args_list, rounds):
    import jax

    for f, a in zip(fs, args_list):
        jax.block_until_ready(f(*a))
    wall = [[] for _ in fs]
    cpu = [[] for _ in fs]
    for _ in range(rounds):
        for i, (f, a) in enumerate(zip(fs, args_list)):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*a))
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    return wall, cpu


def report(name, wall, cpu, diff):
    b_w, n_w = min(wall[0]), min(wall[1])
    b_c, n_c = min(cpu[0]), min(cpu[1])
    m_w = np.median(wall[1]) / np.median(wall[0])
    print(f"{name:10s} base {1e3 * b_w:8.2f} ms (cpu {1e3 * b_c:8.2f})  new {1e3 * n_w:8.2f} ms (cpu {1e3 * n_c:8.2f})"
          f"  new/base best wall {n_w / b_w:.3f} cpu {n_c / b_c:.3f} median wall {m_w:.3f}  maxdiff {diff:.3g}",
          flush=True)


def maxdiff(a, b):
    import jax
    import jax.numpy as jnp

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return float("nan")
    d = 0.0
    for x, y in zip(la, lb):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape:
            return float("nan")
        d = max(d, float(jnp.max(jnp.abs(x.astype(jnp.float64) - y.astype(jnp.float64)))) if x.size else 0.0)
    return d


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="main")
    p.add_argument("--stages", default="")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--whole", action="store_true")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--chunk_size", type=int, default=64)
    p.add_argument("--packed", type=int, default=0,
                   help="N > 0: the tokens packed as N sequences of random lengths (cu_seqlens, seed 0; shared chunks)")
    o = p.parse_args()
    dest, sha = export_base(o.base)
    sys.path.insert(0, dest)
    import jax
    import equinox as eqx
    import kdax
    import kdax_base
    from kdax import bench as b
    from kdax._runner.runner import stage_inputs as new_inputs
    from kdax_base._runner.runner import stage_inputs as base_inputs

    print(f"base {sha} ({kdax_base.__file__}) vs new ({kdax.__file__}); rounds {o.rounds}", flush=True)
    s = b.Shape(B=o.B, T=o.T, H=o.H, HV=o.H, K=o.K, V=o.V, chunk_size=o.chunk_size)
    x = b.make_inputs(s)
    opts = dict(chunk_size=s.chunk_size)
    if o.packed:
        import numpy as np
        cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, s.T), o.packed - 1, replace=False))
        opts["cu_seqlens"] = jax.numpy.asarray(np.concatenate([[0], cuts, [s.T]]), jax.numpy.int32)
    names = [n for n in o.stages.split(",") if n]
    if names:
        pb, pn = kdax_base.KDAPipeline.reference(), kdax.KDAPipeline.reference()
        tb = base_inputs(pb, *x, **opts)
        tn = new_inputs(pn, *x, **opts)
        for name in names:
            sb, sn = getattr(pb, name), getattr(pn, name)
            cb = eqx.filter_jit(sb).lower(*tb[name]).compile()
            cn = eqx.filter_jit(sn).lower(*tn[name]).compile()
            diff = maxdiff(cb(*tb[name]), cn(*tn[name]))
            wall, cpu = timed([cb, cn], [tb[name], tn[name]], o.rounds)
            report(name, wall, cpu, diff)
    if o.whole:
        w = b.cotangent(s)
        fs = [jax.jit(lambda *a: kdax_base.chunk_kda(*a, **opts)[0]).lower(*x).compile(),
              jax.jit(lambda *a: kdax.chunk_kda(*a, **opts)[0]).lower(*x).compile()]
        diff = maxdiff(fs[0](*x), fs[1](*x))
        wall, cpu = timed(fs, [x, x], o.rounds)
        report("forward", wall, cpu, diff)
        grad = lambda mod: jax.jit(jax.grad(lambda *a: (mod.chunk_kda(*a, **opts)[0] * w).sum(), argnums=(0, 1, 2, 3, 4)))
        ss = [grad(kdax_base).lower(*x).compile(), grad(kdax).lower(*x).compile()]
        diff = maxdiff(ss[0](*x), ss[1](*x))
        wall, cpu = timed(ss, [x, x], o.rounds)
        report("step", wall, cpu, diff)


if __name__ == "__main__":
    main()
