"""kdax.testing: check_stage / check_pipeline pass on every shipped stage and pipeline and
fail, naming the check, on deliberately broken ones."""

import dataclasses
import inspect
import pathlib
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import kdax
from kdax.stages import (
    KDA,
    AbstractDAv,
    AbstractDhu,
    AbstractGate,
    AbstractIntra,
    AbstractOutput,
    AbstractState,
    AbstractWY,
    AbstractWYDqkg,
    ReferenceDAv,
    ReferenceDhu,
    ReferenceGate,
    ReferenceIntra,
    ReferenceOutput,
    ReferenceState,
    ReferenceWY,
    ReferenceWYDqkg,
    StateOut,
)
from kdax.testing import Case, check_pipeline, check_stage
from kdax._layouts.tokens import as_chunked  # (the runner's own reading of a view)
from kdax._layouts.layout import make_layout  # (a block of chunks as a dense call's layout)
from kdax._runner.routes import RESET_FIELDS
from kdax.typing import Tokens

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
    assert {"contract", "reference", "nan-isolation", "nan-reach", "causal", "jit", "vmap"} <= names
    assert "reference" in {c.name for c in report.checks if c.passed}
    if field == "wy_dqkg":  # (its own row: a dw row overflowing from finite operands)
        assert [c.case for c in report.checks if c.name == "overflow"] == ["dense f64", "packed f64", "shared f64"]
    if field in RESET_FIELDS:  # (the overflowing sequence's own rows too)
        row = next(c for c in report.checks if c.name == "reset" and c.case.endswith("overflow"))
        assert "its own non-finite where the reference pipeline's are" in row.detail, row
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
    # The example's stages refuse the in-kernel l2norm (UnsupportedCase) and declare math of
    # their own, so no pipeline falls back for them: chunk_kda raises on those cases, and
    # the report fails them (they were "skip: the pipeline falls back" before issue 49).
    l2norm = {"softplus f64", "lower-bound f64", "lower-bound-noA f64"}
    gate = check_stage(pipe.gate, "gate", base=pipe, dtypes=(jnp.float64,))
    assert {(c.name, c.case) for c in gate.failed} == {("contract", n) for n in l2norm}, str(gate)
    assert all("no pipeline falls back" in c.detail and "l2norm" in c.detail for c in gate.failed), str(gate)
    with pytest.raises(kdax.UnsupportedCase, match="l2norm"):
        (q, k, v, g, beta), kw = Case("l2norm", options=(("use_qk_l2norm_in_kernel", True),)).inputs()
        kdax.chunk_kda(q, k, v, g, beta, pipeline=dataclasses.replace(pipe, fallback=True), **kw)
    # (its backward stage is not run there: the forward raised first)
    bwd = check_stage(pipe.gate_bwd, "gate_bwd", base=pipe, dtypes=(jnp.float64,))
    _assert_ok(bwd)
    assert {c.case for c in bwd.checks if c.name == "contract" and c.passed is None} == l2norm, str(bwd)
    assert {c.case for c in bwd.checks if c.name == "contract" and c.passed} >= {"dense f64", "packed f64", "short f64",
                                                                              "chunk64 f64"}, str(bwd)
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
    assert any(c.case == "heads f64" and c.passed for c in report.checks), str(report)  # (no array: three heads)


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


class FirstSequenceGate(AbstractGate):
    """Other math: each chunk's log decay plus a tenth of the first chunk's (packed: the
    first sequence reaches every other, which a NaN in a middle sequence does not show)."""

    math: ClassVar = "leaky"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g + 0.1 * g[:, :, :1], beta, A_log, dt_bias, valid)


class LastRowGate(AbstractGate):
    """Other math: each row's log decay plus a tenth of the last row's (dense: row 1 reaches row 0)."""

    math: ClassVar = "leaky"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g + 0.1 * g[-1:], beta, A_log, dt_bias, valid)


class BatchDecisionGate(AbstractGate):
    """Other math: every log decay halved if any in the call is positive (a decision on the
    whole batch; NaN compares False, so only other values show it)."""

    math: ClassVar = "leaky"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        g = jnp.where(jnp.max(g) > 0, 0.5, 1.0) * g
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


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


class ZeroTimesChunkWY(AbstractWY):
    """KDA's F3 with ``reset``, plus each chunk's row sum times zero: the same numbers for
    finite values, but an inf in one sequence (float overflow) becomes NaN in every row of
    its chunks, the other sequences' too (as kernels that multiply the zeros between
    sequences did before: docs/DESIGN.md §7)."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "G_lo"})

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        out = ReferenceWY()(q, k, v, beta, G, Akk, G_lo=G_lo, reset=reset)
        return dataclasses.replace(out, w=out.w + 0.0 * jnp.sum(out.w, axis=-2, keepdims=True))


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


def test_rows_on_a_single_array_output_name_it():
    """An F5's output is one array (no path): its rows say "the output" where they said
    nothing ("vs ReferenceOutput: : shape ...", "non-finite: ")."""
    report = check_stage(OffByOnePercentOutput(), "output", **_small())
    failed = [c for c in report.failed if c.name == "reference"]
    assert failed and all("(the output)" in c.detail for c in failed), str(report)


class _UndeclaredGLoIntra(AbstractIntra):
    """KDA's F2 taking ``G_lo`` without declaring it (``accepts``): the pipeline never passes it."""

    math: ClassVar = KDA

    def __call__(self, scale, q, k, beta, G, G_lo=None):
        return ReferenceIntra()(scale, q, k, beta, G, G_lo=G_lo)


def test_undeclared_parameter_fails_declarations():
    """A parameter the pipeline passes only when declared (``G_lo``, ``reset``, ...), taken
    but not declared, fails ``declarations``: written as docs/stages.md once said (a
    parameter of that name sufficed), the stage got ``G_lo=None``, no error."""
    report = check_stage(_UndeclaredGLoIntra(), "intra", **_small())
    row = next(c for c in report.failed if c.name == "declarations")
    assert "takes ['G_lo'] but accepts does not declare ['G_lo']" in row.detail, str(report)


def test_nan_leak_fails_isolation():
    _assert_fails(check_stage(LeakyOutput(), "output", **_small()), "nan-isolation")


class ZeroesNonFiniteOutput(AbstractOutput):
    """KDA's F5 with its non-finite entries set to zero: the reference's numbers wherever
    they are finite, a NaN in its arguments read as a number."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return jnp.where(jnp.isfinite(o), o, 0.0)


def test_non_finite_read_as_numbers_fails_nan_reach():
    """``nan-reach``: an F5 that zeroes its non-finite entries fails it on the cases where it
    runs (and nothing else: it isolates sequences, and is exact on finite values); before
    it, ``check_stage`` said ok. The reference F5 passes it."""
    report = check_stage(ZeroesNonFiniteOutput(), "output", **_small())
    assert report.names_failed == {"nan-reach"}, str(report)
    failed = [c for c in report.failed if c.name == "nan-reach"]
    assert {c.case for c in failed} == {"dense f64", "packed f64"}, str(report)
    assert "finite where the reference stage's are not" in failed[0].detail


class FiniteFromFiniteWYDqkg(AbstractWYDqkg):
    """KDA's B3 whose non-finite outputs are zero when every argument is finite: exact on
    finite values, its arguments' NaN carried, but an overflow inside it (a row of ``dw =
    -dv_new h^T`` from finite operands) read as zero, as the Pallas B3's kernel did on
    shared chunks before session 63."""

    transposes: ClassVar = {"wy": KDA, "state": KDA, "output": KDA}
    accepts: ClassVar[frozenset] = frozenset({"reset", "G_lo"})

    def __call__(self, scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, G_lo=None, reset=None):
        args = (q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new)
        out = ReferenceWYDqkg()(scale, *args, G_lo=G_lo, reset=reset)
        finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in args]))
        return jax.tree.map(lambda x: jnp.where(finite & ~jnp.isfinite(x), 0.0, x), out)


def test_dw_overflow_read_as_zero_fails_overflow():
    """B3's ``overflow`` row: a B3 that zeroes what overflows inside it fails it on the dense,
    packed and shared cases (the rows of dk, dbeta, dG and dL that the ``dw`` row reaches),
    and nothing else; before it, ``check_stage`` said ok. The reference B3 passes it
    (``test_reference_stages_pass``)."""
    report = check_stage(FiniteFromFiniteWYDqkg(), "wy_dqkg", **_small())
    assert report.names_failed == {"overflow"}, str(report)
    failed = [c for c in report.failed if c.name == "overflow"]
    assert {c.case for c in failed} == {"dense f64", "packed f64", "shared f64"}, str(report)
    assert all(f".{x} at" in c.detail for c in failed for x in ("dk", "dbeta", "dG", "dL")), failed


def _doubled_with_vjp(factor: float):
    """``2 x`` under a ``jax.custom_vjp`` whose backward multiplies by ``factor``."""
    @jax.custom_vjp
    def doubled(x):
        return 2 * x

    doubled.defvjp(lambda x: (2 * x, None), lambda _, g: (factor * g,))
    return doubled


class DoubledOutput(AbstractOutput):
    """Other math: twice KDA's F5, under a custom VJP that scales the cotangent by
    ``factor`` (2: its derivative; 1: a slip that every other row and ``check_pipeline``
    cannot see, since a derived backward uses this very VJP)."""

    math: ClassVar = "doubled"
    factor: float = eqx.field(static=True, default=2.0)

    def __call__(self, scale, qg, h, Aqk, v_new):
        return _doubled_with_vjp(self.factor)(ReferenceOutput()(scale, qg, h, Aqk, v_new))


def test_wrong_custom_vjp_fails_grad():
    """``grad`` (float64, a forward stage of other math): JAX's gradient against central
    differences. A custom VJP off by a factor of 2 fails it, by name (before: "4 gradients,
    finite", ok); the right one passes, with room (float64: ~1e-11 against a 1e-6 bound)."""
    report = check_stage(DoubledOutput(factor=1.0), "output", **_small())
    assert report.names_failed == {"grad"}, str(report)
    assert "not the derivative of the stage's outputs" in next(c for c in report.failed if c.name == "grad").detail
    right = check_stage(DoubledOutput(), "output", **_small())
    assert right.ok, str(right)
    row = next(c for c in right.checks if c.name == "grad")
    assert float(row.detail.split("directions: ")[1].split()[0]) < 1e-9, row


def test_wrong_custom_vjp_fails_check_pipeline_differences():
    """``check_pipeline``'s ``differences`` (float64): the pipeline's gradients against
    central differences of ``chunk_kda``. A pipeline whose F5 (other math) has a custom VJP
    off by 2 passes ``gradients`` (its differentiable forward runs that VJP too) and fails
    ``differences`` on every case it runs. The shipped pipelines pass it
    (``test_shipped_pipelines_pass``; the right VJP: ``test_wrong_custom_vjp_fails_grad``)."""
    ref = kdax.KDAPipeline.reference()
    wrong = check_pipeline(eqx.tree_at(lambda p: p.output, ref, DoubledOutput(factor=1.0)))
    assert wrong.names_failed == {"differences"}, str(wrong)
    rows = [c for c in wrong.checks if c.name == "differences"]
    assert len(rows) >= 5 and not any(c.passed for c in rows), str(wrong)


class ChunkScaledOutput(AbstractOutput):
    """KDA's F5 scaled by a number taken over the whole chunk and back (``o s / s``, ``s``
    from the chunk's largest ``v_new``): the reference's values to rounding, but an earlier
    row's last bits follow later tokens, as an anchor of the exponents chosen over the
    chunk does (docs/DESIGN.md §2, "causal to the bit")."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        s = 1.0 + jnp.max(jnp.abs(v_new), axis=(-2, -1), keepdims=True) / 3
        return ReferenceOutput()(scale, qg, h, Aqk, v_new) * s / s


def test_later_tokens_in_earlier_rows_fail_causal():
    """``causal``: each sequence's tokens from its middle one on changed in every per-token
    argument; an F5 whose earlier rows' rounding follows the chunk's later values fails it
    on the cases where it runs, and nothing else (before it, ``check_stage`` said ok: within
    every tolerance). The reference stages pass it (``test_reference_stages_pass``)."""
    report = check_stage(ChunkScaledOutput(), "output", **_small())
    assert report.names_failed == {"causal"}, str(report)
    failed = [c for c in report.failed if c.name == "causal"]
    assert {c.case for c in failed} == {"dense f64", "packed f64"}, str(report)
    assert "the reference stage's keeps" in failed[0].detail, failed


def _passed(report, check, case):
    return next(c for c in report.checks if c.name == check and c.case == case).passed


def test_cross_sequence_leaks_fail_isolation():
    """Each sequence in turn, every element of its part: a leak from the first packed
    sequence, from the last dense row, or through a comparison fails (the check poisoned one
    element of one middle sequence and passed the first two)."""
    first = check_stage(FirstSequenceGate(), "gate", **_small())
    for check in ("nan-isolation", "isolation"):
        assert not _passed(first, check, "packed f64") and _passed(first, check, "dense f64"), str(first)
    assert "g of sequence 0 negated and scaled by 1e4 reached .G" in str(first)
    last = check_stage(LastRowGate(), "gate", **_small())
    for check in ("nan-isolation", "isolation"):
        assert not _passed(last, check, "dense f64") and _passed(last, check, "packed f64"), str(last)
    decision = check_stage(BatchDecisionGate(), "gate", **_small())
    _assert_fails(decision, "isolation")
    assert "nan-isolation" not in decision.names_failed, str(decision)


def test_wrong_shape_fails_contract():
    report = check_stage(WrongShapeOutput(), "output", **_small())
    _assert_fails(report, "contract")
    assert "expected" in report.failed[0].detail


def test_false_reset_fails():
    report = check_stage(MisreadsResetGate(), "gate", **_small())
    _assert_fails(report, "reset")
    assert "declares `reset`" in next(c for c in report.failed if c.name == "reset").detail


class NextKeyGate(AbstractGate):
    """F1 of other math whose key at token t adds half the key at t + 1 (inside its chunk):
    another formula, and one that reads the future."""

    math: ClassVar = "next-key"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        nxt = jnp.concatenate([k[..., 1:, :], jnp.zeros_like(k[..., :1, :])], axis=-2)
        return ReferenceGate()(config, q, k + 0.5 * nxt, g, beta, A_log, dt_bias, valid)


class NextValueOutput(AbstractOutput):
    """F5 of other math adding the next token's ``v_new`` to each output."""

    math: ClassVar = "next-value"

    def __call__(self, scale, qg, h, Aqk, v_new):
        nxt = jnp.concatenate([v_new[..., 1:, :], jnp.zeros_like(v_new[..., :1, :])], axis=-2)
        return ReferenceOutput()(scale, qg, h, Aqk, v_new) + nxt


@pytest.mark.parametrize("field,stage", [("gate", NextKeyGate()), ("output", NextValueOutput())], ids=["F1", "F5"])
def test_forward_stage_of_other_math_reading_later_tokens_fails_causal(field, stage):
    """Causality does not depend on the formula: a forward stage of other math (its values
    compared with nothing) whose outputs before a token change with that token fails
    ``causal`` (before: no causal row for other math, and the report was ok)."""
    report = check_stage(stage, field, **_small())
    assert report.names_failed == {"causal"}, str(report)
    assert all("before the first changed token" in c.detail for c in report.failed), str(report)
    # T = 32, C = 16: the middle token starts a chunk, which a mix inside chunks does not
    # cross; the row's second cut, a token later, does
    one = check_stage(stage, field, cases=(Case("dense f64"),))
    assert one.names_failed == {"causal"}, str(one)


class NaiveTemperedGate(AbstractGate):
    """F1 of other math on ``g * tau``, the product taken at a hard forget too: its
    derivative in ``tau`` there is ``0 * inf`` (NaN) though the outputs are exact."""

    tau: jax.Array
    math: ClassVar = "tempered"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        tau = self.tau[None, :, None, None, None].astype(g.dtype)
        return ReferenceGate()(config, q, k, g * tau, beta, A_log, dt_bias, valid)


def test_nan_gradient_at_a_hard_forget_fails_grad():
    """The ``grad`` row runs on the case with log decays at -1000 and -inf too and names the
    non-finite gradient (before: only on the first dense case, without them: ok)."""
    report = check_stage(NaiveTemperedGate(jnp.array([0.5, 2.0])), "gate", dtypes=(jnp.float64, jnp.float32))
    assert report.names_failed == {"grad"}, str(report)
    row = next(c for c in report.failed if c.name == "grad")
    assert row.case == "dense f32" and "NON-FINITE: [0].gate.tau" in row.detail, row


class DoublesOnResetOutput(AbstractOutput):
    """KDA's F5 declaring ``reset`` and returning twice the output whenever it is passed:
    right on every layout without resets, wrong wherever sequences share chunks."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new, reset=None):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new, reset)
        return o if reset is None else 2 * o


def test_false_reset_of_an_output_stage_fails():
    """The pipeline passes F5 ``reset`` when it declares it (F5's is optional), so
    ``check_stage`` runs F5's shared-chunk cases and its ``reset`` row (before: ok)."""
    report = check_stage(DoublesOnResetOutput(), "output", **_small())
    _assert_fails(report, "reset")
    assert any(c.case.startswith("shared") and c.name == "reference" and c.passed is False
               for c in report.checks), str(report)


def test_overflow_meeting_the_zeros_between_sequences_fails_reset():
    """``reset``'s overflow row: a stage exact on finite values whose products carry one
    sequence's inf (keys at ±7e153 or ±2e307 in float64) to the other sequences of its
    chunks fails it, by name; KDA's reference F3 passes it."""
    report = check_stage(ZeroTimesChunkWY(), "wy", **_small())
    _assert_fails(report, "reset")
    failed = [c for c in report.failed if c.name == "reset"]
    assert [c.case for c in failed] == ["packed f64 overflow"], str(report)
    assert "a float overflow in sequence 1 changes sequence 0's" in failed[0].detail
    rows = [c for c in check_stage(ReferenceWY(), "wy", **_small()).checks if c.case == "packed f64 overflow"]
    assert len(rows) == 1 and rows[0].passed, rows


class FiniteFromFiniteIntra(AbstractIntra):
    """KDA's F2 whose non-finite outputs are zero when every argument is finite: exact on
    finite values and isolating, but an inverse that overflows inside it (keys whose
    products overflow) read as zero."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "G_lo"})

    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None):
        out = ReferenceIntra()(scale, q, k, beta, G, G_lo=G_lo, reset=reset)
        finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in (q, k, beta, G)]))
        return jax.tree.map(lambda x: jnp.where(finite & ~jnp.isfinite(x), 0.0, x), out)


def test_overflow_read_as_a_number_fails_reset():
    """``reset``'s overflow row, in the overflowing sequence itself: an F2 that zeroes an
    inverse overflowing inside it leaves outputs and gradients of that sequence finite
    where the reference pipeline's are not, and fails the row by saying so (before: ok);
    the reference stages pass it (``test_reference_stages_pass``)."""
    report = check_stage(FiniteFromFiniteIntra(), "intra", **_small())
    assert report.names_failed == {"reset"}, str(report)
    failed = [c for c in report.failed if c.name == "reset"]
    assert [c.case for c in failed] == ["packed f64 overflow"], str(report)
    assert "sequence 1's own" in failed[0].detail and "finite where the reference pipeline's are not" in failed[
        0].detail, failed


def test_false_tile_safe_fails():
    _assert_fails(check_stage(ZeroStartState(), "state", **_small()), "tile_safe")


def test_false_half_stored_fails():
    report = check_stage(MisreadsHalfOutput(), "output", **_small())
    _assert_fails(report, "half_stored")
    assert "declares `half_stored`" in next(c for c in report.failed if c.name == "half_stored").detail


class EndNotStartDhu(AbstractDhu):
    """A B2 declaring ``dh_start`` that adds it to ``dh`` at each chunk's end and carries it
    no further: the reference's numbers wherever the pipeline passes none."""

    transposes: ClassVar = {"state": KDA, "output": KDA}
    accepts: ClassVar[frozenset] = frozenset({"reset", "dh_start"})

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout, reset=None, *, dh_start=None):
        out = ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout, reset)
        return out if dh_start is None else dataclasses.replace(out, dh=out.dh + dh_start)


def test_false_dh_start_fails():
    """``dh_start``'s row (dense and shared chunks: random cotangents against the same entering
    through ``scale qg^T do``) fails a B2 that misplaces them; so do, on shared chunks (whose
    recorded loss reads the final states, so the pipeline passes ``dh_start`` there), the
    reference and ``reset`` rows, and nothing else. The reference B2 passes the row."""
    report = check_stage(EndNotStartDhu(), "dhu", **_small())
    assert {"dh_start", "reference", "reset"} == report.names_failed, str(report)
    assert {c.case for c in report.failed if c.name == "reference"} == {"shared f64", "shared-exact f64"}, str(report)
    assert "declares `dh_start`" in next(c for c in report.failed if c.name == "dh_start").detail
    rows = [c for c in check_stage(ReferenceDhu(), "dhu", **_small()).checks if c.name == "dh_start"]
    assert [c.case for c in rows] == ["dense f64", "shared f64"] and all(c.passed for c in rows), rows


class SignSlipGLoIntra(AbstractIntra):
    """An F2 declaring ``G_lo`` that subtracts the low part instead of adding it: within the
    float32 tolerance of the reference row, but farther from its own float64 output than
    without ``G_lo``."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"G_lo"})

    def __call__(self, scale, q, k, beta, G, G_lo=None):
        return ReferenceIntra()(scale, q, k, beta, G, None if G_lo is None else -G_lo)


class UnusedGLoIntra(AbstractIntra):
    """An F2 declaring ``G_lo`` and leaving it out: harmless (as accurate as a stage without
    the declaration), and the row says it gains nothing."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"G_lo"})

    def __call__(self, scale, q, k, beta, G, G_lo=None):
        return ReferenceIntra()(scale, q, k, beta, G)


class GLoIntra(AbstractIntra):
    """The reference F2 declaring ``G_lo`` alone (its other rows' checks: the reference
    stages' tests)."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"G_lo"})

    def __call__(self, scale, q, k, beta, G, G_lo=None):
        return ReferenceIntra()(scale, q, k, beta, G, G_lo)


def _row(report, check):
    return next(c for c in report.checks if c.name == check)


def test_false_G_lo_fails():
    """The ``G_lo`` row (float32 with strong gates, against the stage's own float64 output;
    the default run's checks are float64, where it does not run): the reference F2 gains
    from the low part, a sign slip that the float32 reference row lets through fails it,
    and an unused ``G_lo`` passes, said so."""
    case = (Case("dense f32", jnp.float32, strong=True),)
    ref = check_stage(GLoIntra(), "intra", dtypes=(jnp.float32,), cases=case)
    _assert_ok(ref)
    assert _row(ref, "G_lo").passed and "does not use" not in _row(ref, "G_lo").detail, str(ref)
    slip = check_stage(SignSlipGLoIntra(), "intra", dtypes=(jnp.float32,), cases=case)
    assert slip.names_failed == {"G_lo"} and "makes it worse" in _row(slip, "G_lo").detail, str(slip)
    assert _row(slip, "reference").passed, str(slip)
    unused = check_stage(UnusedGLoIntra(), "intra", dtypes=(jnp.float32,), cases=case)
    _assert_ok(unused)
    assert "does not use it" in _row(unused, "G_lo").detail, str(unused)


def _views_misread(x):
    """A layout slip: the caller's ``[B, T, H, D]`` reshaped to ``[B, H, NC, C, D]`` with
    the head axis left in place."""
    if not isinstance(x, Tokens):
        return x
    return x.x.astype(x.dtype).reshape(x.shape) if x.group == 1 else x.chunked()


class ViewsGate(AbstractGate):
    """An F1 declaring ``tokens``: it reads each view as its chunked copy."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tokens"})
    read = staticmethod(as_chunked)

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, *map(self.read, (q, k, g, beta)), A_log, dt_bias, valid)


class MisreadsViewsGate(ViewsGate):
    """ViewsGate with the layout slip: right on chunked copies (every other row), wrong on
    the views only the ``tokens`` row passes it."""

    read = staticmethod(_views_misread)


def test_false_tokens_fails():
    """The ``tokens`` row (views of the caller's arrays against their chunked copies, in a
    pipeline with the stage; the shipped stages declaring it are Pallas stages checked with
    ``-m slow``): a stage that reads the views right passes, one that misreads their
    layout fails it, and only it."""
    case = (Case("dense f64"),)
    good = check_stage(ViewsGate(), "gate", cases=case)
    _assert_ok(good)
    assert _row(good, "tokens").passed, str(good)
    bad = check_stage(MisreadsViewsGate(), "gate", cases=case)
    assert bad.names_failed == {"tokens"} and "declares `tokens`" in _row(bad, "tokens").detail, str(bad)


class ZeroStartKDAState(AbstractState):
    """ZeroStartState declaring KDA's math: right on whole inputs without initial states,
    so the pipeline would tile it (a KDA stage that declares tile_safe); a tile starts
    from a carried state, and the reference check on a tile of each case reports it."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

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


class LateBlockOutput(AbstractOutput):
    """KDA's F5 as a grid over blocks of 4 chunks whose later blocks read the state one
    chunk late (a block offset off by one): right on inputs of up to 4 chunks."""

    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        if h.shape[2] > 4:
            h = jnp.concatenate([h[:, :, :4], h[:, :, 3:-1]], axis=2)
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


def test_wrong_stages_fail_check_pipeline():
    """A wrong B1 fails the gradients; an F5 wrong past 4 chunks fails the forward on the
    one case that long (a packed sequence of 32 chunks at chunk 64), and only there."""
    pipe = eqx.tree_at(lambda p: (p.dav, p.output), kdax.KDAPipeline.reference(), (ScaledDvDAv(), LateBlockOutput()))
    report = check_pipeline(pipe)
    _assert_fails(report, "gradients")
    assert _failing_cases(report, "forward") == {"packed chunk64 f64"}, str(report)
    # and the B1 alone: it declares KDA's transpose, and differs from ReferenceDAv
    _assert_fails(check_stage(ScaledDvDAv(), "dav", **_small()), "reference")


class BlockedState(AbstractState):
    """KDA's F4 on dense rows in blocks of 4 chunks, each block starting from the row's
    initial state (the state not carried from block to block): right on up to 4 chunks."""

    math: ClassVar = KDA

    def __call__(self, w, u, kg, G, h0, layout):
        NC = w.shape[2]
        if not layout.dense or NC <= 4:
            return ReferenceState()(w, u, kg, G, h0, layout)
        C, outs = layout.chunk_size, []
        for c0 in range(0, NC, 4):
            n = min(NC, c0 + 4) - c0
            block = make_layout(layout.first.shape[0], min(layout.T - c0 * C, n * C), C)  # (a dense call's)
            outs.append(ReferenceState()(*(x[:, :, c0:c0 + n] for x in (w, u, kg, G)), h0, block))
        return StateOut(jnp.concatenate([o.h for o in outs], 2), jnp.concatenate([o.v_new for o in outs], 2),
                        outs[-1].final)


class FirstKBlockOutput(AbstractOutput):
    """KDA's F5 whose loop over the key channels in blocks of 64 stops after the first
    block (q·h over the channels past 64 left out): right on up to 64 channels."""

    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        qg = jnp.where(jnp.arange(qg.shape[-1]) < 64, qg, 0.0)
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


@pytest.mark.parametrize("field, stage", [("state", BlockedState()), ("output", FirstKBlockOutput())],
                         ids=["state-chunk-blocks", "output-channel-blocks"])
def test_stage_wrong_past_a_block_fails(field, stage):
    """The chunk64 case's 33 chunks of 128 channels (every other case has at most 3 chunks
    of 8): an F4 that loses its state between blocks of chunks, an F5 that stops after a
    block of channels fail there, and only there."""
    report = check_stage(stage, field, **_small())
    assert _failing_cases(report) == {"chunk64 f64"}, str(report)
    assert {c.name for c in report.failed} == {"reference"}, str(report)


@pytest.mark.slow
def test_custom_math_pipeline_passes_check_pipeline():
    # An F5 of other math with the reference backward: on one device its transpose is
    # derived by jax.vjp in B1's place (exact), so check_pipeline passes and says so.
    class Scaled(AbstractOutput):
        math: ClassVar = "2 kda"

        def __call__(self, scale, qg, h, Aqk, v_new):
            return 2.0 * ReferenceOutput()(scale, qg, h, Aqk, v_new)

    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), Scaled())
    report = check_pipeline(pipe)
    _assert_ok(report)
    rows = [c.detail for c in report.checks if c.name == "gradients"]
    assert rows and all(d.startswith("six-stage (F5's transpose by jax.vjp) backward") for d in rows), rows


def test_report_table():
    report = check_stage(ReferenceOutput(), "output", cases=(Case("dense f64"),))
    text = str(report)
    n, s = len(report.checks), sum(c.passed is None for c in report.checks)
    assert text.splitlines()[0].endswith(f": ok: no check failed ({n - s} passed, {s} skipped)"), text
    assert "cases:" in text and "scale=K**-0.5" in text  # the legend: what each case gives the stage
    assert "contract" in text and "reference" in text
    # "not compared" rows counted as such, not as skipped (a stage of other math)
    other = check_stage(NaiveTemperedGate(jnp.array([0.5, 2.0])), "gate", cases=(Case("dense f64"),))
    nc = len([c for c in other.checks if c.passed is None and c.detail.startswith("not compared")])
    skip = sum(c.passed is None for c in other.checks) - nc
    assert nc and f" skipped, {nc} not compared);" in str(other).splitlines()[0], str(other)
    assert f"passed, {skip} skipped, " in str(other).splitlines()[0]
    failed = check_stage(OffByOnePercentOutput(), "output", cases=(Case("dense f64"),))
    assert "FAIL" in str(failed) and not failed.ok


@pytest.mark.slow
@pytest.mark.parametrize("field", FIELDS)
def test_reference_stages_pass_full_matrix(field):
    _assert_ok(check_stage(getattr(kdax.KDAPipeline.reference(), field), field, full=True))


@pytest.mark.slow
def test_reference_pipeline_full():
    _assert_ok(check_pipeline(kdax.KDAPipeline.reference(), full=True))


# -- stages wrong outside the old matrix (issue 49 item 4) ----------------------------------
# Each is KDA's stage but for one argument or option the old matrix never varied; the
# matrix now reaches it, and the failing rows are the cases that vary it.


def _failing_cases(report, check="reference"):
    return {c.case for c in report.failed if c.name == check}


class IgnoresScaleOutput(AbstractOutput):
    """F5 with the default scale ``K ** -0.5`` in place of the call's ``scale``."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(qg.shape[-1] ** -0.5, qg, h, Aqk, v_new)


class ValueWidthScaleOutput(AbstractOutput):
    """F5 that rescales ``scale`` from K's default to V's (``V ** -0.5`` where K's was
    meant): right whenever K == V, whatever the scale."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale * (qg.shape[-1] / v_new.shape[-1]) ** 0.5, qg, h, Aqk, v_new)


class WrongAtChunk64Intra(AbstractIntra):
    """F2 with ``Aqk`` 0.1% off at chunk size 64 only (the API's default)."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})  # (reset, G_lo: their checks would pass)

    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None):
        out = ReferenceIntra()(scale, q, k, beta, G, G_lo, reset)
        if q.shape[3] != 64:
            return out
        return dataclasses.replace(out, Aqk=out.Aqk * (1 + 1e-3))


class IgnoresNegEigvalGate(AbstractGate):
    """F1 that ignores ``allow_neg_eigval`` (beta = sigmoid, not 2 sigmoid)."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})  # (reset: its checks would pass)

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        config = dataclasses.replace(config, allow_neg_eigval=False)
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid, reset)


class WrongSingleChunkWY(AbstractWY):
    """F3 with ``w`` 0.4% off when the input fits one chunk (T <= C)."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})  # (reset, G_lo: their checks would pass)

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        out = ReferenceWY()(q, k, v, beta, G, Akk, G_lo, reset)
        if q.shape[2] != 1:
            return out
        return dataclasses.replace(out, w=out.w * 1.004)


def test_output_ignoring_scale_fails():
    report = check_stage(IgnoresScaleOutput(), "output", **_small())
    # the dense and heads rows, scale=0.3 (the other cases keep the default, where it is right)
    assert _failing_cases(report) == {"dense f64", "dense f64 tile", "heads f64", "heads f64 tile"}, str(report)


def test_output_with_value_width_scale_fails():
    report = check_stage(ValueWidthScaleOutput(), "output", **_small())
    assert _failing_cases(report) == {"dense f64", "dense f64 tile", "heads f64", "heads f64 tile",  # K != V
                                      "lower-bound f64", "lower-bound f64 tile"}, str(report)


def test_intra_wrong_at_chunk_64_fails():
    report = check_stage(WrongAtChunk64Intra(), "intra", **_small())
    assert _failing_cases(report) == {"chunk64 f64", "chunk64 f64 tile"}, str(report)


def test_gate_ignoring_allow_neg_eigval_fails():
    report = check_stage(IgnoresNegEigvalGate(), "gate", **_small())
    assert _failing_cases(report) == {"softplus f64", "softplus f64 tile"}, str(report)


class KeepsInfiniteGate(AbstractGate):
    """KDA's F1 that floors only finite log decays (keeping NaN and inf, as if for the
    isolation's sake): a hard decay (g = -inf) then reaches G as -inf, and every product
    after it as NaN. Right wherever the gates are finite, -1000 included."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        act = ReferenceGate(split=False)(config, q, k, g, beta, A_log, dt_bias, valid)
        if config.use_gate_in_kernel:
            return act
        floor = kdax.ref.log_decay_floor(g.dtype)
        g = jnp.where(jnp.isfinite(g), jnp.maximum(g, floor), g)
        return dataclasses.replace(act, G=jnp.cumsum(jnp.where(valid[:, None, :, :, None], g, 0.0), axis=-2))


def test_gate_keeping_an_infinite_decay_fails():
    """The float32 dense, packed and short cases' strong gates include -inf (a hard
    forget): the cases where this F1 differs. (With -1000 alone it passed every row.)"""
    report = check_stage(KeepsInfiniteGate(), "gate", dtypes=(jnp.float32,))
    assert _failing_cases(report) == {"dense f32", "dense f32 tile", "packed f32", "packed f32 tile", "short f32"}, \
        str(report)
    assert {c.name for c in report.failed} == {"finite", "reference"}, str(report)
    assert "non-finite at" in next(c for c in report.failed if c.name == "reference").detail, str(report)


def test_wy_wrong_when_input_fits_one_chunk_fails():
    report = check_stage(WrongSingleChunkWY(), "wy", **_small())
    failing = _failing_cases(report)
    # "short": T = 12 <= C = 16; and the tiles that are one chunk (the last of NC = 2)
    assert "short f64" in failing, str(report)
    assert {c for c in failing if c != "short f64"} == {"softplus f64 tile", "lower-bound f64 tile",
                                                       "lower-bound-noA f64 tile"}, str(report)


class ZeroOutput(AbstractOutput):
    """An F5 of undeclared math returning zeros: every check of its own passes, and
    nothing compares its values with a formula."""

    def __call__(self, scale, qg, h, Aqk, v_new):
        return jnp.zeros(qg.shape[:-1] + v_new.shape[-1:], qg.dtype)


def test_undeclared_math_rows_say_not_compared():
    report = check_stage(ZeroOutput(), "output", **_small())
    assert report.ok, str(report)  # ok: no check failed ...
    rows = [c for c in report.checks if c.name == "reference"]
    cases = {c.case for c in report.checks if c.name == "contract"}
    # ... and one row per case says its values were never compared
    assert {c.case for c in rows} == cases and len(cases) >= 7, str(report)
    assert all(c.passed is None and c.detail.startswith("not compared") for c in rows), str(report)
    assert report.not_compared == tuple(rows)
    head = str(report).splitlines()[0]
    assert "NOT compared" in head and "n/c" in str(report), head
    # a stage of KDA's math has none
    assert not check_stage(ReferenceOutput(), "output", cases=(Case("dense f64"),)).not_compared


class CannotRunOutput(AbstractOutput):
    """Raises UnsupportedCase on every case. With ``math`` other than KDA's no pipeline
    falls back for it (``chunk_kda`` raises); with KDA's a pipeline with fallback does."""

    math: ClassVar = "kda-but-unsaid"

    def __call__(self, scale, qg, h, Aqk, v_new):
        raise kdax.UnsupportedCase("no case")


class CannotRunKDAOutput(AbstractOutput):
    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        raise kdax.UnsupportedCase("no case")


def _call(stage):
    case = Case("dense f64")
    (q, k, v, g, beta), kw = case.inputs()
    pipe = eqx.tree_at(lambda p: p.output, dataclasses.replace(kdax.KDAPipeline.reference(), fallback=True), stage)
    return kdax.chunk_kda(q, k, v, g, beta, pipeline=pipe, **kw)


def test_unsupported_case_of_other_math_is_an_error():
    # what the report says is what a call does: a pipeline with fallback raises for it ...
    with pytest.raises(kdax.UnsupportedCase):
        _call(CannotRunOutput())
    report = check_stage(CannotRunOutput(), "output", cases=(Case("dense f64"),))
    _assert_fails(report, "contract")
    row = next(c for c in report.failed if c.name == "contract")
    assert "no pipeline falls back" in row.detail, str(report)
    assert "falls back" not in row.detail.replace("no pipeline falls back", ""), str(report)


def test_unsupported_case_of_kda_math_is_a_skip():
    # ... and falls back to the reference stage for a stage of KDA's math
    with pytest.warns(kdax.FallbackWarning):
        _call(CannotRunKDAOutput())
    report = check_stage(CannotRunKDAOutput(), "output", cases=(Case("dense f64"),))
    _assert_ok(report)
    row = next(c for c in report.checks if c.name == "contract")
    assert row.passed is None and "fallback=True" in row.detail, str(report)


# -- plan: the first true reason of each route (issue 49 item 5) -----------------------------


class OtherMathTileSafeGate(AbstractGate):
    math: ClassVar = "kda-other"
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class KDANotTileSafeGate(AbstractGate):
    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid, reset)


def _plan_text(gate, share_chunks=True):
    import jax

    pipe = eqx.tree_at(lambda p: p.gate, dataclasses.replace(kdax.KDAPipeline.reference(), tile=32,
                                                             share_chunks=share_chunks), gate)
    s = jax.ShapeDtypeStruct
    qk, beta = s((1, 64, 2, 8), jnp.float32), s((1, 64, 2), jnp.float32)
    return str(pipe.plan(qk, qk, qk, qk, beta, cu_seqlens=jnp.array([0, 30, 64], jnp.int32)))


def test_plan_gives_the_math_not_tile_safety_for_a_tile_safe_gate_of_other_math():
    text = _plan_text(OtherMathTileSafeGate())
    forward = next(line for line in text.splitlines() if line.startswith("forward:"))
    layout = next(line for line in text.splitlines() if line.startswith("layout:"))
    assert "not tile-safe" not in forward and "math 'kda-other', not KDA's" in forward, text
    assert "per-sequence" in layout and "math 'kda-other', not KDA's" in layout, text


def test_plan_reasons_of_a_kda_stage():
    text = _plan_text(KDANotTileSafeGate(), share_chunks=False)
    forward = next(line for line in text.splitlines() if line.startswith("forward:"))
    layout = next(line for line in text.splitlines() if line.startswith("layout:"))
    assert "not tile-safe: gate (KDANotTileSafeGate does not declare tile_safe)" in forward, text
    assert "share_chunks=False" in layout, text


# -- check times (issue 49 item 4) ----------------------------------------------------------


def test_recording_ends_at_the_checked_stage_and_equal_cases_share_a_program():
    import jax
    import numpy as np

    from kdax.testing import _runs

    case = Case("dense f64", T=20)
    pipe = _runs._pipe_for(_runs._base(None), case)
    upto = _runs._record(pipe, case, False, backward=False, field="intra")[0]
    whole = _runs._record(pipe, case, False, backward=False)[0]
    # the stages after the checked one are neither traced nor compiled ...
    assert "intra" in upto and not {"wy", "state", "output"} & set(upto), sorted(upto)
    assert {"gate", "intra", "wy", "state", "output"} <= set(whole), sorted(whole)
    # ... and it gets the same arguments
    for a, b in zip(jax.tree.leaves(upto["intra"]), jax.tree.leaves(whole["intra"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # a case and its other seed: one program
    args = [_runs._recording_args(pipe, c, False, "intra") for c in (case, dataclasses.replace(case, seed=1))]
    assert _runs._compiled(_runs._recording_program(), *args[0]) is _runs._compiled(_runs._recording_program(), *args[1])


# -- an error anywhere in a stage's outputs ----------------------------------------------


def _slightly_off(field: str, leaf, axis, index: int, seen: dict):
    """``field``'s reference stage, declared as it is, with output leaf ``leaf`` (None:
    every floating leaf) 0.1% off: the whole leaf (``axis`` None) or its ``index`` slice
    of ``axis`` where that axis is long enough to tell ``index`` 0 from -1. ``seen`` records
    at trace time the number of leaves and the shapes of those changed."""
    ref, family = kdax.pipeline.STAGES[field].reference, kdax.pipeline.STAGES[field].family

    def off(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or (axis is not None and (x.ndim <= axis or x.shape[axis] < 2)):
            return x
        seen.setdefault("changed", set()).add(tuple(x.shape))
        at = True if axis is None else (jnp.arange(x.shape[axis]) == index % x.shape[axis]).reshape(
            [-1 if a == axis else 1 for a in range(x.ndim)])
        return jnp.where(at, x * (1 + 1e-3) + 1e-6, x)

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree.flatten(ref()(*args, **kwargs))
        seen["leaves"] = len(leaves)
        return jax.tree.unflatten(tree, [off(x) if leaf in (None, j) else x for j, x in enumerate(leaves)])

    __call__.__signature__ = inspect.signature(ref.__call__)
    declared = {n: getattr(ref, n) for n in ("math", "transposes", "accepts") if hasattr(ref, n)}
    cls = type(f"SlightlyOff{ref.__name__}", (family,),
               {"__call__": __call__, "__annotations__": {n: ClassVar for n in declared}, **declared})
    return cls()


@pytest.mark.slow  # (10-25 checks of every case a field: 0.5-7 minutes each, 35 in all, here)
@pytest.mark.parametrize("field", FIELDS)
def test_an_error_anywhere_in_the_outputs_fails(field):
    """Each output leaf of the reference stage 0.1% off, then each end of each axis of
    every leaf: ``check_stage`` fails every such stage of KDA's math (a mutation sweep:
    an error confined to one sequence, chunk, row, head or column, or to one output)."""
    def check(leaf, axis, index, seen):
        return check_stage(_slightly_off(field, leaf, axis, index, seen), field, dtypes=(jnp.float64,))

    seen = {}
    report = check(None, None, 0, seen)  # (also the leaves' count and shapes)
    assert seen.get("changed"), "no output leaf was changed"
    assert not report.ok, f"every leaf 0.1% off passed:\n{report}"
    for leaf in range(seen["leaves"]):
        one = {}
        report = check(leaf, None, 0, one)
        assert not one.get("changed") or not report.ok, (
            f"leaf {leaf} {sorted(one['changed'])} 0.1% off passed:\n{report}")
    for axis in range(max(len(s) for s in seen["changed"])):
        for index in (0, -1):
            one = {}
            report = check(None, axis, index, one)
            assert not one.get("changed") or not report.ok, (
                f"axis {axis}[{index}] of {sorted(one['changed'])} 0.1% off passed:\n{report}")


def test_dtypes_checked_first():
    """The checks' dtypes, checked before anything runs, each error naming the argument.
    Without JAX's 64-bit mode a float64 case computes in float32 and was compared at
    float64's tolerance: the reference F1 failed its own ``reset`` and ``tile_safe`` rows
    (rel-RMS 3e-7 against 1e-10); the G_lo row, whose yardstick is float64, is a skip.
    An integer dtype ran, and a correct stage failed 9 of 11 rows; no dtype at all was an
    IndexError; no case at all would compare nothing."""
    from kdax.testing._capabilities import _G_lo_check
    from kdax.testing._cases import DTYPES, check_dtypes
    from kdax.testing._report import _Collector

    ref = kdax.KDAPipeline.reference()
    for bad in ((), (jnp.int32,), (jnp.float32, "complex64"), (None,)):
        with pytest.raises(ValueError, match=r"^dtypes: check_stage expected one or more of float64, float32, "
                                             r"bfloat16, float16, got \((|int32|float32, complex64|None)\)\.$"):
            check_stage(ref.output, "output", dtypes=bad)
    with pytest.raises(ValueError, match=r"^cases: check_stage expected one or more of .*got \(int32\)\.$"):
        check_stage(ref.output, "output", cases=(Case("dense i32", jnp.int32),))
    with pytest.raises(ValueError, match=r"^cases: check_stage expected at least one Case"):
        check_stage(ref.output, "output", cases=())
    with pytest.raises(ValueError, match=r"^dtype: check_pipeline expected one or more of"):
        check_pipeline(ref, dtype=jnp.int8)
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"^dtypes: check_stage was asked for float64 cases, but JAX's 64-bit "
                                             r"mode is off.*jax_enable_x64"):
            check_stage(ref.gate, "gate")
        with pytest.raises(ValueError, match=r"^cases: check_stage .*64-bit mode is off"):
            check_stage(ref.gate, "gate", dtypes=(jnp.float32,), cases=(Case("dense f64"),))
        with pytest.raises(ValueError, match=r"^dtype: check_pipeline .*64-bit mode is off"):
            check_pipeline(ref)
        check_dtypes((jnp.float32, jnp.bfloat16, jnp.float16), "dtypes", "check_stage")  # nothing to refuse
        col, f32 = _Collector(), Case("dense f32", jnp.float32)
        _G_lo_check(col, ref, "intra", ref.intra, (f32,), {f32.name: (ref, {}, None, {"G_lo": jnp.zeros(1)})})
        assert [(r.name, r.passed) for r in col.rows] == [("G_lo", None)] and "64-bit" in col.rows[0].detail
    check_dtypes(DTYPES, "dtypes", "check_stage")  # (x64 on, as in the suite)


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_checks_in_a_loop_release_compiled_programs_near_the_mapping_limit(monkeypatch):
    """JAX keeps every program a check compiles (for the stage it checks), and XLA:CPU maps
    each one's code: a process checking stages in a loop reached the kernel's limit on
    memory mappings and died in a compile. Near the limit a check first drops them all.
    (Last in this module: the release makes later checks here compile their programs again.)"""
    from kdax import _platform
    from kdax.testing import _runs

    maps = lambda: pathlib.Path("/proc/self/maps").read_text().count("\n")
    assert _platform.near_the_mapping_limit(0.0) and not _platform.near_the_mapping_limit(1.0)
    cases = (Case("dense f64"),)
    # checks in a loop, each near the limit: each asks first, then releases
    asked, released = [], []
    with monkeypatch.context() as m:
        m.setattr(_runs, "near_the_mapping_limit", lambda: asked.append(len(_runs._COMPILED)) or True)
        m.setattr(_runs, "release_compiled_programs", lambda: released.append(len(_runs._COMPILED)))
        reports = [check_stage(stage, "output", cases=cases) for stage in (ReferenceOutput(), OffByOnePercentOutput())]
    assert len(asked) == len(released) == 2 and released[1] > 0, (asked, released)
    assert reports[0].ok and not reports[1].ok
    # the release: every compiled program dropped, their code unmapped
    held = maps()
    _runs.release_compiled_programs()
    assert not _runs._COMPILED and maps() < held - 50, (held, maps())


def test_comparison_tells_non_finite_kinds_apart():
    """A NaN where the reference has an inf (or -inf for +inf) is a difference, as a
    finite value would be; the same kinds at the same places compare equal."""
    import numpy as np

    from kdax.testing._compare import _compare

    ref = {"o": np.array([1.0, np.nan, np.inf, -np.inf])}
    assert _compare(ref, ref, 1e-12)[0]
    for i, other in ((1, np.inf), (2, np.nan), (3, np.inf)):
        got = {"o": ref["o"].copy()}
        got["o"][i] = other
        ok, detail = _compare(got, ref, 1e-12)
        assert not ok and "non-finite of another kind at 1 places" in detail, detail


class PairedHeadsOutput(AbstractOutput):
    """KDA's F5 over value heads in pairs, as if their count were even (a vectorised kernel
    taking two heads a step): with three, the last head's outputs stay zero. Every other
    case has two heads, where it is right."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        HV, V = qg.shape[1], v_new.shape[-1]
        o = jnp.zeros(qg.shape[:-1] + (V,), qg.dtype)
        for i in range(0, HV - 1, 2):
            pair = slice(i, i + 2)
            o = o.at[:, pair].set(ReferenceOutput()(scale, qg[:, pair], h[:, pair], Aqk[:, pair], v_new[:, pair]))
        return o


class PerHeadWeightOutput(AbstractOutput):
    """KDA's F5 holding a per-head array (unused here): its head count is fixed at two, so
    check_stage gives it no case of three heads."""

    math: ClassVar = KDA
    weight: jax.Array = eqx.field(default_factory=lambda: jnp.ones(2))

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


def test_stage_taking_heads_in_pairs_fails_the_heads_case():
    """A stage holding no array gets a dense case with three value heads (every other case
    has two): one that takes them in pairs fails there, and there alone."""
    report = check_stage(PairedHeadsOutput(), "output", **_small())
    assert _failing_cases(report) == {"heads f64", "heads f64 tile"}, str(report)
    assert "HV=2" in report.cases["dense f64"] and "HV=3" in report.cases["heads f64"]


def test_stage_holding_an_array_keeps_two_heads():
    report = check_stage(PerHeadWeightOutput(), "output", **_small())
    _assert_ok(report)
    assert "heads f64" not in report.cases and not any(c.case.startswith("heads") for c in report.checks)


# -- wrong stages a user's audit wrote, each passing every row before the cases widened ----


class BatchMagnitudeOutput(AbstractOutput):
    """F5 scaling its output when any sequence's ``v_new`` exceeds 1e3 (NaN skipped): one
    sequence's values reach the others through a batch-wide decision."""

    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        big = jnp.max(jnp.where(jnp.isfinite(v_new), jnp.abs(v_new), 0)) > 1e3
        return jnp.where(big, o * (1 + 1e-3), o)


class Chunk32Output(AbstractOutput):
    """F5 off by 1e-3 at chunk size 32 alone."""

    math: ClassVar = KDA

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return o + 1e-3 if qg.shape[-2] == 32 else o


class LinearSoftplusGate(AbstractGate):
    """F1 taking softplus(x) for x past 5 (an approximation that raw gates near 0 never reach)."""

    math: ClassVar = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        if config.use_gate_in_kernel and config.lower_bound is None:
            HV, K = g.shape[1], g.shape[-1]
            x = g + (0 if dt_bias is None else dt_bias.reshape(HV, K)[None, :, None, None, :])
            g = jnp.where(x > 5, g + jnp.log1p(-jnp.exp(-jnp.maximum(x, 5))), g)
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class FourthSequenceState(AbstractState):
    """F4 whose final states from the fourth sequence on are 1e-3 off."""

    math: ClassVar = KDA

    def __call__(self, w, u, kg, G, h0, layout):
        out = ReferenceState()(w=w, u=u, kg=kg, G=G, h0=h0, layout=layout)
        return StateOut(out.h, out.v_new, out.final.at[3:].multiply(1 + 1e-3))


class Float64HardForgetGate(AbstractGate):
    """F1 exact for finite gates and NaN at g = -inf, in float64 alone."""

    math: ClassVar = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        if g.dtype == jnp.float64 and not config.use_gate_in_kernel:
            hi = jnp.round(g * 1024) / 1024
            g = hi + (g - hi)
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class ValuesPastKState(AbstractState):
    """F4 1e-3 off in the value columns past K (a kernel assuming V <= K)."""

    math: ClassVar = KDA

    def __call__(self, w, u, kg, G, h0, layout):
        out = ReferenceState()(w=w, u=u, kg=kg, G=G, h0=h0, layout=layout)
        f = lambda x: x.at[..., w.shape[-1]:].multiply(1 + 1e-3)
        return StateOut(f(out.h), f(out.v_new), f(out.final))


class NoInitialStateWYDqkg(AbstractWYDqkg):
    """B3 whose first chunk's dk is 1e-3 off in dense rows without initial states."""

    transposes: ClassVar = ReferenceWYDqkg.transposes
    accepts: ClassVar = frozenset({"G_lo", "reset"})

    def __call__(self, scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, G_lo=None, reset=None):
        out = ReferenceWYDqkg()(scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new, G_lo=G_lo, reset=reset)
        if h.shape[0] < 2:
            return out
        f = jnp.ones(out.dk.shape[2], out.dk.dtype).at[0].set(1 + 1e-3)
        return eqx.tree_at(lambda c: c.dk, out, jnp.where(jnp.all(h[:, :, 0] == 0), out.dk * f[:, None, None], out.dk))


class StrongFloat64Dhu(AbstractDhu):
    """B2 whose dv_new is 1e-3 off in float64 in chunks before the last that end in a hard forget."""

    transposes: ClassVar = ReferenceDhu.transposes

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout):
        out = ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout)
        if G.dtype != jnp.float64:
            return out
        NC = G.shape[2]
        hit = jnp.any(G[:, :, :, -1, :] < -500, axis=-1) & (jnp.arange(NC) < NC - 1)
        return eqx.tree_at(lambda c: c.dv_new, out, jnp.where(hit[..., None, None], out.dv_new * (1 + 1e-3), out.dv_new))


class FifthSequenceDhu(AbstractDhu):
    """B2 whose initial-state gradients from the fifth sequence on are 1e-3 off."""

    transposes: ClassVar = ReferenceDhu.transposes

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout):
        out = ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout)
        return eqx.tree_at(lambda c: c.dh0, out, out.dh0.at[4:].multiply(1 + 1e-3))


@pytest.mark.parametrize("stage, field, row, case", [
    (NoInitialStateWYDqkg(), "wy_dqkg", "reference", "lower-bound-noA f64"),
    (StrongFloat64Dhu(), "dhu", "reference", "packed f64"),
    (FifthSequenceDhu(), "dhu", "reference", "packed f64"),
    (BatchMagnitudeOutput(), "output", "isolation", "dense f64"),
    (Chunk32Output(), "output", "reference", "softplus f64"),
    (LinearSoftplusGate(), "gate", "reference", "softplus f64"),
    (FourthSequenceState(), "state", "reference", "packed f64"),
    (Float64HardForgetGate(), "gate", "reference", "short f64"),
    (ValuesPastKState(), "state", "reference", "lower-bound f64"),
], ids=lambda x: type(x).__name__ if isinstance(x, eqx.Module) else None)
def test_wrong_stages_the_widened_cases_catch(stage, field, row, case):
    """Nine wrong stages of KDA's math that passed every row of ``check_stage`` and
    ``check_pipeline`` with silently wrong numbers in ``chunk_kda`` or its gradient (two
    users' audits): the cases now hold a dense case without initial states
    (``lower-bound-noA``), float64 gates at -1000 and -inf over several chunks
    (``packed``) and in one (``short``), six packed sequences, a sequence scaled by 1e4
    (isolation), chunk size 32 (``softplus``), raw in-kernel gates past |x| = 5 and V > K
    (``lower-bound``)."""
    report = check_stage(stage, field, **_small())
    assert case in _failing_cases(report, row), str(report)
