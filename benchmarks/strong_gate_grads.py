"""float32 gradients of ``chunk_kda`` at gates from weak to strong, against the float64
recurrence: the gate's gradient (and, with the in-kernel gate, ``A_log``'s and
``dt_bias``'s), rel-RMS, median and max over seeds, beside the float32 recurrence's.

    python benchmarks/strong_gate_grads.py                  # this tree's kdax
    python benchmarks/strong_gate_grads.py --tree /tmp/old  # another tree's kdax
                                                            # (git archive <rev> kdax | tar -x -C /tmp/old)
    python benchmarks/strong_gate_grads.py --b4 triton:16   # B4 a Pallas kernel (interpreted):
                                                            # tpu, triton (halving levels), triton:16 or :32 (rows)

Inputs: B=1 T=256 H=4 K=V=32, in-kernel l2norm and beta sigmoid, a random linear loss of the
outputs. Gates: ``g = -s |N(0, 1)|`` (log decays given), or the raw gate ``s N(0, 1)`` with
``use_gate_in_kernel`` and ``A_log`` = a, for (s, a) from (1, 0) to (30, 3), or that gate computed
by the caller and its log decays given (``--gates outside``: FLA's ``fused_kda_gate`` then
``chunk_kda``, differentiated through the caller's gate): at the strongest,
most log decays are below -20, where the true dg is near zero and any rounding noise that
B5's reverse cumsum carries is the whole error (benchmarks/NOTES.md, "float32 dg at strong
gates")."""

import argparse
import dataclasses
import sys

import numpy as np

SHAPE = dict(B=1, T=256, H=4, K=32, V=32)
GATES = ((1.0, 0.0), (3.0, 1.0), (10.0, 2.0), (30.0, 3.0))


def errors(kdax, jax, jnp, seed: int, s: float, a: float, in_kernel, pipeline=None) -> dict:
    """``{path: [rel-RMS per differentiated input]}`` for chunk_kda and the recurrence in float32;
    ``in_kernel``: True, False (log decays given) or "outside" (the gate computed by the caller)."""
    B, T, H, K, V = (SHAPE[n] for n in "BTHKV")
    r = np.random.default_rng(seed)
    q, k = r.normal(size=(B, T, H, K)), r.normal(size=(B, T, H, K))
    v, beta, w = r.normal(size=(B, T, H, V)), r.normal(size=(B, T, H)), r.normal(size=(B, T, H, V))
    g = s * r.normal(size=(B, T, H, K)) if in_kernel else -s * np.abs(r.normal(size=(B, T, H, K)))
    args = (jnp.asarray(g), jnp.asarray(np.full(H, a)), jnp.asarray(r.normal(size=H * K) * 0.5))
    argnums = (0, 1, 2) if in_kernel else (0,)

    def loss(fn, dtype, g, A_log, dt_bias):
        g, A_log, dt_bias = g.astype(dtype), A_log.astype(dtype), dt_bias.astype(dtype)
        gate = {}
        if in_kernel == "outside":
            g = -jnp.exp(A_log)[:, None] * jax.nn.softplus(g + dt_bias.reshape(H, K))
        elif in_kernel:
            gate = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)
        o, _ = fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), g, jnp.asarray(beta, dtype),
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)
        return (o.astype(jnp.float64) * w).sum()

    want = jax.grad(lambda *x: loss(kdax.fused_recurrent_kda, jnp.float64, *x), argnums=argnums)(*args)
    out = {}
    chunked = lambda *a, **kw: kdax.chunk_kda(*a, **kw, pipeline=pipeline)  # noqa: E731
    for name, fn in (("chunk_kda", chunked), ("recurrence", kdax.fused_recurrent_kda)):
        got = jax.jit(jax.grad(lambda *x: loss(fn, jnp.float32, *x), argnums=argnums))(*args)
        out[name] = [float(np.sqrt(np.mean((np.asarray(x, np.float64) - np.asarray(y)) ** 2))
                           / np.sqrt(np.mean(np.asarray(y) ** 2))) for x, y in zip(got, want)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", help="a tree holding the kdax package to measure (default: this checkout's)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--b4", help="B4 as PallasIntraBackward, interpreted: tpu, triton or triton:ROWS (default: the "
                                 "reference pipeline's)")
    ap.add_argument("--gates", choices=("both", "given", "in-kernel", "outside"), default="both")
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import kdax

    pipeline = None
    if args.b4:
        from kdax import pallas as P

        target, _, rows = args.b4.partition(":")
        b4 = P.PallasIntraBackward(target=target, interpret=True, rows=int(rows or 64))
        pipeline = dataclasses.replace(kdax.KDAPipeline.reference(), intra_bwd=b4)
    print(f"kdax from {kdax.__file__}; B4 {args.b4 or 'reference'}; B=1 T=256 H=4 K=V=32 float32 against float64, "
          f"rel-RMS over {args.seeds} seeds (median / max)")
    modes = {"both": (False, True), "given": (False,), "in-kernel": (True,), "outside": ("outside",)}
    for in_kernel in modes[args.gates]:
        cols = "d(raw g) dA_log ddt_bias" if in_kernel else "dg"
        print({False: "log decay -s |N(0,1)|", True: "raw gate s N(0,1), use_gate_in_kernel, A_log = a",
               "outside": "raw gate s N(0,1), the gate computed by the caller (log decays given), A_log = a"}[in_kernel]
              + f": {cols}")
        for s, a in GATES:
            runs = [errors(kdax, jax, jnp, seed, s, a, in_kernel, pipeline) for seed in range(args.seeds)]
            line = f"  s={s:4g} a={a:g}"
            for path in ("chunk_kda", "recurrence"):
                e = np.array([run[path] for run in runs])
                line += f"  {path}: " + " ".join(f"{m:.1e}/{x:.1e}" for m, x in zip(np.median(e, 0), e.max(0)))
            print(line, flush=True)


if __name__ == "__main__":
    main()
