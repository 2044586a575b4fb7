"""A gate at or below the log decay floor forgets its channel exactly (issue 39, item 1).

Tokens with values x1e30 (float64) or x1e8 (float32), then a gate of -inf, -1e4 or -100 on
every channel or on half of them (the big tokens then write only those channels), or a
packed sequence whose first token's gate is -inf with an initial state x1e30: the tokens
after the hard decay, the final states and every gradient equal the recurrence's, in
every pipeline. Before the floor was an exact zero (e^-20 and e^-60) the tokens after it
were 4.3e3 (float64) and 0.10 (float32) off.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import kdax
from kdax.ref import naive_recurrent_kda
from kdax.stages import ReferenceDhu, ReferenceState, SegmentedDhu, SegmentedState
from tests._util import rel_rms

B, T, H, K, V, C = 1, 40, 2, 8, 8, 16
T0 = 20  # the hard decay (inside the second chunk; the big tokens before it, some in that chunk)
CU = [0, 7, T0, T]  # packed: the sequence starting at T0 has the hard first token
TOL = {jnp.float64: 1e-12, jnp.float32: 1e-6}  # float32: the recurrence's own error is ~1.3e-7
BIG = {jnp.float64: 1e30, jnp.float32: 1e8}


def _case(dtype, gate, packed, per_channel):
    r = np.random.default_rng(0)
    q = r.standard_normal((B, T, H, K)) / np.sqrt(K)
    k = r.standard_normal((B, T, H, K))
    v = r.standard_normal((B, T, H, V))
    g = -0.1 * np.abs(r.standard_normal((B, T, H, K)))
    beta = r.uniform(0.2, 0.9, (B, T, H))
    h0 = r.standard_normal((len(CU) - 1, H, K, V)) * BIG[dtype] if packed else None
    if not packed:
        v[:, :T0] *= BIG[dtype]
    hard = slice(0, K // 2) if per_channel else slice(None)
    g[:, T0, :, hard] = gate
    if per_channel:  # the big tokens write only the channels then forgotten
        k[:, :T0, :, K // 2:] = 0.0
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    return {n: None if a is None else jnp.asarray(a, dtype) for n, a in x.items()}


def _oracle(x, packed):
    x = {n: None if a is None else a.astype(jnp.float64) for n, a in x.items()}
    if not packed:
        return naive_recurrent_kda(**x, output_final_state=True)
    outs = [naive_recurrent_kda(*(x[n][:, s:e] for n in ("q", "k", "v", "g", "beta")),
                                initial_state=x["initial_state"][i:i + 1], output_final_state=True)
            for i, (s, e) in enumerate(zip(CU[:-1], CU[1:]))]
    return jnp.concatenate([o for o, _ in outs], 1), jnp.concatenate([h for _, h in outs], 0)


def _weights(shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float64).reshape(shape))


def _loss_grads(fn, x, after):
    """Outputs, final states and the gradients of a loss on the tokens after the hard decay
    and on the final states (the tokens before are big; their own errors are not this test's)."""
    names = [n for n in x if x[n] is not None]

    def loss(xs):
        o, ht = fn({**x, **xs})
        w = jnp.where((jnp.arange(T) >= after.start)[None, :, None, None], _weights(o.shape), 0.0)
        return jnp.sum(o.astype(jnp.float64) * w) + jnp.sum(ht.astype(jnp.float64) * _weights(ht.shape)), (o, ht)

    grads, (o, ht) = jax.jit(jax.grad(loss, has_aux=True))({n: x[n] for n in names})
    return o, ht, grads


def _check(fn, dtype, gate=-np.inf, packed=False, per_channel=False):
    x = _case(dtype, gate, packed, per_channel)
    after = slice(T0, None) if packed else slice(T0 + 1, None)
    o, ht, grads = _loss_grads(fn, x, after)
    o_r, ht_r, grads_r = _loss_grads(lambda xs: _oracle(xs, packed), x | {n: a.astype(jnp.float64) for n, a in x.items() if a is not None}, after)
    o, o_r = np.asarray(o)[:, after], np.asarray(o_r)[:, after]
    errs = {"o": rel_rms(o, o_r), "ht": rel_rms(ht, ht_r)}
    errs |= {"d" + n: rel_rms(grads[n], grads_r[n]) for n in grads}
    bad = {n: e for n, e in errs.items() if not e <= TOL[dtype]}  # NaN fails
    assert not bad, f"over {TOL[dtype]:.0e}: {bad} (all: {errs})"
    return errs


def _chunk(pipeline, packed, **kw):
    cu = jnp.asarray(CU, jnp.int32) if packed else None
    return lambda x: kdax.chunk_kda(**x, output_final_state=True, cu_seqlens=cu, chunk_size=C, pipeline=pipeline, **kw)


REFERENCE = kdax.KDAPipeline.reference()
CASES = [  # (gate, packed, per_channel)
    pytest.param(-np.inf, False, False, id="dense-inf"),
    pytest.param(-1e4, False, True, id="dense-1e4-per-channel"),
    pytest.param(-100.0, False, False, id="dense-100"),
    pytest.param(-np.inf, True, False, id="packed-first-token-inf"),
]


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("gate, packed, per_channel", CASES)
def test_reference(dtype, gate, packed, per_channel):
    _check(_chunk(REFERENCE, packed), dtype, gate, packed, per_channel)


@pytest.mark.parametrize("target", ["tpu", "triton"])
@pytest.mark.parametrize("gate, packed, per_channel", [CASES[0], CASES[3]])
def test_pallas(target, gate, packed, per_channel):
    _check(_chunk(kdax.KDAPipeline.pallas(target, interpret=True), packed), jnp.float64, gate, packed, per_channel)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu", "triton"])
@pytest.mark.parametrize("gate, packed, per_channel", CASES)
def test_pallas_float32(target, gate, packed, per_channel):
    _check(_chunk(kdax.KDAPipeline.pallas(target, interpret=True), packed), jnp.float32, gate, packed, per_channel)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
def test_segments(dtype):
    seg = dataclasses.replace(REFERENCE.untiled(), state=SegmentedState(ReferenceState(), 3),
                              dhu=SegmentedDhu(ReferenceDhu(), 3))
    _check(_chunk(seg, False), dtype)
    _check(_chunk(seg, True), dtype, packed=True)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices: see tests/conftest.py")
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
def test_sequence_parallel(dtype):
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    for packed in (False, True):
        cu = jnp.asarray(CU, jnp.int32) if packed else None
        fn = lambda x: kdax.parallel.chunk_kda(mesh, "sp", **x, output_final_state=True, cu_seqlens=cu,
                                               chunk_size=C, pipeline=REFERENCE.untiled())
        _check(fn, dtype, packed=packed)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("gate, packed, per_channel", [CASES[0], CASES[1], CASES[3]])
def test_fused_recurrent(dtype, gate, packed, per_channel):
    cu = jnp.asarray(CU, jnp.int32) if packed else None
    fn = lambda x: kdax.fused_recurrent_kda(**x, output_final_state=True, cu_seqlens=cu)
    _check(fn, dtype, gate, packed, per_channel)


def test_strong_gates_keep_float32_dg_accurate():
    """float32 ``dg`` through the six-stage backward stays as accurate at strong gates as at
    weak ones. Where most log decays are below ~-20, a token's true dg is near zero: the
    reverse cumsum that B5 takes of dG sums terms that cancel, so any rounding noise in dG
    reaches the chunk's first rows whole. B4 once kept the pairs i = j (which add to dG_i
    and take from it alike) in both its row and column sums: 3.1e-6 rel-RMS here against
    8.4e-7 at weak gates; without them 5.2e-7 and 6.3e-7 (the float32 recurrence: ~1e-7).
    Against the float64 recurrence, B=1 T=256 H=4 K=V=32, unit q and k."""
    r = np.random.default_rng(0)
    shape = (1, 256, 4, 32)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (r.normal(size=shape), r.normal(size=shape)))
    v, w = r.normal(size=shape), r.normal(size=shape)
    beta = 1 / (1 + np.exp(-r.normal(size=shape[:3])))
    depth = np.abs(r.normal(size=shape))

    def loss(fn, dtype, g):
        o, _ = fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), g.astype(dtype), jnp.asarray(beta, dtype))
        return (o.astype(jnp.float64) * w).sum()

    chunked = jax.jit(jax.grad(lambda g: loss(kdax.chunk_kda, jnp.float32, g)))
    oracle = jax.jit(jax.grad(lambda g: loss(naive_recurrent_kda, jnp.float64, g)))
    err = {}
    for s in (1.0, 30.0):
        g = jnp.asarray(-s * depth, jnp.float64)
        err[s] = rel_rms(chunked(g), oracle(g))
    assert err[30.0] < 1e-6 and err[30.0] < 1.5 * err[1.0], err


@pytest.mark.parametrize("in_kernel", [True, False], ids=["in-kernel", "gate-outside"])
def test_strong_gates_keep_float32_dA_log_accurate(in_kernel):
    """Kimi Linear's gate ``-exp(A_log) softplus(g + dt_bias)`` at raw gates ``30 N(0, 1)``
    and ``A_log = 3``: half the activated decays fall below float32's floor (-128), where F1
    clamps them and B5 gives dg = 0. Before, B5 passed the reverse cumsum's noise through
    there, and dA_log summed it against decays of -128 to -1800: 3.3e-3 rel-RMS against the
    float64 recurrence (the float32 recurrence: ~3e-7); now 8.6e-5 (d g 6.0e-5 -> 2.3e-5,
    ddt_bias 2.6e-4 -> 4.6e-5). ``gate-outside``: the gate computed by the caller and the
    log decays given (FLA's ``fused_kda_gate`` then ``chunk_kda``), which B5 was not told
    until session 53: dA_log 8.9e-3, ddt_bias 2.6e-4, d g 5.8e-5 then; now as in-kernel.
    B=1 T=256 H=4 K=V=32, in-kernel l2norm and beta sigmoid (benchmarks/strong_gate_grads.py)."""
    r = np.random.default_rng(0)
    shape = (1, 256, 4, 32)
    q, k, v, w = (r.normal(size=shape) for _ in range(4))
    beta = r.normal(size=shape[:3])
    g = jnp.asarray(30.0 * r.normal(size=shape))
    A_log, dt_bias = jnp.full((4,), 3.0), jnp.asarray(0.5 * r.normal(size=4 * 32))

    def loss(fn, dtype, g, A_log, dt_bias):
        A_log, dt_bias = A_log.astype(dtype), dt_bias.astype(dtype)
        gate = dict(g=g.astype(dtype), A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True) if in_kernel else dict(
            g=-jnp.exp(A_log)[:, None] * jax.nn.softplus(g.astype(dtype) + dt_bias.reshape(4, 32)))
        o, _ = fn(*(jnp.asarray(x, dtype) for x in (q, k, v)), beta=jnp.asarray(beta, dtype), **gate,
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        return (o.astype(jnp.float64) * w).sum()

    grads = lambda fn, dtype: jax.jit(jax.grad(lambda *a: loss(fn, dtype, *a), argnums=(0, 1, 2)))(g, A_log, dt_bias)
    got, want = grads(kdax.chunk_kda, jnp.float32), grads(kdax.fused_recurrent_kda, jnp.float64)
    err = {n: rel_rms(a, b) for n, a, b in zip(("g", "A_log", "dt_bias"), got, want)}
    assert err["A_log"] < 1e-3 and err["g"] < 5e-5 and err["dt_bias"] < 1e-4, err
