"""benchmarks/gpu_cost_model.py regenerates its table from the compiles: the training step's
Triton kernels lowered for CUDA and compiled for sm_90 (no GPU), calibrated on the H200
profile, and a prediction at a small shape. Checks the structure and sanity of what it
prints (every kernel has bytes, instructions and a positive time; the results file's two
last lines parse; the calibration factor is finite), not its numbers. Skipped where the
Triton compile tooling is unavailable: no ``triton`` package, or a JAX whose Pallas Triton
lowering refuses without a GPU (``tests/pallas/_triton.py``, ``skip_reason``)."""

import dataclasses
import math
import re

import pytest

from ._load import load_benchmark

SMALL = "1,256,2"  # B, T, H: four chunks per sequence


@pytest.fixture(scope="module")
def text():
    from tests.pallas._triton import skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    m = load_benchmark("gpu_cost_model")
    return m.main(["--pipes", m.CANDIDATE, "--shape", SMALL, "--no-spill-check"])


def _rows(text: str, title: str, has: str = "") -> list:
    """The kernel rows of the table whose title starts with ``title`` (and holds ``has``)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(title) and has in line)
    out = []
    for line in lines[i + 2:]:
        if line.startswith("sum "):
            return out
        out.append(line.split())
    raise AssertionError(f"no sum line after {title!r}")


_LOO = r"calibration \(leave-one-out\): worst factor ([\d.]+) over (\d+) kernels"
_STEP = (r"candidate step with glue: predicted ([\d.]+) ms \(kernels ([\d.]+) ms, outside the kernels ([\d.]+) ms\); "
         r"FLA measured ([\d.]+) ms")


def test_final_lines_parse(text):
    """The in-sample and leave-one-out calibration, the bytes a step moves with the
    intermediates float32 (as profiled) and stored bf16 (the checkout, ``"fast"``: fewer),
    the step's range and the step with its glue (issue 53's form); without the spill check
    (``--no-spill-check``) no line about the default tuning's spills."""
    *_, moved, steps, cal, rng, head, loo, step = text.splitlines()
    m = re.fullmatch(r"calibration \(in-sample\): worst factor ([\d.]+) over (\d+) kernels", cal)
    assert m and float(m.group(1)) >= 1.0 and int(m.group(2)) == 12, cal
    m = re.fullmatch(_LOO, loo)
    assert m, loo
    # out of sample is no better than in sample; 10 distinct kernels (WY and State twice)
    assert float(m.group(1)) >= float(re.search(r"([\d.]+) over", cal).group(1)) and int(m.group(2)) == 10
    m = re.match(r"bytes a step's kernels move .*: ([\d.]+) GiB with float32 intermediates .*, ([\d.]+) GiB with bf16 ",
                 moved)
    assert m, moved
    assert 0 < float(m.group(2)) < float(m.group(1)), moved
    m = re.fullmatch(r"steps predicted: ([\d.]+) ms the kernels profiled \(measured ([\d.]+)\), ([\d.]+) ms \S+ "
                     r"\(the checkout\), ([\d.]+) ms \S+ \(the checkout's fastest\)", steps)
    assert m, steps
    assert all(float(x) > 0 for x in m.groups())
    best = float(m.group(4))
    # the headline model: the one out of sample the better (per-warp, or R and bandwidth fitted together)
    m = re.fullmatch(r"headline model: (per-warp|two-rate) \(the smaller worst leave-one-out factor; in-sample worst "
                     r"([\d.]+)\)", head)
    assert m, head
    if m.group(1) == "two-rate":
        best = float(re.search(r"two-rate model: .*, \S+\+block_v=32 ([\d.]+), ", text).group(1))
    m = re.fullmatch(_STEP, step)
    assert m, step
    total, kern, glue, fla = (float(x) for x in m.groups())
    assert kern == best and glue > 0 and total == pytest.approx(kern + glue, abs=0.011) and fla == 7.80
    m = re.match(r"candidate step range: ([\d.]+) to ([\d.]+) ms", rng)
    assert m and float(m.group(1)) <= total <= float(m.group(2)), (rng, step)


def test_results_file_ends_with_the_issue_lines():
    """``benchmarks/results/gpu_cost_model.txt`` (the goal shape, with the spill check)
    ends with the leave-one-out calibration, the step with its glue against FLA, and the
    default tuning's spills: "no spills" or the kernels that spill."""
    m = load_benchmark("gpu_cost_model")
    *_, loo, step, spills = (m.ROOT / "benchmarks/results/gpu_cost_model.txt").read_text().splitlines()
    assert re.fullmatch(_LOO, loo) and int(re.fullmatch(_LOO, loo).group(2)) >= 8, loo
    assert re.fullmatch(_STEP, step), step
    assert spills == "default triton tuning: no spills" or spills.startswith("default triton tuning: spills in "), spills


def test_leave_one_out_and_per_sm():
    """Each profiled kernel predicted by a rate fitted without it (and without its twin):
    the rate differs from the full fit's, and a kernel's held-out factor is at least its
    in-sample one where the fit moved towards it. The per-SM variant gives a tuning twice
    the warps at half the instructions a warp the same issue time; the per-warp model half."""
    m = load_benchmark("gpu_cost_model")
    ks, meas = m.profiled_kernels(), m.measured()
    rate = m.fit_rate(ks, meas)
    loo = m.leave_one_out(ks, meas)
    assert len(loo) == 12 and len(m.twins(ks)) == 10
    assert all(r != rate and p > 0 and f >= 1.0 for _, r, p, f in loo)
    assert max(f for *_, f in loo) >= max(m.factor(k.predict_s(rate), meas[k.name]) for k in ks)
    k = next(k for k in ks if k.name == "kdax_PallasIntraBackward_kernel")
    wide = dataclasses.replace(k, warps=2 * k.warps, instructions=k.instructions / 2, registers=min(k.registers, 128))
    assert wide.issue_s(1e10, per_sm=True) == pytest.approx(k.issue_s(1e10, per_sm=True))
    assert wide.issue_s(0.28e9) == pytest.approx(k.issue_s(0.28e9) / 2)


def test_two_rate_model():
    """The two-rate variant fits the per-warp rate and an effective HBM bandwidth together:
    the bandwidth found lies inside its search range and below nothing physical (1-6 TB/s),
    the fit's log residuals are no larger than those of the rate alone at the copy's 4.3
    TB/s (one more free parameter, the same data), and its leave-one-out refits each held-out
    kernel's (rate, bandwidth) without it and its twin."""
    m = load_benchmark("gpu_cost_model")
    ks, meas = m.profiled_kernels(), m.measured()
    rate, bw = m.fit_rate_bw(ks, meas)
    assert 1e12 < bw < 6e12 and rate > 0
    sq = lambda pred: sum(math.log(pred(k) * 1e3 / meas[k.name]) ** 2 for k in ks)  # noqa: E731
    r1 = m.fit_rate(ks, meas)
    assert sq(lambda k: k.predict_s(rate, bw=bw)) <= sq(lambda k: k.predict_s(r1)) + 1e-9
    loo = m.leave_one_out_bw(ks, meas)
    assert len(loo) == 12 and all(fit != (rate, bw) and p > 0 and f >= 1.0 for _, fit, p, f in loo)


def test_terms_tried():
    """The terms tried for the leave-one-out goal: occupancy_bw is the resident warps' pull
    up to the copy's bandwidth (the state kernels: 32 busy SMs); each term is fitted with
    the per-warp rate inside its search range, and its leave-one-out worst factor is no
    better than its in-sample one."""
    m = load_benchmark("gpu_cost_model")
    ks, meas = m.profiled_kernels(), m.measured()
    state = next(k for k in ks if k.name == "kdax_PallasState_kernel")
    assert state.programs == 32 and m.occupancy_bw(state, 1e9) == pytest.approx(32 * state.ctas_per_sm * 8 * 1e9)
    assert m.occupancy_bw(state, 1e15) == m.HBM_MEASURED
    for term in m.TERMS:
        lo, hi = m.TERMS[term][1]
        x, fit, loo = m.term_calibration(ks, meas, term)
        assert lo <= x <= hi and 1.0 <= fit <= loo, (term, x, fit, loo)


def test_calibration_rows(text):
    """Every kernel the profile timed, from the frozen figures, beside its measured time:
    the fit is over all of them, whatever the checkout's kernels have become."""
    rows = _rows(text, "Calibration:")
    assert {r[0] for r in rows} >= {"kdax_PallasIntra_kernel", "kdax_PallasState_kernel", "kdax_PallasDhu_kernel"}
    assert len(rows) == 12 and all(r[18] != "-" for r in rows), rows
    for r in rows:
        pred, meas, factor = float(r[17]), float(r[18]), float(r[19])
        assert pred > 0 and meas > 0 and math.isfinite(factor) and factor == pytest.approx(pred / meas, rel=0.02), r
    assert re.search(r"calibration \(in-sample\): worst factor [\d.]+ over 12 kernels", text)


def test_profiled_kernels_frozen():
    """The profiled kernels' figures as committed: the profile's twelve kernels (as the
    profile names them, each with a time there), compiled figures for each (registers,
    instructions, bytes), lowered at the commit the file names."""
    m = load_benchmark("gpu_cost_model")
    ks = m.profiled_kernels()
    meas = m.measured()
    assert [k.name for k in ks] and {k.name for k in ks} == set(meas), (sorted(meas), [k.name for k in ks])
    for k in ks:
        assert k.registers > 0 and k.instructions > 0 and k.read + k.written > 0 and k.ctas_per_sm >= 1, k


@pytest.mark.slow
def test_freeze_profiled_reproduces_the_file(tmp_path):
    """``--freeze-profiled`` from the profile's commit gives the committed figures (needs
    the commit in this clone's history: skipped in a shallow one)."""
    import subprocess

    from tests.pallas._triton import skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    m = load_benchmark("gpu_cost_model")
    have = subprocess.run(["git", "-C", str(m.ROOT), "cat-file", "-e", m.PROFILE_COMMIT + "^{commit}"],
                          capture_output=True)
    if have.returncode:
        pytest.skip(f"{m.PROFILE_COMMIT[:7]} is not in this clone's history")
    out = tmp_path / "profiled.json"
    m.freeze_profiled(out=out)
    assert m.profiled_kernels(out) == m.profiled_kernels()


def test_small_shape_rows(text):
    """Every kernel of the step at the small shape: bytes, instructions, a time."""
    rows = _rows(text, "Prediction:", "T=256 H=2")
    assert len(rows) >= 10, rows
    for r in rows:
        read, written, instr, pred = float(r[8]), float(r[9]), float(r[11]), float(r[17])
        assert read + written > 0 and instr > 0 and pred > 0 and int(r[6]) >= 1, r  # r[6]: CTAs per SM


def test_fastest_tuning_rows(text):
    """The candidate's fastest tuning (``BEST``): F2 and B4 at 16 warps (fewer instructions
    a warp: their elementwise work over twice the threads), F4 and B2 (and B0's F4) over
    twice the programs (32 value columns each, fewer instructions a warp); every other
    kernel as the candidate's."""
    now = {r[0]: r for r in _rows(text, "Prediction:", "as the checkout builds it")}
    best = {r[0]: r for r in _rows(text, "Prediction:", "F2 and B4 at 16 warps")}
    assert set(now) == set(best)
    wide = ("kdax_PallasIntra_kernel", "kdax_PallasIntraBackward_kernel")
    state = ("kdax_PallasState_kernel", "kdax_PallasState_kernel__1", "kdax_PallasDhu_kernel")
    for k in wide:
        assert best[k][2] == "16" and now[k][2] == "8" and float(best[k][11]) < float(now[k][11]), (now[k], best[k])
    programs = lambda r: math.prod(int(x) for x in r[1].split("x"))  # noqa: E731
    for k in state:
        assert programs(best[k]) == 2 * programs(now[k]) and float(best[k][11]) < float(now[k][11]), (now[k], best[k])
    assert all(best[k] == now[k] for k in now if k not in wide + state)


def test_bf16_storage_rows(text):
    """The checkout's candidate at the goal shape beside the calibration (float32
    intermediates, as profiled): the same kernels, and the kernels that write or read the
    intermediates stored bf16 under "fast" move fewer bytes (F2, F3, F4, F5, B1, B3)."""
    cal = {r[0]: r for r in _rows(text, "Calibration:")}
    now = {r[0]: r for r in _rows(text, "Prediction:", "as the checkout builds it")}
    assert set(cal) == set(now)
    moved = lambda r: float(r[8]) + float(r[9])  # noqa: E731
    for name in ("Intra", "WY", "State", "Output", "DAv", "WYDqkg"):
        k = f"kdax_Pallas{name}_kernel"
        assert moved(now[k]) < moved(cal[k]), (k, cal[k], now[k])


# A 16-step loop LLVM unrolled by 4 (B4's offset loop at 16 warps, abridged from its SASS):
# the counter R96 stepped by 4, the exit test against the TTGIR bound 16.
_UNROLLED = """
        /*0220*/                   LDC.64 R108, c[0x0][0x238] ;
        /*0320*/                   IADD3 R98, R96, 0x1, RZ ;
        /*0790*/                   ISETP.GE.U32.AND P0, PT, R96, R94.reuse, PT ;
        /*07c0*/                   VIADD R96, R96, 0x4 ;
        /*0870*/                   MUFU.EX2 R18, R18 ;
        /*0fa0*/                   ISETP.NE.U32.AND P0, PT, R96, 0x10, PT ;
        /*1160*/              @!P3 FFMA R7, R18, R33, R7 ;
        /*1170*/               @P0 BRA 0x220 ;
"""


def test_unroll_factor():
    """A loop LLVM unrolled partly runs count / u passes of its SASS body (read from the
    exit test and the counter's step), a loop run as written 1 pass a step; a loop whose
    exit test is not against the TTGIR bound is taken as not unrolled."""
    m = load_benchmark("gpu_cost_model")
    ins = m.sass_instructions(_UNROLLED)
    rng = m.sass_loops(ins)
    assert rng == [(0x220, 0x1170)]
    lp = m.Loop("i", "%c0", "%c16", "%c1", 0, None, count=16, bounds=(16, 1))
    assert m.unroll_factor(ins, rng[0], lp) == 4
    assert m.unroll_factor(m.sass_instructions(_UNROLLED.replace("0x4 ;", "0x1 ;")), rng[0], lp) == 1
    other = m.Loop("i", "%c0", "%c32", "%c1", 0, None, count=32, bounds=(32, 1))
    assert m.unroll_factor(ins, rng[0], other) == 1
    assert m.unroll_factor(ins, rng[0], None) == 1
