"""Smoke test of the tiny KDA language model example (``examples/tiny_lm.py``): a few
training steps, the no-memory baseline, and greedy generation with the cache equal to
teacher-forced logits."""

import importlib.util
import pathlib

import numpy as np
import pytest

pytest.importorskip("optax")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_lm.py"


def test_tiny_lm_few_steps():
    spec = importlib.util.spec_from_file_location("tiny_lm", SCRIPT)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    cfg = lm.Config(pairs=3, keys=6, values=6, d_model=16, heads=2, head_dim=8, layers=1, mlp=16, batch=4,
                    steps=3, lr=1e-2, train_mode="recurrent")
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
