"""``benchmarks/packed_ab.py`` runs its four cases end to end at a tiny shape, the forward
and (``--step``) the training step (speed is measured by the script, never asserted here)."""

import pytest

from ._load import load_benchmark


@pytest.mark.parametrize("step", [False, True], ids=["forward", "step"])
def test_cases_run_against_head(step):
    mod = load_benchmark("packed_ab")
    lines = mod.main(["--base", "HEAD", "--rounds", "1", "--n", "3", "--T", "150", "--heads", "2", "--dim", "8"]
                     + ["--step"] * step)
    what = "training step" if step else "forward"
    assert len(lines) == 5 and lines[0].startswith(f"chunk_kda {what}, packed: base ")
    for line, (name, _, _) in zip(lines[1:], mod.CASES):
        assert line.startswith(name) and "new/base median" in line
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line  # (this tree against HEAD: the same numbers up to rounding)
