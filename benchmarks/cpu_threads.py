"""How many of the CPU's cores XLA:CPU gives kdax's work (issue 51), each part in fresh
processes, float32:

1. ``loop``: one elementwise computation (four exponentials an element, ``[512, 64, 128]``)
   at the program's top level and inside a ``fori_loop`` over groups of 16 chunks, the form
   of the reference stages' chunk loops (``over_chunks``): once with each group's result
   only written into the output (XLA fuses the computation into the in-place write), once
   also added into a carry (the computation a fusion of its own): time, CPU time over wall,
   and whether XLA gave the computation parallel partitions (``outer_dimension_partitions``
   in the compiled HLO).
2. ``dots``: 512 dots of ``[64, 128] @ [128, 128]`` (a chunk's ``q h``: one batched dot)
   against one dot of the same FLOPs with a shared operand.
3. ``two loops``: two independent loops of part 1's fusion in one program against one
   loop over both halves: whether XLA:CPU runs independent loops at once.
4. ``heads``: the main job's forward and training step (B=1 T=4096 H=8 K=V=128) with the
   heads split over 2 host devices (the main job's ``--host-devices 2`` programs:
   ``jax.shard_map``, ``--xla_force_host_platform_device_count=2``),
   beside one device, both with ``kdax.reuse_freed_memory()`` (which limits glibc to one
   arena with several devices: each device's program runs on a thread of its own); also
   one device with one arena, and two with an arena per thread (glibc's default).
5. ``tiles``: the main job's training step as a ``jax.lax.scan`` of ``chunk_kda`` over token
   tiles, the state carried (its gradient is JAX's through the scan), against the step whole.

    python benchmarks/cpu_threads.py [--parts loop,dots,two loops,heads,tiles] [--reps 9] [--write]

``--write`` appends the report to ``benchmarks/results/cpu_threads.txt``."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "cpu_threads.txt"

# Shared by the workers: best-of-reps timing with CPU time (all threads) and page faults.
COMMON = r"""
import ctypes, json, os, sys, time
import jax, jax.numpy as jnp
import kdax
kdax.reuse_freed_memory()  # (as the main job: no page faults from fresh temporaries; one arena with several devices)
# glibc's M_ARENA_MAX, overriding reuse_freed_memory's choice: every thread allocates from the
# main heap ("one arena"), or from an arena of its own (glibc's default limit: "arenas").
ARENAS = {"one arena": 1, "arenas": 8 * os.cpu_count()}
if sys.argv[-1] in ARENAS:
    ctypes.CDLL("libc.so.6").mallopt(-8, ARENAS[sys.argv[-1]])

from kdax.bench._timing import best_call

def timed(fn, args, reps):
    wall, cpu, faults = best_call(fn, args, reps)
    return dict(ms=wall * 1e3, cpu=cpu / wall, faults=faults)

def partitioned(fn, args, in_loop):
    # Whether XLA gave parallel partitions to a kernel of the loop body (in_loop) or of the top level.
    lines = jax.jit(fn).lower(*args).compile().as_text().splitlines()
    return any("outer_dimension_partitions" in l and ("while/body" in l) == in_loop for l in lines)

def work(c):  # four exponentials an element, no slicing (a loop-body fusion of plain index maps)
    e = jnp.exp(c * 0.5) * jnp.exp(-0.25 - c)
    f = jnp.exp(e - 1.0) * c
    return jnp.exp(f * 0.5 - 1.0) + e

def loop(x, g=16, also_added=False):  # over_chunks' form: groups of g chunks, each result written in place
    xs = x.reshape(x.shape[0] // g, g, *x.shape[1:])
    def step(i, carry):
        o, acc = carry
        y = work(xs[i])
        return jax.lax.dynamic_update_index_in_dim(o, y, i, 0), (acc + y if also_added else acc)
    o, acc = jax.lax.fori_loop(0, xs.shape[0], step, (jnp.zeros_like(xs), jnp.zeros_like(xs[0])))
    return o.reshape(x.shape), acc
"""

WORKERS = {
    "loop": r"""
x = -jnp.abs(jax.random.normal(jax.random.key(0), (512, 64, 128)))
out = {"top level": dict(timed(jax.jit(work), (x,), REPS), partitioned=partitioned(work, (x,), False))}
for name, also in (("loop, result written", False), ("loop, result also added", True)):
    fn = lambda x, also=also: loop(x, also_added=also)
    out[name] = dict(timed(jax.jit(fn), (x,), REPS), partitioned=partitioned(fn, (x,), True))
""",
    "dots": r"""
x = jax.random.normal(jax.random.key(0), (512, 64, 128))
h = jax.random.normal(jax.random.key(1), (512, 128, 128))
flops = 2 * 512 * 64 * 128 * 128
out = {}
for name, fn in (("512 dots [64,128]@[128,128]", lambda x, h: x @ h),
                 ("one dot [32768,128]@[128,128]", lambda x, h: x.reshape(-1, 128) @ h[0])):
    r = timed(jax.jit(fn), (x, h), REPS)
    out[name] = dict(r, gflops=flops / r["ms"] / 1e6)
""",
    "two loops": r"""
x = -jnp.abs(jax.random.normal(jax.random.key(0), (512, 64, 128)))
a, b = x[:256] + 0, x[256:] + 0
out = {}
for name, fn in (("one loop over both", lambda a, b: loop(jnp.concatenate([a, b]))[0]),
                 ("two independent loops", lambda a, b: (loop(a)[0], loop(b)[0]))):
    out[name] = timed(jax.jit(fn), (a, b), REPS)
""",
    "heads": r"""
devices = int(sys.argv[3])
from kdax.bench import Shape, cotangent, make_inputs
from kdax.bench._run import kdax_paths
from kdax.bench._shape import over_heads
s = Shape()
args, w = make_inputs(s), cotangent(s)
if devices > 1:  # (the main job's --host-devices: each device's chunk_kda on its own heads)
    split = over_heads((*args, w), devices)
    args, w = split[:5], split[5]
fwd, step = kdax_paths(s, None, w, devices=devices)  # (pipeline None: chunk_kda's default)
out = {"forward": timed(fwd, args, REPS), "training step": timed(step, args, REPS)}
""",
    "tiles": r"""
from kdax.bench import Shape, cotangent, make_inputs
s = Shape()
args, w = make_inputs(s), cotangent(s)

def tiled(q, k, v, g, beta, tile):
    B, T = q.shape[:2]
    split = lambda x: jnp.moveaxis(x.reshape(B, T // tile, tile, *x.shape[2:]), 1, 0)
    def body(h, xs):
        o, h = kdax.chunk_kda(*xs, chunk_size=s.chunk_size, initial_state=h, output_final_state=True)
        return h, o
    h0 = jnp.zeros((B, v.shape[2], q.shape[3], v.shape[3]), q.dtype)
    o = jax.lax.scan(body, h0, tuple(map(split, (q, k, v, g, beta))))[1]
    return jnp.moveaxis(o, 0, 1).reshape(v.shape)

from kdax.bench._baselines import _TrainStep  # (the main table's step: value_and_grad of sum(o * w))

whole = _TrainStep(lambda *a: kdax.chunk_kda(*a, chunk_size=s.chunk_size), w)
ref = whole(*args)
out = {"whole": timed(whole, args, REPS)}
for tile in (256, 512, 1024):
    st = _TrainStep(lambda *a, tile=tile: (tiled(*a, tile),), w)
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(st(*args)), jax.tree.leaves(ref)))
    out[f"tiles of {tile} tokens"] = dict(timed(st, args, REPS), max_diff=diff)
""",
}


def run_part(part: str, reps: int, *extra: str) -> dict:
    """One fresh process running ``WORKERS[part]``; its ``out`` dict."""
    code = COMMON + f"REPS = {reps}\n" + WORKERS[part] + "\nprint(json.dumps(out))\n"
    env = dict(os.environ)
    if part == "heads":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={extra[0]}".strip()
    res = subprocess.run([sys.executable, "-c", code, part, str(reps), *extra], capture_output=True, text=True,
                         env=env)
    if res.returncode:
        raise RuntimeError(f"part {part!r} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _row(name: str, r: dict) -> str:
    more = "".join(f"  {k} {v}" if not isinstance(v, float) else f"  {k} {v:.3g}"
                   for k, v in r.items() if k not in ("ms", "cpu", "faults"))
    return f"  {name:42s} {r['ms']:8.2f} ms  CPU/wall {r['cpu']:4.2f}  faults {r['faults']:6d}{more}"


def report(parts, reps: int) -> list:
    lines = []
    for part in parts:
        shown = len(lines)
        lines.append(f"{part}:")
        if part == "heads":
            for devices, arena in (("1", "as set"), ("1", "one arena"), ("2", "arenas"), ("2", "as set")):
                out = run_part(part, reps, devices, arena)
                label = f"{devices} device{'s' if devices != '1' else ''}" + ("" if arena == "as set" else f", {arena}")
                lines += [_row(f"{label}: {k}", r) for k, r in out.items()]
        else:
            lines += [_row(k, r) for k, r in run_part(part, reps).items()]
        print("\n".join(lines[shown:]), flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(WORKERS))
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--write", action="store_true")
    a = p.parse_args()
    import jax

    from kdax.bench._timing import _cpu  # (the CPU's model and vector unit, without creating a backend here)

    cpu = " ".join(p for p in _cpu() if p)
    head = (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {cpu + ', ' if cpu else ''}{os.cpu_count()} cores, "
            f"jax {jax.__version__}, "
            f"load {os.getloadavg()[0]:.1f}; best of {a.reps} calls, CPU/wall: all threads' CPU time over wall time")
    print(head)
    lines = [head] + report([s.strip() for s in a.parts.split(",")], a.reps)
    if a.write:
        with RESULTS.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
