"""``benchmarks/core_coverage.py``: what moving tests to ``-m slow`` costs the fast core."""

import pytest

from ._load import load_benchmark


@pytest.fixture(scope="module")
def cc():
    return load_benchmark("core_coverage")


def test_durations_sum_a_tests_phases(cc, tmp_path):
    log = tmp_path / "durations.log"
    log.write_text("===== slowest durations =====\n"
                   "12.50s call     tests/test_a.py::test_f[float64-1e-10]\n"
                   "0.50s setup    tests/test_a.py::test_f[float64-1e-10]\n"
                   "3.00s call     tests/test_b.py::test_g[dense, F1 too]\n"
                   "(2 durations < 0.005s hidden.)\n")
    assert cc.durations(str(log)) == {"tests/test_a.py::test_f[float64-1e-10]": 13.0,
                                      "tests/test_b.py::test_g[dense, F1 too]": 3.0}


def test_patterns_name_case_prefixes_or_whole_functions(cc):
    assert cc.moves("tests/t.py::test_f[float32-a]", "tests/t.py::test_f[float32")
    assert not cc.moves("tests/t.py::test_f[float64-a]", "tests/t.py::test_f[float32")
    assert cc.moves("tests/t.py::test_f[float64-a]", "tests/t.py::test_f")
    assert cc.moves("tests/t.py::test_f", "tests/t.py::test_f")
    assert not cc.moves("tests/t.py::test_f_more", "tests/t.py::test_f")


def test_report_names_the_lines_only_moved_tests_execute(cc):
    lines = {"tests/t.py::test_f[a]": {("pipeline.py", 1), ("pipeline.py", 2)},
             "tests/t.py::test_f[b]": {("pipeline.py", 1), ("_validate.py", 3)},
             "tests/t.py::test_g": {("pipeline.py", 2)}}
    secs = {"tests/t.py::test_f[a]": 4.0, "tests/t.py::test_f[b]": 6.0, "tests/t.py::test_g": 10.0}
    out = cc.report(lines, secs, ["tests/t.py::test_f[a"])
    assert out == ["1 tests move: 4 of 20 worker-seconds; 0 kdax lines only they execute"]
    out = cc.report(lines, secs, ["tests/t.py::test_f[b", "tests/t.py::test_h"])
    assert out[0] == "no test matches 'tests/t.py::test_h'"
    assert out[1] == "1 tests move: 6 of 20 worker-seconds; 1 kdax lines only they execute"
    assert out[2].startswith("  kdax/_validate.py:3 ") and out[2].endswith("<- tests/t.py::test_f[b]")
    assert len(out) == 3
