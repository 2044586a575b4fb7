"""Outputs and gradients of this tree's reference pipeline against another revision's
(``kdax_base``, exported as benchmarks/stage_ab.py does) on lowered_hashes.py's 12 cases
(float32/bfloat16 inputs; dense, packed, packed with initial states; chunk 16, final
states) and the same cases in float64, plus the main job's shape (B=1 T=4096 H=8
K=V=128 float32, dense): per case, the largest ``max |diff| / max |ref|`` over the
outputs and the five input gradients, and which array it is.

    PYTHONPATH=. python benchmarks/exactness_ab.py [--base main] [--no-main-shape]"""
import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="main")
    p.add_argument("--no-main-shape", action="store_true")
    o = p.parse_args()
    from stage_ab import export_base

    dest, sha = export_base(o.base)
    sys.path.insert(0, dest)
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import kdax
    import kdax_base
    from lowered_hashes import cases

    def run(mod, args, opts):
        pipe = mod.KDAPipeline.reference()
        fwd = lambda *a: mod.chunk_kda(*a, pipeline=pipe, **opts)
        loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32) if x.dtype != jnp.float64 else x) for x in fwd(*a) if x is not None)
        outs = [x for x in jax.jit(fwd)(*args)]
        if outs[-1] is None:
            outs[-1] = jnp.zeros(())
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
        return list(outs) + list(grads)

    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta"]

    def compare(name, args, opts):
        a, b = run(kdax_base, args, opts), run(kdax, args, opts)
        worst, which, bitwise = 0.0, "", True
        for n, x, y in zip(names, a, b):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            if not np.array_equal(x, y, equal_nan=True):
                bitwise = False
            r = np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-300)
            if r > worst:
                worst, which = r, n
        print(f"{name:<28} {'bitwise equal' if bitwise else f'max rel diff {worst:.2e} ({which})'}", flush=True)

    print(f"base {sha} vs this tree")
    for name, args, opts in cases():
        compare(name, args, opts)
        if name.startswith("float32"):
            a64 = tuple(x.astype(jnp.float64) for x in args)
            o64 = dict(opts)
            if "initial_state" in o64:
                o64["initial_state"] = o64["initial_state"].astype(jnp.float64)
            compare(name.replace("float32", "float64"), a64, o64)
    if not o.no_main_shape:
        from kdax import bench as b

        s = b.Shape()
        compare("main shape float32 dense", b.make_inputs(s), {})


if __name__ == "__main__":
    main()
