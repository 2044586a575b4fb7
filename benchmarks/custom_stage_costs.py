"""What a custom stage costs a training step (issue 49): ``jit(grad(chunk_kda))`` time, XLA's
temp bytes and compile time for the default pipeline beside

- an F1 of other math alone (an undeclared no-op wrapper of F1: B0-B4 hand-written, B5 the
  F1's VJP, ``kdax.stages.GateVjpBackward``), and Gated DeltaNet's F1 (examples/gated_deltanet.py);
- an undeclared no-op F5 wrapper (B0, B2-B5 hand-written, F5's transpose its ``jax.vjp``:
  ``kdax._runner.output_vjp``);
- an undeclared no-op F4 wrapper (the backward derived whole by ``jax.vjp``);
- every forward stage an undeclared wrapper (derived whole);

(a derived backward differentiates the reference stages through their chunk loops' own
VJPs: ``kdax._numerics.chunk_loops.over_chunks``, F4's recurrence, F2's inverse)

and an eager derived gradient's time a call against its jitted one. Ratios against the
default measured in the same process, the paths timed in interleaved rounds.

    python benchmarks/custom_stage_costs.py            # T=2048 H=4 K=V=64 and the main job's shape
    python benchmarks/custom_stage_costs.py --quick    # T=2048 only
"""

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kdax  # noqa: E402
from kdax import stages as S  # noqa: E402

warnings.simplefilter("ignore", kdax.FallbackWarning)


class WrapGate(S.AbstractGate):
    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return S.ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class WrapIntra(S.AbstractIntra):
    def __call__(self, scale, q, k, beta, G):
        return S.ReferenceIntra()(scale, q, k, beta, G)


class WrapWY(S.AbstractWY):
    def __call__(self, q, k, v, beta, G, Akk):
        return S.ReferenceWY()(q, k, v, beta, G, Akk)


class WrapState(S.AbstractState):
    def __call__(self, w, u, kg, G, h0, layout):
        return S.ReferenceState()(w, u, kg, G, h0, layout)


class WrapOutput(S.AbstractOutput):
    def __call__(self, scale, qg, h, Aqk, v_new):
        return S.ReferenceOutput()(scale, qg, h, Aqk, v_new)


def pipelines() -> dict:
    ref = kdax.KDAPipeline.reference()
    sys.path.insert(0, str(ROOT / "examples"))
    import gated_deltanet

    every = eqx.tree_at(lambda p: (p.gate, p.intra, p.wy, p.state, p.output), ref,
                        (WrapGate(), WrapIntra(), WrapWY(), WrapState(), WrapOutput()))
    return {
        "default": ref,
        "F1 of other math (no-op wrapper)": eqx.tree_at(lambda p: p.gate, ref, WrapGate()),
        "Gated DeltaNet F1": gated_deltanet.gdn_pipeline(ref),
        "undeclared F5 wrapper (F5 VJP)": eqx.tree_at(lambda p: p.output, ref, WrapOutput()),
        "undeclared F4 wrapper (derived)": eqx.tree_at(lambda p: p.state, ref, WrapState()),
        "every forward stage (derived)": every,
    }


def inputs(B, T, H, K, V):
    r = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(r[0], (B, T, H, K))
    k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    v = jax.random.normal(r[2], (B, T, H, V))
    g = jnp.broadcast_to(jax.random.normal(r[3], (B, T, H, 1)), (B, T, H, K))  # raw, one value per head
    b = jax.random.normal(r[4], (B, T, H))
    A_log, dt = jnp.zeros(H), jnp.zeros(H * K)
    return (q, k, v, g, b), dict(A_log=A_log, dt_bias=dt, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True, chunk_size=64)


def step_fn(pipe, opts):
    def loss(q, k, v, g, b):
        return jnp.sum(kdax.chunk_kda(q, k, v, g, b, pipeline=pipe, **opts)[0])

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def measure(shape, reps, log):
    args, opts = inputs(*shape)
    rows = {}
    runs = {}
    for name, pipe in pipelines().items():
        log(f"  compiling {name}")
        t0 = time.perf_counter()
        compiled = jax.jit(step_fn(pipe, opts)).lower(*args).compile()
        rows[name] = dict(compile_s=time.perf_counter() - t0,
                          temp=compiled.memory_analysis().temp_size_in_bytes)
        jax.block_until_ready(compiled(*args))
        runs[name] = compiled
    best = {n: float("inf") for n in runs}
    for _ in range(reps):  # interleaved rounds: the machine's drift reaches every path alike
        for n, f in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[n] = min(best[n], time.perf_counter() - t0)
    for n in rows:
        rows[n]["time_s"] = best[n]
    return rows


def eager_vs_jit(log, T=512):
    args, opts = inputs(1, T, 4, 64, 64)
    out = {}
    for name in ("default", "undeclared F5 wrapper (F5 VJP)", "undeclared F4 wrapper (derived)"):
        f = step_fn(pipelines()[name], opts)
        jax.block_until_ready(f(*args))  # compiles
        j = jax.jit(f)
        jax.block_until_ready(j(*args))
        te = min(_timed(f, args) for _ in range(3))
        tj = min(_timed(j, args) for _ in range(3))
        out[name] = (te, tj)
        log(f"  eager {name}: {te * 1e3:.1f} ms a call, jitted {tj * 1e3:.1f} ms")
    return out


def _timed(f, args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)
    shapes = [(1, 2048, 4, 64, 64)] + ([] if a.quick else [(1, 4096, 8, 128, 128)])
    print(f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} device(s) "
          f"{jax.devices()[0].platform}, jax {jax.__version__}")
    for shape in shapes:
        log(f"B, T, H, K, V = {shape}")
        rows = measure(shape, a.reps, log)
        base = rows["default"]
        print(f"\njit(grad(chunk_kda)), float32, B, T, H, K, V = {shape} (best of {a.reps} interleaved rounds)")
        print(f"{'pipeline':<36} {'time ms':>9} {'x default':>10} {'temp MiB':>9} {'x default':>10} {'compile s':>10}")
        for n, r in rows.items():
            print(f"{n:<36} {r['time_s'] * 1e3:>9.1f} {r['time_s'] / base['time_s']:>10.2f} "
                  f"{r['temp'] / 2**20:>9.1f} {r['temp'] / max(base['temp'], 1):>10.2f} {r['compile_s']:>10.1f}")
    print("\neager jax.grad (no jit) after the first call, T=512 H=4 K=V=64:")
    for n, (te, tj) in eager_vs_jit(log).items():
        print(f"{n:<36} eager {te * 1e3:8.1f} ms, jitted {tj * 1e3:8.1f} ms: {te / tj:.2f}x")


if __name__ == "__main__":
    main()
