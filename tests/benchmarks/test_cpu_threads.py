"""benchmarks/cpu_threads.py: each part runs in a fresh process and reports its rows; the
XLA:CPU behaviour the notes rest on (benchmarks/NOTES.md, "Loop-body fusions are split
over the cores, except the one that writes a loop's output") read from the compiled HLO
of the jaxlib it was measured on. Times are never asserted."""

import os

import jaxlib
import pytest

from ._load import load_benchmark


@pytest.fixture(scope="module")
def ct():
    return load_benchmark("cpu_threads")


@pytest.mark.skipif(os.cpu_count() < 2 or not jaxlib.__version__.startswith("0.10."),
                    reason="measured with jaxlib 0.10 on two or more cores")
def test_loop_part_reads_where_xla_splits_a_fusion(ct):
    out = ct.run_part("loop", 1)
    assert list(out) == ["top level", "loop, result written", "loop, result also added"]
    assert [r["partitioned"] for r in out.values()] == [True, False, True]
    assert all(r["ms"] > 0 and r["cpu"] > 0 for r in out.values())


def test_report_rows(ct):
    lines = ct.report(["two loops"], 1)
    assert lines[0] == "two loops:"
    assert [line.split()[0:2] for line in lines[1:]] == [["one", "loop"], ["two", "independent"]]
    assert all(" ms  CPU/wall " in line for line in lines[1:])
