import os

# 8 simulated CPU devices for the sharding and sequence-parallel tests (tests/parallel);
# set before jax is imported, harmless to single-device tests (they use device 0).
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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    # XLA:CPU maps each compiled program's code into memory; a worker that keeps every
    # program of the suite reaches the kernel's limit on mappings (vm.max_map_count,
    # 65530) two thirds through a run and dies in the next compile (a segfault or abort).
    # A test module's programs are its own: drop them when it ends.
    yield
    jax.clear_caches()


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # (not Linux)
        return 0


@pytest.fixture(autouse=True)
def _release_near_the_mapping_limit():
    # One module can reach the limit too: the slow tests of tests/test_testing.py took a
    # process from 18k to 64k mappings in three minutes, then XLA aborted in a compile.
    yield
    if _mappings() > 40000:
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    # kdax warns once per process for each fallback (kdax._runner.routes.warn_once); a test
    # that expects the warning must not depend on which test ran before it in its worker.
    from kdax._runner import routes

    routes.warn_once.cache_clear()
    yield


# The default run's fast core keeps the cases named here of each sweep (substrings of the
# case id); ``pytest -m slow`` runs the others, with the tests marked slow in their files.
# Chosen from a full run's durations on the 2-core AVX2 development machine (session 33:
# 36 minutes there, 26 after a first cut, against a 25-minute budget): what moves to the
# slow run is the same check at another dtype, layout, size or stage of a family that stays
# in the core.
CORE_CASES = {
    # the 16-row kernels: their golden cases, gradients and non-finite reach stay in the core
    "tests/pallas/test_intra_rows.py::test_rows16_equals_the_reference": (),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_equals_the_reference": (),
    "tests/pallas/test_intra_rows.py::test_preset_pipeline_golden_float64": ("varlen_basic",),
    "tests/pallas/test_intra_rows.py::test_rows16_causal_to_the_bit": ("21",),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_causal_to_the_bit": ("21",),
    "tests/pallas/test_intra_rows.py::test_rows16_fits_four_ctas_an_sm": ("packed",),
    "tests/pallas/test_intra_rows_f2.py::test_rows16_fits_several_ctas_an_sm": ("packed",),
    # every option on one Pallas pipeline at least
    "tests/pallas/test_pipeline.py::test_options_against_oracle": (
        "pallas_tpu-c16_T37", "pallas_tpu-softplus_gate_nobias", "pallas_tpu-lower_bound_noA",
        "pallas_tpu-varlen_gate_c64", "pallas_triton-c32_gva", "pallas_triton-lower_bound_gate",
        "pallas_triton-l2norm_sigmoid", "pallas_triton-state_v_first", "pallas_triton-varlen", "mixed-c128_strong",
        "mixed-neg_eigval", "mixed-no_h0", "mixed-disable_recompute"),
    "tests/pallas/test_stages.py::test_gate_stages": ("float64", "triton-interpret"),
    "tests/pallas/test_stages.py::test_gate_stages_with_resets": ("float64", "triton-interpret"),
    "tests/pallas/test_stages.py::test_triton_intra_backward_tile_products": ("f64",),
    "tests/pallas/test_stages.py::test_triton_chunk_kernels_over_column_blocks": ("float64",),
    "tests/pallas/test_stages.py::test_forward_stages": ("-32-12-6-", "-64-16-16-"),
    "tests/pallas/test_stages.py::test_backward_stages": ("-32-12-6-", "-64-16-16-"),
    "tests/pallas/test_stages.py::test_wy_stages_with_resets": ("triton-interpret", "G_lo", "device"),
    "tests/pallas/test_final_grads.py::test_triton_isolation_in_stages_exact": ("f32",),
    "tests/pallas/test_triton_registers.py::test_gate_kernels_fit_in_registers": ("8-reset",),
    "tests/pallas/test_triton_registers.py::test_chunk_kernels_fit_in_registers": ("bfloat16-packed",),
    "tests/test_precision.py::test_candidate_within_fla_tolerances": ("tf32x3_packed",),
    "tests/test_precision.py::test_fast_policy_stores_intermediates_in_bf16": ("-fast",),
    "tests/test_derived.py::test_reference_stage_vjp_through_its_loop": ("packed", "gate-in-kernel"),
    "tests/test_capabilities.py::test_false_reset_of_kda_stage_changes_no_number": ("no-h0",),
    "tests/test_capabilities.py::test_false_reset_of_kda_stage_is_reported": ("intra]", "gate"),
    # every family's check but WY's (B3 and B0 are the WY family's backward and recompute)
    "tests/test_testing.py::test_reference_stages_pass": ("gate", "intra", "state", "output", "dhu"),
    "tests/test_testing.py::test_pallas_triton_stages_pass": ("state",),
    "tests/pallas/test_pipeline.py::test_golden": ("float64", "pallas_triton"),
}


@pytest.hookimpl(tryfirst=True)  # (before -m deselects by mark)
def pytest_collection_modifyitems(config, items):
    kept = {}
    for item in items:
        name, _, case = item.nodeid.partition("[")
        core = CORE_CASES.get(name)
        if core is None:
            continue
        keep = any(c in case for c in core)
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
