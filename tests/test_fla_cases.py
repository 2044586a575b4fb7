"""FLA's KDA test parametrisations replayed against kdax's float64 oracle.

Source: fla-org/flash-linear-attention ``tests/ops/test_kda.py`` at commit
027787caa0bfc246fed3540ff13ae3c3d06c75c5 (the stored copy). Each case keeps FLA's shapes,
dtypes, options, masks, varlen offsets and FLA's tolerances (its ``assert_close`` ratio is
rel-RMS, ``tests._util.rel_rms``); inputs are drawn as FLA draws them (numpy instead of
torch). Shapes too big for a CPU are cut along T (and B) with the case id saying so; the
default run keeps the smallest case of each test, the rest are marked slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax.ref import naive_chunk_kda, naive_recurrent_kda

from ._util import assert_close, oracle_kda, outputs_and_grads

T_CUT, B_CUT = 256, 2


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _normalize(x):  # F.normalize(x, p=2, dim=-1)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _cut(B, T, slow):
    return (min(B, B_CUT), min(T, T_CUT)) if slow else (B, T)


def _case(test, slow):
    """pytest.param with FLA's id; slow ones (and their cut shape) marked."""
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(*test, slow, id="-".join(map(str, test)), marks=marks)


def _check(got, want, tols):
    for n, tol in tols.items():
        if n in got:
            assert_close(got[n], want[n], tol, n)


# -- test_chunk ---------------------------------------------------------------------------

CHUNK = [
    (1, 63, 1, 64, 1, 1, 0, False, False),
    (2, 500, 3, 60, 1, 1, 0, False, False),
    (2, 1000, 3, 64, 0.1, 1, 0.5, False, False),
    (3, 1024, 4, 100, 1, 0.1, 0, False, False),
    (4, 1024, 4, 128, 0.1, 1, 0, False, False),
    (4, 1024, 4, 128, 0.1, 1, 0, True, False),
    (2, 1500, 4, 128, 0.1, 10, 0, False, True),
    (4, 2048, 8, 64, 0.1, 1, 0, False, True),
]
CHUNK_TOLS = dict(o=0.005, ht=0.005, q=0.008, k=0.008, v=0.008, g=0.02, beta=0.02, A_log=0.001, dt_bias=0.001,
                  initial_state=0.008)


@pytest.mark.parametrize("B, T, H, D, scale, normalizer, mask_p, l2_in_kernel, gate_in_kernel, slow",
                         [_case(t, i > 0) for i, t in enumerate(CHUNK)])
def test_chunk(B, T, H, D, scale, normalizer, mask_p, l2_in_kernel, gate_in_kernel, slow):
    """FLA's test_chunk (float16 inputs): outputs and every gradient of
    ``sum(o * do) + sum(ht * dht)``."""
    B, T = _cut(B, T, slow)
    r = np.random.default_rng(42)
    q, k, v = (r.uniform(size=(B, T, H, D)) for _ in range(3))
    g = r.normal(size=(B, T, H, D))
    x = {}
    if gate_in_kernel:
        x["A_log"], x["dt_bias"] = r.normal(size=(H,)), r.normal(size=(H * D,))
    else:
        g = _logsigmoid(g) / normalizer * (r.uniform(size=g.shape) > mask_p)
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, H))))
    if not l2_in_kernel:
        q, k = _normalize(q), _normalize(k)
    f16 = lambda a: jnp.asarray(a, jnp.float16)
    x.update(q=f16(q), k=f16(k), v=f16(v), g=jnp.asarray(g, jnp.float32), beta=f16(beta),
             initial_state=jnp.asarray(r.normal(size=(B, H, D, D)), jnp.float32))
    x = {n: (jnp.asarray(a, jnp.float32) if n in ("A_log", "dt_bias") else a) for n, a in x.items()}
    opts = dict(scale=float(scale), output_final_state=True, use_qk_l2norm_in_kernel=l2_in_kernel,
                use_gate_in_kernel=gate_in_kernel)
    do = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float16)
    dht = jnp.asarray(r.normal(size=(B, H, D, D)), jnp.float32)
    _against_oracle(kdax.chunk_kda, x, opts, do, dht, CHUNK_TOLS)


def _against_oracle(fn, x, opts, do, dht, tols):
    x64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    o, ht, got = outputs_and_grads(fn, x, opts, do, dht)
    o_ref, ht_ref, want = outputs_and_grads(oracle_kda, x64, opts, do.astype(jnp.float64), dht.astype(jnp.float64))
    _check(dict(o=o, ht=ht, **got), dict(o=o_ref, ht=ht_ref, **want), tols)


# -- test_chunk_varlen ----------------------------------------------------------------------

VARLEN = [
    (4, 60, 0, [0, 15]),
    (4, 64, 0, [0, 256, 500, 1000]),
    (4, 128, 0.5, [0, 256, 500, 1000]),
    (4, 100, 0, [0, 15, 100, 300, 1200, 2000]),
    (4, 256, 0, [0, 100, 300, 1200, 3000, 4096]),
]
VARLEN_TOLS = dict(o=0.005, ht=0.005, q=0.007, k=0.008, v=0.007, g=0.015, beta=0.015, initial_state=0.007)


def _cut_offsets(cu):
    """FLA's offsets scaled down to a total of at most T_CUT tokens, every sequence kept
    non-empty and in order."""
    cu = np.asarray(cu)
    if cu[-1] <= T_CUT:
        return [int(c) for c in cu]
    out = np.round(cu * T_CUT / cu[-1]).astype(int)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + 1)
    return [int(c) for c in out]


# All slow: each compiles the oracle once per sequence (73 s for FLA's first case on a busy
# 2-core machine); tests/test_pipeline.py covers varlen in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("H, D, mask_p, cu, slow", [_case((h, d, m, tuple(c)), i > 0) for i, (h, d, m, c) in enumerate(VARLEN)])
def test_chunk_varlen(H, D, mask_p, cu, slow):
    """FLA's test_chunk_varlen (float16 inputs, packed sequences with their own initial
    states); offsets scaled down when cut."""
    cu = _cut_offsets(cu) if slow else list(cu)
    T, N = cu[-1], len(cu) - 1
    r = np.random.default_rng(42)
    f16 = lambda a: jnp.asarray(a, jnp.float16)
    g = _logsigmoid(r.normal(size=(1, T, H, D)))
    x = dict(
        q=f16(r.normal(size=(1, T, H, D))), k=f16(_normalize(r.normal(size=(1, T, H, D)))),
        v=f16(r.normal(size=(1, T, H, D))), g=jnp.asarray(g * (r.uniform(size=g.shape) > mask_p), jnp.float32),
        beta=f16(1 / (1 + np.exp(-r.uniform(size=(1, T, H))))),
        initial_state=jnp.asarray(r.normal(size=(N, H, D, D)), jnp.float32),
    )
    opts = dict(output_final_state=True, cu_seqlens=jnp.asarray(cu, jnp.int32))
    do = jnp.asarray(r.normal(size=(1, T, H, D)), jnp.float16)
    dht = jnp.asarray(r.uniform(size=(N, H, D, D)), jnp.float32)
    _against_oracle(kdax.chunk_kda, x, opts, do, dht, VARLEN_TOLS)


# -- test_fused_recurrent, test_naive_chunk --------------------------------------------------

RECURRENT = [
    (1, 64, 1, 64, 1, 1, False),
    (2, 512, 3, 60, 1, 1, False),
    (3, 1000, 4, 100, 0.1, 1, True),
    (4, 1024, 4, 128, 0.1, 1, False),
]


def _recurrent_inputs(B, T, H, D, normalizer, seed=42):
    r = np.random.default_rng(seed)
    q, k, v = (r.uniform(size=(B, T, H, D)) for _ in range(3))
    g = _logsigmoid(r.normal(size=(B, T, H, D))) / normalizer
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, H))))
    return q, k, v, g, beta, r.normal(size=(B, H, D, D))


@pytest.mark.parametrize("B, T, H, D, scale, normalizer, l2_in_kernel, slow", [_case(t, i > 0) for i, t in enumerate(RECURRENT)])
def test_fused_recurrent(B, T, H, D, scale, normalizer, l2_in_kernel, slow):
    B, T = _cut(B, T, slow)
    q, k, v, g, beta, h0 = _recurrent_inputs(B, T, H, D, normalizer)
    want = naive_recurrent_kda(*(jnp.asarray(a) for a in (_normalize(q), _normalize(k), v, g, beta)),
                               scale=float(scale), initial_state=jnp.asarray(h0), output_final_state=True)
    if not l2_in_kernel:
        q, k = _normalize(q), _normalize(k)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    o, ht = kdax.fused_recurrent_kda(f32(q), f32(k), f32(v), f32(g), f32(beta), scale=float(scale),
                                     initial_state=f32(h0), output_final_state=True, use_qk_l2norm_in_kernel=l2_in_kernel)
    assert_close(o, want[0], 0.005, "o")
    assert_close(ht, want[1], 0.005, "ht")


NAIVE_CHUNK = [
    (1, 64, 1, 64, 1, 1),
    (2, 512, 3, 60, 1, 1),
    (4, 1024, 4, 128, 0.1, 1),
    (4, 1024, 4, 128, 1, 10),
]


@pytest.mark.parametrize("B, T, H, D, scale, normalizer, slow", [_case(t, i > 0) for i, t in enumerate(NAIVE_CHUNK)])
def test_naive_chunk(B, T, H, D, scale, normalizer, slow):
    """kdax.ref.naive_chunk_kda against the recurrence, float32 inputs (FLA's tolerance)."""
    B, T = _cut(B, T, slow)
    q, k, v, g, beta, h0 = _recurrent_inputs(B, T, H, D, normalizer)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    args = (f32(_normalize(q)), f32(_normalize(k)), f32(v), f32(g), f32(beta))
    want = naive_recurrent_kda(*(a.astype(jnp.float64) for a in args), scale=float(scale),
                               initial_state=jnp.asarray(h0), output_final_state=True)
    o, ht = naive_chunk_kda(*args, scale=float(scale), initial_state=f32(h0), output_final_state=True)
    assert_close(o, want[0], 0.005, "o")
    assert_close(ht, want[1], 0.005, "ht")


# -- test_gate -------------------------------------------------------------------------------

GATE = [(b, t, h, d, bias) for bias in (False, True)
        for b, t, h, d in ((1, 2, 2, 12), (1, 32, 2, 16), (2, 64, 4, 32), (4, 128, 8, 64), (4, 128, 8, 128))]


@pytest.mark.parametrize("B, T, H, D, bias", [
    pytest.param(*t, marks=[pytest.mark.slow] if t[1] > 32 else []) for t in GATE
])
def test_gate(B, T, H, D, bias):
    """FLA's test_gate: ``kdax.kda_gate`` (FLA's ``fused_kda_gate``) in float32 with FLA's
    ``A_log`` shape ``[1, 1, H, 1]``, output and gradients against float64."""
    r = np.random.default_rng(42)
    g = r.normal(size=(B, T, H, D)) * 10
    A_log = np.log(r.uniform(1, 16, size=(1, 1, H, 1)))
    dt_bias = r.normal(size=(H * D,)) if bias else None
    do = r.normal(size=(B, T, H, D))
    args64 = [jnp.asarray(a) for a in (g, A_log)] + ([jnp.asarray(dt_bias)] if bias else [])
    args32 = [a.astype(jnp.float32) for a in args64]

    def loss(*a):
        out = kdax.kda_gate(a[0], a[1], a[2] if bias else None)
        return jnp.sum(out * do.astype(out.dtype)), out

    (_, o), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args32))), has_aux=True)(*args32)
    (_, o_ref), want = jax.value_and_grad(loss, argnums=tuple(range(len(args64))), has_aux=True)(*args64)
    assert_close(o, o_ref, 1e-4, "o")
    for name, a, b in zip(("dg", "dA", "dbias"), grads, want):
        assert_close(a, b, 1e-4, name)
