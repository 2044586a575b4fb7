"""``examples/custom_stage.py`` checks its own gradients against plain JAX (issue 50): the
script runs as written and prints the comparison; the check holds to float64 budgets and
catches a backward stage that forgets the gain's transpose."""

import pathlib
import subprocess
import sys
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from kdax.stages import AbstractGateBackward, ReferenceGateBackward
from kdax.testing import Case, check_stage

from ._util import load_example

EX = load_example("custom_stage")
ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("o", "d k_scale", "d gain (F1's copy)", "d q", "d k", "d v", "d g", "d beta")


def _layer(dtype, backward=None):
    gain = jnp.array([0.5, 2.0], dtype)
    pipe = EX.gain_pipeline(gain)
    if backward is not None:
        pipe = eqx.tree_at(lambda p: p.gate_bwd, pipe, backward(gain))
    return EX.Layer(jnp.ones((8,), dtype), pipe)


def _run(layer, x):
    d, *d_x = EX.model_grads((layer, *x))
    o = eqx.filter_jit(lambda m, *a: m(*a))(layer, *x)  # under jit, as the script runs it
    return o, d, tuple(d_x)


def test_script_runs_and_prints_its_check():
    run = subprocess.run([sys.executable, "examples/custom_stage.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "checked against plain JAX" in out and "float32" in out
    for name in NAMES:
        line = next(l for l in out.splitlines() if l.strip().startswith(name + " "))
        assert line.rstrip().endswith("ok"), line
    assert "MISMATCH" not in out


def test_float64_check_against_plain_jax():
    x = EX.inputs(jax.random.key(0), dtype=jnp.float64)
    layer = _layer(jnp.float64)
    o, d, d_x = _run(layer, x)
    errors = EX.check_against_plain_jax(layer, x, o, d, d_x, verbose=False)
    assert sorted(errors) == sorted(NAMES)
    assert all(e <= 1e-10 for e in errors.values()), errors


class ForgetsTheGain(AbstractGateBackward):
    """A wrong B5: declares the transpose of QGainGate but leaves dq unscaled."""

    gain: jax.Array
    transposes: ClassVar[dict] = {"gate": "kda+qgain"}

    def __call__(self, config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG):
        return ReferenceGateBackward()(config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG)


def test_check_raises_on_a_wrong_backward():
    x = EX.inputs(jax.random.key(0), dtype=jnp.float64)
    layer = _layer(jnp.float64, ForgetsTheGain)
    o, d, d_x = _run(layer, x)
    with pytest.raises(EX.GradientMismatch, match=r"d q: relative RMS .* > 1e-10") as e:
        EX.check_against_plain_jax(layer, x, o, d, d_x, verbose=False)
    assert "d k_scale" not in str(e.value)  # the gain's transpose touches dq alone
    # one wrong number in the layer's gradient is named too
    good = _layer(jnp.float64)
    o, d, d_x = _run(good, x)
    off = eqx.tree_at(lambda t: t.k_scale, d, d.k_scale.at[0].multiply(1 + 1e-6))
    with pytest.raises(EX.GradientMismatch, match=r"d k_scale: relative RMS"):
        EX.check_against_plain_jax(good, x, o, off, d_x, verbose=False)


def test_check_stage_compares_b5_with_the_vjp_of_its_f1():
    """A B5 transposing an F1 of other math, checked in that F1's pipeline (``base=``):
    its values against ``jax.vjp`` of the F1 (``GateVjpBackward``), where before nothing
    compared them and the wrong one passed."""
    gain = jnp.array([0.5, 2.0])
    base, cases = EX.gain_pipeline(gain), (Case("dense f64"), Case("packed f64"), Case("dense f32"))
    good = check_stage(EX.QGainGateBackward(gain), "gate_bwd", base=base, cases=cases)
    rows = [c for c in good.checks if c.name == "reference"]
    assert good.ok and not good.not_compared and len(rows) == 3, str(good)
    assert all("vs jax.vjp of QGainGate" in c.detail for c in rows), str(good)
    bad = check_stage(ForgetsTheGain(gain), "gate_bwd", base=base, cases=cases)
    failed = [c for c in bad.checks if c.passed is False]
    assert {c.name for c in failed} == {"reference"} and len(failed) == 3, str(bad)
    assert all("transposes 'kda+qgain' but differs from jax.vjp of QGainGate" in c.detail and "(.dq)" in c.detail
               for c in failed), str(bad)
    # without the F1 it transposes, nothing to compare with: said, and how to get it
    alone = check_stage(ForgetsTheGain(gain), "gate_bwd", cases=cases[:1])
    assert alone.ok and len(alone.not_compared) == 1 and "given base=" in alone.not_compared[0].detail, str(alone)


class OpaqueGain(EX.QGainGate):
    """``QGainGate`` as JAX cannot differentiate it (an opaque kernel, as a Pallas one of other
    math may be)."""

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return _no_vjp(lambda *a: EX.QGainGate.__call__(self, config, *a), q, k, g, beta, A_log, dt_bias, valid)


def _no_vjp(f, *args):
    @jax.custom_jvp
    def opaque(*a):
        return f(*a)

    @opaque.defjvp
    def _(primals, tangents):
        raise NotImplementedError("OpaqueGain has no derivative")

    return opaque(*args)


def test_check_stage_of_b5_beside_an_f1_jax_cannot_differentiate():
    gain = jnp.array([0.5, 2.0])
    base = eqx.tree_at(lambda p: (p.gate, p.gate_bwd), EX.gain_pipeline(gain), (OpaqueGain(gain),
                                                                               EX.QGainGateBackward(gain)))
    report = check_stage(EX.QGainGateBackward(gain), "gate_bwd", base=base, cases=(Case("dense f64"),))
    assert report.ok and len(report.not_compared) == 1, str(report)
    assert "jax.vjp of OpaqueGain raised" in report.not_compared[0].detail, str(report)
