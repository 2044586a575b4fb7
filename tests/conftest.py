import os

# 8 simulated CPU devices for the sharding and sequence-parallel tests (tests/parallel);
# set before jax is imported. Single-device tests use device 0, but chunk_kda takes other
# paths than on one CPU device (its non-finite tests, its in-program input check):
# tests/test_one_device.py runs those in a one-device process against this one's numbers.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles hundreds of small programs, and LLVM's optimisation of each took about
# half of XLA:CPU's compile time (a chunk_kda gradient: 6.6 s -> 3.5 s) for nothing at test
# sizes. XLA's own HLO passes still run and floating-point semantics are unchanged (no
# fast-math at any level). Set the level in XLA_FLAGS to override.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " --xla_backend_optimization_level=0").strip()

# XLA:CPU's newer fusion emitters took half of the compile time of a typical test (a Pallas
# pipeline's gradient in interpret mode: compiles 11.5 s -> 5.7 s; a reference one's test
# 23 s -> 16 s; the default suite 27:03 -> 19:59 on a 2-core machine); the older emitters
# compute the same floating-point operations.
# One LLVM module a program: at optimization level 0 XLA:CPU compiled the same fused
# computation with or without FMA contractions by which of its 32 module parts it landed in,
# so two programs that share a kernel (eager and jitted calls, checked and unchecked ones:
# tests/nn/test_decode_eager.py, tests/test_bench.py) rounded it differently
# (benchmarks/results/codegen_splits.txt); kdax.testing compiles its checks so too.
# Each flag is used only where this XLA knows it (a newer one may not: an unknown flag is
# fatal), probed once in a subprocess; xdist workers inherit the result.
for _FLAG in ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"):
    if _FLAG.split("=")[0][2:] in os.environ["XLA_FLAGS"]:
        continue
    import subprocess
    import sys

    _env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {_FLAG}", JAX_PLATFORMS="cpu")
    try:
        _probe = subprocess.run([sys.executable, "-c", "import jax.numpy as j; print(float(j.ones(2).sum()))"],
                                env=_env, capture_output=True, text=True, timeout=120)
        if _probe.returncode == 0 and _probe.stdout.strip() == "2.0":
            os.environ["XLA_FLAGS"] = _env["XLA_FLAGS"]
    except (OSError, subprocess.SubprocessError):
        pass  # without the flag: slower compiles (the first), or the pairs above may differ (the second)

import gc  # noqa: E402

# Python's cyclic garbage collector at its default thresholds (700, 10, 10) ran a full
# collection every few seconds of tracing (JAX allocates millions of small objects), each
# walking every live object of the worker (its compiled programs and their jaxprs, ~0.25 s
# each): 7.1 of 83 s in tests/test_capabilities.py, 2.4 of 63 s in the Pallas stage tests.
# At 10,000 allocations a young collection: 1.3 s and 0.2 s, the same peak memory (the
# cycles are still collected, in fewer passes).
gc.set_threshold(10_000, 10, 10)

import jax  # noqa: E402

import kdax  # noqa: E402,F401  (before any computation: XLA:CPU's YNNPACK fusions off, kdax._platform)

# float64 oracles everywhere; float32 tests build float32 arrays explicitly.
jax.config.update("jax_enable_x64", True)


import pytest  # noqa: E402

from kdax.testing._runs import release_compiled_programs, release_near_the_mapping_limit  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    # XLA:CPU maps each compiled program's code into memory; a worker that keeps every
    # program of the suite reaches the kernel's limit on mappings (vm.max_map_count,
    # 65530) two thirds through a run and dies in the next compile (a segfault or abort).
    # A test module's programs are its own: drop them when it ends (kdax.testing's too).
    yield
    release_compiled_programs()


@pytest.fixture(autouse=True)
def _release_near_the_mapping_limit():
    # One module can reach the limit too: the slow tests of tests/test_testing.py took a
    # process from 18k to 64k mappings in three minutes, then XLA aborted in a compile.
    yield
    release_near_the_mapping_limit()


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    # kdax warns once per process for each fallback (kdax._runner.routes.warn_once); a test
    # that expects the warning must not depend on which test ran before it in its worker.
    from kdax._runner import routes

    routes.warn_once.cache_clear()
    yield


# The default run's fast core keeps the cases named here of each sweep (substrings of
# "[" + the case id: "[1-chunk]" is that case alone); ``pytest -m slow`` runs the others,
# with the tests marked slow in their files.
# What moves to the slow run is the same check at another dtype, layout, size, backend or
# stage of a family that stays in the core. First cut (session 33, the 2-core AVX2 machine:
# 36 minutes there, 26 after it). Second cut (session 43: CI read 2131 s against a 25-minute
# budget; 35:54 -> 26:11 here, with eight single tests marked slow in their files): every
# kdax line the default run executed is still executed by the tests kept
# (benchmarks/core_coverage.py).
CORE_CASES = {
    # the 16-row kernels: their golden cases, gradients and non-finite reach stay in the core
    "tests/pallas/test_intra_rows.py::test_rows16_equals_the_reference": (),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_equals_the_reference": (),
    # (the "candidate-rows16-f2" preset runs the other's B4 kernel, and its F2 on 16 rows too)
    "tests/pallas/test_intra_rows.py::test_preset_pipeline_golden_float64": ("varlen_basic-candidate-rows16-f2]",),
    "tests/pallas/test_intra_rows.py::test_rows16_causal_to_the_bit": ("21",),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_causal_to_the_bit": ("21",),
    "tests/pallas/test_intra_rows.py::test_rows16_fits_four_ctas_an_sm": ("packed",),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_fits_several_ctas_an_sm": ("packed",),
    "tests/pallas/test_stages.py::test_gate_stages": ("float64", "triton-interpret"),
    "tests/pallas/test_stages.py::test_gate_stages_with_resets": ("float64", "triton-interpret"),
    "tests/pallas/test_stages.py::test_triton_intra_backward_tile_products": ("f64",),
    "tests/pallas/test_stages.py::test_triton_chunk_kernels_over_column_blocks": ("float64",),
    "tests/pallas/test_triton_registers.py::test_gate_kernels_fit_in_registers": ("8-reset",),
    "tests/pallas/test_triton_registers.py::test_chunk_kernels_fit_in_registers": ("bfloat16-packed",),
    "tests/test_precision.py::test_candidate_within_fla_tolerances": ("tf32x3_packed",),
    "tests/test_capabilities.py::test_false_reset_of_kda_stage_changes_no_number": (
        "no-h0-intra]", "no-h0-wy]", "no-h0-intra_bwd]"),
    "tests/test_testing.py::test_pallas_triton_stages_pass": ("state",),
    # (the second cut, session 43)
    "tests/nn/test_pretrained.py::test_kimi_k3_layers_equal_the_published_formula": ("-5.0-False]", "None-True]"),
    "tests/numerics/test_chunk_loops.py::test_over_chunks_vjp": (
        "nc-slices-False-lead0-4]", "nc-slices-False-lead2-1]", "nc-slices-True-lead0-4]", "nc-slices-True-lead1-6]",
        "nc-slices-True-lead2-1]", "flat-groups-False-lead0-4]", "flat-groups-False-lead2-1]",
        "flat-groups-True-lead0-4]", "flat-groups-True-lead1-6]", "flat-groups-True-lead2-1]"),
    "tests/numerics/test_chunk_loops.py::test_unit_lower_inverse": ("16]", "64]"),
    "tests/numerics/test_chunk_loops.py::test_unit_lower_inverse_vjp": ("64]",),
    "tests/pallas/test_final_grads.py::test_triton_isolation_in_stages_exact": ("both-f32]",),
    "tests/pallas/test_intra_rows.py::test_preset_pipeline_gradients_causal_to_the_bit": (
        "21-candidate-rows16-f2]", "48-candidate-rows16]"),
    "tests/pallas/test_intra_rows.py::test_preset_pipeline_shared_chunks_against_oracle": ("candidate-rows16-f2]",),
    "tests/pallas/test_intra_rows.py::test_rows16_nonfinite_reach": ("47-G]", "3-beta]"),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_nonfinite_reach": ("48-G]", "47-G]", "3-beta]"),
    "tests/pallas/test_packed_short.py::test_shared_chunks_exact": ("pallas_triton]",),
    "tests/pallas/test_pipeline.py::test_golden": ("pallas_triton-varlen_basic-float64-1e-10-1e-10]",),
    "tests/pallas/test_pipeline.py::test_lowering": ("tpu-K128-varlen]", "triton-K128-varlen]"),
    # (bfloat16 inputs stay: the same float32 kernels after the same cast; float16 on the reference pipeline)
    "tests/pallas/test_pipeline.py::test_low_precision_inputs": ("bfloat16-pallas_triton]",),
    # every option on one Pallas pipeline at least
    "tests/pallas/test_pipeline.py::test_options_against_oracle": (
        "pallas_tpu-c16_T37]", "pallas_tpu-softplus_gate_nobias]", "pallas_triton-c32_gva]",
        "pallas_triton-lower_bound_gate]", "pallas_triton-l2norm_sigmoid]", "pallas_triton-state_v_first]",
        "pallas_triton-varlen]", "mixed-c128_strong]", "mixed-neg_eigval]", "mixed-no_h0]", "mixed-disable_recompute]"),
    "tests/pallas/test_stages.py::test_backward_stages": (
        "float64-1e-12-32-12-6-tpu-interpret]", "float64-1e-12-32-12-6-triton-interpret]",
        "float64-1e-12-32-12-6-device]", "float32-1e-05-64-16-16-triton-interpret]", "float32-1e-05-64-16-16-device]"),
    "tests/pallas/test_stages.py::test_forward_stages": (
        "float64-1e-12-32-12-6-tpu-interpret]", "float64-1e-12-32-12-6-triton-interpret]",
        "float64-1e-12-32-12-6-device]", "float32-1e-05-64-16-16-triton-interpret]", "float32-1e-05-64-16-16-device]"),
    "tests/pallas/test_stages.py::test_gate_kernels_read_the_callers_layout": (
        "triton-interpret-float64]", "device-float64]", "device-bfloat16]", "tpu-interpret-bfloat16]"),
    "tests/pallas/test_stages.py::test_state_kernels_k_tiles": ("packed-f64]",),
    "tests/pallas/test_stages.py::test_state_kernels_round_operands_in_kernel": ("packed]",),
    "tests/pallas/test_stages.py::test_triton_gate_kernels_over_column_blocks": (
        "float64-1e-12-softplus_l2_sigmoid]", "float64-1e-12-lower_bound_neg]"),
    "tests/pallas/test_stages.py::test_triton_intra_tile_products": ("float64-1e-12]",),
    "tests/pallas/test_stages.py::test_values_read_from_the_callers_layout": (
        "triton-interpret-float64]", "device-float64]", "device-bfloat16]", "tpu-interpret-bfloat16]"),
    "tests/pallas/test_stages.py::test_wy_stages_with_resets": (
        "f64-triton-interpret]", "f64-device]", "f32-device]", "f32-G_lo-tpu-interpret]", "f32-G_lo-triton-interpret]",
        "f32-G_lo-device]"),
    "tests/pallas/test_triton_glue.py::test_state_kernels_read_last_rows_of_G": (
        "dense-16]", "packed-None]", "packed-16]"),
    "tests/pallas/test_triton_registers.py::test_state_kernels_hold_the_state_on_chip": (
        "w8_s2_k64-packed]", "w4_s3_k64_v32-dense]", "w8_s2_k64-dense_tokens]", "w8_s2_k64-packed_start]"),
    "tests/pallas/test_triton_shared_memory.py::test_G_lo_kernels_fit_hopper_shared_memory": (
        "intra]", "wy]", "wy_dqkg]", "intra_bwd]"),
    "tests/pallas/test_triton_shared_memory.py::test_state_kernels_fit_hopper_shared_memory": ("fast_w8_s2]",),
    "tests/parallel/test_custom_stages.py::test_sequence_parallel_custom_stages_exact": (
        "bias F5 with transposes-packed]", "undeclared F1 wrapper-dense]", "undeclared F5 wrapper-packed]"),
    "tests/parallel/test_eager_shard_map.py::test_apply_layer_eagerly_equals_one_device": ("AxisType.Explicit]",),
    "tests/parallel/test_isolation.py::test_overflowing_sequence_reaches_no_other_across_devices": (
        "forward-gather]", "backward-device-2-doubling]", "backward-device-3-gather]"),
    "tests/parallel/test_shard.py::test_head_sharded_grouped_values": (
        "chunk-1-mesh_shape0]", "recurrent-1-mesh_shape0]", "recurrent-2-mesh_shape1]"),
    "tests/parallel/test_shard.py::test_intermediate_states_keep_the_sharding": ("False]",),
    "tests/parallel/test_shard.py::test_shard_map": (
        "AxisType.Auto-recurrent]", "AxisType.Explicit-chunk]", "AxisType.Explicit-recurrent]"),
    "tests/parallel/test_stage_arrays.py::test_traced_array_pipeline_sequence_parallel": (
        "False-False]", "False-True]"),
    "tests/ref/test_chunk.py::test_naive_chunk_equals_recurrent": (
        "130-2-4-64-True]", "200-2-2-128-True]", "1-1-1-16-False]"),
    "tests/stages/test_intra.py::test_intra_backward_is_vjp": ("64-4-True-3-2]", "32-1-True-3-2]"),
    "tests/stages/test_intra.py::test_intra_forward": ("16-3-False-2-2]", "64-4-True-2-2]", "128-5-True-2-2]"),
    "tests/stages/test_intra.py::test_intra_vjp_is_the_formulas": ("16-3-True-G]", "16-3-True-G + G_lo]"),
    "tests/test_capabilities.py::test_false_reset_of_kda_stage_is_reported": ("gate]",),
    "tests/test_chunk_states.py::test_dense_start_states_are_the_recurrence": (
        "False-16-45-2-2]", "False-64-64-1-2]", "True-16-45-2-2]", "True-64-64-1-2]", "True-32-100-2-4]"),
    "tests/test_chunk_states.py::test_packed_start_states_in_flas_order": ("False]",),
    "tests/test_derived.py::test_modified_stage_gives_the_modified_algorithms_gradients": (
        "gate]", "intra]", "output]"),
    "tests/test_derived.py::test_output_alone_differs_keeps_the_hand_written_backward": (
        "dense, F1 too]", "packed, B2 by identity rows]"),
    "tests/test_derived.py::test_reference_stage_vjp_through_its_loop": (
        "gate-packed]", "intra-packed]", "wy-packed]", "state-packed]", "output-packed]"),
    "tests/test_fla_api.py::test_scale_any_real_number": (
        "[1-chunk]", "[1-recurrent]", "scale1-recurrent]", "scale2-recurrent]", "scale3-recurrent]", "scale4-chunk]",
        "scale4-recurrent]"),
    "tests/test_hard_decay.py::test_pallas": ("dense-inf-tpu]", "packed-first-token-inf-triton]"),
    "tests/test_hard_decay.py::test_reference": (
        "dense-inf-f32]", "dense-1e4-per-channel-f64]", "dense-100-f64]", "packed-first-token-inf-f32]"),
    "tests/test_hard_decay.py::test_segments": ("f64]",),
    "tests/test_hard_decay.py::test_sequence_parallel": ("f64]",),
    "tests/test_hardening.py::test_float32_extreme_gates_within_10x_recurrence": ("one_token-16]",),
    "tests/test_isolation.py::test_non_finite_final_state_cotangent_stays_in_its_sequence": ("initial-states]",),
    "tests/test_isolation.py::test_other_pipelines_exact_resets": ("pallas-cu]", "untiled-one_start]"),
    "tests/test_layout_goals.py::test_initial_state_walk": ("dense]",),
    "tests/test_packed_short.py::test_float32_sweep_random_packed_lengths": ("[l2norm]",),
    "tests/test_packed_short.py::test_hessian_vector_product_through_shared_chunks": ("final_states_loss]",),
    "tests/test_packed_short.py::test_initial_states_enter_shared_chunks": ("C64_in_kernel_gate]",),
    "tests/test_packed_short.py::test_loss_on_final_states_of_shared_chunks": ("64]",),
    "tests/test_pipeline.py::test_forward_causal_to_the_bit": ("[1]", "[23]", "[65]"),
    "tests/test_pipeline.py::test_golden": (
        "float64-1e-10-1e-10-dense_basic]", "float64-1e-10-1e-10-gate_softplus_l2]",
        "float64-1e-10-1e-10-varlen_basic]", "float32-1e-05-0.0001-varlen_basic]"),
    "tests/test_pipeline.py::test_gradients_causal_to_the_bit": ("9]", "47]"),
    "tests/test_pipeline.py::test_tiled_forward": ("dense_options-3]", "varlen-3]"),
    "tests/test_precision.py::test_fast_policy_stores_intermediates_in_bf16": ("pallas_tpu-fast]",),
    "tests/test_precision.py::test_fast_precision_policy_within_fla_tolerances": (
        "reference_packed]", "pallas_triton_packed]", "pallas_tpu]"),
    "tests/test_ragged.py::test_second_order_against_autodiff_of_the_loop": ("exact]",),
    # a forward family with an in-kernel option (F1), the inverse (F2), a backward recurrence (B2);
    # check_pipeline's test checks the whole reference pipeline
    "tests/test_testing.py::test_reference_stages_pass": ("gate]", "intra]", "dhu]"),
    "tests/test_tokens.py::test_views_stand_for_the_packed_inputs": (
        "False-False-float64-float64]", "True-True-float64-float64]", "True-True-float32-float32]",
        "True-True-bfloat16-float32]"),
}


@pytest.hookimpl(tryfirst=True)  # (before -m deselects by mark)
def pytest_collection_modifyitems(config, items):
    kept = {}
    for item in items:
        name, _, case = item.nodeid.partition("[")
        core = CORE_CASES.get(name)
        # (an accelerator's compiled cases, "pallas_device" where one is present, run whole:
        # they are what a device session's run is for; the cores name CPU cases)
        if core is None or "pallas_device" in case:
            continue
        keep = any(c in "[" + case for c in core)
        kept[name] = kept.get(name, False) or keep
        if not keep:
            item.add_marker(pytest.mark.slow)
    # A renamed test or case id must not empty a sweep's core, nor leave a stale entry.
    modules = {item.nodeid.split("::")[0]: item.module for item in items if hasattr(item, "module")}
    for name, core in CORE_CASES.items():
        path, _, function = name.partition("::")
        if path in modules and not hasattr(modules[path], function):
            raise pytest.UsageError(f"tests/conftest.py CORE_CASES: no test {name}")
        if core and kept.get(name) is False:
            raise pytest.UsageError(f"tests/conftest.py CORE_CASES: {name} keeps none of its cases {core}")
