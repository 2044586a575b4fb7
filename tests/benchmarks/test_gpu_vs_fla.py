"""benchmarks/gpu_vs_fla.py's CPU side: FLA reported as skipped where it cannot run, the
table and ratios, argument errors; end to end on a tiny shape with -m slow (times are
not asserted: speed is measured on the GPU, never in tests)."""

import json
import sys

import numpy as np
import pytest

from ._load import load_benchmark

@pytest.fixture(scope="module")
def gvf():
    return load_benchmark("gpu_vs_fla")


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
    # a second process's path on the saved inputs and reference (gpu_candidate_run.py's per-path
    # processes): its rows join the first's, checked against the same reference
    gvf.main(["--shapes", "1x64x2", "--K", "32", "--V", "32", "--pipes", "default+no_recompute", "--reps", "2",
              "--no-fla", "--load-ref", str(tmp_path / "ref_{shape}.npz"), "--out", str(out)])
    rows = {(r["path"], r["pass_"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    for pas in ("fwd", "train"):
        r = rows[("kdax[default+no_recompute]", pas)]
        assert r["ok"] and r["errors"] and r["xla_mib"] > 0 and r["compile_s"] > 0, r
        assert r["peak_mib"] is None  # the CPU backend reports no device memory
    assert rows[("kdax[reference]", "train")]["ok"]
    # the same path, the same inputs: recomputing or keeping h and v_new gives the same output
    assert rows[("kdax[default+no_recompute]", "fwd")]["errors"]["o"] == pytest.approx(
        rows[("kdax[reference]", "fwd")]["errors"]["o"], rel=1e-6)


def test_no_recompute_is_a_call_option(gvf, monkeypatch):
    """``+no_recompute`` leaves the pipeline as it is and reaches ``chunk_kda`` as
    ``disable_recompute=True`` (issue 26 item 4's row); ``default`` is what
    ``chunk_kda(pipeline=None)`` runs."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from kdax.pipeline import default_pipeline

    assert gvf.call_options("default+no_recompute") == {"disable_recompute": True}
    assert gvf.call_options("default") == {} and gvf.call_options("reference+fast") == {}
    assert eqx.tree_equal(gvf.kdax_pipeline("default+no_recompute"), default_pipeline())
    seen = []

    def fake_chunk_kda(q, k, v, *args, **kwargs):  # records the call instead of running the kernel
        seen.append(kwargs)
        return v * 0, None

    monkeypatch.setattr(gvf.kdax, "chunk_kda", fake_chunk_kda)
    for name in ("default+no_recompute", "default"):
        fwd, step = gvf.kdax_fns(gvf.kdax_pipeline(name), 64, **gvf.call_options(name))
        s = [jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.bfloat16)] * 4 + [jax.ShapeDtypeStruct((1, 64, 2), jnp.bfloat16),
                                                                        jax.ShapeDtypeStruct((2,), jnp.float32),
                                                                        jax.ShapeDtypeStruct((64,), jnp.float32)]
        jax.eval_shape(step, *s, jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32))
        assert seen[-1].get("disable_recompute", False) is (name == "default+no_recompute")
        assert seen[-1]["pipeline"] is not None and seen[-1]["use_gate_in_kernel"]


def test_column_and_state_tile_options(gvf):
    """``+cols=N`` sets the chunk-parallel Pallas kernels' feature blocks and nothing else;
    ``+block_k=N`` the state kernels' row tiles and nothing else; ``+incast`` their
    rounding of product-only operands in the kernel and nothing else."""
    from kdax.pallas._common import PallasFeatureBlocks
    from kdax.pallas import PallasDhu, PallasState

    base = gvf.kdax_pipeline("pallas")
    cols = gvf.kdax_pipeline("pallas+cols=16")
    tiles = gvf.kdax_pipeline("pallas+block_k=64")
    blocked = [n for n in ("intra", "wy", "wy_dqkg", "intra_bwd") if isinstance(getattr(base, n), PallasFeatureBlocks)]
    assert blocked == ["intra", "wy", "wy_dqkg", "intra_bwd"]
    for n in blocked:
        assert getattr(cols, n).block_k == 16 and getattr(tiles, n) == getattr(base, n)
    incast = gvf.kdax_pipeline("pallas+incast")
    for n, cls in (("state", PallasState), ("dhu", PallasDhu)):
        assert isinstance(getattr(base, n), cls)
        assert getattr(cols, n) == getattr(base, n) and getattr(tiles, n).block_k == 64
        assert getattr(incast, n).round_in_kernel and not getattr(base, n).round_in_kernel
    assert all(getattr(incast, n) == getattr(base, n) for n in blocked)
    noviews = gvf.kdax_pipeline("pallas+noviews")
    assert all(getattr(base, n).read_views and not getattr(noviews, n).read_views for n in blocked + ["state", "gate"])


def test_one_stage_warps(gvf):
    """``+warps.FIELD=N`` sets that Pallas stage's warps and nothing else, after ``+warps=N``
    set every stage's; a field that is not a Pallas stage is named in the error."""
    import dataclasses

    from kdax.pallas._common import PallasTarget

    path = gvf.kdax_pipeline("pallas+warps=8+warps.intra_bwd=16")
    fields = [f.name for f in dataclasses.fields(path) if isinstance(getattr(path, f.name), PallasTarget)]
    assert "intra_bwd" in fields and len(fields) > 5
    assert {n: getattr(path, n).num_warps for n in fields} == {n: 16 if n == "intra_bwd" else 8 for n in fields}
    with pytest.raises(ValueError, match="'precision' is not a Pallas stage"):
        gvf.kdax_pipeline("pallas+warps.precision=16")


def test_table_memory_pending_and_superseded_rows(gvf):
    """Memory columns (a peak that may not be the row's own is starred), rows still
    waiting for the float64 reference, and a path's "skipped" row dropped once a later
    process timed it; FLA first within a shape."""
    base = dict(B=1, T=64, H=2, K=32, V=32, chunk=64, dtype="bfloat16")
    rows = [
        dict(base, path="fla", pass_="-", status="skipped: --no-fla given"),
        dict(base, path="kdax[default]", pass_="train", time_ms=6.0, reps=3, peak_mib=1500.4, peak_own=True,
             xla_mib=1200.0, errors={"q": 1e-3}, status="ok"),
        dict(base, path="kdax[default+no_recompute]", pass_="train", time_ms=5.0, reps=3, peak_mib=2100.0,
             peak_own=False, xla_mib=1900.0, errors={}, status="errors pending: the float64 reference did not finish"),
        dict(base, path="fla", pass_="train", time_ms=4.0, reps=3, peak_mib=900.0, peak_own=True, xla_mib=None,
             errors={"q": 4e-3}, status="ok"),
    ]
    rows = gvf.with_ratios(gvf.current(rows))
    assert [r["path"] for r in rows if r["pass_"] == "-"] == []  # FLA was timed at this shape after all
    text = gvf.table(rows, "head").splitlines()
    body = text[3:]
    assert body[0].split()[3] == "fla"  # FLA first, then kdax's paths in the order they came
    line = {ln.split()[3]: ln for ln in body}
    assert " 1500 " in line["kdax[default]"] and " 1200 " in line["kdax[default]"]
    assert " 2100* " in line["kdax[default+no_recompute]"]  # not this path's own peak
    assert "errors pending" in line["kdax[default+no_recompute]"]
    assert " 1.25 " in line["kdax[default+no_recompute]"]  # 5.0 / 4.0
    assert " 1.50 " in line["kdax[default]"]  # 6.0 / 4.0 against FLA's training step


def test_inputs_are_bf16_exact_and_deterministic(gvf):
    import ml_dtypes

    a, b = gvf.make_inputs(1, 16, 2, 8, 8, seed=3), gvf.make_inputs(1, 16, 2, 8, 8, seed=3)
    for n in ("q", "k", "v", "g", "beta"):
        assert a[n].dtype == np.float32 and np.array_equal(a[n], b[n])
        assert np.array_equal(a[n].astype(ml_dtypes.bfloat16).astype(np.float32), a[n])
    assert a["A_log"].shape == (2,) and a["dt_bias"].shape == (16,) and a["w"].shape == (1, 16, 2, 8)


def test_reference_file_round_trip(gvf, tmp_path):
    """``--save-ref`` writes what ``--load-ref`` and fla_side.py read back."""
    x = gvf.make_inputs(1, 16, 2, 8, 8)
    r = np.random.default_rng(0)
    ref = (r.normal(size=(1, 16, 2, 8)), {n: r.normal(size=x[n].shape) for n in gvf.GRAD_NAMES})
    path = tmp_path / "sub" / "ref_1x16x2.npz"
    gvf.save_ref(path, x, ref)
    x2, ref2 = gvf.load_ref(path)
    assert all(np.array_equal(x[n], x2[n]) for n in x)
    assert np.allclose(ref2[0], ref[0], rtol=1e-6) and ref2[0].dtype == np.float64
    assert all(np.allclose(ref2[1][n], ref[1][n], rtol=1e-6) for n in gvf.GRAD_NAMES)
    with pytest.raises(ValueError, match="--load-ref"):  # the file holds another shape
        gvf.bench_shape((1, 32, 2), ["default"], 8, 8, 64, 1, 60.0, "--no-fla given", lambda r: None,
                        load_ref_from=str(path))
