"""The benchmark harness runs end to end on a tiny shape (numbers are not asserted: speed
is measured by ``python -m kdax.bench``, never in tests)."""

import json
import os
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax import _platform
from kdax import bench
from kdax import stages as S
from kdax.bench._shape import flops_per_token_head
from kdax.bench._timing import _cpu, best_call
from kdax import chunk_kda as kdax_chunk


def test_bench_shape_rows_and_results(tmp_path):
    shape = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
    pipes = {"reference": bench.pipelines()["reference"]}
    lines = []
    rows = bench.with_ratios(bench.bench_shape(shape, 2, pipes, baselines=True, check=True, log=lines.append,
                                               slow_baselines=True, heavy_reps=1))
    got = {(r["name"], r["kind"]) for r in rows}
    assert got == {
        ("chunk_kda[reference]", "fwd"),
        ("chunk_kda[reference]", "fwd+bwd"),
        ("chunk_kda[reference, check_inputs=False]", "fwd"),  # the in-program check's cost
        ("chunk_kda[reference, check_inputs=False]", "fwd+bwd"),
        ("scan", "fwd"),
        ("scan", "fwd+bwd"),
        ("autodiff_chunk", "fwd+bwd"),
        ("fused_recurrent", "fwd"),
        ("plain_scan", "fwd"),
        ("plain_scan", "fwd+bwd"),
    }
    for r in rows:
        assert r["time_s"] > 0
        assert r["peak_bytes"] > 0  # XLA:CPU reports it; the training steps are lowered with their cotangent
        # the heavy baselines (gradients of the scans and of autodiff) at heavy_reps, the rest at reps
        assert r["reps"] == (1 if r["kind"] == "fwd+bwd" and not r["name"].startswith("chunk_kda") else 2)
    # progress: what compiles and what is timed, as it happens
    assert any("compiling chunk_kda[reference] fwd+bwd" in line for line in lines)
    assert any("float64 reference" in line for line in lines)
    assert any("timing plain_scan fwd+bwd (1 run after a warm-up)" in line for line in lines)
    ours = {r["kind"]: r for r in rows if r["name"] == "chunk_kda[reference]"}
    unchecked = {r["kind"]: r for r in rows if r["name"] == "chunk_kda[reference, check_inputs=False]"}
    for kind in ("fwd", "fwd+bwd"):  # the check adds an error branch, no arithmetic: the same numbers
        assert unchecked[kind]["max_err"] == ours[kind]["max_err"]
    # checked against the float64 recurrence in float32
    assert ours["fwd"]["max_err"] < 1e-4 and ours["fwd+bwd"]["max_err"] < 1e-3
    assert "vs_scan" in ours["fwd"] and "vs_autodiff_chunk" in ours["fwd+bwd"]
    assert "mem_vs_autodiff_chunk" in ours["fwd+bwd"]
    assert "vs_plain_scan" in ours["fwd"] and "vs_plain_scan" in ours["fwd+bwd"]
    assert ours["fwd+bwd"]["compile_s"] > 0 and ours["fwd"]["compile_s"] is None  # jit(grad(chunk_kda))
    assert ours["fwd+bwd"]["gflops"] > 0
    table = bench.format_table(rows, 100.0)
    assert "chunk_kda[reference]" in table and "fused_recurrent" in table and "compile s" in table
    written = bench.write_results(rows, dict(machine=bench.machine(), matmul_gflops=100.0, reps=2), str(tmp_path))
    with open(os.path.join(tmp_path, "results.json")) as f:
        assert len(json.load(f)["rows"]) == len(rows)
    assert os.path.exists(os.path.join(tmp_path, "results.csv"))
    try:
        import matplotlib  # noqa: F401  (installed by the [test] extra: the plots are written)
    except ImportError:
        return
    for png in ("time_fwd.png", "time_fwd_bwd.png"):
        assert os.path.join(str(tmp_path), png) in written and os.path.getsize(os.path.join(tmp_path, png)) > 0


def test_default_run_leaves_the_slow_baseline_out_and_says_so():
    shape = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
    w = bench.cotangent(shape)
    names = lambda paths: [(n, k) for n, k, _, _ in paths]
    default, slow = bench.baseline_paths(shape, w), bench.baseline_paths(shape, w, slow_baselines=True)
    assert ("scan", "fwd+bwd") not in names(default) and ("plain_scan", "fwd+bwd") in names(default)
    assert set(names(slow)) == set(names(default)) | {("scan", "fwd+bwd")}
    rows = [dict(T=40, name=n, kind=k, time_s=1.0, peak_bytes=1, reps=1, gflops=None, max_err=None)
            for n, k in names(default)]
    assert "run with --slow-baselines" in bench.format_table(bench.with_ratios(rows), 100.0)


def test_log_lines_say_what_and_when():
    import io

    out = io.StringIO()
    log = bench.Log(stream=out)
    log("compiling x")
    bench.Log(False, stream=out)("silent")
    line = out.getvalue()
    assert line.startswith("[") and " s] compiling x\n" in line and "silent" not in line


class _BrokenOutput(S.AbstractOutput):
    """An F5 that cannot run (as a kernel a backend cannot compile)."""

    def __call__(self, scale, qg, h, Aqk, v_new):
        raise RuntimeError("kernel does not compile here")


def test_failed_pipeline_is_reported_and_the_rest_runs(tmp_path):
    shape = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
    ref = bench.pipelines()["reference"]
    pipes = {"broken": eqx.tree_at(lambda p: p.output, ref, _BrokenOutput()), "reference": ref}
    rows = bench.bench_shape(shape, 1, pipes, baselines=False, check=True)
    failed = [r for r in rows if r["time_s"] is None]
    assert [(r["name"], r["kind"]) for r in failed] == [("chunk_kda[broken]", "failed")]
    assert "kernel does not compile here" in failed[0]["error"]
    assert {r["kind"] for r in rows if r["name"] == "chunk_kda[reference]"} == {"fwd", "fwd+bwd"}
    assert "FAILED" in bench.format_table(bench.with_ratios(rows), 100.0)
    bench.write_results(rows, dict(machine="test", matmul_gflops=100.0, reps=1), str(tmp_path))


def test_bench_stages_times_each_stage_alone():
    shape = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
    ref = bench.pipelines()["reference"]
    pipes = {"reference": ref, "broken": eqx.tree_at(lambda p: p.output, ref, _BrokenOutput())}
    seen = []
    rows = bench.bench_stages(shape, 1, pipes, on_row=seen.append)
    assert seen == rows and len(rows) == 2 * len(bench.STAGES)
    assert [r["stage"] for r in rows[::2]] == list(bench.STAGES)
    failed = [(r["stage"], r["pipeline"]) for r in rows if r["time_s"] is None]
    assert failed == [("output", "broken")]
    assert all(r["time_s"] > 0 for r in rows if r["time_s"] is not None)
    # XLA's counts for each stage's program: every matmul stage does FLOPs, every stage moves bytes
    ok = [r for r in rows if r["time_s"] is not None]
    assert all(r["bytes"] > 0 for r in ok) and all(r["flops"] > 0 for r in ok if r["stage"] in ("intra", "state"))
    # the FLOP model's count (as the main table's) for the matmul stages: XLA counts a loop's body once
    assert all((r["model_flops"] is None) == (r["stage"] in ("gate", "gate_bwd")) for r in rows)
    intra = next(r for r in rows if r["stage"] == "intra")
    assert intra["model_flops"] == flops_per_token_head(16, 8, 8)["F2_intra"] * 40 * 2
    glue = bench.bench_glue(shape, 1, rows)
    assert [r["stage"] for r in glue] == ["glue fwd", "glue bwd"] and all(r["time_s"] is not None for r in glue)
    line = bench.format_stage_row(ok[1], {}, 100.0)
    assert len(line.split()) >= 10  # time, ratio, GFLOP, GFLOP/s, %mm, MB, GB/s
    table = bench.format_stage_table(rows)
    assert "FAILED: RuntimeError: kernel does not compile here" in table and "ReferenceIntraBackward" in table


def test_time_rounds_interleaves():
    # Every round calls each function once, in order, after one warm-up call each.
    calls = []
    fs = [lambda x, i=i: (calls.append(i), x)[1] for i in range(3)]
    ts = bench.time_rounds(fs, (jnp.zeros(2),), 2)
    assert len(ts) == 3 and all(t >= 0 for t in ts)
    assert calls == [0, 1, 2] * 3


def test_best_call_reports_the_fastest_call():
    # Two warm-up calls, then the fastest of the timed ones, with its CPU time and faults.
    calls, slow = [], iter([0.05, 0.0, 0.0])

    def f(x):
        calls.append(1)
        if len(calls) > 2:
            time.sleep(next(slow))
        return x

    wall, cpu, faults = best_call(f, (jnp.zeros(2),), 3)
    assert len(calls) == 5 and 0 <= wall < 0.05 and cpu >= 0 and faults >= 0


def test_machine_names_the_cpu_model_and_its_vector_extension(tmp_path):
    # Hosts of one name differ by vector unit (AVX-512 or AVX2: 3x the matmul rate), so the
    # tables name it; a field missing or no cpuinfo at all leaves it out.
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
                   "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm sve\nCPU part\t: 0xd40\n")
    assert _cpu(str(x86)) == ("AMD EPYC", "(AVX2)")
    assert _cpu(str(arm)) == ("", "(SVE)")
    assert _cpu(str(tmp_path / "none")) == ("", "")
    dev = jax.devices()[0]
    ynn = _platform.ynn_fusion_types()
    assert bench.machine().endswith(f"cores, {dev.platform} ({dev.device_kind}), jax {jax.__version__}"
                                    + ("" if ynn is None else f", YNNPACK fusions {ynn or 'none'}"))


def test_machine_names_the_ynn_fusion_types(monkeypatch):
    # The same program's time moves 10-25% with XLA:CPU's YNNPACK fusion types
    # (benchmarks/ynn_fusions.py), so a CPU table says which were set.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=dot")
    assert bench.machine().endswith(", YNNPACK fusions dot")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
    assert bench.machine().endswith(", YNNPACK fusions none")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert bench.machine().endswith(f"jax {jax.__version__}")


def test_train_step_loss_weights_are_an_argument():
    """The training step's loss is ``sum(o * w)`` with ``w`` an argument of the compiled
    program (a constant cotangent could be folded by XLA): its gradients are those of that
    loss, and the lowered program takes six arrays."""
    shape = bench.Shape(B=1, T=20, H=1, HV=1, K=4, V=4, chunk_size=16)
    args, w = bench.make_inputs(shape, dtype=jnp.float64), bench.cotangent(shape, dtype=jnp.float64)
    step = bench._TrainStep(lambda *a: (a[2] * a[4][..., None], None), w)  # o = v * beta
    loss, grads = step(*args)
    assert jnp.allclose(loss, jnp.sum(args[2] * args[4][..., None] * w))
    assert jnp.allclose(grads[2], args[4][..., None] * w)
    assert len(step.lower(*args).args_info[0]) == 6


def test_plain_scan_baseline_is_kda():
    """The honest baseline computes KDA: outputs, final state and gradients of the float64
    oracle."""
    from kdax.ref import naive_recurrent_kda

    a = tuple(x.astype(jnp.float64) for x in bench.make_inputs(bench.Shape(T=40, H=2, HV=2, K=8, V=8)))
    o, S = bench.plain_scan_kda(*a)
    o_ref, S_ref = naive_recurrent_kda(*a, output_final_state=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(S, S_ref, rtol=1e-12, atol=1e-12)
    # and its gradients (the main job's float64 reference when H == HV)
    w = bench.cotangent(bench.Shape(T=40, H=2, HV=2, K=8, V=8), dtype=jnp.float64)
    _, g = bench._TrainStep(bench.plain_scan_kda, w)(*a)
    _, g_ref = bench._TrainStep(naive_recurrent_kda, w)(*a)
    for x, y in zip(g, g_ref):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_plain_scan_baseline_grouped_heads_and_cli_heads():
    """Grouped value heads (HV > H) in the plain-scan baseline, as the oracle reads them;
    ``--HV`` follows ``--H`` on the command line unless given."""
    from kdax.bench._main import _parser
    from kdax.ref import naive_recurrent_kda

    a = tuple(x.astype(jnp.float64) for x in bench.make_inputs(bench.Shape(T=40, H=2, HV=4, K=8, V=8)))
    o, S = bench.plain_scan_kda(*a)
    o_ref, S_ref = naive_recurrent_kda(*a, output_final_state=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(S, S_ref, rtol=1e-12, atol=1e-12)
    args = _parser().parse_args(["--H", "2"])
    assert args.HV is None and args.H == 2  # (main sets HV = H)


def test_main_job_header_says_how_memory_is_allocated(capsys):
    """``python -m kdax.bench`` at a tiny shape: its header names the machine and whether
    freed memory is reused (``kdax.reuse_freed_memory``, the default there; ``--fresh-memory``
    leaves malloc alone, as here, so that this test process keeps glibc's defaults)."""
    from kdax.bench._main import main

    status = main(["--T", "40", "--H", "2", "--K", "8", "--V", "8", "--chunk_size", "16", "--no-baselines",
                   "--reps", "1", "--out", "", "--quiet", "--fresh-memory"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "fresh memory each call; large float32 matmul" in out.splitlines()[0], out
    assert "chunk_kda[reference]" in out
    # the second yardstick: the run's chunk products (B H NC = 1 * 2 * 3 of [16, 8] @ [8, 8]) as one batched dot
    line = next(ln for ln in out.splitlines() if ln.startswith("large float32 matmul, best of before and after"))
    rate = re.search(r"6 of \[16,8\]@\[8,8\], as the stages run them; XLA:CPU runs it on one core\): ([0-9.]+) GFLOP/s",
                     line)
    assert rate and float(rate.group(1)) > 0, line


def test_chunk_dot_yardstick_counts_the_products():
    """``chunk_dot_gflops``: FLOPs of the batched dot over its time, finite and positive."""
    from kdax.bench import chunk_dot_gflops

    rate = chunk_dot_gflops(4, 16, 8, 8, reps=1)
    assert np.isfinite(rate) and rate > 0
    # the main job's and --stages' dims: one product per chunk and head (T=40 in chunks of 16: 3)
    from kdax.bench._main import _chunk_dims

    assert _chunk_dims(bench.Shape(B=2, T=40, H=2, HV=4, K=8, V=16, chunk_size=16)) == (24, 16, 8, 16)


def test_main_job_heads_over_host_devices(capsys):
    """``--host-devices 2``: every path runs on two host devices, each on its own heads
    (``per_device``; this test process has 8 CPU devices already); the header says so, and
    chunk_kda still agrees with the float64 recurrence. Heads that do not split are refused."""
    from kdax.bench._main import main

    tiny = ["--T", "40", "--K", "8", "--V", "8", "--chunk_size", "16", "--reps", "1", "--heavy-reps", "1", "--out", "",
            "--quiet", "--fresh-memory"]
    assert main(["--H", "2", "--host-devices", "2", *tiny]) == 0
    out = capsys.readouterr().out
    assert "fresh memory each call, heads split over 2 host devices;" in out.splitlines()[0], out
    for name in ("chunk_kda[reference]", "autodiff_chunk", "fused_recurrent", "plain_scan"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["--H", "3", "--host-devices", "2", *tiny])
    assert "--host-devices 2 must divide --H 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--H", "2", "--host-devices", "2", "--stages", *tiny])
    assert "--host-devices: the main table and --sweep only" in capsys.readouterr().err


def test_per_device_paths_split_the_heads():
    """``over_heads``/``per_device``: the inputs' heads on two devices, each device's
    chunk_kda on its own (one head each): the same outputs as one device's call."""
    from kdax.bench._shape import over_heads, per_device

    shape = bench.Shape(B=1, T=40, H=2, HV=2, K=8, V=8, chunk_size=16)
    args = bench.make_inputs(shape)
    split = over_heads(args, 2)
    assert {d.id for d in split[0].sharding.device_set} == {d.id for d in jax.devices()[:2]}
    fn = lambda *a: kdax_chunk(*a, chunk_size=16)
    o_split = jax.jit(lambda *a: per_device(fn, 2)(*a)[0])(*split)
    assert o_split.sharding.spec[2] == "heads"
    np.testing.assert_allclose(np.asarray(o_split), np.asarray(fn(*args)[0]), rtol=1e-6, atol=1e-6)
    assert per_device(fn, 1) is fn


def test_profile_sums_a_programs_operations_by_kind():
    """``kdax.bench._profile``: XLA's operation names sorted into kinds, and a traced
    program's leaf operations summed per call (the kinds add up to the busy time)."""
    from kdax.bench._profile import KINDS, format_profiles, kind, profile

    names = {"ynn_fusion.44": "dot", "dot_general.3": "dot", "bitcast_dynamic-update-slice_fusion.2":
             "loop slices and updates", "minimum_exponential_fusion": "exponential", "add_concatenate_fusion.4":
             "concatenate", "copy_bitcast_fusion.19": "copy, transpose", "wrapped_reduce-window.4": "reduce",
             "select_select_fusion": "other elementwise"}
    assert {n: kind(n) for n in names} == names
    a = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64, 64)), jnp.float32)
    fn = jax.jit(lambda a: jnp.exp(-jnp.abs(a @ a)).sum(-1))
    p = profile(fn, (a,), calls=3)
    assert p["wall"] > 0 and p["ops"] > 0 and 0 < p["outside"] <= p["busy"]
    assert set(p["kinds"]) <= {k for k, _ in KINDS} and "dot" in p["kinds"]
    assert sum(ms for ms, _ in p["kinds"].values()) == pytest.approx(p["busy"])
    assert sum(n for _, n in p["kinds"].values()) == p["ops"]
    table = format_profiles({"x": p})
    assert "overlap (busy / wall)" in table and "cores (CPU time / wall)" in table and "dot" in table
    assert p["cores"] > 0


def test_main_job_profile_option(capsys):
    """``python -m kdax.bench --profile`` at a tiny shape: the forward's and the training
    step's operations by kind."""
    from kdax.bench._main import main

    status = main(["--T", "40", "--H", "2", "--K", "8", "--V", "8", "--chunk_size", "16", "--profile", "--reps", "2",
                   "--fresh-memory"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "XLA's operations in a jax.profiler trace of 2 calls" in out.splitlines()[0], out
    assert "reference fwd" in out and "reference fwd+bwd" in out and "\ndot " in out, out


@pytest.mark.parametrize("argv,err", [
    (["--pipelines", "bogus"], "--pipelines: unknown ['bogus']; expected a comma list of reference"),
    (["--T", "0"], "argument --T: expected an integer >= 1, got '0'"),
    (["--K", "-4"], "argument --K: expected an integer >= 1, got '-4'"),
    (["--reps", "0"], "argument --reps: expected an integer >= 1, got '0'"),
    (["--heavy-reps", "x"], "argument --heavy-reps: expected an integer >= 1, got 'x'"),
    (["--H", "2", "--HV", "3"], "--HV 3 must be a multiple of --H 2"),
    (["--chunk_size", "48"], "--chunk_size: expected 16, 32, 64 or 128, got 48."),
])
def test_main_job_options_refused_by_name(capsys, argv, err):
    """An unknown pipeline was a KeyError, T=0 and K<0 numpy's tracebacks, --reps 0 a table
    of nan with exit status 0: argparse's error (exit 2) naming the option, before anything runs."""
    from kdax.bench._main import main

    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", "", "--quiet"])
    assert e.value.code == 2 and err in capsys.readouterr().err
