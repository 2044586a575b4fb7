"""All-Pallas and mixed pipelines end to end (interpret mode; compiled for the accelerator
where one is present: ``pallas_device``), fallback, and lowering of the kernels for TPU
(Mosaic) and GPU (Triton) on any machine."""

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import kdax
from kdax import pallas as P

from .._util import (
    GOLDEN_CASES, ON_DEVICE, assert_close, check_golden, oracle_kda, output_shapes, outputs_and_grads, run, split_args,
)
from ..test_pipeline import GRID, build_case, check_against_oracle, cotangents
from ..test_precision import _assert_within_fla, _hard_gate_errors, _listed

PIPELINES = {
    "pallas_tpu": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
    "mixed": lambda: kdax.KDAPipeline.mixed("tpu", interpret=True),
}
if ON_DEVICE:  # the present accelerator's kernels, compiled for real
    PIPELINES["pallas_device"] = lambda: kdax.KDAPipeline.pallas(interpret=False)


# Every golden case in float64 for every pipeline; in float32 for the all-Pallas ones on the
# dense and packed cases (the gate case's float32 run, whose gate kernels test_stages.py
# checks in float32, and the mixed pipeline's, whose stages both of those cover, with -m slow).
GOLDEN_RUNS = [
    pytest.param(p, n, dt, to, tg,
                 marks=pytest.mark.slow if dt == jnp.float32 and (p == "mixed" or n == "gate_softplus_l2") else ())
    for p in PIPELINES for n in GOLDEN_CASES
    for dt, to, tg in [(jnp.float64, 1e-10, 1e-10), (jnp.float32, 1e-5, 1e-4)]
]


@pytest.mark.parametrize("pipe,name,dtype,tol_o,tol_g", GOLDEN_RUNS)
def test_golden(pipe, name, dtype, tol_o, tol_g):
    check_golden(PIPELINES[pipe](), name, dtype, tol_o, tol_g)


# The options grid of the reference pipeline: for each Pallas pipeline a spread of cases
# that together cover every option and chunk size (the rest run with -m slow); every case
# on a present accelerator.
# (state_v_first is a layout change outside the kernels; l2norm_sigmoid, neg_eigval, no_h0
# and disable_recompute run through the same kernels in the triton and mixed pipelines.)
FAST = {
    "pallas_tpu": ["c16_T37", "c32_gva", "c128_strong", "softplus_gate_nobias", "lower_bound_noA",
                   "varlen_gate_c64"],
    "pallas_triton": ["c16_T37", "c32_gva", "lower_bound_gate", "l2norm_sigmoid", "state_v_first", "varlen"],
    "mixed": ["c128_strong", "softplus_gate", "neg_eigval", "no_h0", "disable_recompute", "varlen_gate_c64"],
    "pallas_device": list(GRID),
}
GRID_CASES = [
    pytest.param(p, n, marks=() if n in FAST[p] else pytest.mark.slow) for p in PIPELINES for n in GRID
]


@pytest.mark.parametrize("pipe,name", GRID_CASES)
def test_options_against_oracle(pipe, name):
    pipeline = PIPELINES[pipe]()
    x, opts = build_case(GRID[name])
    check_against_oracle(pipeline, x, opts)


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_varlen_runs_without_fallback(target):
    """Packed varlen (one sequence per chunk) with every stage a Pallas kernel: the state
    kernels read each chunk's sequence boundaries (TPU: scalar-prefetched, picking the
    sequence's h0 / final block; Triton: read in the loop over chunks)."""
    x, opts = build_case(GRID["varlen"])
    strict = dataclasses.replace(kdax.KDAPipeline.pallas(target, interpret=True), fallback=False, share_chunks=False)
    pos, kw = split_args(x)
    plan = strict.plan(*pos, **kw, **opts)  # (shared chunks without fallback: tests/pallas/test_packed_short.py)
    assert plan.layout == "per-sequence" and not plan.fallbacks, plan
    check_against_oracle(strict, x, opts)


@pytest.mark.parametrize("K,V", [(8, 160), (136, 8)])
def test_triton_width_limit_falls_back(K, V):
    """Widths the Triton kernels cannot take (V = 160 or K = 136: padded to 256, over one
    Hopper program's shared memory) are refused before any kernel is built, naming the
    stage; the default Pallas pipeline runs those stages' references and stays exact."""
    x, opts = build_case(dict(T=20, K=K, V=V, chunk_size=16))
    strict = dataclasses.replace(kdax.KDAPipeline.pallas("triton", interpret=True), fallback=False)
    with pytest.raises(kdax.UnsupportedCase, match=r"Pallas\w+: the Triton kernels take K and V up to 128"):
        run(strict, x, opts)
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True)
    check_against_oracle(pipe, x, opts)


def test_pallas_defaults():
    pipe = kdax.KDAPipeline.pallas()
    assert isinstance(pipe.intra, P.PallasIntra) and isinstance(pipe.gate_bwd, P.PallasGateBackward)
    assert pipe.intra.interpret == (jax.default_backend() == "cpu")
    mixed = kdax.KDAPipeline.mixed()
    assert isinstance(mixed.gate, P.PallasGate) and not isinstance(mixed.intra, P.PallasIntra)


LOWERINGS = [
    pytest.param(target, platform, K, False, id=f"{target}-K{K}")
    for target, platform in (("tpu", "tpu"), ("triton", "cuda"))
    for K in (128, 64)
] + [pytest.param(target, platform, 128, True, id=f"{target}-K128-varlen") for target, platform in (("tpu", "tpu"), ("triton", "cuda"))]
KERNEL_CALL = {"tpu": "tpu_custom_call", "triton": "triton"}


@pytest.mark.parametrize("target,platform,K,varlen", LOWERINGS)
def test_lowering(target, platform, K, varlen):
    """Forward and backward lower for the device (kernels compiled to Mosaic / Triton IR)
    at B=2, T=1024, H=4, K=V, chunk 64 (varlen: B=1 packing 3 sequences): a kernel the
    device cannot take fails here."""
    B, T, H = (1, 2048, 4) if varlen else (2, 1024, 4)
    s = jax.ShapeDtypeStruct
    args = (s((B, T, H, K), jnp.float32),) * 4 + (s((B, T, H), jnp.float32),)
    pipe = dataclasses.replace(kdax.KDAPipeline.pallas(target, interpret=False), fallback=False)
    cu = jnp.array([0, 1000, 1001, T], jnp.int32) if varlen else None

    def fwd(*a):
        return kdax.chunk_kda(*a, pipeline=pipe, chunk_size=64, use_gate_in_kernel=True, A_log=jnp.zeros(H),
                              use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=cu)

    def loss(*a):
        o, ht = fwd(*a)
        return jnp.sum(o) + jnp.sum(ht)

    bwd = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    for f, n_min in ((lambda *a: fwd(*a)[0], 5), (bwd, 11)):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        calls = re.findall(r"stablehlo\.custom_call @(\S+)\(", text)
        kernels = [c for c in calls if KERNEL_CALL[target] in c]
        assert len(kernels) >= n_min, calls


@pytest.mark.parametrize("target,platform", [("tpu", "tpu"), ("triton", "cuda")])
def test_lowering_shared_chunks(target, platform):
    """Short packed sequences sharing chunks: every Pallas kernel takes the reset table
    (none falls back) and the state kernels the one-entry state table; the whole training
    step lowers for the device."""
    T, H, K = 1024, 4, 128
    s = jax.ShapeDtypeStruct
    args = (s((1, T, H, K), jnp.float32),) * 4 + (s((1, T, H), jnp.float32),)
    pipe = kdax.KDAPipeline.pallas(target, interpret=False)
    cu = jnp.array([0, 10, 11, 90, 500, T], jnp.int32)
    kw = dict(chunk_size=64, use_gate_in_kernel=True, A_log=jnp.zeros(H), output_final_state=True, cu_seqlens=cu)
    plan = pipe.plan(*args, **kw)
    assert plan.layout == "shared" and not plan.fallbacks, plan

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, pipeline=pipe, **kw)
        return jnp.sum(o) + jnp.sum(ht)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    names = set(re.findall(r'kdax_(Pallas\w+?)_kernel', text))
    assert {"PallasGate", "PallasGateBackward", "PallasState", "PallasDhu", "PallasWY", "PallasWYDqkg"} <= names, names


# The named Triton tunings but "default" (every pallas_device case) and "minimal" (spills)
TUNED = [t for t in P.TUNINGS if t not in ("default", "minimal")]


@pytest.mark.skipif(not ON_DEVICE, reason="no accelerator")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("tuning", TUNED)
def test_tunings_within_fla_tolerances_on_device(tuning, packed):
    """Each named Triton tuning compiled for the GPU present, at the precision it sets
    (``"fast"``): bf16 inputs with Kimi Linear's options, 5% of the gates at -1e4, dense
    and packed with initial states: every output and gradient within FLA's tolerances
    against the float64 oracle. The CPU checks the candidate in an emulation of sm_90's
    products (``tests/test_precision.py::test_candidate_within_fla_tolerances``); the
    README recommends ``tuning="candidate"`` for speed, and these ran only in the timings
    (dense, no hard gates) before."""
    errs = _hard_gate_errors(kdax.KDAPipeline.pallas("triton", tuning=tuning), (1, 256, 2, 32, 64), packed)
    print(f"\n{tuning}, packed={packed}: " + _listed(errs))
    _assert_within_fla(errs)


SPLIT_CASES = {"dense": dict(chunk_size=16, T=100, use_gate_in_kernel=True, A_log=True, dt_bias=True),
               "packed": GRID["varlen"]}


def _check_split(pipe, how, case, dtype, tol_o, tol_g):
    """``pipe`` under ``kdax.stages.segmented`` (3 segments: F4 and B2 on the segment rows'
    packed layout and extended state tables) or inside ``jax.shard_map``
    (``kdax.parallel.chunk_kda`` on a one-device mesh of the first device): outputs, final
    states and every gradient against the float64 oracle on the same values."""
    x, opts = build_case(SPLIT_CASES[case], dtype=dtype)
    if how == "segmented":
        fn = kdax.stages.segmented(pipe, 3)
    else:
        mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
        fn = functools.partial(kdax.parallel.chunk_kda, mesh, "sp", pipeline=pipe)
    x64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    do, dht = cotangents(*output_shapes(oracle_kda, x64, opts))
    o, ht, grads = outputs_and_grads(fn, x, opts, do.astype(dtype), dht.astype(dtype))
    o_ref, ht_ref, ref = outputs_and_grads(oracle_kda, x64, opts, do, dht)
    assert_close(o, o_ref, tol_o, "o")
    assert_close(ht, ht_ref, tol_o, "ht")
    for n in ref:
        assert_close(grads[n], ref[n], tol_g, "d" + n)


def test_segmented_pallas_state_kernels():
    """The Triton state kernels (interpret mode) as ``segmented``'s inner F4 and B2, packed
    sequences with initial states, float64 (the reference stages': tests/stages/test_segments.py)."""
    _check_split(kdax.KDAPipeline.pallas("triton", interpret=True), "segmented", "packed", jnp.float64, 1e-10, 1e-10)


@pytest.mark.skipif(not ON_DEVICE, reason="no accelerator")
@pytest.mark.parametrize("dtype,tol_o,tol_g", [(jnp.float64, 1e-10, 1e-10), (jnp.float32, 1e-5, 1e-4)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize("how", ["segmented", "sequence_parallel"])
def test_segmented_and_sequence_parallel_on_device(how, case, dtype, tol_o, tol_g):
    """The present accelerator's kernels compiled (``default_pipeline()`` on sm_90 or later)
    under ``segmented`` and inside ``shard_map``: the suite's multi-device runs are on
    simulated CPU devices, in interpret mode (tests/parallel/test_pallas.py)."""
    _check_split(kdax.KDAPipeline.pallas(interpret=False), how, case, dtype, tol_o, tol_g)


@pytest.mark.parametrize("pipe", [p for p in ("pallas_triton", "pallas_device") if p in PIPELINES])
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(pipe, dt):
    """bf16/fp16 inputs through the all-Pallas pipeline: float32 inside the kernels (the
    "highest" precision policy; the default policy's rounding: tests/test_precision.py)."""
    x, opts = build_case(dict(T=40, chunk_size=16, use_gate_in_kernel=True, A_log=True, dt_bias=True))
    xl = {n: a.astype(dt) for n, a in x.items()}
    x64 = {n: a.astype(jnp.float64) for n, a in xl.items()}
    pipe = PIPELINES[pipe]().with_precision("highest")
    do, dht = cotangents(*output_shapes(oracle_kda, x64, opts))
    do, dht = do.astype(dt), dht.astype(jnp.float32)  # (as the pipeline's outputs)
    o, ht, grads = outputs_and_grads(pipe, xl, opts, do, dht)
    o_ref, ht_ref, ref = outputs_and_grads(oracle_kda, x64, opts, do.astype(jnp.float64), dht.astype(jnp.float64))
    assert o.dtype == dt and ht.dtype == jnp.float32
    assert_close(o, o_ref, 5e-3, "o")
    assert_close(ht, ht_ref, 1e-5, "ht")
    for n in ref:
        assert grads[n].dtype == dt, n
        assert_close(grads[n], ref[n], 5e-3, "d" + n)


@pytest.mark.parametrize("pipe", ["pallas_triton", pytest.param("mixed", marks=pytest.mark.slow)])
def test_initial_states_enter_shared_chunks(pipe):
    """Packed initial states entering shared chunks (``kdax._layouts.shared_states``) through the
    Pallas stages (interpret mode; the Triton F4/B2 load and leave the state table of
    ``injected_layout``), a loss on o and the final states: every gradient, ``dh0``
    included, as the reference pipeline with one sequence per chunk gives, in float64. A
    Pallas B2 runs once, the final states' chunk-start cotangents given as ``dh_start``."""
    mix = [0, 0, 1, 2, 2, 3, 16, 17, 65, 66, 70, 70, 85, 85]
    r = np.random.default_rng(0)
    T, H, K, V, N = mix[-1], 2, 16, 16, len(mix) - 1
    f = lambda *s: jnp.asarray(r.normal(size=s))
    x = (f(1, T, H, K), f(1, T, H, K) / 4, f(1, T, H, V), -jnp.abs(f(1, T, H, K)) * 0.2,
         jax.nn.sigmoid(f(1, T, H)), f(N, H, K, V))
    cu, do, dht = jnp.asarray(mix, jnp.int32), f(1, T, H, V), f(N, H, K, V)

    def step(p):
        def loss(*a):
            o, ht = kdax.chunk_kda(*a[:5], initial_state=a[5], cu_seqlens=cu, output_final_state=True,
                                   chunk_size=16, pipeline=p)
            return jnp.sum(o * do) + jnp.sum(ht * dht)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    grads = lambda p: step(p)(*x)  # noqa: E731
    p = PIPELINES[pipe]()
    assert p.plan(*x[:5], initial_state=x[5], cu_seqlens=cu, output_final_state=True, chunk_size=16).layout == "shared"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        got = grads(p)
        if isinstance(p.dhu, P.PallasDhu):  # (the mixed pipeline's B2 is the reference)
            assert str(jax.make_jaxpr(step(p))(*x)).count("name=kdax_PallasDhu_kernel") == 1
    want = grads(dataclasses.replace(kdax.KDAPipeline.reference(), share_chunks=False))
    for g, w, n in zip(got, want, ("q", "k", "v", "g", "beta", "initial_state")):
        assert_close(g, w, 1e-10, "d" + n)


def test_stages_read_the_callers_layout():
    """Dense input whose T is a multiple of the chunk size, Kimi Linear's options, two
    value heads per q/k head: the Triton F1 reads q, k, g, beta, B5 g, F3, B0 and B3 v,
    B1, B2 and B3 do from the caller's arrays (``kdax._layouts.tokens``, no chunked copies);
    outputs and every gradient against the float64 oracle. With NaN and inf inputs in
    three rows (float32): NaN exactly where the reference pipeline has it, every other
    value its value (non-finite elements cleaned as the kernels load them)."""
    from kdax._runner.runner import recording
    from kdax._layouts.tokens import Tokens

    spec = dict(chunk_size=16, T=64, B=3, H=2, HV=4, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pipe = PIPELINES["pallas_triton"]()
    x, opts = build_case(spec)
    with recording() as rec:
        check_against_oracle(pipe, x, opts)
    views = [("gate", "q"), ("gate", "beta"), ("gate_bwd", "g"), ("wy", "v"), ("recompute", "v"), ("wy_dqkg", "v"),
             ("dav", "do"), ("dhu", "do"), ("wy_dqkg", "do")]
    assert all(isinstance(rec.inputs[n][a], Tokens) for n, a in views), rec.inputs
    for dtype, tol in ((jnp.float32, 1e-5),):  # (the kernels' float64 view reads: test_stages.py)
        x, opts = build_case(spec, dtype=dtype)
        x = dict(x, g=x["g"].at[1, 20, 1, 3].set(jnp.nan), k=x["k"].at[2, 40, 0, 2].set(jnp.inf),
                 q=x["q"].at[0, 10, 1, 0].set(jnp.nan), beta=x["beta"].at[0, 50, 2].set(jnp.nan))
        do, dht = cotangents(*output_shapes(oracle_kda, x, opts))
        o, ht, grads = outputs_and_grads(pipe, x, opts, do, dht)
        o_ref, ht_ref, ref = outputs_and_grads(kdax.KDAPipeline.reference(), x, opts, do, dht)
        got, want = (o, ht, *grads.values()), (o_ref, ht_ref, *ref.values())
        for i, (a, b) in enumerate(zip(got, want)):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=str(i))
            assert np.isnan(b).any() or i > 1
            assert_close(np.nan_to_num(a), np.nan_to_num(b), tol, str(i))

