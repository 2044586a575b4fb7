"""``benchmarks/recurrent_ab.py`` runs its cases end to end at tiny shapes (speed is measured
by the script, never asserted here)."""

from ._load import load_benchmark


def test_cases_parse_and_run_against_head():
    mod = load_benchmark("recurrent_ab")
    assert list(mod.cases("16,1 1,8,2 1,6,grad")) == [(16, 1, None, False), (1, 8, 2, False), (1, 6, None, True)]
    lines = mod.main(["--base", "HEAD", "--rounds", "1", "--cases", "2,3 1,8,2 1,6,grad", "--heads", "2",
                      "--dim", "4"])
    assert len(lines) == 4 and lines[0].startswith("fused_recurrent_kda, base ")
    for line, name in zip(lines[1:], ("B=2 T=3", "B=1 T=8 N=2", "B=1 T=6 grad")):
        assert line.startswith(name) and "new/base median" in line
        assert float(line.rsplit(" ", 1)[1]) < 1e-4, line  # (this tree against HEAD: the same numbers up to rounding)
