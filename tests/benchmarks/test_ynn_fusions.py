"""benchmarks/ynn_fusions.py: each setting of XLA:CPU's YNNPACK fusion types runs in fresh
processes that report the main job's programs under it (the worker's header names the
setting it ran with); the report's rounds and medians. Times are never asserted."""

import json

import jaxlib
import pytest

from ._load import load_benchmark


@pytest.mark.slow  # (a study's script: three processes, each compiling a training step)
@pytest.mark.skipif(not jaxlib.__version__.startswith("0.10."), reason="the option is known to jaxlib 0.10's XLA")
def test_each_setting_runs_in_a_process_of_its_own(capsys):
    yf = load_benchmark("ynn_fusions")
    shape = {"B": 1, "T": 32, "H": 1, "HV": 1, "K": 16, "V": 16, "chunk_size": 16}
    r = yf.run("dot", shape, reps=1, dots=False)
    assert r["machine"].endswith(", YNNPACK fusions dot")
    assert r["fwd_ms"] > 0 and r["step_ms"] > 0 and r["mm"] > 0 and r["compile_step"] > 0
    assert yf.main(["--settings", "individual_dot,dot", "--pairs", "1", "--reps", "1", "--shape", json.dumps(shape)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["round", "1", "individual_dot,dot", "forward"]
    assert lines[1].startswith("medians (1 processes each")
    assert lines[2].split()[:2] == ["individual_dot,dot", "forward"] and "(1.00x)" in lines[2]
