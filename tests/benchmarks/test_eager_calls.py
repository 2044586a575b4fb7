"""``benchmarks/eager_calls.py`` runs end to end at tiny shapes and writes its table (speed
is measured by the script, never asserted here); the committed results hold every row."""

from ._load import BENCH, load_benchmark

TINY = dict(decode=(2, 2, 8), small=(1, 1, 4), long=(1, 16, 2, 8), layer=(2, 16, 2, 8))
NAMES = ["recurrent decode", "recurrent decode", "recurrent small", "recurrent T=16", "recurrent T=16 grad",
         "layer decode"]


def test_rows_at_tiny_shapes(tmp_path):
    out = tmp_path / "eager_calls.txt"
    rows = load_benchmark("eager_calls").main(["--reps", "2", "--op-by-op", "--out", str(out)], **TINY)
    assert [r["row"] for r in rows] == NAMES
    for r in rows:
        assert r["eager_s"] > 0 and r["jit_s"] > 0 and r["first_s"] > 0
        assert r["ratio"] == r["eager_s"] / r["jit_s"]
    text = out.read_text()
    assert "before issue 50" in text and text.count("layer decode") == 2 and "ratio" in text


def test_committed_results_have_every_row():
    text = (BENCH / "results" / "eager_calls.txt").read_text()
    assert "2-core CPU" in text and "before issue 50" in text
    for name in ("recurrent decode", "recurrent small", "recurrent T=512", "recurrent T=512 grad", "layer decode"):
        assert text.count(name) >= 2, name
