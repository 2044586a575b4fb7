"""benchmarks/bench_parallel.py runs at a tiny shape and reports every column."""

import importlib.util
import pathlib

import jax
import pytest

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_parallel.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_parallel", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_shape():
    bench = _module()
    shape = bench.Shape(B=1, T=128, H=2, HV=2, K=8, V=8, chunk_size=16)
    rows = bench.run(shape, 4, 1, prefixes=("gather",), kinds=("forward",))
    assert [(r["kind"], r["name"]) for r in rows] == [("forward", "1 device"), ("forward", "4 devices (gather)")]
    for r in rows:
        assert r["peak"] > 0 and r["time_s"] > 0
        # one device moves nothing; four move the gathered summaries [P, HV, K, K + V]
        # (float32) and the isolation's per-device flags [P, B, HV] (bool: a non-finite
        # input seen, kdax._numerics.isolation)
        if r["name"] == "1 device":
            assert r["moved"] == {}
        else:
            assert r["moved"] == {"all-gather": 4 * 2 * 8 * 16 * 4 + 4 * 1 * 2}
    table = bench.format_rows(rows, shape, 4)
    assert "peak MB/dev" in table and "all-gather" in table
