"""What each reference stage costs inside the main job's programs (issue 51): the forward
(``o`` alone) and the training step (``sum(o * w)`` and every input gradient), each timed
against the same program with one stage's work left out. The stage left out returns zeros
of its outputs' shapes (``zeroed``: it calls the reference stage for the shapes, which XLA
then drops as dead code; the zeros read one element of each input behind an optimization
barrier, so the work that makes the inputs stays, and are opaque); it declares what
the reference stage declares and the pipeline trusts declarations, so every route (tiles,
the six-stage backward) stays the same. The difference is the stage's marginal cost
there, which ``python -m kdax.bench --stages`` (each stage alone, on the whole input) and
a profile's per-operation times do not give: stages run on tiles in the forward, and a
change that made F2 alone 0.76-0.98x the time left the forward unchanged (NOTES.md,
session 56).

    PYTHONPATH=. python benchmarks/marginal_costs.py [--rounds 15] [--T 4096 --H 8 --K 128 --V 128]
        [--stages intra,wy] [--forward-only]

The stages downstream of the one left out run the same operations on zeros, but not always
at the same speed: without F1, a trace of the step had F2's and B4's exponential fusions
at 12.4 and 12.3 ms against 18.7 and 18.8, though a bare exponential takes the same time
on zeros as on [-6.4, 0] (0.67-0.70 ms over [512, 64, 128]); so F1's row in the step (33
ms, F1 itself ~12) holds ~20 ms of the later stages that are not understood. Each round times the full program and then the one without a stage, for every
stage: the marginal cost is the median over rounds of (full - without), with its
quartiles."""

import argparse
import dataclasses
import inspect
import time
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdax
from kdax._runner.contracts import STAGES
from kdax.bench._main import cotangent
from kdax.bench._run import kdax_paths
from kdax.bench._shape import Shape, make_inputs


def zeroed(name: str):
    """A stage of field ``name``'s family returning zeros of the reference stage's outputs,
    with the reference class's declarations and signature."""
    ref_cls = STAGES[name].reference
    sig = inspect.signature(ref_cls.__call__)

    def __call__(self, *args, **kwargs):
        out = self.ref(*args, **kwargs)  # (for the shapes: unused, so XLA drops its work)
        inputs = [a for a in jax.tree.leaves((args, kwargs)) if hasattr(a, "dtype") and a.size]
        zeros = jax.tree.map(lambda a: jnp.zeros_like(a) if hasattr(a, "dtype") else a, out)
        # The inputs stay computed: the zeros depend on one element of each, read behind a
        # barrier (zeros without them let XLA drop all the work only this stage consumed:
        # F5's took the forward's h, Aqk and qg along; the inputs passed through a barrier
        # whose outputs go unused were dropped too). The zeros stay opaque (zeros XLA can
        # see simplify the stages after: a product with zeros is not a product).
        zeros, inputs = jax.lax.optimization_barrier((zeros, inputs))
        dep = sum(0 * x.ravel()[0].astype(jnp.float32) for x in inputs)
        return jax.lax.optimization_barrier(jax.tree.map(lambda z: z + dep.astype(z.dtype), zeros))

    __call__.__signature__ = sig
    declared = {k: getattr(ref_cls, k) for k in ("math", "tile_safe", "accepts", "transposes") if hasattr(ref_cls, k)}
    ns = dict(__call__=__call__, __annotations__=dict(ref=Any, **{k: ClassVar for k in declared}), **declared)
    cls = type(f"Zeroed{ref_cls.__name__}", (STAGES[name].family,), ns)
    return cls(ref=ref_cls())


def without(pipe, name: str):
    """``pipe`` with field ``name`` zeroed (``zeroed``), declarations trusted so that its routes stay."""
    return dataclasses.replace(eqx.tree_at(lambda p: getattr(p, name), pipe, zeroed(name)), trust_declarations=True)


def paired(full, fs: dict, args, rounds: int) -> dict:
    """Per program of ``fs``, ``rounds`` pairs ``(full, without)`` of times (ms), each pair run
    back to back: the host drifts by tens of percent within a minute, a pair hardly."""
    for f in (full, *fs.values()):
        jax.block_until_ready(f(*args))
    ts = {k: [] for k in fs}

    def ms(f):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        return 1e3 * (time.perf_counter() - t0)

    for _ in range(rounds):
        for k, f in fs.items():
            ts[k].append((ms(full), ms(f)))
    return ts


def report(kind: str, ts: dict) -> list:
    fulls = [a for pairs in ts.values() for a, _ in pairs]
    print(f"{kind}: full best {min(fulls):.1f} ms, median {np.median(fulls):.1f}")
    rows = []
    for k, pairs in ts.items():
        d = np.array([a - b for a, b in pairs])
        share = d / np.array([a for a, _ in pairs])
        q1, med, q3 = np.percentile(d, [25, 50, 75])
        rows.append((k, float(med), float(np.median(share))))
        print(f"  {STAGES[k].step} {k:10s} marginal: median of pairs {med:6.1f} ms ({100 * np.median(share):4.1f}% of "
              f"the full), quartiles {q1:6.1f} .. {q3:6.1f} ms", flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--stages", default="", help="the fields to leave out, comma separated (default: all)")
    p.add_argument("--forward-only", action="store_true")
    o = p.parse_args(argv)
    kdax.reuse_freed_memory()
    s = Shape(B=o.B, T=o.T, H=o.H, HV=o.H, K=o.K, V=o.V)
    args, w = make_inputs(s), cotangent(s)
    pipe = kdax.KDAPipeline.reference()
    names = [n for n in o.stages.split(",") if n] or list(STAGES)
    print(f"B={s.B} T={s.T} H={s.H} K={s.K} V={s.V} float32, {jax.devices()[0].device_kind}; rounds {o.rounds}")
    out = {}
    for kind, idx in (("forward", 0), ("step", 1)):
        if kind == "step" and o.forward_only:
            break
        keep = [n for n in names if kind == "step" or STAGES[n].forward]
        compile_ = lambda pp: jax.jit(kdax_paths(s, pp, w)[idx]).lower(*args).compile()
        fs = {n: compile_(without(pipe, n)) for n in keep}
        out[kind] = report(kind, paired(compile_(pipe), fs, args, o.rounds))
    return out


if __name__ == "__main__":
    main()
