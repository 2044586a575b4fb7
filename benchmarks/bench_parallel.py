"""Sequence-parallel chunk_kda against one device, in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_parallel.py \
        --out benchmarks/results/parallel.txt

For the forward and the training step (loss ``sum(o * w)``, every input gradient) at
B=1, T=32768, H=8, K=V=128 float32 (default): per-device peak memory from the compiled
program's memory analysis (temporaries + outputs), the bytes each device's collectives move
per call read from the compiled HLO, and the time, for one device and for P devices of a
mesh axis splitting the tokens (``kdax.parallel.chunk_kda``, both prefix methods).

Simulated CPU devices share the host's cores, so the time of P simulated devices is no
measure of a real speed-up: it shows the extra work of the summaries (two local passes).
"""

import argparse
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import kdax
from kdax.bench import Shape, cotangent, make_inputs, time_rounds

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\("
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def collective_bytes(hlo: str) -> dict:
    """Bytes of the results of each kind of collective in compiled HLO text (per device,
    one call; none of kdax's collectives sit inside a loop)."""
    out: dict = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        n = 0
        for dt, dims in _ARRAY.findall(m.group(1)):
            if dt in _BYTES:
                n += _BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        if m.group(3):  # an async start returns (operand, result): count the result once
            n //= 2
        out[m.group(2)] = out.get(m.group(2), 0) + n
    return out


def _memory(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)


def run(shape: Shape, devices: int, reps: int, prefixes=("gather", "doubling"), kinds=("forward", "train step")) -> list:
    args = make_inputs(shape)
    w = cotangent(shape)
    mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:devices])
    fns = {"1 device": lambda *a: kdax.chunk_kda(*a, chunk_size=shape.chunk_size)}
    for p in prefixes:
        fns[f"{devices} devices ({p})"] = (
            lambda *a, p=p: kdax.parallel.chunk_kda(mesh, "sp", *a, prefix=p, chunk_size=shape.chunk_size)
        )
    rows = []
    for kind in kinds:
        progs, compiled = [], []
        for name, fn in fns.items():
            if kind == "forward":
                f = jax.jit(lambda *a, fn=fn: fn(*a)[0])
            else:
                loss = lambda *a, fn=fn: jnp.sum(fn(*a[:5])[0] * a[5])
                f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
            t0 = time.perf_counter()
            c = f.lower(*args, *(() if kind == "forward" else (w,))).compile()
            rows.append(dict(kind=kind, name=name, compile_s=time.perf_counter() - t0, peak=_memory(c),
                             moved=collective_bytes(c.as_text())))
            progs.append(c)
            compiled.append(c)
        call_args = args if kind == "forward" else args + (w,)
        times = time_rounds([lambda *a, c=c: c(*a) for c in progs], call_args, reps)
        for r, t in zip(rows[-len(progs):], times):
            r["time_s"] = t
    return rows


def format_rows(rows: list, shape: Shape, devices: int) -> str:
    lines = [
        f"kdax sequence parallel: B={shape.B} T={shape.T} H={shape.H} K={shape.K} V={shape.V} "
        f"chunk={shape.chunk_size} float32, {devices} simulated CPU devices on {jax.devices()[0].device_kind} "
        f"({len(jax.devices())} devices, one process)",
        f"{'kind':<11} {'program':<26} {'peak MB/dev':>11} {'vs 1':>6} {'moved KB/dev':>12} "
        f"{'time s':>8} {'vs 1':>6} {'compile s':>9}  collectives",
    ]
    base = {}
    for r in rows:
        if r["name"] == "1 device":
            base[r["kind"]] = r
        b = base[r["kind"]]
        moved = sum(r["moved"].values())
        kinds = ", ".join(f"{k} {v / 1024:.1f} KB" for k, v in sorted(r["moved"].items())) or "none"
        lines.append(
            f"{r['kind']:<11} {r['name']:<26} {r['peak'] / 2**20:>11.1f} {r['peak'] / b['peak']:>6.3f} "
            f"{moved / 1024:>12.1f} {r['time_s']:>8.3f} {r['time_s'] / b['time_s']:>6.2f} {r['compile_s']:>9.1f}  {kinds}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    if jax.device_count() < a.devices:
        print(f"needs {a.devices} devices, found {jax.device_count()}: set "
              f"XLA_FLAGS=--xla_force_host_platform_device_count={a.devices}", file=sys.stderr)
        return 2
    shape = Shape(B=1, T=a.T, H=a.H, HV=a.H, K=a.K, V=a.K, chunk_size=a.chunk)
    table = format_rows(run(shape, a.devices, a.reps), shape, a.devices)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
