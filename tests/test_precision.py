"""The precision policy (``kdax._numerics.precision``): which products take half-precision operands
under bf16/fp16 inputs, which stay at HIGHEST, and the errors of the fast policy against
the float64 oracle within FLA's tolerances."""

import dataclasses
import re
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._numerics import precision as _precision
from kdax._runner.contracts import STAGES
from kdax.pallas import PallasDhu, PallasIntraBackward, PallasState
from kdax.pallas._common import PallasTarget
from kdax.stages import AbstractOutput, ReferenceOutput

from ._gpu_products import gpu_products
from ._util import (
    assert_close, dot_eqns, load_golden, make_inputs, oracle_kda, output_shapes, outputs_and_grads, rel_rms, run,
    split_args,
)

# FLA's tolerances for half-precision inputs (rel-RMS against a float64 reference).
FLA_TOL = {"o": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "g": 2e-2, "beta": 2e-2, "A_log": 2e-2, "dt_bias": 2e-2}
KIMI = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
FAST = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def test_resolve():
    assert _precision.resolve("auto", jnp.bfloat16) == "bfloat16"
    assert _precision.resolve("auto", jnp.float16) == "float16"
    assert _precision.resolve("auto", jnp.float32) == "highest"
    assert _precision.resolve("bfloat16", jnp.float32) == "bfloat16"
    assert _precision.resolve("bfloat16", jnp.float64) == "highest"  # the float64 oracle stays exact
    assert _precision.resolve("fast", jnp.bfloat16) == "fast"
    assert _precision.resolve("fast", jnp.float64) == "highest"
    with pytest.raises(ValueError, match="precision"):
        _precision.resolve("tf32", jnp.float32)
    with pytest.raises(ValueError, match="precision"):
        kdax.KDAPipeline.reference().with_precision("tf32")
    # "fast" is opt-in by name: the default stays "auto" (recurrences at float32).
    assert kdax.KDAPipeline.reference().precision == "auto"
    assert kdax.KDAPipeline.reference().with_precision("fast").precision == "fast"
    # A call's inputs decide: float64 anywhere is "highest"; half products only where q, k
    # and v are all half (the products' operands), whatever dtype g and beta carry.
    bf16, f16, f32, f64 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64
    assert _precision.resolve("auto", bf16, bf16, bf16, f32, f32) == "bfloat16"  # (FLA's layer: g, beta float32)
    assert _precision.resolve("auto", bf16, f32, f32) == "highest"
    assert _precision.resolve("auto", bf16, f16, bf16) == "highest"
    assert _precision.resolve("fast", bf16, bf16, bf16, f32, f32, f64) == "highest"  # (a float64 initial state)
    assert _precision.resolve("auto", bf16, bf16, bf16, None, None, None) == "bfloat16"
    pipe = kdax.KDAPipeline.reference()
    assert pipe.with_precision("fast").resolved(f64).precision == "highest"
    assert pipe.with_precision("bfloat16").resolved(f32).precision == "bfloat16"
    assert pipe.resolved(bf16, f32, bf16).precision == "highest"
    st = kdax.stages
    bf16 = jnp.dtype(jnp.bfloat16)
    assert _precision.operand("fast", st.ReferenceState) == _precision.operand("fast", PallasDhu) == bf16
    assert _precision.operand("bfloat16", st.ReferenceState) is None
    assert _precision.operand("fast", st.ReferenceIntraBackward) is None
    assert _precision.operand("bfloat16", st.ReferenceIntra) == bf16 and _precision.operand("highest", st.ReferenceIntra) is None
    # What must stay float32 (see kdax._numerics.precision): the gate cumsum, the state recurrence
    # (F4, B2, B0's F4) and B4, whose dG cancels (rounded, dA_log's error was 6e-2 on an H100).
    slow = {"AbstractGate", "AbstractState", "AbstractRecompute", "AbstractDhu", "AbstractIntraBackward",
            "AbstractGateBackward"}
    assert slow.isdisjoint(_precision.FAST_FAMILIES)


def _dots(jaxpr, stack=""):
    """``(name stack, precision)`` of every dot_general in ``jaxpr`` and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        here = stack + "/" + str(eqn.source_info.name_stack)
        if eqn.primitive.name == "dot_general":
            out.append((here, eqn.params["precision"]))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _dots(sub.jaxpr, here)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _dots(sub, here)
    return out


def _stage_of(stack: str) -> str:
    names = re.findall(r"kdax_(\w+)", stack)
    return names[-1] if names else ""


@pytest.mark.parametrize("policy", ["bfloat16", "fast"])
def test_float64_inputs_run_highest_under_any_policy(policy):
    """Float64 inputs run every product at float64, whatever policy the pipeline names
    (``KDAPipeline.resolved`` returned a named policy unresolved: 3e-3 off the oracle),
    and ``plan`` says so."""
    x, opts = make_inputs(seed=5, T=70, K=16, V=16), dict(use_qk_l2norm_in_kernel=True)
    pipe = kdax.KDAPipeline.reference().with_precision(policy)
    do = np.random.default_rng(1).normal(size=x["v"].shape)
    o, _, grads = outputs_and_grads(lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw), x, opts, do, None)
    want, _, want_grads = outputs_and_grads(kdax.fused_recurrent_kda, x, opts, do, None)
    assert o.dtype == jnp.float64
    assert_close(o, want, 1e-12, "o")
    for name in want_grads:
        assert_close(grads[name], want_grads[name], 1e-11, name)
    assert pipe.plan(*(x[n] for n in ("q", "k", "v", "g", "beta"))).config["precision"] == "highest"


def test_precision_follows_every_product_operand():
    """A bf16 q beside float64 k, v, g, beta and initial state: the products run at float64
    (q's dtype alone chose "bfloat16": the final state, which q does not reach, 2.7e-3 off);
    o comes back in q's dtype, as FLA's, rounded from the float64 result."""
    x = make_inputs(seed=6, T=40, K=16, V=8)
    opts = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    _, want = kdax.fused_recurrent_kda(*args, **opts)
    args[0] = args[0].astype(jnp.bfloat16)
    o, ht = kdax.chunk_kda(*args, **opts)
    assert ht.dtype == jnp.float64
    assert_close(ht, want, 1e-12, "final state")
    ref_o, _ = kdax.fused_recurrent_kda(*args, **opts)  # (float64: v's dtype; chunk_kda's o is q's, as FLA's)
    assert o.dtype == jnp.bfloat16, o.dtype
    # o: the float64 result rounded to bf16 (within one bf16 step, 2^-8 relative, of it)
    err = np.abs(np.asarray(o, np.float64) - np.asarray(ref_o))
    assert np.all(err <= 2.0**-8 * np.abs(np.asarray(ref_o))), float(np.max(err / np.abs(np.asarray(ref_o))))


@pytest.mark.parametrize("policy", ["auto", "highest"])
def test_products_follow_the_policy(policy):
    """bf16 inputs: under "auto" every product of the fast stages asks for bf16 operands
    with float32 accumulation and every other product (gate cumsum, state recurrence,
    (I+L)^-1) for HIGHEST; under "highest" every product asks for HIGHEST."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 64, 2, 16), jnp.bfloat16),) * 4 + (s((1, 64, 2), jnp.bfloat16),)
    pipe = kdax.KDAPipeline.reference().untiled().with_precision(policy)

    def loss(*a):
        o, _ = kdax.chunk_kda(*a, chunk_size=16, A_log=jnp.zeros(2), pipeline=pipe, **KIMI)
        return jnp.sum(o.astype(jnp.float32))

    dots = _dots(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args).jaxpr)
    by_stage = {}
    for stack, prec in dots:
        by_stage.setdefault(_stage_of(stack), set()).add(str(prec))
    # Products of every stage that has any; the solve's products (inside intra) stay exact.
    # B0 recomputes through the pipeline's own F3/F4 stages, so its products carry their
    # names (kdax_recompute/kdax_wy, .../kdax_state) and their policy.
    assert {"intra", "wy", "state", "output", "dav", "dhu", "wy_dqkg", "intra_bwd"} <= set(by_stage)
    assert any("kdax_recompute" in stack for stack, _ in dots)
    for stage, precs in by_stage.items():
        if stage == "recompute":
            continue
        if policy == "auto" and STAGES[stage].family.__name__ in _precision.FAST_FAMILIES:
            # Row sums (kdax._numerics.arrays.rowsum) and the solve stay exact inside these stages.
            assert str(FAST) in precs and precs <= {str(FAST), str(HIGHEST)}, (stage, precs)
        else:
            assert precs == {str(HIGHEST)}, (stage, precs)
    # B0's recomputed F3 follows F3's policy, its F4 stays exact.
    rec_wy = {str(p) for st, p in dots if "kdax_recompute" in st and _stage_of(st) == "wy"}
    rec_state = {str(p) for st, p in dots if "kdax_recompute" in st and _stage_of(st) == "state"}
    f3 = {str(p) for st, p in dots if "kdax_recompute" not in st and _stage_of(st) == "wy"}
    assert rec_wy == f3 == ({str(FAST)} if policy == "auto" else {str(HIGHEST)})
    assert rec_state == {str(HIGHEST)}


PIPES = {
    # The reference stages' products with XLA:GPU's operand rounding (XLA:CPU ignores it).
    "reference": lambda: kdax.KDAPipeline.reference().untiled(),
    # In-kernel products cast their operands explicitly: rounded in interpret mode too.
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
}


@pytest.mark.parametrize("name,dtype", [
    ("reference", jnp.bfloat16), ("pallas_triton", jnp.bfloat16),
    pytest.param("reference", jnp.float16, marks=pytest.mark.slow),
    pytest.param("pallas_triton", jnp.float16, marks=pytest.mark.slow),
])
def test_fast_policy_within_fla_tolerances(name, dtype):
    """Half-precision inputs with Kimi Linear's options under the default ("auto")
    policy: the output, the final state and every gradient (A_log's and dt_bias's too)
    against the float64 oracle within FLA's tolerances; and the policy does round (the
    output differs from the same pipeline's at "highest")."""
    with gpu_products():
        _check_fast_policy(PIPES[name](), dtype)


def _check_fast_policy(pipe, dtype):
    x64 = make_inputs(seed=3, B=1, T=256, H=2, K=32, V=32, gate="raw", A_log=True, dt_bias=True, h0=False, beta_raw=True)
    x = {n: a.astype(jnp.float32 if n in ("A_log", "dt_bias") else dtype) for n, a in x64.items()}
    xr = {n: a.astype(jnp.float64) for n, a in x.items()}  # the same values, exactly
    opts = dict(chunk_size=32, output_final_state=True, **KIMI)
    fn = lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw)  # noqa: E731
    do = jnp.asarray(np.random.default_rng(1).normal(size=output_shapes(oracle_kda, xr, opts)[0].shape))
    o, ht, grads = outputs_and_grads(fn, x, opts, do.astype(jnp.float32), None)
    o_ref, ht_ref, want = outputs_and_grads(oracle_kda, xr, opts, do, None)
    assert o.dtype == dtype and ht.dtype == jnp.float32
    assert_close(o, o_ref, FLA_TOL["o"], "o")
    assert_close(ht, ht_ref, FLA_TOL["o"], "ht")
    for n, gr in grads.items():
        assert_close(gr, want[n], FLA_TOL[n], "d" + n)
    exact = pipe.with_precision("highest")
    o_hi, _ = run(lambda *a, **kw: kdax.chunk_kda(*a, pipeline=exact, **kw), x, opts)
    assert not np.array_equal(np.asarray(o_hi, np.float32), np.asarray(o, np.float32))


def _dot_operands(jaxpr, stack=""):
    """``(name stack, operand dtypes, result dtype)`` of every dot_general in ``jaxpr``."""
    out = []
    for eqn in jaxpr.eqns:
        here = stack + "/" + str(eqn.source_info.name_stack)
        if eqn.primitive.name == "dot_general":
            out.append((here, tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _dot_operands(sub.jaxpr, here)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _dot_operands(sub, here)
    return out


@pytest.mark.parametrize("policy", ["fast", "auto"])
def test_fast_policy_rounds_the_recurrences(policy):
    """Under "fast" every product of F4, B2 and B0's F4 takes explicit bf16 operands with a
    float32 result (on every backend, as the GPU computes them), and B4 and the gate stay
    float32; under "auto" the recurrences keep float32 operands."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 64, 2, 16), jnp.bfloat16),) * 4 + (s((1, 64, 2), jnp.bfloat16),)
    pipe = kdax.KDAPipeline.reference().untiled().with_precision(policy)

    def loss(*a):
        o, _ = kdax.chunk_kda(*a, chunk_size=16, A_log=jnp.zeros(2), pipeline=pipe, **KIMI)
        return jnp.sum(o.astype(jnp.float32))

    dots = _dot_operands(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args).jaxpr)
    rec = [(ops, res) for st, ops, res in dots if _stage_of(st) in ("state", "dhu")]
    assert {_stage_of(st) for st, _, _ in dots} >= {"state", "dhu"}
    assert any("kdax_recompute" in st and _stage_of(st) == "state" for st, _, _ in dots)
    want = ("bfloat16", "bfloat16") if policy == "fast" else ("float32", "float32")
    assert rec and all(ops == want and res == "float32" for ops, res in rec), rec
    for st, ops, _ in dots:
        if _stage_of(st) in ("intra_bwd", "gate", "gate_bwd"):
            assert ops == ("float32", "float32"), (st, ops)


FAST_PIPES = {
    # (pipeline, rows of per-chunk resets): the reference stages with XLA:GPU's rounding
    # emulated (tests/_gpu_products.py) and the recurrences' explicit bf16 casts; the
    # Pallas (Triton, interpret mode) state kernels with their in-kernel bf16 dots.
    "reference": lambda: kdax.KDAPipeline.reference().untiled(),
    "pallas_state": lambda: eqx.tree_at(lambda p: (p.state, p.dhu), kdax.KDAPipeline.reference().untiled(),
                                        (PallasState(target="triton", interpret=True),
                                         PallasDhu(target="triton", interpret=True))),
    # Every stage a Pallas kernel (interpret mode), reading and writing the stored
    # intermediates in bf16 (the TPU state kernels refuse packed input: reference F4/B2).
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
    "pallas_tpu": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
}


@pytest.mark.parametrize("name,shape,packed", [
    ("reference", (1, 256, 2, 32, 32), False),
    ("reference", (1, 256, 2, 32, 32), True),
    ("pallas_state", (1, 256, 2, 32, 32), True),
    # FLA's benchmark sequence length, head size and chunk with one head (B, T, H, K, C):
    # minutes on the CPU; the float64 oracle's gradient keeps every step's state (16 heads:
    # 34 GB, more than a CI machine has).
    ("pallas_triton", (1, 256, 2, 32, 32), False),
    ("pallas_triton", (1, 256, 2, 32, 32), True),
    ("pallas_tpu", (1, 256, 2, 32, 32), False),
    pytest.param("reference", (1, 16384, 1, 128, 64), False, marks=pytest.mark.slow),
], ids=["reference", "reference_packed", "pallas_state_packed", "pallas_triton", "pallas_triton_packed", "pallas_tpu",
        "reference_T16384_K128"])
def test_fast_precision_policy_within_fla_tolerances(name, shape, packed):
    """``precision="fast"`` (bf16 operands in the recurrences too; Aqk, Akk, w, u, kg, h
    and v_new stored as bf16 arrays, ``test_fast_policy_stores_intermediates_in_bf16``): bf16 inputs with Kimi Linear's gates (softplus gate with A_log and dt_bias in
    the kernel, l2norm, beta sigmoid), 5% of the raw gates at 1e4 (log decays down to
    about -1e4 · e^A_log), against the float64 oracle within FLA's tolerances (o and ht
    5e-3, dq/dk/dv 8e-3, dg/dbeta/dA_log/ddt_bias 2e-2); dense and packed (cu_seqlens
    with sequence starts inside chunks' rows, an initial state per sequence). That the
    recurrences' products do round: ``test_fast_policy_rounds_the_recurrences``."""
    errs = _hard_gate_errors(FAST_PIPES[name]().with_precision("fast"), shape, packed)
    print(f"\nfast policy, {name}, packed={packed}: " + _listed(errs))
    _assert_within_fla(errs)


def _hard_gate_errors(pipe, shape, packed: bool, tf32: str = "truncate") -> dict:
    """rel-RMS errors against the float64 oracle of ``pipe`` (precision set) on bf16
    inputs of ``shape`` = (B, T, H, K, C) with Kimi Linear's gates, 5% of the raw gates at
    1e4 (log decays down to about -1e4 · e^A_log); ``packed``: cu_seqlens with sequence
    starts inside chunks' rows and an initial state per sequence. ``{"o", "ht", "dq",
    ..., "ddt_bias"}``; the products as the GPU computes them (``gpu_products(tf32)``)."""
    B, T, H, K, C = shape
    N = 3 if packed else B
    x64 = make_inputs(seed=5, B=B, T=T, H=H, K=K, V=K, N=N, gate="raw", A_log=True, dt_bias=True,
                      h0=packed, beta_raw=True)
    g = np.array(x64["g"])
    g[np.random.default_rng(6).uniform(size=g.shape) < 0.05] = 1e4
    x64["g"] = jnp.asarray(g)
    x = {n: a.astype(jnp.float32 if n in ("A_log", "dt_bias", "initial_state") else jnp.bfloat16)
         for n, a in x64.items()}
    xr = {n: a.astype(jnp.float64) for n, a in x.items()}
    opts = dict(chunk_size=C, output_final_state=True, **KIMI)
    if packed:
        opts["cu_seqlens"] = jnp.asarray([0, 37, 37 + T // 2, T], jnp.int32)
    fn = lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw)  # noqa: E731
    o_s, ht_s = output_shapes(oracle_kda, xr, opts)
    do = jnp.asarray(np.random.default_rng(1).normal(size=o_s.shape), jnp.float32)
    dht = jnp.asarray(np.random.default_rng(2).normal(size=ht_s.shape), jnp.float32)
    with gpu_products(tf32):
        o, ht, grads = outputs_and_grads(fn, x, opts, do, dht)
    o_ref, ht_ref, want = outputs_and_grads(oracle_kda, xr, opts, do.astype(jnp.float64), dht.astype(jnp.float64))
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    # (every error measured before any is asserted, and printed: benchmarks/NOTES.md)
    errs = {"o": rel_rms(o, o_ref), "ht": rel_rms(ht, ht_ref)}
    errs.update({"d" + n: rel_rms(gr, want[n]) for n, gr in grads.items()})
    return errs


def _listed(errs: dict) -> str:
    return ", ".join(f"{n} {e:.2e}" for n, e in errs.items())


def _assert_within_fla(errs: dict):
    """Every error within FLA's tolerance (o and ht 5e-3, dq/dk/dv 8e-3, dg/dbeta/dA_log/ddt_bias 2e-2)."""
    tol = lambda n: FLA_TOL.get(n[1:] if n.startswith("d") else n, FLA_TOL["o"])  # noqa: E731  (dq: q's)
    over = {n: (e, tol(n)) for n, e in errs.items() if not e <= tol(n)}  # (NaN: over)
    assert not over, f"over FLA's tolerances (error, tolerance): {over}"


def candidate(b4_f32_dot: str):
    """The GPU candidate (``benchmarks/gpu_cost_model.py``'s ``CANDIDATE``) as Triton
    stages in interpret mode: precision "fast", every stage's Triton tuning ``num_warps=8,
    num_stages=2, f32_dot="tf32x3"`` but B4's ``f32_dot``, ``b4_f32_dot``; its float32
    products as the GPU runs them (``tuned_interpret``) under ``gpu_products``."""
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True).with_precision("fast")
    tuned = {}
    for f in dataclasses.fields(pipe):
        s = getattr(pipe, f.name)
        if isinstance(s, PallasTarget):
            f32 = b4_f32_dot if isinstance(s, PallasIntraBackward) else "tf32x3"
            tuned[f.name] = dataclasses.replace(s, num_warps=8, num_stages=2, f32_dot=f32, tuned_interpret=True)
    return dataclasses.replace(pipe, **tuned)


# Plain TF32 in B4 (one product a level, as FLA runs its float32 tl.dot) was past FLA's
# dA_log tolerance at the hard gates until B5 set dg = 0 where the activated decay is below
# the floor (b87161d): the pairs after a -1e4 gate cancel in dg at that token in exact
# arithmetic, their TF32 rounding did not, and dA_log weighed that token's dg by its gate,
# ~1e4 e^A_log (dense 2.43, packed 0.40). With dg = 0 there: dense 5.0e-3, packed 9.7e-4
# (TF32x3 5.3e-3 and 8.8e-4). benchmarks/NOTES.md, "Session 18: plain TF32 in B4".
@pytest.mark.parametrize("b4,packed", [("tf32x3", False), ("tf32x3", True), ("tf32", False), ("tf32", True)],
                         ids=["tf32x3", "tf32x3_packed", "plain_tf32_b4", "plain_tf32_b4_packed"])
def test_candidate_within_fla_tolerances(b4, packed):
    """The all-Triton GPU candidate (``candidate``: every float32 product TF32x3, the
    "fast" policy's bf16 products and storage) with B4's halving-level products as
    ``b4`` (``"tf32"``: one TF32 product a level, as FLA's ``chunk_kda_bwd_intra`` runs
    its float32 ``tl.dot``): the kernels traced with their tuning in interpret mode and
    every product's operands rounded as on sm_90 (TF32 truncated, TF32x3's big parts
    rounded, ``tests/_gpu_products.py``), bf16 inputs with Kimi Linear's options, 5% of the
    gates at -1e4, FLA's chunk 64, dense and packed: within FLA's tolerances against the
    float64 oracle, with TF32x3 in B4 and with plain TF32 (the comment above). That the
    emulation does round B4's products: ``test_tf32_emulation_rounds_b4``."""
    errs = _hard_gate_errors(candidate(b4), (1, 256, 2, 32, 64), packed)
    print(f"\ncandidate, B4 {b4}, packed={packed}: " + _listed(errs))
    _assert_within_fla(errs)


def test_fast_inverse_takes_plain_tf32():
    """F2's ``(I + L)^-1`` under the "fast" policy with the candidate's tuning: one TF32
    product a step (``doubling_unit_lower_inverse``'s ``plain_tf32``, as FLA's float32
    ``tl.dot``): its Akk is off the same stage with IEEE float32 products (the same bf16
    scores, an exact inverse) by TF32's rounding (rel-RMS between 1e-6 and 1e-3), and Aqk,
    which the inverse does not touch, is equal; under "highest" the same tuning keeps
    TF32x3 (within 1e-6 of the float64 stage). The candidate stays within FLA's
    tolerances with it: ``test_candidate_within_fla_tolerances``."""
    from kdax.pallas import PallasIntra

    from .pallas.test_stages import _x

    x = _x(jnp.float32, 64, 32, 32)
    args = (x["scale"], x["q"], x["k"], x["beta"], x["G"])
    want = PallasIntra(target="triton", interpret=True)(*jax.tree.map(
        lambda a: a.astype(jnp.float64) if isinstance(a, jax.Array) else a, args))
    stage = lambda f32: PallasIntra(target="triton", interpret=True, num_warps=8, f32_dot=f32,  # noqa: E731
                                    tuned_interpret=True)
    with gpu_products():
        plain, exact = stage("tf32x3")(*args, precision="fast"), stage("ieee")(*args, precision="fast")
        x3 = stage("tf32x3")(*args, precision="highest")
    e_plain, e_x3 = rel_rms(plain.Akk, exact.Akk), rel_rms(x3.Akk, want.Akk)
    print(f"\nF2's Akk under fast, plain TF32 inverse against an exact one: {e_plain:.1e}; "
          f"highest (TF32x3) against float64: {e_x3:.1e}")
    assert 1e-6 <= e_plain <= 1e-3 and e_x3 <= 1e-6, (e_plain, e_x3)
    np.testing.assert_array_equal(np.asarray(plain.Aqk), np.asarray(exact.Aqk))


def test_tf32_emulation_rounds_b4():
    """Triton B4 in interpret mode with its tuning (``tuned_interpret``) under the
    GPU's product emulation (``gpu_products``), float32, gates down to -1000, C = 64, K =
    128 (two 64-column programs a chunk under "tf32", four of 32 under "tf32x3"):
    "tf32x3" stays within 1e-6 of the float64 stage on the same values (measured 3e-8 to
    8e-8), while "tf32" (operands truncated to TF32) is off by TF32's rounding: rel-RMS
    between 1e-5 and 1e-3 in every gradient, over 100x tf32x3's (measured 1.3e-5 to
    1.2e-4); without the hook the tuning is unused ("tf32" as float32, within 1e-6)."""
    from .pallas.test_stages import _b4_args

    args = _b4_args(jnp.float32, 64, 128, seed=64)
    args64 = jax.tree.map(lambda a: a.astype(jnp.float64) if isinstance(a, jax.Array) else a, args)  # (exactly)
    want = PallasIntraBackward(target="triton", interpret=True)(*args64)
    def stage(f32, tuned=True):
        stage = PallasIntraBackward(target="triton", interpret=True, block_k=64, f32_dot=f32, tuned_interpret=tuned)
        return stage(*args)
    with gpu_products():
        plain, x3, tf32 = stage("tf32", tuned=False), stage("tf32x3"), stage("tf32")
    err = lambda got, f: rel_rms(getattr(got, f), getattr(want, f))  # noqa: E731
    errs = {f: (err(plain, f), err(x3, f), err(tf32, f)) for f in ("dq", "dk", "dbeta", "dG")}
    print("\nB4 rel-RMS against float64 (no hook, tf32x3, tf32): "
          + ", ".join(f"{f} " + " ".join(f"{e:.1e}" for e in es) for f, es in errs.items()))
    for f, (e_plain, e_x3, e_tf32) in errs.items():
        assert e_plain <= 1e-6 and e_x3 <= 1e-6, (f, e_plain, e_x3)
        assert 1e-5 <= e_tf32 <= 1e-3 and e_tf32 > 100 * e_x3, (f, e_x3, e_tf32)


def _pallas_outputs(jaxpr):
    """``(kernel name, output dtypes)`` of every ``pallas_call`` in ``jaxpr`` and its
    sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append((str(eqn.params["name"]), tuple(str(v.aval.dtype) for v in eqn.outvars)))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _pallas_outputs(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _pallas_outputs(sub)
    return out


# What each kernel writes under "fast" (bf16: the intermediates of _precision.STORED).
_KERNEL_OUTPUTS = {
    "kdax_PallasIntra_kernel": ("bfloat16", "bfloat16"),  # Aqk, Akk
    "kdax_PallasWY_kernel": ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),  # w, u, qg, kg
    "kdax_PallasState_kernel": ("bfloat16", "bfloat16", "float32"),  # h, v_new, final
}


@pytest.mark.parametrize("policy", ["fast", "auto", "highest"])
@pytest.mark.parametrize("name", ["reference", "pallas_triton", "pallas_tpu"])
def test_fast_policy_stores_intermediates_in_bf16(name, policy):
    """bf16 inputs with Kimi Linear's options: under "fast" the forward cache holds Aqk,
    Akk, w, u, qg, kg, h and v_new as bf16 arrays (FLA's storage; G and the final state
    float32), B0 rebuilds them to the bit, B2's dh (the state gradient at each chunk's end)
    reaches B3 in bf16, and the Pallas kernels write them in bf16 themselves (their
    ``pallas_call`` outputs, no float32 copy converted after); every gradient the caller
    gets is float32; under "auto" and "highest" every intermediate stays float32. G is
    float32 alone under "fast" (no ``G_lo``, FLA's cumsum: ``keeps_low_part``), ``G +
    G_lo`` otherwise."""
    r = np.random.default_rng(4)
    B, T, H, K, C = 1, 64, 2, 16, 16
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.bfloat16)
    args = (f(B, T, H, K), f(B, T, H, K), f(B, T, H, K), f(B, T, H, K), f(B, T, H))
    opts = dict(chunk_size=C, output_final_state=True, A_log=jnp.zeros(H, jnp.float32), **KIMI)
    pipe = FAST_PIPES[name]().with_precision(policy)
    o, ht, res = pipe.forward(*args, **opts)
    want = jnp.bfloat16 if policy == "fast" else jnp.float32
    c = res.cache
    for n in sorted(_precision.STORED - {"dh"}):
        assert getattr(c, n).dtype == want, (n, getattr(c, n).dtype)
    assert c.G.dtype == ht.dtype == jnp.float32 and o.dtype == jnp.bfloat16
    G_lo = res.act.G_lo
    assert G_lo is None if policy == "fast" else (G_lo.dtype == jnp.float32 and G_lo.shape == c.G.shape)
    rebuilt = pipe.resolved(jnp.bfloat16).recomputed(eqx.tree_at(lambda x: x.cache, res, None, is_leaf=lambda x: x is None))
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(c)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    do, dht = jnp.ones(o.shape, jnp.float32), jnp.ones(ht.shape, jnp.float32)
    grads = pipe.backward(res, do, dht)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    dh = kdax.stage_inputs(pipe, *args, **opts)["wy_dqkg"][10]  # (B3's dh: a float32 copy where B3 wants one)
    assert (dh.dtype == want) if isinstance(pipe.wy_dqkg, PallasTarget) else dh.dtype == jnp.float32
    dh32 = np.asarray(dh, np.float32)
    assert np.array_equal(dh32, np.asarray(jnp.asarray(dh32).astype(jnp.bfloat16), np.float32)) == (policy == "fast")
    if name == "reference":
        return
    bwd = _pallas_outputs(jax.make_jaxpr(lambda r: pipe.backward(r, do, dht))(res).jaxpr)
    assert ("kdax_PallasDhu_kernel", (str(jnp.dtype(want)), "float32", "float32")) in bwd, bwd
    kernels = _pallas_outputs(jax.make_jaxpr(lambda *a: pipe.forward(*a, **opts)[:2])(*args).jaxpr)
    seen = {n for n, _ in kernels}
    assert set(_KERNEL_OUTPUTS) <= seen, seen
    for n, dts in kernels:
        if n in _KERNEL_OUTPUTS:
            assert dts == (_KERNEL_OUTPUTS[n] if policy == "fast" else ("float32",) * len(dts)), (n, dts)


class _OwnProductOutput(AbstractOutput):
    """KDA's F5 composed, plus a product of its own (a user's stage). It declares
    ``precision`` and passes the policy it is told on to the stage it composes."""

    math: ClassVar = "kda-plus-own-product"
    accepts: ClassVar = frozenset({"precision"})

    def __call__(self, scale, qg, h, Aqk, v_new, precision="highest"):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new, precision=precision)
        with jax.named_scope("user_own_product"):
            return o + 1e-3 * jnp.einsum("rhncv,rhnvw->rhncw", o, h[..., : o.shape[-1], :])


class _UntoldOutput(AbstractOutput):
    """The same without declaring ``precision``: the stage it composes is told nothing."""

    math: ClassVar = "kda-plus-own-product"

    def __call__(self, scale, qg, h, Aqk, v_new):
        return _OwnProductOutput()(scale, qg, h, Aqk, v_new)


def _dot_precisions_by_scope(jaxpr):
    """``(where: "own" inside the user's own named scope, "output" elsewhere in F5, else
    "other"; precision)`` of every dot_general."""
    def where(e):
        stack = str(e.source_info.name_stack)
        return "own" if "user_own_product" in stack else ("output" if "kdax_output" in stack else "other")

    return [(where(e), e.params["precision"]) for e in dot_eqns(jaxpr)]


@pytest.mark.parametrize("told", [True, False], ids=["told", "untold"])
@pytest.mark.parametrize("policy", ["highest", "bfloat16"])
def test_policy_reaches_kdax_products_only(policy, told):
    """The precision policy is kdax's choice for kdax's products (issue 38, item 4), passed
    as an argument (issue 52): a user's stage keeps the caller's matmul precision for its
    own products; the reference stage it composes follows the policy when the user's stage
    declares ``precision`` and passes it on, and runs at HIGHEST when it is told nothing;
    every other stage follows the policy."""
    stage = _OwnProductOutput() if told else _UntoldOutput()
    pipe = dataclasses.replace(kdax.KDAPipeline.reference().untiled(), output=stage, precision=policy)
    s = jax.ShapeDtypeStruct
    args = (s((1, 32, 2, 16), jnp.float32),) * 4 + (s((1, 32, 2), jnp.float32),)
    fn = lambda *a: kdax.chunk_kda(*a, chunk_size=16, pipeline=pipe)[0]
    dots = _dot_precisions_by_scope(jax.make_jaxpr(fn)(*args).jaxpr)
    own = [p for w, p in dots if w == "own"]
    composed = [p for w, p in dots if w == "output"]
    other = [p for w, p in dots if w == "other"]
    assert own and composed and other
    assert all(p is None or p == (jax.lax.Precision.DEFAULT,) * 2 for p in own), own
    rounded = policy == "bfloat16" and told
    assert all((p == FAST) if rounded else (p == HIGHEST) for p in composed), composed
    if policy == "highest":
        assert all(p == HIGHEST for p in other), other
    else:  # the other fast stages' products take the policy's algorithm, the rest HIGHEST
        assert FAST in other and all(p in (FAST, HIGHEST) for p in other), other
    with jax.default_matmul_precision("highest"):  # the caller's choice reaches the user's products
        dots = _dot_precisions_by_scope(jax.make_jaxpr(fn)(*args).jaxpr)
    assert all(p == HIGHEST for w, p in dots if w == "own")


@pytest.mark.parametrize("name", ["reference", "pallas_triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_every_product_of_the_step_says_its_precision(name, dtype):
    """The step on packed sequences sharing chunks with initial and final states (the
    golden ``varlen_basic``'s shapes): every float32 product asks for HIGHEST, those
    between the stages (the entering and final states' products) too, as JAX's default
    is TF32 on a GPU (that golden case 7.5e-5 off in float32 on an H200, session 66); no
    product of float64 operands asks for a float32 result (cuBLAS has none: the same
    run's Pallas B3 failed in float64)."""
    inputs, options, *_ = load_golden("varlen_basic")
    args = {n: jax.ShapeDtypeStruct(np.shape(a), dtype) for n, a in inputs.items()}
    pipe = PIPES[name]()

    def loss(arrays):
        pos, kw = split_args(arrays)
        o, ht = kdax.chunk_kda(*pos, **kw, **options, pipeline=pipe)
        return jnp.sum(o) + jnp.sum(ht)

    eqns = dot_eqns(jax.make_jaxpr(jax.grad(loss))(args).jaxpr)
    floats = [e for e in eqns if jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
    assert len(floats) > 20
    for e in floats:
        where = str(e.source_info.name_stack)
        if dtype == jnp.float32:
            assert e.params["precision"] == HIGHEST, (where, e.params["precision"])
        else:
            assert e.outvars[0].aval.dtype == jnp.float64, (where, e.outvars[0].aval.dtype)
