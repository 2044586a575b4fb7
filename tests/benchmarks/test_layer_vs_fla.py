"""benchmarks/layer_vs_fla.py's CPU side: kdax's half writes what FLA's half loads (FLA's
parameter names and shapes, bf16-exact values), and the report merges an FLA result
into the table with the right errors and ratios. The FLA results here are FIXTURES of
the merge logic, made from known numbers: they are not measurements of FLA (FLA runs on
the GPU only). Times are never asserted."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ._load import load_benchmark

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = dict(B=1, T=32, hidden=16, heads=2, head_dim=8, conv_size=4, norm_eps=1e-6, chunk=16)


@pytest.fixture(scope="module")
def lvf():
    return load_benchmark("layer_vs_fla")


def _bf16_exact(a):
    return np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a)


def test_saved_inputs_are_what_fla_loads(lvf, tmp_path):
    """layer_in.npz: the config FLA's constructor needs, x and w, and one ``p.<name>``
    per parameter of FLA 0.6.0's ``KimiDeltaAttention`` at that config (convolutions
    without bias, the output gate's ``g_proj.1.bias``), FLA's shapes, bf16-exact values."""
    from kdax.nn import weight_shapes

    sd, x, w = lvf.save_inputs(TINY, tmp_path)
    d = np.load(tmp_path / "layer_in.npz")
    cfg = json.loads(str(d["cfg"]))
    assert cfg == TINY
    want = weight_shapes("fla", num_heads=2, head_dim=8, hidden_size=16, conv_size=4)
    assert len(want) == 16 and "g_proj.1.bias" in want and "q_conv1d.bias" not in want
    params = {n[2:]: d[n] for n in d.files if n.startswith("p.")}
    assert {n: p.shape for n, p in params.items()} == want
    assert want["q_conv1d.weight"] == (16, 1, 4) and want["A_log"] == (2,) and want["dt_bias"] == (16,)
    for n, p in params.items():
        assert p.dtype == np.float32 and np.all(np.isfinite(p)) and _bf16_exact(p), n
        assert np.array_equal(p, sd[n])
    assert d["x"].shape == (1, 32, 16) and _bf16_exact(d["x"]) and d["w"].shape == (1, 32, 16)
    assert np.all(params["o_norm.weight"] == 1) and np.any(params["q_proj.weight"] != 0)


NAMES = ("y", "d.x", "d.q_proj.weight", "d.A_log", "d.g_proj.1.bias")


def _fixture_files(work, scale_kdax=1.001, scale_fla=0.998, names=NAMES):
    """FIXTURE of the merge logic, not a result: a 'reference' of random numbers, kdax's
    and FLA's 'outputs' as that reference scaled (rel-RMS errors known exactly)."""
    r = np.random.default_rng(0)
    ref = {n: r.normal(size=(3, 4)).astype(np.float32) for n in NAMES}
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "layer_ref.npz", **ref)
    np.savez(work / "layer_kdax.npz", **{n: ref[n] * scale_kdax for n in NAMES})
    if names is not None:
        np.savez(work / "layer_fla.npz", **{n: ref[n] * scale_fla for n in names})


def _rows(lvf, out, fla=True):
    from fla_side import LAYER_PATH, merge_rows

    kdax = [dict(path=lvf.KDAX_PATH, pass_=p, reps=3, time_ms=t, peak_mib=m, peak_own=True, inputs_mib=10.0,
                 xla_mib=m - 5) for p, t, m in (("fwd", 3.0, 300.0), ("train", 12.0, 900.0))]
    merge_rows(out / "layer.json", kdax, dict(device="fixture", config=TINY), key=("path", "pass_"))
    if fla:  # FIXTURE: what fla_side.py --layer merges, with made-up numbers
        rows = [dict(path=LAYER_PATH, pass_=p, reps=3, time_ms=t, peak_mib=m, peak_own=True, inputs_mib=10.0,
                     xla_mib=None) for p, t, m in (("fwd", 2.0, 200.0), ("train", 8.0, 600.0))]
        merge_rows(out / "layer.json", rows, dict(torch="fixture", fla_layers="fixture"), key=("path", "pass_"))


def test_report_merges_an_fla_result(lvf, tmp_path):
    work, out = tmp_path / "w", tmp_path / "o"
    _fixture_files(work)
    _rows(lvf, out)
    res = lvf.main(["--report", "--work", str(work), "--out", str(out)])
    rows = {(r["path"], r["pass_"]): r for r in res["rows"]}
    k, f = rows[(lvf.KDAX_PATH, "train")], rows[("fla.layers", "train")]
    # errors against the float64 reference: exactly the scales' offsets
    assert k["errors"]["x"] == pytest.approx(1e-3, rel=1e-3) and f["errors"]["x"] == pytest.approx(2e-3, rel=1e-3)
    assert set(k["errors"]) == {"x", "q_proj.weight", "A_log", "g_proj.1.bias"}
    assert rows[(lvf.KDAX_PATH, "fwd")]["errors"] == {"y": pytest.approx(1e-3, rel=1e-3)}
    # kdax against FLA, FLA's values as reference: 1.001 / 0.998 - 1
    assert res["kdax_vs_fla"]["d.A_log"] == pytest.approx(1.001 / 0.998 - 1, rel=1e-3)
    assert k["vs_fla"] == pytest.approx(1.5) and k["mem_vs_fla"] == pytest.approx(1.5)
    assert rows[(lvf.KDAX_PATH, "fwd")]["vs_fla"] == pytest.approx(1.5) and f["vs_fla"] is None
    assert res["missing"] == [] and res["problems"] == []
    assert res["env"]["device"] == "fixture" and res["env"]["torch"] == "fixture"  # both sides' env kept
    text = (out / "layer.txt").read_text().splitlines()
    assert text[3].startswith("fla.layers   fwd") and text[5].startswith("kdax.nn      fwd")
    assert " 1.50 " in text[6] and "1.00e-03" in text[6] and "kdax against FLA" in text[7]
    # the report is idempotent: run again, same numbers
    again = lvf.report(work, out)
    assert again["kdax_vs_fla"] == res["kdax_vs_fla"]


def test_report_says_what_is_missing(lvf, tmp_path):
    """No FLA outputs (its step did not run): kdax's errors still computed, FLA's
    comparison named as missing; FLA outputs lacking a parameter: not compared, named."""
    work, out = tmp_path / "w", tmp_path / "o"
    _fixture_files(work, names=None)
    _rows(lvf, out, fla=False)
    res = lvf.report(work, out)
    assert res["kdax_vs_fla"] is None and res["missing"] == ["FLA's outputs (layer_fla.npz)"]
    assert all(r["errors"] and r["vs_fla"] is None for r in res["rows"])
    assert "missing: FLA's outputs" in (out / "layer.txt").read_text()
    _fixture_files(work, names=NAMES[:-1])  # FLA's file lacks g_proj.1.bias
    _rows(lvf, out)
    res = lvf.report(work, out)
    assert res["kdax_vs_fla"] is None and len(res["problems"]) == 2
    assert all("g_proj.1.bias" in p for p in res["problems"])
    assert "not compared" in (out / "layer.txt").read_text()


@pytest.mark.slow
def test_kdax_half_end_to_end(lvf, tmp_path):
    """kdax's half at a tiny shape on the CPU: inputs, kdax's outputs and the float64
    reference written, its rows merged; then a FIXTURE standing in for FLA's half
    (kdax's outputs scaled by 1.002, not FLA) and the report."""
    work, out = tmp_path / "w", tmp_path / "o"
    lvf.main(["--work", str(work), "--out", str(out), "--reps", "1"]
             + [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))])
    kd = dict(np.load(work / "layer_kdax.npz"))
    ref = dict(np.load(work / "layer_ref.npz"))
    names = {"y", "d.x"} | {"d." + n[2:] for n in np.load(work / "layer_in.npz").files if n.startswith("p.")}
    assert set(kd) == set(ref) == names
    np.savez(work / "layer_fla.npz", **{n: v * 1.002 for n, v in kd.items()})  # FIXTURE, not FLA
    from fla_side import LAYER_PATH, merge_rows

    merge_rows(out / "layer.json", [dict(path=LAYER_PATH, pass_=p, reps=1, time_ms=1.0, peak_mib=None,
                                         peak_own=True, xla_mib=None) for p in ("fwd", "train")], {},
               key=("path", "pass_"))
    res = lvf.report(work, out)
    k = {r["pass_"]: r for r in res["rows"] if r["path"] == lvf.KDAX_PATH}
    # bf16 parameters and activations against float64: small, not zero
    assert 1e-5 < k["fwd"]["errors"]["y"] < 3e-2 and 1e-5 < k["train"]["errors"]["x"] < 3e-2
    assert all(np.isfinite(e) for e in k["train"]["errors"].values())
    assert set(res["kdax_vs_fla"]) == names  # every output and gradient compared, each off by the fixture's scale
    assert all(v == pytest.approx(0.002 / 1.002, rel=1e-3) for v in res["kdax_vs_fla"].values())
    assert k["train"]["compile_s"] > 0 and k["train"]["xla_mib"] > 0
