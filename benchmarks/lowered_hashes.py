"""Hashes of the reference pipeline's lowered programs (the forward and the training step
of ``chunk_kda``), to show that a change to kdax's Python leaves what XLA compiles
byte-identical: run it before and after, compare the lines.

    python benchmarks/lowered_hashes.py   # float32 and bfloat16; dense, packed, packed with initial states
    python benchmarks/lowered_hashes.py --no-checks   # the same with check_inputs=False
    python benchmarks/lowered_hashes.py --more   # 36 more: tiles, per-sequence, many short sequences

``--no-checks`` leaves out the in-program domain check of g and beta (``check_inputs``, on
by default since session 24): the programs of the algorithm alone, comparable with the
hashes recorded before it.

The programs are lowered (``jax.jit(...).lower``), not compiled: the StableHLO text with
its location metadata stripped (file and line numbers move with any edit)."""

import dataclasses
import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kdax  # noqa: E402

_LOC = re.compile(r"\s*loc\([^\n]*?\)(?=\s*$)|#loc[^\n]*", re.M)


def lowered_text(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).as_text(debug_info=False)
    return _LOC.sub("", text)


def cases():
    B, T, H, K, V = 1, 96, 2, 16, 16
    r = jax.random.split(jax.random.key(0), 5)
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jax.random.normal(r[0], (B, T, H, K), dtype)
        k = jax.random.normal(r[1], (B, T, H, K), dtype)
        v = jax.random.normal(r[2], (B, T, H, V), dtype)
        g = -jax.nn.softplus(jax.random.normal(r[3], (B, T, H, K))).astype(dtype)
        beta = jax.nn.sigmoid(jax.random.normal(r[4], (B, T, H))).astype(dtype)
        h0 = jax.random.normal(r[0], (3, H, K, V), jnp.float32)
        for layout in ("dense", "packed", "packed+h0"):
            opts = dict(chunk_size=16, output_final_state=True)
            if layout != "dense":
                opts["cu_seqlens"] = jnp.array([0, 5, 40, 96], jnp.int32)
            if layout == "packed+h0":  # (initial states entering shared chunks)
                opts["initial_state"] = h0
            yield f"{jnp.dtype(dtype).name} {layout}", (q, k, v, g, beta), opts


def more_cases():
    """``--more``: what ``cases`` does not reach: the forward in tiles (dense, T a multiple
    of the chunk or not, per-sequence and shared chunks), one sequence per chunk, twelve
    short sequences sharing chunks (narrow ragged blocks), with and without initial states."""
    H, K, V = 2, 16, 16
    r = jax.random.split(jax.random.key(1), 5)
    ref = kdax.KDAPipeline.reference()
    tiled = lambda n, **kw: dataclasses.replace(ref, tile=n, **kw)
    cu3 = jnp.array([0, 5, 40, 96], jnp.int32)
    cu12 = jnp.array([0, 3, 9, 10, 20, 21, 30, 41, 50, 60, 70, 81, 96], jnp.int32)
    h0 = lambda N: jax.random.normal(r[0], (N, H, K, V))
    for dtype in (jnp.float32, jnp.bfloat16):
        n = jnp.dtype(dtype).name
        runs = [(f"{n} dense T{T} B{B} tiles", B, T, {}, tiled(8)) for T in (96, 90) for B in (1, 2)]
        runs += [(f"{n} per-seq tiles", 1, 96, dict(cu_seqlens=cu3), tiled(4, share_chunks=False)),
                 (f"{n} shared tiles", 1, 96, dict(cu_seqlens=cu3), tiled(4)),
                 (f"{n} shared 12", 1, 96, dict(cu_seqlens=cu12), ref),
                 (f"{n} shared 12+h0", 1, 96, dict(cu_seqlens=cu12, initial_state=h0(12)), ref),
                 (f"{n} per-seq+h0", 1, 96, dict(cu_seqlens=cu3, initial_state=h0(3)),
                  dataclasses.replace(ref, share_chunks=False))]
        for name, B, T, opts, pipe in runs:
            q, k = (jax.random.normal(r[i], (B, T, H, K), dtype) for i in (0, 1))
            v = jax.random.normal(r[2], (B, T, H, V), dtype)
            g = -jax.nn.softplus(jax.random.normal(r[3], (B, T, H, K))).astype(dtype)
            beta = jax.nn.sigmoid(jax.random.normal(r[4], (B, T, H))).astype(dtype)
            yield name, (q, k, v, g, beta), dict(opts, chunk_size=16, output_final_state=True), pipe


def main():
    reference = kdax.KDAPipeline.reference()
    more = "--more" in sys.argv[1:]
    for name, args, opts, pipe in more_cases() if more else ((*c, reference) for c in cases()):
        if "--no-checks" in sys.argv[1:]:
            opts = dict(opts, check_inputs=False)
        fwd = lambda *a: kdax.chunk_kda(*a, pipeline=pipe, **opts)
        loss = lambda *a: sum(jnp.sum(x.astype(jnp.float32)) for x in fwd(*a))
        step = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        for what, fn in (("forward", fwd), ("training step", step)):
            h = hashlib.sha256(lowered_text(fn, *args).encode()).hexdigest()[:16]
            print(f"{name:<{28 if more else 18}} {what:<14} {h}", flush=True)


if __name__ == "__main__":
    main()
