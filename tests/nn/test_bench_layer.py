"""The layer benchmark (``benchmarks/bench_layer.py``) runs end to end at a tiny shape and
writes its rows (speed is measured by the script, never asserted here)."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_layer.py"


RESULTS = SCRIPT.parent / "results" / "layer.txt"
TINY = dict(B=1, T=40, hidden=16, heads=2, head_dim=8, chunk_size=16, batch=3)


def _load():
    spec = importlib.util.spec_from_file_location("bench_layer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rows", ["decode", pytest.param("train,decode,decode_chunk", marks=pytest.mark.slow)])
def test_bench_layer_rows(tmp_path, rows):
    out = tmp_path / "layer.txt"
    got = _load().main(["--reps", "1", "--rows", rows, "--out", str(out)], **TINY)
    names = {"train": "train", "decode": "decode[recurrent]", "decode_chunk": "decode[chunk]"}
    names = [names[r] for r in rows.split(",")]
    assert [r["row"] for r in got] == names
    for r in got:
        assert r["layer_s"] > 0 and r["kernel_s"] > 0 and 0 < r["share"]
    text = out.read_text()
    assert all(n in text for n in names) and "share" in text


def test_committed_results_have_the_rows():
    text = RESULTS.read_text()
    assert "B=1 T=4096 hidden=1024 H=8 K=V=128" in text and "batch=16 1 token" in text
    assert all(n in text for n in ("train", "decode[recurrent]", "decode[chunk]"))


def test_base_mode_times_the_step_against_another_revision():
    """``--base HEAD``: the train row's step of this tree against HEAD's, in one process (the
    same parameters: the gradients agree where the layer's code is unchanged)."""
    line = _load().main(["--reps", "1", "--base", "HEAD"], **TINY)
    assert "new/base best" in line and "temporaries" in line
    diff = float(line.rsplit(" ", 1)[1])
    assert 0 <= diff < 1e-3, line
