"""``KDAPipeline.pallas("triton", tuning=...)``: the named Triton tunings
(``kdax.pallas.TUNINGS``), what each sets on the stages, the errors for a bad name, and
how the default tuning compiles for sm_90 (the spill checks need ``triton``: skipped
without it)."""

import dataclasses

import pytest

from kdax import KDAPipeline
from kdax.pallas import TUNINGS, PallasDhu, PallasState
from kdax.pallas._common import PallasTarget
from kdax.pipeline import STAGES


def _fields(pipe) -> dict:
    """``{stage: (num_warps, num_stages, f32_dot, block_k, block_v)}`` of a pipeline's
    Pallas stages (None where a stage has no such field)."""
    return {n: tuple(getattr(getattr(pipe, n), f, None) for f in ("num_warps", "num_stages", "f32_dot", "block_k", "block_v"))
            for n in STAGES if isinstance(getattr(pipe, n), PallasTarget)}


def test_presets_named():
    assert tuple(TUNINGS) == ("default", "default-rows16", "fastest-modelled", "candidate", "candidate-rows16",
                             "candidate-rows16-f2", "minimal")
    for name, t in TUNINGS.items():
        assert t.name == name and t.doc and set(t.fields) == set(STAGES), name


def test_default_is_the_default_tuning():
    """``pallas("triton")`` is ``tuning="default"``: 8 warps, 2 stages, TF32x3 products, the
    state kernels as 64-row tiles of 32 value columns (4 warps, 16 columns where their
    products take float32 operands), B3 at 16 feature columns (16 x 16 columns, 1 stage,
    unchained TF32x3 where its products take float32 operands), F2 at 32 feature columns
    where its do, B5 at one stage; the pipeline's precision
    left as it was (``"auto"``)."""
    pipe = KDAPipeline.pallas("triton", interpret=True)
    assert pipe == KDAPipeline.pallas("triton", interpret=True, tuning="default")
    assert pipe.precision == "auto"
    got = _fields(pipe)
    assert got["state"] == got["dhu"] == (8, 2, "tf32x3", 64, 32)
    assert pipe.state.f32_tuning == pipe.dhu.f32_tuning == (("num_warps", 4), ("block_v", 16))
    assert pipe.intra.f32_tuning == (("block_k", 32),)
    assert dict(pipe.wy_dqkg.f32_tuning) == dict(num_stages=1, block_k=16, block_v=16, f32_dot="tf32x3_split")
    assert (pipe.wy_dqkg.block_k, pipe.wy_dqkg.block_v) == (16, 32)
    assert got["gate_bwd"] == (8, 1, "tf32x3", None, None)
    assert got["intra"][:3] == got["wy_dqkg"][:3] == got["intra_bwd"][:3] == (8, 2, "tf32x3")


def test_f32_tuning_applies_where_products_take_float32():
    """A stage's ``f32_tuning`` replaces its fields where its products take float32
    operands (no half dtype for it under the policy it is given) and the tuning applies (compiled
    Triton, or ``tuned_interpret``); elsewhere the stage is as built. The tuning reaches
    the kernel builders as arguments: ``products`` and ``triton_params``."""
    st = PallasState(target="triton", interpret=False, num_warps=8, block_v=32,
                     f32_tuning=(("num_warps", 4), ("block_v", 16)))
    exact = st.for_operands("bfloat16")  # (the recurrence keeps float32 products)
    half = st.for_operands("fast")
    assert (exact.num_warps, exact.block_v, exact.f32_tuning) == (4, 16, ())
    assert half == st and half.triton_params() == dict(num_warps=8, num_stages=1)
    assert exact.triton_params() == dict(num_warps=4, num_stages=1)
    interp = dataclasses.replace(st, interpret=True)
    assert interp.for_operands("highest") == interp and interp.products("highest").f32_dot == "ieee"
    assert dataclasses.replace(interp, tuned_interpret=True).for_operands("highest").num_warps == 4


@pytest.mark.parametrize("bad,match", [
    ((("num_warps", 3),), "num_warps: expected 1, 2, 4, 8 or 16, got 3"),
    ((("block_v", 24),), "block_v: expected a power of 2 of at least 16, got 24"),
    ((("block_q", 16),), r"f32_tuning: \['block_q'\] are not tuning fields of PallasState"),
    ((("interpret", True),), r"f32_tuning: \['interpret'\] are not tuning fields"),
    ({"num_warps": 4}, "f32_tuning: expected a tuple of"),
])
def test_f32_tuning_checked_when_built(bad, match):
    with pytest.raises(ValueError, match=match):
        PallasState(target="triton", f32_tuning=bad)


def test_minimal_is_every_fields_default():
    pipe = KDAPipeline.pallas("triton", interpret=True, tuning="minimal")
    for name, stage in ((n, getattr(pipe, n)) for n in STAGES):
        assert stage == type(stage)(target="triton", interpret=True), name


@pytest.mark.parametrize("preset,path", [("fastest-modelled", "CANDIDATE_BEST"), ("candidate", "CANDIDATE")])
def test_presets_are_the_benchmark_paths(preset, path):
    """``"fastest-modelled"`` is the cost model's ``BEST`` (``gpu_candidate_run.py``'s
    ``CANDIDATE_BEST``), ``"candidate"`` its ``CANDIDATE``, as ``gpu_vs_fla.py`` builds
    them from their path strings (precision ``"fast"`` included): stage for stage."""
    from tests.benchmarks._load import load_benchmark

    run, gvf = load_benchmark("gpu_candidate_run"), load_benchmark("gpu_vs_fla")
    built = gvf.kdax_pipeline(getattr(run, path))
    built = dataclasses.replace(built, **{n: dataclasses.replace(getattr(built, n), target="triton", interpret=True)
                                          for n in STAGES if isinstance(getattr(built, n), PallasTarget)})
    assert KDAPipeline.pallas("triton", interpret=True, tuning=preset) == built
    assert KDAPipeline.pallas("triton", interpret=True, tuning=preset).precision == "fast"


@pytest.mark.parametrize("bad", ["fast", "Default", "", 8])
def test_bad_tuning_names_the_presets(bad):
    with pytest.raises(ValueError, match=r"tuning: expected one of \('default', 'default-rows16', 'fastest-modelled', "
                                         r"'candidate', 'candidate-rows16', 'candidate-rows16-f2', 'minimal'\)"):
        KDAPipeline.pallas("triton", interpret=True, tuning=bad)


def test_tpu_takes_no_triton_tuning():
    """TPU kernels have no Triton fields: ``"default"`` and ``"minimal"`` give the fields'
    defaults (as before tunings), any other tuning is refused by name."""
    assert KDAPipeline.pallas("tpu", interpret=True, tuning="default") == KDAPipeline.pallas("tpu", interpret=True)
    assert KDAPipeline.pallas("tpu", interpret=True).state == PallasState(target="tpu", interpret=True)
    with pytest.raises(ValueError, match=r"tuning: 'fastest-modelled' tunes Triton kernels; target is 'tpu'"):
        KDAPipeline.pallas("tpu", interpret=True, tuning="fastest-modelled")


def test_mixed_takes_the_default_tuning():
    mixed = KDAPipeline.mixed("triton", interpret=True)
    assert mixed.wy == KDAPipeline.pallas("triton", interpret=True).wy
    assert isinstance(KDAPipeline.pallas("triton", interpret=True).dhu, PallasDhu)


# -- sm_90 compiles of the default tuning -----------------------------------------------------
def _step(policy: str, packed: bool, dtype: str = "bfloat16", tuning: str = "default") -> dict:
    """``{(kernel, warps, stages): Resources}`` of a training step at ``tuning``."""
    from tests.pallas._triton import skip_reason, step_resources

    if reason := skip_reason():
        pytest.skip(reason)
    used = step_resources(KDAPipeline.pallas("triton", interpret=False, tuning=tuning), policy, packed, dtype=dtype)
    assert len({n for n, _, _ in used}) >= 10, sorted(used)
    for (name, _, _), r in used.items():
        assert r.shared <= 232448 and r.registers <= 255, (name, r)
    return used


def _spills(used: dict) -> dict:
    return {name: r.local for (name, _, _), r in used.items() if r.local}


# The one spill of the default tuning: F2 on packed input where its products take float32
# operands ("highest", what "auto" gives float32 inputs: 32 feature columns a step,
# ``f32_tuning``), 255 registers and 8 B a thread (dense: 254, none). 16 columns a step
# fit (254, none) at +25% of the kernel's instructions a warp (gpu_cost_model.py's count:
# 20,968 -> 26,169 packed), more than one spilled word costs, so the tuning keeps 32.
# Measured in session 64, where the kernel spilled so at aa28295 and ec09023 as well.
F32_PACKED_SPILL = {"kdax_PallasIntra_kernel": 8}


@pytest.mark.slow  # (the core keeps every kernel's spill check at the candidate's tuning: test_triton_registers.py)
def test_default_tuning_highest_packed_no_spills():
    """The sweep's representative below: under "highest" (what ``"auto"`` gives float32
    inputs: every product float32, the state kernels and B3 at their ``f32_tuning``) on
    packed sequences (B5's reset table) every Triton kernel of a training step at the
    default tuning compiles for sm_90 with no thread-local memory but F2's 8 B
    (``F32_PACKED_SPILL``); the kernels were launched with the float32 tuning's warps and
    stages (the fields reached the calls)."""
    used = _step("highest", packed=True)
    assert _spills(used) == F32_PACKED_SPILL
    configs = {name: (w, st) for name, w, st in used}
    assert configs["kdax_PallasState_kernel"] == configs["kdax_PallasDhu_kernel"] == (4, 2), configs
    assert configs["kdax_PallasWYDqkg_kernel"] == (8, 1) and configs["kdax_PallasGateBackward_kernel"] == (8, 1)
    assert configs["kdax_PallasIntra_kernel"] == (8, 2), configs


@pytest.mark.slow
@pytest.mark.parametrize("tuning", ["default", "default-rows16"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("policy,dtype", [("auto", "float32"), ("auto", "bfloat16"), ("highest", "bfloat16"),
                                          ("bfloat16", "bfloat16"), ("float16", "bfloat16"), ("fast", "bfloat16")])
def test_default_tuning_every_precision_no_spills(policy, dtype, packed, tuning):
    """No kernel of the default tuning spills on sm_90, under any precision (``"auto"``
    with float32 and bf16 inputs, and every policy by name), dense or packed, but F2's 8 B
    on packed input under float32 products (``F32_PACKED_SPILL``; about 20 s each on a
    2-core machine); ``"default-rows16"`` spills the same, its B4 on 4 warps."""
    used = _step(policy, packed, dtype, tuning)
    f32 = packed and (policy == "highest" or (policy, dtype) == ("auto", "float32"))  # (F2's float32 products)
    assert _spills(used) == (F32_PACKED_SPILL if f32 else {})
    b4 = (4, 2) if tuning == "default-rows16" else (8, 2)
    assert {(w, st) for name, w, st in used if name == "kdax_PallasIntraBackward_kernel"} == {b4}, sorted(used)


# -- the default tuning's products, traced as on sm_90 ------------------------------------------
def _tuned(pipe):
    """``pipe`` with every Pallas stage traced with its Triton tuning in interpret mode
    (``tuned_interpret``: the GPU's dot algorithms, which ``tests/_gpu_products.py`` rounds
    as sm_90 does)."""
    return dataclasses.replace(pipe, **{n: dataclasses.replace(getattr(pipe, n), tuned_interpret=True)
                                        for n in STAGES if isinstance(getattr(pipe, n), PallasTarget)})


@pytest.mark.slow  # (the core keeps sm_90's TF32x3 products at the candidate's tuning: test_precision.py)
@pytest.mark.parametrize("tuning", ["default", "default-rows16"])
def test_default_tuning_float32_products_stay_float32_accurate(tuning):
    """Under "auto" with float32 inputs (every product float32: the stages' ``f32_tuning``,
    B3's unchained TF32x3, F4/B2's lazily loaded tiles, B3's ``Akk`` as the second
    operand, B5's mask products from TF32 parts) on packed sequences with sequences
    starting inside chunks, the default tuning's products as sm_90 computes them
    (TF32x3) keep the step at float32 accuracy: against the same pipeline with exact
    float32 products, outputs and every gradient within 2e-5 relative RMS (TF32x3's
    products: about 1e-6 relative each; a bf16 rounding anywhere would give ~1e-3)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kdax
    from tests._gpu_products import gpu_products
    from tests._util import loss_grads, make_inputs, rel_rms, run

    B, T, H, K, C = 1, 192, 2, 64, 64
    x = make_inputs(seed=3, B=B, T=T, H=H, K=K, V=K, N=3, gate="raw", A_log=True, dt_bias=True, h0=True,
                    beta_raw=True)
    x = {n: a.astype(jnp.float32) for n, a in x.items()}
    opts = dict(chunk_size=C, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, cu_seqlens=jnp.asarray([0, 37, 37 + T // 2, T], jnp.int32))
    exact = KDAPipeline.pallas("triton", interpret=True, tuning=tuning)
    tuned = _tuned(exact)
    assert tuned.wy_dqkg.products("highest").f32_dot == "tf32x3" and exact.wy_dqkg.products("highest").f32_dot == "ieee"
    fn = lambda pipe: lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw)  # noqa: E731
    o_ref, ht_ref = run(fn(exact), x, opts)
    do = jnp.asarray(np.random.default_rng(1).normal(size=o_ref.shape), jnp.float32)
    dht = jnp.asarray(np.random.default_rng(2).normal(size=ht_ref.shape), jnp.float32)
    want = loss_grads(fn(exact), x, opts, do, dht)
    with gpu_products():
        o, ht = run(fn(tuned), x, opts)
        got = loss_grads(fn(tuned), x, opts, do, dht)
    errs = {"o": rel_rms(o, o_ref), "ht": rel_rms(ht, ht_ref)}
    errs.update({"d" + n: rel_rms(g, want[n]) for n, g in got.items()})
    print(f"\n{tuning} tuning, float32 products as on sm_90 vs exact: "
          + ", ".join(f"{n} {float(e):.1e}" for n, e in errs.items()))
    assert all(jax.numpy.isfinite(e) and e < 2e-5 for e in errs.values()), errs
    assert any(e > 0 for e in errs.values()), errs  # (the tuned products did run)


# -- the default with B4 on 16-row programs ---------------------------------------------------
def test_default_rows16_is_the_default_but_b4():
    """``"default-rows16"``: every stage as ``"default"`` but B4, which takes
    ``"candidate-rows16"``'s grid (one 4-warp program per 16-token sub-block; its exactness:
    tests/pallas/test_intra_rows.py), at the pipeline's own precision ``"auto"``."""
    rows16 = KDAPipeline.pallas("triton", interpret=True, tuning="default-rows16")
    default = KDAPipeline.pallas("triton", interpret=True)
    assert rows16.precision == "auto"
    assert (rows16.intra_bwd.rows, rows16.intra_bwd.num_warps) == (16, 4)
    assert dataclasses.replace(rows16.intra_bwd, rows=64, num_warps=8) == default.intra_bwd
    assert all(getattr(rows16, n) == getattr(default, n) for n in STAGES if n != "intra_bwd")
    assert rows16.intra_bwd == KDAPipeline.pallas("triton", interpret=True, tuning="candidate-rows16").intra_bwd


@pytest.mark.parametrize("policy,packed", [("highest", True), ("bfloat16", True), ("fast", False)])
def test_default_rows16_b4_fits_four_ctas_an_sm(policy, packed):
    """sm_90 at K = 128, chunk 64: the preset's B4 under float32 products ("highest", what
    "auto" gives float32 inputs), G's low part ("bfloat16", what it gives bf16 inputs) and
    "fast": no thread-local memory, at most 138 registers a thread (session 67: 128 dense,
    138 packed under every policy but "fast"'s 128). The whole step under every policy:
    ``test_default_tuning_every_precision_no_spills`` (-m slow)."""
    from tests.pallas._triton import chunk_kernels, resources, skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    t = dict(TUNINGS["default-rows16"].fields["intra_bwd"])
    (text,) = chunk_kernels(policy, t, only=("intra_bwd",), packed=packed).values()
    r = resources(text, 4, 2)
    assert r.local == 0 and r.registers <= 138, r
