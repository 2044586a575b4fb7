"""``benchmarks/fuzz_against_oracle.py`` runs a drawn configuration end to end in a fresh
process (it turns on JAX's 64-bit mode, so never in the suite's): here a float32 one
(``--float32``: kdax's inputs in float32 against the float64 recurrence), packed with an
empty sequence and initial states, the in-kernel lower-bound gate, and the Triton kernels
(interpret mode) under ``segmented``."""

import re
import subprocess
import sys

from .._util import one_device_env

from ._load import BENCH


def test_a_float32_seed_passes_against_the_float64_recurrence():
    run = subprocess.run([sys.executable, str(BENCH / "fuzz_against_oracle.py"), "3969", "1", "--float32"],
                         env=one_device_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = run.stdout.splitlines()[0]
    assert line.startswith("seed 3969 ok") and "'cu_seqlens': [0, 33, 33, 36]" in line, line
    assert "'segmented(pallas triton, 2)', 'tuning': 'default'" in line and "'lower_bound': -5.0" in line, line
    assert "'initial_state': True" in line, line
    worst = float(re.search(r"worst (\S+)", line).group(1))
    assert 0 < worst <= 1e-4, line  # float32 rounding: above zero, far below the tolerance
    assert run.stdout.splitlines()[-1] == "0 of 1 seeds failed"


def test_an_unknown_pipeline_is_refused_before_any_seed():
    """``--pipeline`` names one of the drawn pipelines; another name is an argument error
    (exit status 2) that lists them, before any seed runs."""
    run = subprocess.run([sys.executable, str(BENCH / "fuzz_against_oracle.py"), "0", "3", "--pipeline", "triton"],
                         env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--pipeline: expected one of" in run.stderr and "'pallas triton'" in run.stderr, run.stderr[-2000:]
    assert "seed 0" not in run.stdout, run.stdout
