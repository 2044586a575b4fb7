"""chunk_kda end to end: forward and six-stage backward against the float64 oracle."""

import dataclasses
import re
from typing import ClassVar
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kdax
from kdax.stages import KDA, AbstractOutput, AbstractState, ReferenceOutput, ReferenceState

from ._util import (
    GOLDEN_CASES, assert_close, check_golden, loss_grads, make_inputs, oracle_kda, output_shapes, outputs_and_grads, run,
    split_args,
)

# Each case: options (+ shape overrides). Together they cover every FLA option, GVA,
# varlen (lengths 0, 1, crossing chunks), T not a multiple of the chunk, all chunk sizes.
GRID = {
    "plain_c64": dict(),
    "c16_T37": dict(chunk_size=16, T=37),
    "c32_gva": dict(chunk_size=32, H=1, HV=3),
    "c128_strong": dict(chunk_size=128, T=150, strong=True),
    "softplus_gate": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True),
    "softplus_gate_nobias": dict(use_gate_in_kernel=True, A_log=True),
    "lower_bound_gate": dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=True, dt_bias=True, safe_gate=True),
    "lower_bound_noA": dict(use_gate_in_kernel=True, lower_bound=-2.0, dt_bias=True),
    "l2norm_sigmoid": dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, chunk_size=16),
    "state_v_first": dict(state_v_first=True, chunk_size=32),
    "no_h0": dict(h0=False, scale=0.5),
    "disable_recompute": dict(disable_recompute=True, use_qk_l2norm_in_kernel=True),
    "varlen": dict(cu_seqlens=[0, 0, 1, 17, 80, 80, 96, 131], chunk_size=16, HV=4),
    "varlen_gate_c64": dict(cu_seqlens=[0, 64, 65, 150], use_gate_in_kernel=True, A_log=True,
                            dt_bias=True, use_qk_l2norm_in_kernel=True),
}


def build_case(spec, seed=0, dtype=jnp.float64):
    spec = dict(spec)
    shape = dict(B=2, T=70, H=2, K=16, V=8)
    for key in ("B", "T", "H", "HV", "K", "V"):
        if key in spec:
            shape[key] = spec.pop(key)
    cu = spec.pop("cu_seqlens", None)
    if cu is not None:
        shape.update(B=1, T=cu[-1], N=len(cu) - 1)
        spec["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
    x = make_inputs(
        seed=seed, dtype=dtype, strong=spec.pop("strong", False), h0=spec.pop("h0", True),
        gate="raw" if spec.get("use_gate_in_kernel") else "log", A_log=spec.pop("A_log", False),
        dt_bias=spec.pop("dt_bias", False), beta_raw=spec.get("use_beta_sigmoid_in_kernel", False),
        **shape,
    )
    if spec.get("state_v_first") and "initial_state" in x:
        x["initial_state"] = jnp.swapaxes(x["initial_state"], -1, -2)
    spec["output_final_state"] = True
    return x, spec


def cotangents(o, ht, seed=1):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.normal(size=o.shape), o.dtype), jnp.asarray(r.normal(size=ht.shape), ht.dtype)


def check_against_oracle(pipeline, x, opts, tol=1e-10):
    """Outputs, final states and every input gradient of ``pipeline`` against the float64
    recurrence (random cotangents); the outputs as a training step's forward computes them
    (the forward alone: ``test_golden`` and the causality tests)."""
    do, dht = cotangents(*output_shapes(oracle_kda, x, opts))
    o, ht, grads = outputs_and_grads(pipeline, x, opts, do, dht)
    o_ref, ht_ref, ref = outputs_and_grads(oracle_kda, x, opts, do, dht)
    assert_close(o, o_ref, tol, "o")
    assert_close(ht, ht_ref, tol, "ht")
    for n in ref:
        assert_close(grads[n], ref[n], tol, "d" + n)


# plain_c64 is the golden dense case's options and disable_recompute has its own test
# (test_disable_recompute_same_gradients): both run in full with -m slow.
GRID_SLOW = ("plain_c64", "disable_recompute")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in GRID_SLOW else n for n in GRID])
def test_forward_and_grads_against_oracle(name):
    x, opts = build_case(GRID[name])
    check_against_oracle(kdax.chunk_kda, x, opts)


@pytest.mark.parametrize("name", GOLDEN_CASES)
@pytest.mark.parametrize("dtype,tol_o,tol_g", [(jnp.float64, 1e-10, 1e-10), (jnp.float32, 1e-5, 1e-4)])
def test_golden(name, dtype, tol_o, tol_g):
    check_golden(kdax.chunk_kda, name, dtype, tol_o, tol_g)


def test_disable_recompute_same_gradients():
    x, opts = build_case(dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, use_qk_l2norm_in_kernel=True,
                              use_beta_sigmoid_in_kernel=True, chunk_size=32))
    do, dht = cotangents(*output_shapes(oracle_kda, x, opts))
    g1 = loss_grads(kdax.chunk_kda, x, opts, do, dht)
    g2 = loss_grads(kdax.chunk_kda, x, dict(opts, disable_recompute=True), do, dht)
    for n in g1:
        assert_close(g2[n], g1[n], 1e-12, "d" + n)


@pytest.mark.parametrize("t", [1, 16, 23, 40, 64, 65])
def test_forward_causal_to_the_bit(t):
    x, opts = build_case(dict(chunk_size=16, T=80, use_gate_in_kernel=True, A_log=True,
                              use_qk_l2norm_in_kernel=True), dtype=jnp.float32)
    o1, _ = run(kdax.chunk_kda, x, opts)
    r = np.random.default_rng(t)
    y = {n: (a.at[:, t:].set(jnp.asarray(r.normal(size=a[:, t:].shape) * 50, a.dtype))
             if n in ("q", "k", "v", "g", "beta") else a) for n, a in x.items()}
    o2, _ = run(kdax.chunk_kda, y, opts)
    np.testing.assert_array_equal(np.asarray(o1[:, :t]), np.asarray(o2[:, :t]))
    assert not np.array_equal(np.asarray(o1[:, t:]), np.asarray(o2[:, t:]))


def assert_gradients_causal(t: int, chunk_size: int = 16, pipeline=None):
    """The gradients of every input before token ``t`` are bitwise unchanged when every
    input from ``t`` on is redrawn (large values) and ``do`` is zero there: float32,
    T = 64, ``pipeline`` (None: the default)."""
    x, opts = build_case(dict(chunk_size=chunk_size, T=64, use_beta_sigmoid_in_kernel=True), dtype=jnp.float32)
    opts["output_final_state"] = False
    if pipeline is not None:
        opts["pipeline"] = pipeline
    names = ("q", "k", "v", "g", "beta")
    r = np.random.default_rng(t)
    do = jnp.asarray(r.normal(size=(2, 64, 2, 8)), jnp.float32).at[:, t:].set(0.0)
    g1 = loss_grads(kdax.chunk_kda, x, opts, do, None)
    y = {n: (a.at[:, t:].set(jnp.asarray(r.normal(size=a[:, t:].shape) * 20, a.dtype)) if n in names else a)
         for n, a in x.items()}
    y["g"] = -jnp.abs(y["g"])
    g2 = loss_grads(kdax.chunk_kda, y, opts, do, None)
    for n in names:
        np.testing.assert_array_equal(np.asarray(g1[n][:, :t]), np.asarray(g2[n][:, :t]), err_msg=n)


@pytest.mark.parametrize("t", [9, 32, 47])
def test_gradients_causal_to_the_bit(t):
    assert_gradients_causal(t)


def test_strong_decay_chunk128_finite_float32():
    x, opts = build_case(dict(chunk_size=128, T=256, strong=True), dtype=jnp.float32)
    x["g"] = x["g"].at[:, ::7].set(-1000.0)
    do, dht = cotangents(*output_shapes(oracle_kda, x, opts))  # (a trace of the recurrence: float32 too)
    o, ht, grads = outputs_and_grads(kdax.chunk_kda, x, opts, do, dht)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(ht)))
    for n, gr in grads.items():
        assert np.all(np.isfinite(np.asarray(gr))), n
    # Accuracy with -1000 entries is checked in float64 (GRID "c128_strong"): in float32
    # the chunk cumsum G loses low bits once |G| ~ 1e3 (the same cancellation as FLA's).


@pytest.mark.parametrize("dtype,g,tol,pipe", [
    (jnp.float32, -20.0, 1e-6, None), (jnp.float64, -40.0, 1e-13, None),
    (jnp.float32, -20.0, 1e-6, "triton"), (jnp.float32, -20.0, 1e-6, "tpu")])
def test_dg_of_a_final_state_loss_at_strong_decay(dtype, g, tol, pipe):
    """A loss on the final state alone, constant strong decay: dg is e^g small, and B3 summed
    each chunk's last row's O(1) ``kg dkg`` into ``dgam`` and took it back in that row's
    ``dG``, losing the small terms: float32 0.98 off relative to max|dg| at g = -20 (float64
    at g = -40); ``fused_recurrent_kda`` 1e-7. B3's sum leaves that row out now, the
    reference's and the Pallas kernels' (interpret mode)."""
    x = make_inputs(seed=5, B=1, T=128, H=1, K=8, V=8, dtype=jnp.float64)
    x["g"] = np.full_like(x["g"], g)
    w = np.random.default_rng(6).normal(size=x["initial_state"].shape)

    def dg(fn, dt):
        pos, kw = split_args({n: jnp.asarray(a, dt) for n, a in x.items()})

        def loss(g):
            _, ht = fn(*pos[:3], g, pos[4], **dict(kw, output_final_state=True))
            return jnp.sum(ht * jnp.asarray(w, dt))

        return jax.grad(loss)(pos[3])

    want = dg(kdax.ref.naive_recurrent_kda, jnp.float64)
    pipeline = None if pipe is None else kdax.KDAPipeline.pallas(pipe, interpret=True)  # (its B3: the same sum)
    got = dg(lambda *a, **kw: kdax.chunk_kda(*a, **kw, pipeline=pipeline), dtype)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float64) - want)) / jnp.max(jnp.abs(want)))
    assert err <= tol, err


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(dt):
    x, opts = build_case(dict(T=100, K=32, V=32, use_gate_in_kernel=True, A_log=True, dt_bias=True))
    # The forward in tiles of one chunk (the gradients' forward runs whole); products at
    # HIGHEST (the "auto" policy's half-precision products are tested in test_precision.py).
    opts["pipeline"] = dataclasses.replace(kdax.KDAPipeline.reference(), tile=x["v"].shape[0] * x["v"].shape[2],
                                           precision="highest")
    xl = {n: a.astype(dt) for n, a in x.items()}
    o_ref, ht_ref = run(oracle_kda, {n: a.astype(jnp.float64) for n, a in xl.items()}, opts)
    o, ht = run(kdax.chunk_kda, xl, opts)
    assert o.dtype == dt and ht.dtype == jnp.float32
    assert_close(o, o_ref, 5e-3, "o")
    assert_close(ht, ht_ref, 1e-5, "ht")
    do, dht = cotangents(o, ht)
    grads = loss_grads(kdax.chunk_kda, xl, opts, do, dht)
    ref = loss_grads(oracle_kda, {n: a.astype(jnp.float64) for n, a in xl.items()}, opts,
                     do.astype(jnp.float64), dht.astype(jnp.float64))
    for n in ref:
        assert grads[n].dtype == dt, n
        assert_close(grads[n], ref[n], 5e-3, "d" + n)


def test_varlen_jit_compiles_once():
    x, opts = build_case(dict(cu_seqlens=[0, 10, 11, 40], chunk_size=16))
    traces = []

    @jax.jit
    def f(x, cu):
        traces.append(1)
        pos, kw = split_args(x)
        return kdax.chunk_kda(*pos, **kw, **dict(opts, cu_seqlens=cu))

    for cu in ([0, 10, 11, 40], [0, 0, 33, 40]):
        cu = jnp.asarray(cu, jnp.int32)
        o, ht = f(x, cu)
        pos, kw = split_args(x)
        o_ref, ht_ref = oracle_kda(*pos, **kw, **dict(opts, cu_seqlens=cu))
        assert_close(o, o_ref, 1e-10, "o")
        assert_close(ht, ht_ref, 1e-10, "ht")
    assert len(traces) == 1


class EinsumOutput(AbstractOutput):
    """A user-written F5 (einsum instead of matmul) that counts its calls."""

    calls: list = eqx.field(static=True)

    def __call__(self, scale, qg, h, Aqk, v_new):
        self.calls.append(1)
        return scale * jnp.einsum("...ck,...kv->...cv", qg, h) + jnp.einsum("...ij,...jv->...iv", Aqk, v_new)


def test_swap_stage_with_tree_at():
    calls = []
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), EinsumOutput(calls))
    assert isinstance(pipe.output, EinsumOutput)
    x, opts = build_case(dict(chunk_size=32))
    check_against_oracle(pipe, x, opts)
    assert calls, "the swapped stage was not used"


def test_eager_calls_compile_once():
    """``chunk_kda`` called without any transformation runs one compiled program (traced
    once per shape, not op by op each call: kdax._runner.vjp's ``_compiled_when_eager``);
    the results are the jitted call's, and an eager ``jax.grad`` still works (op by op:
    under a transformation the core is not wrapped)."""
    calls = []
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), EinsumOutput(calls))
    x, opts = build_case(dict(chunk_size=16))
    pos, kw = split_args(x)
    o1, _ = kdax.chunk_kda(*pos, **kw, **opts, pipeline=pipe)
    o2, _ = kdax.chunk_kda(*pos, **kw, **opts, pipeline=pipe)
    assert len(calls) == 1, f"eager calls traced the stage {len(calls)} times"
    o_jit, _ = jax.jit(lambda *a: kdax.chunk_kda(*a, **kw, **opts, pipeline=pipe))(*pos)
    assert np.array_equal(np.asarray(o1), np.asarray(o2)) and np.array_equal(np.asarray(o1), np.asarray(o_jit))
    loss = lambda q: jnp.sum(kdax.chunk_kda(q, *pos[1:], **kw, **opts, pipeline=pipe)[0])
    g1, g2 = jax.grad(loss)(pos[0]), jax.grad(loss)(pos[0])
    assert np.array_equal(np.asarray(g1), np.asarray(g2))


def test_forward_cache_and_explicit_backward():
    x, opts = build_case(dict(chunk_size=16, T=40, use_gate_in_kernel=True, A_log=True))
    pos, kw = split_args(x)
    pipe = kdax.KDAPipeline.reference()
    o, ht, res = eqx.filter_jit(lambda *a: pipe.forward(*a, **kw, **opts))(*pos)  # (eager runs op by op)
    c = res.cache
    assert c.h.shape == (2, 2, 3, 16, 8) and c.Aqk.shape == (2, 2, 3, 16, 16)
    assert c.v_new.shape == c.u.shape == (2, 2, 3, 16, 8)
    # Akk really is (I + L)^-1: unit lower triangular
    A = np.asarray(c.Akk)
    np.testing.assert_allclose(np.diagonal(A, axis1=-2, axis2=-1), 1.0)
    assert np.all(np.triu(A, 1) == 0)
    do, dht = cotangents(o, ht)
    grads = eqx.filter_jit(pipe.backward)(res, do, dht)
    ref = loss_grads(oracle_kda, x, opts, do, dht)
    for n in ref:
        assert_close(getattr(grads, n), ref[n], 1e-10, "d" + n)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    B=st.integers(1, 2), T=st.integers(1, 70), H=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]),
    K=st.sampled_from([4, 8]), V=st.sampled_from([4, 8]), chunk=st.sampled_from([16, 32, 64, 128]),
    strong=st.booleans(), varlen=st.booleans(), tile=st.sampled_from([None, 1, 4, 32]),
)
def test_property_chunked_equals_recurrent(data, B, T, H, rep, K, V, chunk, strong, varlen, tile):
    pipe = dataclasses.replace(kdax.KDAPipeline.reference(), tile=tile)
    opts = dict(chunk_size=chunk, output_final_state=True, pipeline=pipe)
    N = B
    if varlen:
        cuts = sorted(data.draw(st.lists(st.integers(0, T), min_size=0, max_size=4)))
        cu = [0] + cuts + [T]
        B, N = 1, len(cu) - 1
        opts["cu_seqlens"] = jnp.asarray(cu, jnp.int32)
    x = make_inputs(seed=T, B=B, T=T, H=H, HV=H * rep, K=K, V=V, N=N, strong=strong)
    o, ht = run(kdax.chunk_kda, x, opts)
    o_ref, ht_ref = run(oracle_kda, x, {n: a for n, a in opts.items() if n != "pipeline"})
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")


@pytest.mark.parametrize("pipe", ["reference", "pallas"])
@pytest.mark.parametrize("cu", [None, [0, 0], [0, 0, 0]])
@pytest.mark.parametrize("v_first", [False, True])
def test_no_tokens(pipe, cu, v_first):
    # T = 0 (every sequence empty): o is empty and each state passes through unchanged,
    # with its gradient; the recurrence agrees.
    N = 1 if cu is None else len(cu) - 1
    z = lambda *s: jnp.zeros(s, jnp.float32)
    q, v, g, beta = z(1, 0, 2, 16), z(1, 0, 2, 8), z(1, 0, 2, 16), z(1, 0, 2)
    h0 = jnp.asarray(np.random.default_rng(0).normal(size=(N, 2, 8, 16) if v_first else (N, 2, 16, 8)), jnp.float32)
    kw = dict(output_final_state=True, state_v_first=v_first, pipeline=getattr(kdax.KDAPipeline, pipe)(),
              cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32))
    o, ht = kdax.chunk_kda(q, q, v, g, beta, initial_state=h0, **kw)
    assert o.shape == v.shape and ht.shape == h0.shape
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(h0))
    dh0 = jax.grad(lambda h: jnp.sum(kdax.chunk_kda(q, q, v, g, beta, initial_state=h, **kw)[1] * h0))(h0)
    np.testing.assert_array_equal(np.asarray(dh0), np.asarray(h0))
    _, ht0 = kdax.chunk_kda(q, q, v, g, beta, **kw)
    assert ht0.shape == h0.shape and not np.any(np.asarray(ht0))
    if cu is None and not v_first:
        _, ref = kdax.fused_recurrent_kda(q, q, v, g, beta, initial_state=h0, output_final_state=True)
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(h0))
    # plan says why no stage runs (before: B0's row blamed disable_recompute=True)
    kw.pop("pipeline")
    rows = getattr(kdax.KDAPipeline, pipe)().plan(q, q, v, g, beta, initial_state=h0, **kw).rows
    assert {r.reason for r in rows} == {"not run: no work (B, T, K or V is 0): o is zeros, states pass through"}


def test_products_at_full_precision():
    """Every matrix product of the forward and the six-stage backward asks for HIGHEST
    precision: XLA on GPUs runs float32 products in TF32 by default, which on an H200
    gave 1e-2 gradient errors at T=4096."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 100, 2, 16), jnp.float32),) * 4 + (s((1, 100, 2), jnp.float32),)

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, chunk_size=16, output_final_state=True, use_gate_in_kernel=True,
                               A_log=jnp.zeros(2), use_qk_l2norm_in_kernel=True)
        return jnp.sum(o) + jnp.sum(ht)

    for f in (loss, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), lambda *a: kdax.fused_recurrent_kda(*a)[0]):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        dots = re.findall(r"stablehlo\.dot_general.*", text)
        assert dots and all("HIGHEST" in d for d in dots), [d for d in dots if "HIGHEST" not in d][:3]


# Tiled forward (``KDAPipeline.tile``): dense with a ragged tail, an exact multiple of the
# tile, GVA, and packed varlen with sequences of length 0 and 1, crossing tiles and ending
# exactly at a tile's end.
TILED = {
    "dense_ragged_tail": dict(chunk_size=16, T=150),
    "dense_options": dict(chunk_size=16, T=96, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    "dense_gva_no_h0": dict(chunk_size=32, T=200, H=1, HV=3, h0=False),
    "varlen": dict(cu_seqlens=[0, 0, 1, 17, 80, 80, 96, 131, 160, 230], chunk_size=16, HV=2),
    "varlen_c32_gate": dict(cu_seqlens=[0, 64, 65, 150, 300], chunk_size=32, use_gate_in_kernel=True,
                            A_log=True),
}


class RecordingOutput(AbstractOutput):
    """The reference F5 (composed), noting how many chunks each call gets."""

    seen: list = eqx.field(static=True, default=None)
    tile_safe: ClassVar[bool] = True
    math: ClassVar[str] = KDA  # (the reference's own formula: the six-stage backward runs)

    def __call__(self, scale, qg, h, Aqk, v_new):
        self.seen.append(qg.shape[2])
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


# The default run: three cases (tiles of 1 and 3 chunks, dense and varlen); the rest in -m slow.
_FAST_TILES = {("dense_ragged_tail", 1), ("dense_options", 3), ("varlen", 3)}
TILE_CASES = [
    pytest.param(name, chunks, marks=[] if (name, chunks) in _FAST_TILES else [pytest.mark.slow])
    for name in TILED for chunks in (1, 3)
]


@pytest.mark.parametrize("name,chunks", TILE_CASES)
def test_tiled_forward(name, chunks):
    x, opts = build_case(TILED[name])
    rows = 1 if "cu_seqlens" in opts else x["q"].shape[0]
    seen = []
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), RecordingOutput(seen=seen))
    # (packed initial states would enter shared chunks, a forward that runs whole)
    pipe = dataclasses.replace(pipe, tile=chunks * rows * x["v"].shape[2], share_chunks=False)
    o, ht = run(pipe, x, opts)
    assert seen and max(seen) == chunks, f"stages saw {sorted(set(seen))} chunks at a time, wanted tiles of {chunks}"
    o_ref, ht_ref = run(oracle_kda, x, opts)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")
    # The same as one pass over everything, to rounding.
    whole = kdax.KDAPipeline.reference().untiled()
    o1, ht1 = run(whole, x, opts)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht1), rtol=0, atol=1e-13)
    # The residuals a tiled forward leaves, with its cache and without (B0 recomputes).
    pos, kw = split_args(x)
    o2, ht2, res = jax.jit(lambda p, k: pipe.forward(*p, **k, **opts))(pos, kw)
    do, dht = cotangents(o2, ht2)
    ref = loss_grads(oracle_kda, x, opts, do, dht)
    for r in (res, eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda c: c is None)):
        grads = jax.jit(lambda r, do, dht: pipe.backward(r, do, dht))(r, do, dht)
        for n in ref:
            assert_close(getattr(grads, n), ref[n], 1e-10, "d" + n)


class RecordingState(AbstractState):
    """The reference F4, noting the state table's entries and the chunks of each call."""

    seen: list = eqx.field(static=True, default=None)
    tile_safe: ClassVar[bool] = True
    math: ClassVar[str] = KDA

    def __call__(self, w, u, kg, G, h0, layout):
        self.seen.append((h0.shape[0], w.shape[2]))
        return ReferenceState()(w, u, kg, G, h0, layout)


def test_packed_tiles_hold_a_state_entry_per_chunk():
    """Unshared packed input in tiles: each tile's state table holds one entry per chunk of
    the tile and one carry, whatever the number of sequences (a table of all N, passed
    through every tile, made 128 sequences in 4096 tokens 4.7x slower than untiled); exact
    against the oracle with initial and final states, empty sequences, and sequences
    crossing tiles."""
    r = np.random.default_rng(5)
    lens = r.integers(0, 12, size=40)
    lens[[0, 7, 39]] = 0  # (empty first, inside and last)
    lens[[10, 20]] = [40, 33]  # (three chunks: across tiles)
    x, opts = build_case(dict(cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).tolist(), chunk_size=16, H=1, HV=2))
    seen = []
    pipe = eqx.tree_at(lambda p: p.state, kdax.KDAPipeline.reference(), RecordingState(seen=seen))
    pipe = dataclasses.replace(pipe, tile=3 * 2, share_chunks=False)  # (3 chunks of one row, 2 heads)
    o, ht = run(pipe, x, opts)
    # (traced once for the tiles' loop, once for its shapes, once for the last, shorter tile)
    assert (4, 3) in seen and all(entries == n + 1 for entries, n in seen), f"(table entries, chunks) a call: {seen}"
    o_ref, ht_ref = run(oracle_kda, x, opts)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")


def test_shared_chunk_tiles_keep_no_whole_chunked_arrays():
    """Packed sequences sharing chunks, the forward in tiles, final states asked for: each
    tile packs its own tokens (as dense input does) and hands on only the chunks where some
    sequence ends (``tile_finals``), so the compiled forward holds neither the inputs
    chunked whole nor every chunk's start state (it held both: 16 sequences at the main
    job's shape, the forward 0.85x the time without final states, 0.78x with them). Exact
    against the oracle and against one pass over everything, with empty sequences first,
    inside and last, one-token ones, several ending in one chunk, ends at a chunk's and at
    a tile's last token, a sequence crossing tiles, and a shorter last tile (38 tokens)."""
    C, K, V = 16, 8, 4
    cu = [0, 0, 1, 9, 16, 16, 47, 48, 95, 96, 230, 230]  # (tiles of 3 chunks: 48, 96, ...; 15 chunks)
    x, opts = build_case(dict(cu_seqlens=cu, chunk_size=C, H=1, HV=2, K=K, V=V, h0=False))
    pipe = dataclasses.replace(kdax.KDAPipeline.reference(), tile=3 * 2)  # (3 chunks of one row, 2 heads)
    o, ht = run(pipe, x, opts)
    o_ref, ht_ref = run(oracle_kda, x, opts)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")
    o1, ht1 = run(pipe.untiled(), x, opts)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht1), rtol=0, atol=1e-13)
    pos, kw = split_args(x)
    hlo = jax.jit(lambda p, k: kdax.chunk_kda(*p, **k, **opts, pipeline=pipe)).lower(pos, kw).compile().as_text()
    NC = -(-cu[-1] // C)
    assert f"f64[1,2,{NC},{K},{V}]" not in hlo  # (the chunk-start states of every chunk)
    assert f"f64[1,2,{NC},{C},{K}]" not in hlo  # (q, k or g chunked whole)
    assert f"f64[1,2,{len(cu)},{K},{V}]" in hlo  # (those of the chunks where the 11 sequences end, and one more)


@pytest.mark.parametrize("tile", [0, -1, 2.5, True, "32"])
def test_tile_checked_when_built(tile):
    """``tile`` is a positive integer or None, checked when the pipeline is built: 0,
    negatives, fractions and booleans ran as tiles of one chunk."""
    with pytest.raises(ValueError, match=r"^tile: expected a positive int .* or None, got "):
        dataclasses.replace(kdax.KDAPipeline.reference(), tile=tile)
    assert dataclasses.replace(kdax.KDAPipeline.reference(), tile=np.int64(32)).tile == 32  # (numpy's too)


def test_bfloat16_inputs_in_tiles_read_as_their_float32_values():
    """A tiled dense forward on bfloat16 inputs (which enter the tile loop as their bits,
    ``kdax._layouts.tiles``) gives bitwise the float32 call's outputs on the same values,
    rounded to bfloat16, tile by tile and whole; a NaN stays in its row and head."""
    r = jax.random.split(jax.random.key(5), 5)
    B, T, H, K = 2, 200, 2, 16
    q, k = (jax.random.normal(r[i], (B, T, H, K)) / 4 for i in (0, 1))
    v = jax.random.normal(r[2], (B, T, H, K))
    g = -jax.nn.softplus(jax.random.normal(r[3], (B, T, H, K)) - 2)
    beta = jax.nn.sigmoid(jax.random.normal(r[4], (B, T, H)))
    bf = [x.astype(jnp.bfloat16).at[1, 37, 1, 3].set(jnp.nan) if i == 2 else x.astype(jnp.bfloat16)
          for i, x in enumerate((q, k, v, g, beta))]
    f32 = [x.astype(jnp.float32) for x in bf]
    pipe = dataclasses.replace(kdax.KDAPipeline.reference(), tile=2 * H * 3)  # tiles of 3 chunks
    for p in (pipe, pipe.untiled()):
        call = jax.jit(lambda *x, p=p: kdax.chunk_kda(*x, pipeline=p, chunk_size=16, output_final_state=True))
        (o, ht), (o32, ht32) = call(*bf), call(*f32)
        assert o.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o32.astype(jnp.bfloat16), np.float32))
        np.testing.assert_array_equal(np.asarray(ht), np.asarray(ht32))
        o = np.asarray(o, np.float32)  # (isolation: the NaN's head from its token on, in its row)
        assert np.isfinite(o[0]).all() and np.isfinite(o[1, :37]).all() and np.isfinite(o[1, :, 0]).all()
        assert np.isnan(o[1, 37:, 1]).all()


def test_reference_tiles_on_cpu_only():
    # Tiles pay on CPU caches; an accelerator wants each stage over the whole input.
    assert kdax.KDAPipeline.reference().tile == (32 if jax.default_backend() == "cpu" else None)
    assert kdax.KDAPipeline.pallas().tile is None


def test_import_leaves_the_backend_alone():
    # Importing kdax must not start a JAX backend (a user may still pick platforms).
    import subprocess
    import sys

    code = ("import kdax\nfrom jax._src import xla_bridge as xb\n"
            "b = getattr(xb, '_backends', None)\nprint('unknown' if b is None else ('started' if b else 'idle'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[-1] == "unknown":
        pytest.skip("this JAX keeps its backends elsewhere")
    assert out[-1] == "idle"


def test_plan_reports_the_resolved_configuration():
    """Every platform-dependent choice resolved in ``plan().config``, and each settable."""
    x = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 64, 2), jnp.bfloat16)
    pipe = kdax.KDAPipeline.reference()
    cfg = pipe.plan(x, x, x, x, b).config
    assert cfg["backend"] == jax.default_backend()
    assert cfg["precision"] not in (None, "auto")  # resolved for bf16 inputs
    assert cfg["tile"] == pipe.tile
    assert cfg["intra"]["chunk_loops"] == "flat"  # ("auto" with no mesh set)
    assert isinstance(cfg["intra"]["group"], int) and isinstance(cfg["state"]["loop_unroll"], int)
    # Settable as fields: the plan follows.
    pipe2 = eqx.tree_at(lambda p: p.intra, pipe.with_precision("highest"), kdax.stages.ReferenceIntra(group=3))
    cfg2 = pipe2.plan(x, x, x, x, b).config
    assert cfg2["intra"]["group"] == 3 and cfg2["precision"] == "highest"
    assert "config: backend=" in str(pipe2.plan(x, x, x, x, b))
    # The loop form: a field of each looping reference stage, set by KDAPipeline.reference,
    # reported; "auto" takes the slices under a mesh with Auto axes (jax.set_mesh).
    for mode in ("flat", "slices"):
        cfg = kdax.KDAPipeline.reference(chunk_loops=mode).plan(x, x, x, x, b).config
        assert {cfg[n]["chunk_loops"] for n in ("gate", "intra", "wy", "output", "dav", "wy_dqkg", "intra_bwd",
                                                "gate_bwd")} == {mode}
    mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        assert pipe.plan(x, x, x, x, b).config["intra"]["chunk_loops"] == "slices"
    with pytest.raises(ValueError, match="chunk_loops: expected None or one of"):
        kdax.KDAPipeline.reference(chunk_loops="rows")


def test_eager_gradient_is_compiled():
    """An eager ``jax.grad`` of ``chunk_kda`` (the README's example) runs its forward and
    its six-stage backward as compiled programs, cached: op by op it compiled ~770 small
    programs on its first call and took 13 s a call at T=512, H=4, K=V=64 (issue 39 item
    7). The numbers of the jitted gradient (one program there, which XLA may fuse
    differently: to float32 rounding)."""
    compiles = [0]

    def count(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        r = np.random.default_rng(0)
        q, k, v = (jnp.asarray(r.normal(size=(1, 40, 2, 12)), jnp.float32) for _ in range(3))
        g = jnp.asarray(-r.uniform(0.01, 0.5, size=(1, 40, 2, 12)), jnp.float32)
        beta = jnp.asarray(r.uniform(size=(1, 40, 2)), jnp.float32)
        f = lambda q: kdax.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].sum()
        eager = jax.grad(f)(q)
        assert compiles[0] <= 12, compiles[0]  # forward and backward, and a few small ones
        compiles[0] = 0
        again = jax.grad(f)(2 * q)
        assert compiles[0] <= 2, compiles[0]  # (2 * q)
        np.testing.assert_allclose(eager, jax.jit(jax.grad(f))(q), rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(again))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)

