"""Random ``chunk_kda`` calls in float64 against the recurrence: shapes, FLA's options
(``safe_gate`` too), packed layouts (empty sequences too), chunk sizes (16 to 128),
initial states in either layout and pipelines drawn per seed (the Pallas stages for TPU
and for Triton, at a drawn tuning, in interpret mode); the outputs, final states and
every input gradient of a random linear loss compared by relative RMS (a seed fails
above ``--tol``, NaN fails).

    python benchmarks/fuzz_against_oracle.py 0 100          # seeds 0..99, one device
    python benchmarks/fuzz_against_oracle.py 0 100 --sp     # kdax.parallel.chunk_kda on 2 or 4
                                                            # simulated devices against one device
    python benchmarks/fuzz_against_oracle.py 0 100 --float32   # kdax on float32 inputs against the
                                                               # float64 recurrence (--tol 1e-4)
    python benchmarks/fuzz_against_oracle.py 0 20 --pipeline "pallas triton"   # one pipeline

The oracle is ``kdax.ref.naive_recurrent_kda`` per sequence, with the in-kernel options
applied by ``kdax.ref``'s activations (l2norm, the softplus and lower-bound gates, beta's
sigmoid). One line per seed (its configuration; the errors when it fails); the exit status
is the number of failed seeds. A seed takes 5-50 s on the 2-core CPU (compiles)."""

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import warnings

if "--sp" in sys.argv:  # before JAX loads
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kdax  # noqa: E402
from kdax import ref  # noqa: E402

jax.config.update("jax_enable_x64", True)


def oracle(q, k, v, g, beta, *, scale, h0, cu, opts, A_log, dt_bias, v_first):
    """``(o, final states)`` of the recurrence, sequence by sequence when ``cu`` is given."""
    if opts.get("use_qk_l2norm_in_kernel"):
        q, k = ref.l2norm(q), ref.l2norm(k)
    if opts.get("use_gate_in_kernel"):
        g = ref.kda_gate(g, A_log, dt_bias, opts.get("lower_bound"))
    beta = ref.beta_activation(beta, opts.get("use_beta_sigmoid_in_kernel", False), opts.get("allow_neg_eigval", False))
    if h0 is not None and v_first:
        h0 = jnp.swapaxes(h0, -1, -2)
    run = lambda a, b, h: ref.naive_recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), scale=scale,
                                                  initial_state=h, output_final_state=True)
    if cu is None:
        o, S = run(0, q.shape[1], h0)
    else:
        outs, states = [], []
        for n in range(len(cu) - 1):
            h = None if h0 is None else h0[n:n + 1]
            if cu[n + 1] > cu[n]:
                o, S = run(cu[n], cu[n + 1], h)
            else:  # an empty sequence passes its state through
                o, S = v[:, :0], jnp.zeros((1,) + g.shape[2:] + v.shape[-1:]) if h is None else h
            outs.append(o)
            states.append(S)
        o, S = jnp.concatenate(outs, 1), jnp.concatenate(states, 0)
    return o, (jnp.swapaxes(S, -1, -2) if v_first else S)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return np.inf
    scale = np.sqrt(np.mean(b**2))
    return float(np.sqrt(np.mean((a - b) ** 2)) / (scale if scale > 1e-200 else 1.0))


# The pipelines a seed draws from, by name (with --sp: the second list); their order is
# the draw's, so a change to it gives old seeds other pipelines.
PIPELINES = ("reference", "default", "pallas", "segmented(reference, 2)", "segmented(pallas, 3)", "reference, tile",
             "reference, share_chunks=False", "pallas triton", "segmented(pallas triton, 2)")
SP_PIPELINES = ("reference", "default", "pallas", "segmented(reference, 2)", "pallas triton")


def draw(seed: int, sp: bool, pipeline=None):
    """One configuration: ``(inputs, keyword arguments, description)``; ``pipeline``: run
    that one of the drawn pipelines' names (the rest drawn as for any seed)."""
    r = np.random.default_rng(seed)
    H = int(r.choice([1, 2]))
    HV = H * int(r.choice([1, 2, 3] if not sp else [1, 2]))
    K, V = (int(r.choice([4, 8, 16] if not sp else [4, 8])) for _ in range(2))
    chunk = int(r.choice([16, 32, 64] if not sp else [16, 32]))
    devices = int(r.choice([2, 4])) if sp else 1
    if sp or r.random() < 0.4:  # packed
        if sp:
            T = devices * int(r.choice([16, 32, 48, 64]))
            cu = [0, *sorted(int(x) for x in r.integers(0, T + 1, int(r.integers(0, 4)))), T]
        else:
            lens = [int(x) for x in r.choice([0, 1, 5, 16, 17, 33, 64, 70], int(r.integers(1, 5)))]
            lens[-1] = lens[-1] or 3
            cu = [0, *np.cumsum(lens).tolist()]
        B, T, N = 1, cu[-1], len(cu) - 1
    else:
        B, T, cu = int(r.integers(1, 3)), int(r.choice([1, 7, 16, 31, 64, 65, 100])), None
        N = B
    opts = {f: True for f in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel")
            if r.random() < 0.4}
    if opts.get("use_beta_sigmoid_in_kernel") and r.random() < 0.4:
        opts["allow_neg_eigval"] = True
    if opts.get("use_gate_in_kernel") and r.random() < 0.4:
        opts["lower_bound"] = float(r.choice([-5.0, -1.0]))
    q, k = r.normal(size=(B, T, H, K)), r.normal(size=(B, T, H, K))
    if not opts.get("use_qk_l2norm_in_kernel"):
        k = k / np.sqrt(K) / 2  # (a stable delta rule: beta |k|^2 <= 2)
    v = r.normal(size=(B, T, HV, V))
    if opts.get("use_gate_in_kernel"):
        g = r.normal(size=(B, T, HV, K))
    else:
        g = -r.uniform(0.0, 0.7, size=(B, T, HV, K))
        if r.random() < 0.3:
            g[r.uniform(size=g.shape) < 0.05] = -float(r.choice([30.0, 200.0]))
    beta = r.normal(size=(B, T, HV)) if opts.get("use_beta_sigmoid_in_kernel") else r.uniform(0, 1, (B, T, HV))
    in_kernel = opts.get("use_gate_in_kernel")
    A_log = r.uniform(-1, 0.5, HV) if in_kernel and ("lower_bound" not in opts or r.random() < 0.5) else None
    dt_bias = r.normal(size=HV * K) * 0.5 if in_kernel and r.random() < 0.8 else None
    scale = None if r.random() < 0.5 else float(r.uniform(0.1, 1.0))
    v_first = not sp and r.random() < 0.25
    state = (N, HV, V, K) if v_first else (N, HV, K, V)
    h0 = r.normal(size=state) * 0.3 if r.random() < 0.6 else None
    P = kdax.KDAPipeline
    tuned = {}

    def triton():
        """The Triton kernels (interpret mode) at a drawn tuning, under the "auto" policy: a
        tuning's "fast" (bf16 products) would be another precision than the call's."""
        tuned["tuning"] = str(r.choice(sorted(kdax.pallas.TUNINGS)))
        return P.pallas("triton", interpret=True, tuning=tuned["tuning"]).with_precision("auto")

    pipes = {"reference": P.reference, "default": kdax.default_pipeline, "pallas": lambda: P.pallas(interpret=True),
             "segmented(reference, 2)": lambda: kdax.stages.segmented(P.reference(), 2),
             "segmented(pallas, 3)": lambda: kdax.stages.segmented(P.pallas(interpret=True), 3),
             "reference, tile": lambda: dataclasses.replace(P.reference(), tile=int(r.choice([1, 3, 8]))),
             "reference, share_chunks=False": lambda: dataclasses.replace(P.reference(), share_chunks=False),
             "pallas triton": triton, "segmented(pallas triton, 2)": lambda: kdax.stages.segmented(triton(), 2)}
    assert tuple(pipes) == PIPELINES
    names = SP_PIPELINES if sp else PIPELINES
    name = str(r.choice(list(names)))
    if pipeline is not None:
        if pipeline not in names:
            raise ValueError(f"pipeline: expected one of {names}, got {pipeline!r}")
        name = pipeline
    kw = dict(scale=scale, output_final_state=True, chunk_size=chunk, pipeline=pipes[name](), **opts)
    if not sp:
        kw.update(state_v_first=v_first, disable_recompute=bool(r.random() < 0.2))
    # Drawn apart (a second generator), so that every earlier seed keeps its configuration:
    # chunks of 128 (one device) and FLA's safe_gate where its promise holds (the in-kernel
    # lower-bound gate: g in [lower_bound, 0)).
    r2 = np.random.default_rng([seed, 68])
    if not sp and r2.random() < 0.15:
        kw["chunk_size"] = chunk = 128
    if opts.get("use_gate_in_kernel") and "lower_bound" in opts and r2.random() < 0.5:
        kw["safe_gate"] = True
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, A_log=A_log, dt_bias=dt_bias,
                  wo=r.normal(size=v.shape), ws=r.normal(size=state))
    arrays = {n: None if x is None else jnp.asarray(x) for n, x in arrays.items()}
    said = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, chunk=chunk, cu_seqlens=cu, options=dict(opts, **(
                    {"safe_gate": True} if kw.get("safe_gate") else {})), A_log=A_log is not None,
                dt_bias=dt_bias is not None, scale=scale, initial_state=h0 is not None, state_v_first=v_first,
                pipeline=name, **tuned, devices=devices, prefix=str(r.choice(["gather", "doubling"])))
    return arrays, kw, said


def run_seed(seed: int, sp: bool, dtype=jnp.float64, pipeline=None):
    """``(description, {name: rel-RMS error})`` of one seed; kdax's inputs in ``dtype`` (the
    oracle's stay float64)."""
    x, kw, said = draw(seed, sp, pipeline)
    cu = said["cu_seqlens"]
    if cu is not None:
        kw["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
    names = [n for n in ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias") if x[n] is not None]

    def loss(call):
        def f(*a):
            given = dict(zip(names, a))
            o, S = call(*(given[n] for n in ("q", "k", "v", "g", "beta")), given.get("h0"), given.get("A_log"),
                        given.get("dt_bias"))
            return (o * x["wo"]).sum() + (S * x["ws"]).sum(), (o, S)
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(names))), has_aux=True))

    kdax_call = lambda q, k, v, g, beta, h0, A, dt: kdax.chunk_kda(q, k, v, g, beta, initial_state=h0, A_log=A,
                                                                   dt_bias=dt, **kw)
    if sp:
        mesh = jax.make_mesh((said["devices"],), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,),
                             devices=jax.devices()[:said["devices"]])
        want_call = kdax_call
        got_call = lambda q, k, v, g, beta, h0, A, dt: kdax.parallel.chunk_kda(
            mesh, "sp", q, k, v, g, beta, initial_state=h0, A_log=A, dt_bias=dt, prefix=said["prefix"], **kw)
    else:
        mesh = None
        got_call = kdax_call
        want_call = lambda q, k, v, g, beta, h0, A, dt: oracle(
            q, k, v, g, beta, scale=kw["scale"], h0=h0, cu=cu, opts={o: kw[o] for o in said["options"]}, A_log=A,
            dt_bias=dt, v_first=said["state_v_first"])
    args = [x[n] for n in names]
    (_, (o1, S1)), g1 = loss(want_call)(*args)
    args = [a.astype(dtype) for a in args]  # (the oracle's ran in float64 above)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        (_, (o2, S2)), g2 = loss(got_call)(*args)
    errs = {"o": rel(o2, o1), "final": rel(S2, S1), **{f"d{n}": rel(a, b) for n, a, b in zip(names, g2, g1)}}
    if not sp:  # the forward alone (tiles apply there)
        o3, S3 = jax.jit(lambda *a: kdax_call(*(dict(zip(names, a)).get(n) for n in (
            "q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"))))(*args)
        errs.update(o_forward=rel(o3, o1), final_forward=rel(S3, S1))
    return said, errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("start", type=int)
    ap.add_argument("count", type=int)
    ap.add_argument("--sp", action="store_true", help="sequence parallel on simulated devices against one device")
    ap.add_argument("--float32", action="store_true", help="kdax's inputs in float32 (the oracle's in float64)")
    ap.add_argument("--pipeline", default=None, help="run every seed on this one of the drawn pipelines "
                    "(e.g. 'pallas triton'; the other choices drawn as usual)")
    ap.add_argument("--tol", type=float, default=None,
                    help="the largest relative RMS error that passes (default 1e-9; 1e-4 with --float32)")
    args = ap.parse_args()
    if args.pipeline is not None and args.pipeline not in (SP_PIPELINES if args.sp else PIPELINES):
        ap.error(f"--pipeline: expected one of {SP_PIPELINES if args.sp else PIPELINES}, got {args.pipeline!r}")
    dtype = jnp.float32 if args.float32 else jnp.float64
    tol = args.tol if args.tol is not None else (1e-4 if args.float32 else 1e-9)
    warnings.simplefilter("ignore")  # (the fallback and stability warnings of drawn configurations)
    failed = 0
    for seed in range(args.start, args.start + args.count):
        t0 = time.perf_counter()
        try:
            said, errs = run_seed(seed, args.sp, dtype, args.pipeline)
        except Exception as e:  # a refusal of a drawn configuration is a finding too
            print(f"seed {seed} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
            failed += 1
            continue
        worst = max(errs.values())
        ok = worst <= tol
        failed += not ok
        print(f"seed {seed} {'ok' if ok else 'FAILED'} worst {worst:.2e} ({time.perf_counter() - t0:.0f} s) {said}"
              + ("" if ok else f" {errs}"), flush=True)
    print(f"{failed} of {args.count} seeds failed")
    sys.exit(min(failed, 255))


if __name__ == "__main__":
    main()
