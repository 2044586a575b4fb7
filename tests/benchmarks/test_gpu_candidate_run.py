"""benchmarks/gpu_candidate_run.py's CPU side: the plan is what issue 26's GPU run needs (three
shapes, the goal shape first, the no_recompute row, FLA at every shape, the layer), every
step's command line parses in the script it calls, and the run keeps to its time budget
(steps replaced by a fake runner and a fake clock: no process, no timing asserted)."""

import json
from pathlib import Path

import pytest

from ._load import load_benchmark

def _load(name):
    return load_benchmark(name)


@pytest.fixture(scope="module")
def g26():
    return _load("gpu_candidate_run")


@pytest.fixture(scope="module")
def scripts():
    return {"gpu_vs_fla.py": _load("gpu_vs_fla"), "fla_side.py": _load("fla_side"),
            "layer_vs_fla.py": _load("layer_vs_fla")}


def _args(step, scripts):
    """The step's command line as its script parses it."""
    return scripts[Path(step.argv[1]).name].parser().parse_args(step.argv[2:])


def test_plan_three_shapes_goal_first(g26, scripts, tmp_path):
    first = g26.plan(tmp_path / "w", tmp_path / "w" / "gpu", py="python3")
    second = g26.plan(tmp_path / "w", tmp_path / "w" / "gpu", py="python3", second=True)
    goal, shapes = "1x16384x16", ["1x16384x16", "1x4096x16", "4x4096x32"]
    kdax = [(s, _args(s, scripts)) for s in first + second if s.argv[1].endswith("gpu_vs_fla.py") and not s.report]
    # the goal shape first, kdax's default pipeline alone in its process, then the
    # all-Triton candidate and the default's disable_recompute row, each in a process of
    # its own on the saved reference
    assert kdax[0][1].shapes == goal and kdax[0][1].pipes == "default" and kdax[0][1].save_ref
    assert kdax[1][1].shapes == goal and kdax[1][1].pipes == g26.CANDIDATE
    assert kdax[2][1].shapes == goal and kdax[2][1].pipes == g26.CANDIDATE_BEST
    assert kdax[3][1].shapes == goal and kdax[3][1].pipes == g26.TRITON_DEFAULT == "triton"
    assert kdax[1][1].load_ref == kdax[2][1].load_ref == kdax[3][1].load_ref == kdax[0][1].save_ref
    assert first[0] is kdax[0][0]
    # the default's disable_recompute row at the goal shape: the second call's
    assert [a.pipes for s, a in kdax if s in second and a.shapes == goal] == ["default+no_recompute"]
    # the largest shape is the second call's (beside that goal-shape row)
    assert {a.shapes for s, a in kdax if s in second} == {"4x4096x32", goal}
    assert "4x4096x32" not in {a.shapes for s, a in kdax if s in first}
    covered = {}
    for s, a in kdax:
        assert (a.K, a.V, a.chunk, a.no_fla) == (128, 128, 64, True)
        for p in a.pipes.split(","):
            covered.setdefault(a.shapes, set()).add(p)
        for p in a.pipes.split(","):
            scripts["gpu_vs_fla.py"].kdax_pipeline(p)  # a name the script knows
    assert sorted(covered) == sorted(shapes)
    assert all(covered[s] >= {"default", "default+no_recompute"} for s in shapes)
    # FLA at every shape, on the very files kdax's steps write, autotuning as before
    refs = {(a.save_ref or a.load_ref).format(shape=a.shapes): a.shapes for _, a in kdax}
    fla = [_args(s, scripts) for s in first + second if s.fla and "--ref" in s.argv]
    assert sorted(refs[r] for a in fla for r in a.ref) == sorted(shapes)
    assert all(a.max_configs == 4 for a in fla)
    steps = first
    assert [s.name for s in steps].index("fla-1x16384x16-1x4096x16") < [s.name for s in steps].index("layer-kdax")
    # the layer: kdax's side at Kimi's shape, then FLA's on the file it writes, then the reports
    names = [s.name for s in steps]
    lk, lf = (_args(steps[names.index(n)], scripts) for n in ("layer-kdax", "layer-fla"))
    assert (lk.B, lk.T, lk.hidden, lk.heads, lk.head_dim, lk.chunk) == (1, 4096, 2048, 16, 128, 64)
    assert lf.layer == str(Path(lk.work) / "layer_in.npz") and names.index("layer-kdax") < names.index("layer-fla")
    assert [s.name for s in steps if s.report] == names[-2:] == ["report-chunk", "report-layer"]
    assert [s.name for s in second if s.report] == ["report-chunk", "report-layer"]
    # the budget: every step's limit above its estimate, the estimates within the run's total
    for steps in (first, second):
        assert all(s.limit_s >= s.expect_s for s in steps)
        assert sum(s.expect_s for s in steps) <= g26.TOTAL_S
        assert sum(s.limit_s for s in steps if s.report) <= g26.REPORT_S
    assert g26.TOTAL_S <= 420  # about 7 minutes: issue 26's 6, and the two tunings of issue 53 item 4


def test_dry_run_lists_the_plan_and_runs_nothing(g26, tmp_path, capsys):
    work = tmp_path / "w"
    steps = g26.main(["--dry-run", "--work", str(work), "--out", str(tmp_path / "o"), "--extra-pipes",
                      "default+fast"])
    text = capsys.readouterr().out
    for word in ("1x16384x16", "1x4096x16", g26.CANDIDATE, g26.CANDIDATE_BEST, "kdax-1x16384x16-triton ",
                 "default+fast", "layer-fla",
                 f"keeps to {g26.TOTAL_S:.0f} s"):
        assert word in text
    assert any(s.name == "kdax-1x16384x16-default+fast" for s in steps)
    second = g26.main(["--dry-run", "--second", "--work", str(work)])
    text = capsys.readouterr().out
    assert "4x4096x32" in text and "default+no_recompute" in text
    assert {s.name for s in second} >= {"kdax-4x4096x32", "fla-4x4096x32", "kdax-1x16384x16-default+no_recompute"}
    assert not work.exists() and not (tmp_path / "o").exists()
    only = g26.main(["--dry-run", "--work", str(work), "--only", "layer"])
    assert [s.name for s in only] == ["layer-kdax", "layer-fla", "report-chunk", "report-layer"]


def _step(g26, name, limit, expect, report=False, needs=()):
    return g26.Step(name, ["python3", name], limit, expect, report=report, needs=needs)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _fake_runner(clock, took, calls):
    """Each step 'takes' ``took[name]`` seconds, or stops at its limit when that is None
    (a hang); writes a log as a real step would."""
    def runner(argv, limit, log, env):
        name = argv[1]
        calls.append((name, limit))
        t = took[name]
        Path(log).write_text(f"{name} output\n")
        if t is None or t > limit:
            clock.t += limit
            return None, limit
        clock.t += t
        return 0, t
    return runner


def test_run_keeps_to_its_budget(g26, tmp_path):
    """A hanging step stops at its limit and the rest still run; a step that no longer
    fits is skipped, named in run.json; the reports run from the time kept for them."""
    R = g26.REPORT_S
    steps = [_step(g26, "a", 50, 20), _step(g26, "hang", 60, 30), _step(g26, "b", 40, 20),
             _step(g26, "too-big", 100, 90), _step(g26, "c", 30, 10),
             _step(g26, "report", 15, 5, report=True)]
    clock, calls = _Clock(), []
    took = {"a": 25, "hang": None, "b": 15, "too-big": 10, "c": 40, "report": 3}
    total = 200 + R
    done = g26.run(steps, total, tmp_path / "res", tmp_path / "logs", {}, runner=_fake_runner(clock, took, calls),
                   clock=clock)
    status = {d["name"]: d["status"] for d in done}
    assert status["a"] == "ok" and status["b"] == "ok" and status["report"] == "ok"
    assert status["hang"].startswith("stopped at its limit (60 s)")
    # after a (25 s), hang (60) and b (15): 100 s left of 200; too-big expects 90: it runs
    assert status["too-big"] == "ok"
    # then 90 s left: c gets its own limit (30), and takes longer (40): stopped there
    limits = dict(calls)
    assert limits["too-big"] == 100 and limits["c"] == 30 and status["c"].startswith("stopped at its limit")
    assert clock.t <= total + 15  # the run's total, plus at most the report's own limit
    # with less time, too-big is skipped and the cheaper c still runs
    clock2, calls2 = _Clock(), []
    done = g26.run(steps, 150 + R, tmp_path / "res2", tmp_path / "logs2", {},
                   runner=_fake_runner(clock2, took, calls2), clock=clock2)
    status = {d["name"]: d["status"] for d in done}
    assert status["too-big"].startswith("skipped:") and "expected 90 s" in status["too-big"]
    assert status["c"].startswith("stopped at its limit")  # 50 s left, limit 30, it takes 40
    assert [n for n, _ in calls2] == ["a", "hang", "b", "c", "report"]
    rec = json.loads((tmp_path / "res2" / "run.json").read_text())["steps"]
    assert [d["name"] for d in rec] == ["a", "hang", "b", "too-big", "c", "report"]
    logs = (tmp_path / "res2" / "logs.txt").read_text()
    assert "===== hang: stopped at its limit" in logs and "b output" in logs


def test_run_skips_a_step_whose_inputs_are_missing(g26, tmp_path):
    have = tmp_path / "ref_a.npz"
    have.write_bytes(b"")
    steps = [_step(g26, "fla-a", 30, 10, needs=(str(have), str(tmp_path / "ref_b.npz"))),
             _step(g26, "fla-b", 30, 10, needs=(str(tmp_path / "ref_b.npz"),)),
             _step(g26, "report", 10, 2, report=True)]
    clock, calls = _Clock(), []
    done = g26.run(steps, 300, tmp_path / "res", tmp_path / "logs", {},
                   runner=_fake_runner(clock, {"fla-a": 5, "fla-b": 5, "report": 1}, calls), clock=clock)
    assert [n for n, _ in calls] == ["fla-a", "report"]
    assert done[1]["status"].startswith("skipped: needs") and "ref_b.npz" in done[1]["status"]


def test_reference_flags_follow_the_files(g26, tmp_path):
    """A kdax step loads a reference an earlier call left and computes one that is missing."""
    ref = tmp_path / "ref_1x64x2.npz"
    argv = ["python3", "gpu_vs_fla.py", "--shapes", "1x64x2", "--load-ref", str(ref)]
    assert g26.with_ref_found(argv)[-2] == "--save-ref"
    ref.write_bytes(b"")
    assert g26.with_ref_found(argv)[-2] == "--load-ref"
    assert g26.with_ref_found(argv[:-2] + ["--save-ref", str(ref)])[-2] == "--load-ref"


@pytest.mark.slow
def test_rehearsal_end_to_end(g26, tmp_path, capsys):
    """The real steps as processes at tiny sizes (``--rehearse``), the goal shape and the
    layer: kdax's steps write their rows, FLA's fail here (no PyTorch on the CPU suite's
    machine) or run where FLA is installed, the reports run either way, and the results
    reach ``--out``."""
    out, work = tmp_path / "out", tmp_path / "work"
    done = g26.main(["--rehearse", "--only", "1x64x2,layer", "--work", str(work), "--out", str(out)])
    status = {d["name"]: d["status"] for d in done}
    candidate = f"kdax-1x64x2-{g26.CANDIDATE}"  # (the all-Triton candidate, interpreted on a CPU)
    best, triton = f"kdax-1x64x2-{g26.CANDIDATE_BEST}", "kdax-1x64x2-triton"
    assert [d["name"] for d in done] == ["kdax-1x64x2-default", candidate, best, triton,
                                         "fla-1x64x2-1x32x2", "layer-kdax", "layer-fla", "report-chunk",
                                         "report-layer"]
    for n in ("kdax-1x64x2-default", candidate, best, triton, "layer-kdax", "report-chunk", "report-layer"):
        assert status[n] == "ok", (n, status[n], (out / "logs.txt").read_text()[-3000:])
    assert sorted(f.name for f in out.iterdir()) == ["layer.json", "layer.txt", "logs.txt", "results.json",
                                                     "results.png", "results.txt", "run.json"]
    rows = {(r["path"], r["pass_"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    for p in ("kdax[default]", f"kdax[{g26.CANDIDATE}]", f"kdax[{g26.CANDIDATE_BEST}]", "kdax[triton]"):
        assert rows[(p, "train")]["ok"] and rows[(p, "train")]["T"] == 64
    assert "K=32 V=32 chunk 64" in (out / "results.txt").read_text()
    layer = json.loads((out / "layer.json").read_text())
    assert {r["path"] for r in layer["rows"]} >= {"kdax.nn"} and all(
        r["errors"] for r in layer["rows"] if r["path"] == "kdax.nn")
    assert (work / "ref_1x64x2.npz").exists() and (work / "layer_in.npz").exists()


def test_kernels_plan_profiles_candidate_and_fla(g26, scripts, tmp_path):
    # The per-kernel call (issue 36): the candidates with their float64 check first, FLA on
    # that reference with its per-kernel profile, then the candidates' own profiles.
    steps = g26.plan(tmp_path / "w", tmp_path / "w" / "gpu", py="python3", kernels=True)
    names = [s.name for s in steps]
    assert names[0] == f"kdax-1x16384x16-{g26.CANDIDATE}" and names[1] == "fla-1x16384x16"
    assert names[2] == f"profile-{g26.CANDIDATE}" and steps[-1].report
    assert "--save-ref" in steps[0].argv
    fla = _args(steps[1], scripts)
    assert fla.profile == 5 and fla.ref == [str(tmp_path / "w" / "ref_1x16384x16.npz")]
    prof = steps[2].argv
    both = f"{g26.CANDIDATE},{g26.CANDIDATE_BEST}"
    assert prof[prof.index("--pipes") + 1] == both and prof[prof.index("--out") + 1].endswith("profile.txt")
    assert steps[0].argv[steps[0].argv.index("--pipes") + 1] == both
    # it fits what is left of a session's device time after a machine start (~15 min - 2)
    assert sum(s.expect_s for s in steps) <= 300 and sum(s.limit_s for s in steps) <= 480


def test_tests_plan_runs_the_suites_device_cases(g26, tmp_path):
    # --tests: one pytest process over the Pallas stage and pipeline files' device cases,
    # without xdist (addopts off) and without the slow sweeps, its report in the results.
    steps = g26.plan(tmp_path / "w", tmp_path / "w" / "gpu", py="python3", tests=True)
    assert [s.name for s in steps] == ["device-tests"]
    argv = steps[0].argv
    assert argv[:3] == ["python3", "-m", "pytest"]
    files = [a for a in argv if a.endswith(".py")]
    assert [Path(f).relative_to(Path(g26.__file__).resolve().parent.parent).as_posix() for f in files] == list(
        g26.DEVICE_TESTS)
    assert all(Path(f).exists() for f in files)
    assert argv[argv.index("-k") + 1] == "device" and argv[argv.index("-m", 3) + 1] == "not slow"
    assert "addopts=" in argv and any(a.startswith("--junitxml=") and a.endswith("device_tests.xml") for a in argv)
    assert steps[0].expect_s <= 300 and steps[0].limit_s <= 420


def test_tests_plan_collects_every_device_case_on_a_gpu(g26, tmp_path):
    """The --tests command as a GPU machine collects it (``jax.default_backend`` taken as
    "gpu" before the suite's conftest reads it): the 26 Pallas stage cases, the 22
    all-Pallas pipeline cases (``pallas_device``), the named tunings' 10 and ``segmented`` and
    ``shard_map``'s 8 (session 67). Until session
    66 the suite's core selection (``tests/conftest.py``'s ``CORE_CASES``) marked every
    pipeline case slow, so the device runs compiled none of them."""
    import subprocess
    import sys

    argv = g26.plan(tmp_path / "w", tmp_path / "w" / "gpu", py=sys.executable, tests=True)[0].argv
    args = [a for a in argv[3:] if not a.startswith("--junitxml")] + ["--collect-only"]
    code = f"import jax, pytest, sys; jax.default_backend = lambda: 'gpu'; sys.exit(pytest.main({args!r}))"
    root = Path(g26.__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    pipeline = [i for i in ids if i.startswith("tests/pallas/test_pipeline.py::") and "pallas_device" in i]
    tunings = [i for i in ids if i.startswith("tests/pallas/test_pipeline.py::test_tunings_within_fla_tolerances_on")]
    split = [i for i in ids if i.startswith("tests/pallas/test_pipeline.py::test_segmented_and_sequence_parallel_on")]
    stages = [i for i in ids if i.startswith("tests/pallas/test_stages.py::") and "device" in i.split("[")[-1]]
    assert len(pipeline) >= 22 and len(stages) >= 26 and len(tunings) == 10 and len(split) == 8, (
        len(pipeline), len(stages), len(tunings), len(split))
    every = pipeline + stages + tunings + split
    assert len(ids) == len(every), [i for i in ids if i not in every]


def test_prepare_carries_what_the_device_tests_import():
    # The GPU machine reaches no registry: --prepare's wheels must cover pytest's and
    # hypothesis's imports (tests/test_pipeline.py, which the device cases import).
    sh = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_candidate_run.sh").read_text()
    wheels = sh.split('WHEELS="', 1)[1].split('"', 1)[0].split()
    names = {w.split("==")[0] for w in wheels}
    assert {"beartype", "pytest", "pluggy", "iniconfig", "pygments", "hypothesis", "sortedcontainers"} <= names
    for n in ("pytest", "pluggy", "iniconfig", "pygments", "hypothesis", "sortedcontainers"):
        assert f".whl/{n}-*.whl" in sh, n
