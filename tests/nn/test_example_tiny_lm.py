"""Smoke test of the tiny KDA language model example (``examples/tiny_lm.py``): a few
training steps, the no-memory baseline, and greedy generation with the cache equal to
teacher-forced logits; runs are repeatable with a seed; the outputs go to a git-ignored
folder, never over the committed ``examples/results/``."""

import dataclasses
import importlib.util
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("optax")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "tiny_lm.py"
SMALL = dict(pairs=3, keys=6, values=6, d_model=16, heads=2, head_dim=8, layers=1, mlp=16, batch=4, lr=1e-2,
             train_mode="recurrent")


def load():
    spec = importlib.util.spec_from_file_location("tiny_lm", SCRIPT)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    return lm


def test_tiny_lm_few_steps():
    lm = load()
    cfg = lm.Config(steps=3, **SMALL)
    inputs, targets, answer = lm.make_batch(lm.jax.random.key(0), cfg)
    assert inputs.shape == (4, 11) and int(answer.sum()) == 4 * 3
    # each answer is the value paired with the queried key earlier in the sequence
    seq = np.concatenate([np.asarray(inputs), np.asarray(targets[:, -1:])], 1)
    for row in seq:
        pairs = dict(zip(row[0:6:2], row[1:6:2]))
        assert all(pairs[row[i]] == row[i + 1] for i in range(6, 12, 2))
    model, losses, _ = lm.train(cfg, log=None)
    _, base_losses, _ = lm.train(cfg, memory=False, log=None)
    assert losses.shape == (3,) and np.all(np.isfinite(losses)) and np.all(np.isfinite(base_losses))
    diff, scale, _ = lm.generation_check(model, cfg)
    assert diff <= 1e-5 * max(scale, 1.0), (diff, scale)  # float32: recurrent steps vs one chunked call


def test_tiny_lm_same_seed_same_run():
    """Same seed: bitwise the same losses and parameters; another seed: other losses."""
    lm = load()
    cfg = lm.Config(steps=4, **SMALL)
    m1, l1, _ = lm.train(cfg, log=None)
    m2, l2, _ = lm.train(cfg, log=None)
    _, l3, _ = lm.train(dataclasses.replace(cfg, seed=1), log=None)
    assert np.array_equal(l1, l2), (l1, l2)
    leaves = lambda m: lm.jax.tree.leaves(lm.eqx.filter(m, lm.eqx.is_array))
    assert all(np.array_equal(a, b) for a, b in zip(leaves(m1), leaves(m2)))
    assert not np.array_equal(l1, l3)


def test_tiny_lm_writes_to_an_ignored_folder(tmp_path, monkeypatch):
    """The default output folder is examples/out/ (git-ignored), not the committed
    examples/results/; --out writes the CSV and the summary there."""
    lm = load()
    assert lm.parser().parse_args([]).out == SCRIPT.parent / "out"
    git = shutil.which("git")
    if git and (ROOT / ".git").exists():
        ignored = subprocess.run([git, "check-ignore", "-q", "examples/out/tiny_lm.txt"], cwd=ROOT)
        assert ignored.returncode == 0, "examples/out/ must be git-ignored"

    @dataclasses.dataclass(frozen=True)
    class Small(lm.Config):  # main() builds Config(steps=..., seed=...): the tiny model's defaults
        pairs: int = 3
        keys: int = 6
        values: int = 6
        d_model: int = 16
        head_dim: int = 8
        layers: int = 1
        mlp: int = 16
        batch: int = 4
        train_mode: str = "recurrent"

    monkeypatch.setattr(lm, "Config", Small)
    out = lm.main(["--steps", "2", "--out", str(tmp_path / "run"), "--no-plot"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["tiny_lm.txt", "tiny_lm_loss.csv"]
    rows = (tmp_path / "run" / "tiny_lm_loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss_kda,loss_no_memory" and len(rows) == 3
    summary = (tmp_path / "run" / "tiny_lm.txt").read_text()
    assert f"JAX {lm.jax.__version__}, seed 0" in summary and f"KDA {out['acc']:.4f}" in summary
