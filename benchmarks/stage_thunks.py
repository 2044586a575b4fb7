"""Where a reference stage's time goes on XLA:CPU: the compiled stage run under
``jax.profiler`` and its events (thunks: fusions, dots, loops) summed by name (issue 51).

    PYTHONPATH=. python benchmarks/stage_thunks.py intra_bwd [--reps 5] [--top 30] [--hlo FILE]

Prints the top events by total time per call, with their count per call. ``--hlo``:
write the optimized HLO of the stage's program there (to map fusion names to ops)."""

import argparse
import collections
import glob
import os
import re
import tempfile

import equinox as eqx
import jax


def main():
    p = argparse.ArgumentParser()
    p.add_argument("stage")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--hlo", default="")
    p.add_argument("--only", default="", help="list only events attributed to this stage")
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--step", action="store_true", help="profile the whole training step instead")
    o = p.parse_args()
    import kdax
    from kdax import bench as b
    from kdax._runner.runner import stage_inputs

    s = b.Shape(T=o.T)
    x = b.make_inputs(s)
    if o.step:
        w = b.cotangent(s)
        f = jax.jit(jax.grad(lambda *a: (kdax.chunk_kda(*a)[0] * w).sum(), argnums=(0, 1, 2, 3, 4)))
        args = x
        c = f.lower(*args).compile()
    else:
        pn = kdax.KDAPipeline.reference()
        taps = stage_inputs(pn, *x, chunk_size=s.chunk_size)
        args = taps[o.stage]
        c = eqx.filter_jit(getattr(pn, o.stage)).lower(*args).compile()
    text = (c.compiled if hasattr(c, "compiled") else c).as_text()
    if o.hlo:
        with open(o.hlo, "w") as fh:
            fh.write(text)
    where = {}
    for m in re.finditer(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?op_name="([^"]*)"', text, re.M):
        found = re.findall(r"(Reference\w+|Segmented\w+|Pallas\w+|kdax_\w+)", m.group(2))
        where[m.group(1)] = found[-1] if found else "glue: " + m.group(2).split("/")[-1][:30]
    jax.block_until_ready(c(*args))
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(o.reps):
            jax.block_until_ready(c(*args))
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    # Self time of each event (its duration less its children's on the same thread line).
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            evs = sorted(line.events, key=lambda e: (e.start_ns, -e.duration_ns))
            stack = []  # [end, name, child time]
            def close(upto):
                while stack and stack[-1][0] <= upto:
                    end, name, dur, child = stack.pop()
                    tot[name] += dur - child
                    if stack:
                        stack[-1][3] += dur
            for e in evs:
                close(e.start_ns)
                stack.append([e.start_ns + e.duration_ns, e.name, e.duration_ns, 0])
                cnt[e.name] += 1
            close(float("inf"))
    by = collections.defaultdict(float)
    for name, ns in tot.items():
        if name in where:
            by[where[name] + (" (while, inclusive?)" if name.startswith("while") else "")] += ns
    print("by stage (leaf thunks, ms/call):")
    for k, ns in sorted(by.items(), key=lambda kv: -kv[1]):
        print(f"  {ns / 1e6 / o.reps:9.3f}  {k}")
    rows = sorted(tot.items(), key=lambda kv: -kv[1])
    if o.only:
        rows = [r for r in rows if where.get(r[0], "") == o.only]
    for name, ns in rows[: o.top]:
        print(f"{ns / 1e6 / o.reps:9.3f} ms/call  x{cnt[name] / o.reps:7.1f}  {name[:60]:60s} {where.get(name, '')}")


if __name__ == "__main__":
    main()
