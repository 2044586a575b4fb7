"""benchmarks/gpu_vs_fla.py's CPU side: FLA reported as skipped where it cannot run, the
table and ratios, argument errors; end to end on a tiny shape with -m slow (times are
not asserted: speed is measured on the GPU, never in tests)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_vs_fla.py"


@pytest.fixture(scope="module")
def gvf():
    spec = importlib.util.spec_from_file_location("gpu_vs_fla", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fla_absent_is_a_reason(gvf, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    reason = gvf.fla_available()
    assert isinstance(reason, str) and reason.startswith("no PyTorch")


def _row(path, pas, t, **errors):
    return dict(B=1, T=64, H=2, K=32, V=32, chunk=64, dtype="bfloat16", path=path, pass_=pas, time_ms=t,
                errors=errors, status="ok")


def test_table_ratios_and_skipped_rows(gvf):
    rows = [
        dict(B=1, T=64, H=2, K=32, V=32, chunk=64, dtype="bfloat16", path="fla", pass_="-",
             status="skipped: no CUDA device for PyTorch"),
        _row("kdax[reference]", "fwd", 2.0, o=1e-3),
        _row("kdax[reference]", "train", 6.0, q=1e-3, k=1e-3, v=1e-3, g=1.5e-2, beta=1e-3, A_log=1e-3, dt_bias=1e-3),
    ]
    rows = gvf.with_ratios(rows)
    assert all(r.get("vs_fla") is None for r in rows)  # nothing to compare with
    text = gvf.table(rows, "head")
    assert "skipped: no CUDA device for PyTorch" in text
    assert "1.50e-02 (dg)" in text  # the error nearest its tolerance is the one shown
    rows += [_row("fla", "fwd", 1.0, o=4e-3), _row("fla", "train", 4.0, q=4e-3)]
    ratios = {(r["path"], r["pass_"]): r["vs_fla"] for r in gvf.with_ratios(rows)}
    assert ratios[("kdax[reference]", "fwd")] == 2.0 and ratios[("kdax[reference]", "train")] == 1.5


def test_bad_arguments(gvf):
    with pytest.raises(SystemExit):
        gvf.main(["--shapes", "1x64"])
    with pytest.raises(ValueError, match="--pipes"):
        gvf.main(["--shapes", "", "--pipes", "triton_fast"])


@pytest.mark.slow
def test_end_to_end_without_fla(gvf, tmp_path):
    """The kdax half at a tiny shape with FLA unavailable: FLA's row says skipped, kdax's
    rows are timed and within FLA's tolerances, the inputs and reference are saved."""
    out = tmp_path / "res"
    gvf.main(["--shapes", "1x64x2", "--K", "32", "--V", "32", "--pipes", "reference", "--reps", "2",
              "--no-fla", "--save-ref", str(tmp_path / "ref_{shape}.npz"), "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    rows = {(r["path"], r["pass_"]): r for r in res["rows"]}
    assert rows[("fla", "-")]["status"].startswith("skipped")
    for pas in ("fwd", "train"):
        r = rows[("kdax[reference]", pas)]
        assert r["ok"] and r["time_ms"] > 0, r
    assert "kdax[reference]" in (out / "results.txt").read_text()
    saved = np.load(tmp_path / "ref_1x64x2.npz")
    assert {"in_q", "in_w", "ref_o", "ref_dt_bias"} <= set(saved.files)
