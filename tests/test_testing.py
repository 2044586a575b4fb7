"""kdax.testing: check_stage / check_pipeline pass on every shipped stage and pipeline and
fail, naming the check, on deliberately broken ones."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import pytest

import kdax
from kdax.stages import (
    KDA,
    AbstractDAv,
    AbstractGate,
    AbstractOutput,
    AbstractState,
    ReferenceDAv,
    ReferenceGate,
    ReferenceOutput,
    ReferenceState,
)
from kdax.testing import Case, check_pipeline, check_stage

from ._util import load_example

FIELDS = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


def _assert_ok(report):
    assert report.ok, str(report)


def _assert_fails(report, check):
    assert not report.ok, str(report)
    assert check in report.names_failed, f"expected {check!r} to fail:\n{report}"


# -- shipped stages ---------------------------------------------------------------------


# The default run keeps to float64 and one Pallas target (the file in a few minutes on two
# cores); every dtype, the TPU-target stages and the Pallas pipelines run with -m slow.


@pytest.mark.parametrize("field", FIELDS)
def test_reference_stages_pass(field):
    report = check_stage(getattr(kdax.KDAPipeline.reference(), field), field, dtypes=(jnp.float64,))
    _assert_ok(report)
    names = {c.name for c in report.checks}
    assert {"contract", "reference", "nan-isolation", "jit", "vmap"} <= names
    assert "reference" in {c.name for c in report.checks if c.passed}
    if kdax.pipeline.STAGES[field].forward:  # and on a tile of each case (tile_safe stages)
        assert any(c.name == "reference" and c.case.endswith(" tile") and c.passed for c in report.checks)


# (default: the Triton kernels rebuilt for issue 36 and one state kernel; the rest with -m slow)
FAST_PALLAS = ("intra", "intra_bwd", "state")


@pytest.mark.parametrize("field", [f if f in FAST_PALLAS else pytest.param(f, marks=pytest.mark.slow) for f in FIELDS])
def test_pallas_triton_stages_pass(field):
    stage = getattr(kdax.KDAPipeline.pallas("triton", interpret=True), field)
    _assert_ok(check_stage(stage, field, dtypes=(jnp.float64,)))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["triton", "tpu"])
@pytest.mark.parametrize("field", FIELDS)
def test_pallas_stages_pass_every_dtype(target, field):
    stage = getattr(kdax.KDAPipeline.pallas(target, interpret=True), field)
    _assert_ok(check_stage(stage, field))


@pytest.mark.slow
@pytest.mark.parametrize("field", FIELDS)
def test_reference_stages_pass_every_dtype(field):
    _assert_ok(check_stage(getattr(kdax.KDAPipeline.reference(), field), field))


def test_example_stages_pass():
    ex = load_example("custom_stage")
    gain = jnp.array([0.5, 2.0])
    pipe = ex.gain_pipeline(gain)
    _assert_ok(check_stage(pipe.gate, "gate", base=pipe))
    _assert_ok(check_stage(pipe.gate_bwd, "gate_bwd", base=pipe))
    _assert_ok(check_pipeline(pipe))


@pytest.mark.parametrize("make", [
    lambda: kdax.KDAPipeline.reference(),
    pytest.param(lambda: kdax.KDAPipeline.pallas("triton", interpret=True), marks=pytest.mark.slow),
    pytest.param(lambda: kdax.KDAPipeline.pallas("tpu", interpret=True), marks=pytest.mark.slow),
    pytest.param(lambda: kdax.KDAPipeline.mixed("triton", interpret=True), marks=pytest.mark.slow),
], ids=["reference", "triton", "tpu", "mixed"])
def test_shipped_pipelines_pass(make):
    report = check_pipeline(make())
    _assert_ok(report)
    assert {"gradients", "forward", "layouts"} <= {c.name for c in report.checks if c.passed}


# -- broken stages --------------------------------------------------------------------------


class OffByOnePercentOutput(AbstractOutput):
    """Declares KDA's F5 but is 1% off."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        return 1.01 * ReferenceOutput()(scale, qg, h, Aqk, v_new)


class LeakyOutput(AbstractOutput):
    """KDA's F5 plus ``0 * (a sum over every row and chunk)``: a NaN anywhere reaches all."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return o + 0.0 * jnp.sum(o, axis=(0, 2, 3), keepdims=True)


class WrongShapeOutput(AbstractOutput):
    """Returns one value channel too few."""

    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)[..., 1:]


class MisreadsResetGate(AbstractGate):
    """Declares ``reset`` and reads it as "no write" (beta = 0 at each sequence's first
    token): right on every layout without resets, wrong on shared chunks. (A stage that
    merely ignores ``reset`` gives the same numbers: F1's floor and the other stages'
    masks each make the reset exact, so that declaration is harmless.)"""

    math: ClassVar = "kda-misreading-resets"
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        act = ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid, reset)
        if reset is None:
            return act
        return dataclasses.replace(act, beta=jnp.where(reset[:, None], 0.0, act.beta))


class ZeroStartState(AbstractState):
    """Ignores ``h0`` (assumes zero initial states) and declares ``tile_safe``: right on
    whole inputs without initial states, wrong on tiles (which carry the state in h0)."""

    math: ClassVar = "kda-from-zero"
    accepts: ClassVar[frozenset] = frozenset({"tile_safe", "reset"})

    def __call__(self, w, u, kg, G, h0, layout, reset=None):
        return ReferenceState()(w, u, kg, G, jnp.zeros_like(h0), layout, reset)


class MisreadsHalfOutput(AbstractOutput):
    """Declares ``half_stored`` and reads a bf16 ``v_new`` 1% off: right on float32 (and
    float64) arguments, wrong on the bf16 intermediates the "fast" policy stores."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"half_stored"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        dt = jnp.promote_types(qg.dtype, jnp.float32)  # (qg too is stored bf16 under "fast")
        if v_new.dtype == jnp.bfloat16:
            v_new = 1.01 * v_new.astype(dt)
        return ReferenceOutput()(scale, qg.astype(dt), h.astype(dt), Aqk.astype(dt), v_new.astype(dt))


class ScaledDvDAv(AbstractDAv):
    """A B1 declaring it transposes KDA's F5, with dv_intra 1% off."""

    transposes: ClassVar = {"output": KDA}

    def __call__(self, v_new, Aqk, do):
        dAqk, dv = ReferenceDAv()(v_new, Aqk, do)
        return dAqk, 1.01 * dv


def _small():
    return dict(dtypes=(jnp.float64,))


def test_one_percent_error_fails_reference():
    _assert_fails(check_stage(OffByOnePercentOutput(), "output", **_small()), "reference")


def test_nan_leak_fails_isolation():
    _assert_fails(check_stage(LeakyOutput(), "output", **_small()), "nan-isolation")


def test_wrong_shape_fails_contract():
    report = check_stage(WrongShapeOutput(), "output", **_small())
    _assert_fails(report, "contract")
    assert "expected" in report.failed[0].detail


def test_false_reset_fails():
    report = check_stage(MisreadsResetGate(), "gate", **_small())
    _assert_fails(report, "reset")
    assert "declares `reset`" in next(c for c in report.failed if c.name == "reset").detail


def test_false_tile_safe_fails():
    _assert_fails(check_stage(ZeroStartState(), "state", **_small()), "tile_safe")


def test_false_half_stored_fails():
    report = check_stage(MisreadsHalfOutput(), "output", **_small())
    _assert_fails(report, "half_stored")
    assert "declares `half_stored`" in next(c for c in report.failed if c.name == "half_stored").detail


class ZeroStartKDAState(AbstractState):
    """ZeroStartState declaring KDA's math: right on whole inputs without initial states,
    so the pipeline would tile it (a KDA stage that declares tile_safe); a tile starts
    from a carried state, and the reference check on a tile of each case reports it."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe", "reset"})

    def __call__(self, w, u, kg, G, h0, layout, reset=None):
        return ReferenceState()(w, u, kg, G, jnp.zeros_like(h0), layout, reset)


def test_wrong_kda_on_tiles_fails_reference():
    # (whole inputs without initial states, where it is right; "packed f64 tile" starts
    # from a carried state)
    case = Case("packed f64", B=1, T=40, cu=(0, 7, 23, 40), h0=False)
    report = check_stage(ZeroStartKDAState(), "state", cases=(case,))
    rows = {c.case: c.passed for c in report.checks if c.name == "reference"}
    assert rows == {"packed f64": True, "packed f64 tile": False}, str(report)


def test_wrong_family_fails():
    _assert_fails(check_stage(ReferenceOutput(), "gate"), "family")


def test_wrong_backward_fails_check_pipeline():
    pipe = eqx.tree_at(lambda p: p.dav, kdax.KDAPipeline.reference(), ScaledDvDAv())
    _assert_fails(check_pipeline(pipe), "gradients")
    # and the stage alone: it declares KDA's transpose, and differs from ReferenceDAv
    _assert_fails(check_stage(ScaledDvDAv(), "dav", **_small()), "reference")


@pytest.mark.slow
def test_custom_math_pipeline_passes_check_pipeline():
    # A forward stage of other math with the reference backward: the gradient is derived
    # (exact), so check_pipeline passes.
    class Scaled(AbstractOutput):
        math: ClassVar = "2 kda"

        def __call__(self, scale, qg, h, Aqk, v_new):
            return 2.0 * ReferenceOutput()(scale, qg, h, Aqk, v_new)

    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), Scaled())
    report = check_pipeline(pipe)
    _assert_ok(report)
    assert any("derived" in c.detail for c in report.checks if c.name == "gradients")


def test_report_table():
    report = check_stage(ReferenceOutput(), "output", cases=(Case("dense f64"),))
    text = str(report)
    assert text.splitlines()[0].endswith("ok")
    assert "contract" in text and "reference" in text
    failed = check_stage(OffByOnePercentOutput(), "output", cases=(Case("dense f64"),))
    assert "FAIL" in str(failed) and not failed.ok


@pytest.mark.slow
@pytest.mark.parametrize("field", FIELDS)
def test_reference_stages_pass_full_matrix(field):
    _assert_ok(check_stage(getattr(kdax.KDAPipeline.reference(), field), field, full=True))


@pytest.mark.slow
def test_reference_pipeline_full():
    _assert_ok(check_pipeline(kdax.KDAPipeline.reference(), full=True))
