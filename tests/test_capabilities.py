"""Stage capabilities (kdax/_stage_protocol/capabilities.py, through the stage runner kdax/_runner/runner.py):
declared in ``accepts`` (never read from the signature); the runner passes ``G_lo`` /
``reset`` only where accepted and refuses (or falls back on) a layout a stage cannot run."""

import dataclasses
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._stage_protocol.capabilities import Capabilities, capabilities
from kdax.stages import (
    KDA,
    AbstractGate,
    AbstractIntra,
    AbstractDhu,
    AbstractIntraBackward,
    AbstractWY,
    ReferenceDhu,
    ReferenceGate,
    ReferenceIntra,
    ReferenceIntraBackward,
    ReferenceWY,
)
from kdax.testing import Case, check_stage

from ._util import assert_close, make_inputs, oracle_kda, outputs_and_grads, run, split_args


class DeclaredGate(AbstractGate):
    """The reference gate, declaring reset and tile-safety (and KDA's math: it composes
    the reference gate unchanged)."""

    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})
    math: ClassVar[str] = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        assert reset is not None or valid.shape[0] > 0
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid, reset=reset)


class NoResetGate(AbstractGate):
    """No reset, not tile-safe; KDA's math (so that a fallback to the reference gate is exact)."""

    accepts: ClassVar[frozenset] = frozenset()
    math: ClassVar[str] = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, **kwargs):
        assert "reset" not in kwargs  # the declaration wins over **kwargs
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class OldIntra(AbstractIntra):
    """Written before G_lo: no parameter for it, so the runner passes G alone."""

    def __call__(self, scale, q, k, beta, G):
        return ReferenceIntra()(scale, q, k, beta, G)


def test_declarations_and_signatures():
    assert capabilities(DeclaredGate) == Capabilities(G_lo=False, reset=True, tile_safe=True)
    assert capabilities(NoResetGate) == Capabilities(False, False, False)
    assert capabilities(OldIntra) == Capabilities(False, False, False)
    assert capabilities(ReferenceGate).reset and capabilities(ReferenceIntra).G_lo

    class Undeclared(AbstractIntra):
        """Takes G_lo and reset, declares neither: the signature is never read."""

        def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None):
            raise AssertionError

    class ClassVarTiles(AbstractIntra):
        """tile_safe said as a ClassVar beside an accepts that does not list it: both count."""

        accepts: ClassVar[frozenset] = frozenset({"G_lo"})
        tile_safe: ClassVar[bool] = True

        def __call__(self, scale, q, k, beta, G, G_lo=None):
            raise AssertionError

    assert capabilities(Undeclared) == Capabilities(False, False, False)
    assert capabilities(ClassVarTiles) == Capabilities(G_lo=True, reset=False, tile_safe=True)
    # every family's abstract class states the declaration, empty
    for info in kdax.pipeline.STAGES.values():
        assert info.family.accepts == frozenset()

    class Typo(AbstractIntra):
        accepts: ClassVar[frozenset] = frozenset({"G-lo"})

        def __call__(self, scale, q, k, beta, G):
            raise AssertionError

    with pytest.raises(TypeError, match=r"Typo\.accepts: unknown capabilities \['G-lo'\]"):
        capabilities(Typo)


def _o(pipe, pos, cu):
    """The pipeline's output at chunk 16, jitted (eager calls run op by op)."""
    return jax.jit(lambda *a: pipe(*a, cu_seqlens=cu, chunk_size=16)[0])(*pos)


def test_runner_negotiates_reset_and_G_lo():
    x = make_inputs(B=1, T=40, H=2, K=8, V=8, N=3, h0=False)
    pos, _ = split_args(x)
    cu = jnp.array([0, 7, 30, 40], jnp.int32)
    ref = oracle_kda(*pos, cu_seqlens=cu)[0]
    base = kdax.KDAPipeline.reference()
    # Declared reset: the shared layout runs with it.
    pipe = eqx.tree_at(lambda p: p.gate, base, DeclaredGate())
    plan = pipe.plan(*pos, cu_seqlens=cu, chunk_size=16)
    assert plan.layout == "shared" and not plan.fallbacks
    assert_close(_o(pipe, pos, cu), ref, 1e-10, "o (declared reset)")
    # An F2 written before G_lo and reset: G alone, and packed input one sequence per chunk.
    old = eqx.tree_at(lambda p: p.intra, base, OldIntra())
    assert old.plan(*pos, cu_seqlens=cu, chunk_size=16).layout == "per-sequence"
    assert_close(_o(old, pos, cu), ref, 1e-10, "o (G alone, per-sequence)")
    # No reset declared: adapted exactly, one sequence per chunk (the per-sequence layout);
    # with fallback, the shared layout with the reference gate.
    strict = eqx.tree_at(lambda p: p.gate, base, NoResetGate())
    assert strict.plan(*pos, cu_seqlens=cu, chunk_size=16).layout == "per-sequence"
    assert_close(_o(strict, pos, cu), ref, 1e-10, "o (per-sequence)")
    lenient = type(strict)(**{f: getattr(strict, f) for f in kdax.pipeline.STAGES}, fallback=True)
    plan = lenient.plan(*pos, cu_seqlens=cu, chunk_size=16)
    assert plan.layout == "shared" and "gate" in plan.fallbacks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        o = _o(lenient, pos, cu)
    assert_close(o, ref, 1e-10, "o (fallback)")


# -- false declarations change no number (issue 37) ---------------------------------------
#
# A route a declaration selects (shared chunks and `reset`, tiles) is taken only for stages
# whose math check_stage checks against the reference (math = KDA), and the stage runner
# masks what a KDA stage makes of `reset` where that is exact (kdax._layouts.resets.guard_outputs);
# check_stage still reports each false declaration.


class DropsResetIntra(AbstractIntra):
    """KDA's F2, declaring `reset` and dropping it: pairs across sequences not zeroed."""

    math: ClassVar[str] = KDA
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None):
        return ReferenceIntra()(scale, q, k, beta, G, G_lo)


class DropsResetWY(AbstractWY):
    """KDA's F3, declaring `reset` and dropping it: e^G, e^(Γ - G) across sequences."""

    math: ClassVar[str] = KDA
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset", "tile_safe"})

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        return ReferenceWY()(q, k, v, beta, G, Akk, G_lo)


class DropsResetIntraBackward(AbstractIntraBackward):
    """KDA's B4, declaring `reset` and dropping it."""

    transposes: ClassVar[dict] = {"intra": KDA}
    accepts: ClassVar[frozenset] = frozenset({"G_lo", "reset"})

    def __call__(self, scale, q, k, beta, G, dAqk, grads, G_lo=None, reset=None):
        return ReferenceIntraBackward()(scale, q, k, beta, G, dAqk, grads, G_lo)


class DropsResetGate(AbstractGate):
    """KDA's F1, declaring `reset` and dropping it (no log decay floor at sequence starts)."""

    math: ClassVar[str] = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


_CU = jnp.array([0, 7, 23, 40], jnp.int32)


def _grads(pipe, x, do, dht, **opts):
    """``(o, ht)`` and the gradients of ``sum(o do) + sum(ht dht)``, from one jitted program."""
    o, ht, grads = outputs_and_grads(pipe, x, opts, do, dht)
    return (o, ht), grads


def _cotangents(x, N):
    r = np.random.default_rng(3)
    B, T, HV, V = x["v"].shape
    return jnp.asarray(r.normal(size=(B, T, HV, V))), jnp.asarray(r.normal(size=(N, HV, x["q"].shape[-1], V)))


def _max_rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(a, b))


def _assert_bitwise(a, b, what):
    for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        assert jnp.array_equal(x, y), f"{what}: leaf {i} differs, max {float(jnp.max(jnp.abs(x - y))):.1e}"


# field, stage, exact (the masks make it so), the checks of check_stage that report it
FALSE_RESETS = [
    ("intra", DropsResetIntra(), True, {"reference", "reset"}),
    ("wy", DropsResetWY(), True, {"reference", "reset"}),
    ("intra_bwd", DropsResetIntraBackward(), True, {"reference", "reset"}),
    # F1's floor cannot be masked in: G's cumsum runs through the previous sequence, and
    # the other stages' masks make the reset exact to rounding (docs/stages.md); the
    # reference check sees the missing floor
    ("gate", DropsResetGate(), False, {"reference"}),
]
_IDS = [f for f, *_ in FALSE_RESETS]


@pytest.mark.parametrize("field,stage,exact,reported", FALSE_RESETS, ids=_IDS)
@pytest.mark.parametrize("h0", [False, True], ids=["no-h0", "h0"])
def test_false_reset_of_kda_stage_changes_no_number(field, stage, exact, reported, h0):
    # Shared chunks (with initial states entering them when h0): the pipeline with the stage
    # against the reference pipeline, outputs and every gradient.
    x = make_inputs(B=1, T=40, H=2, K=8, V=8, N=3, h0=h0)
    do, dht = _cotangents(x, 3)
    ref = kdax.KDAPipeline.reference()
    pipe = eqx.tree_at(lambda p: getattr(p, field), ref, stage)
    opts = dict(cu_seqlens=_CU, chunk_size=16, output_final_state=True)
    pos, kw = split_args(x)
    assert pipe.plan(*pos, **kw, **opts).layout == "shared"
    (o, ht), d = _grads(pipe, x, do, dht, **opts)
    (o0, ht0), d0 = _grads(ref, x, do, dht, **opts)
    # (one program of the whole step: XLA fuses it around the masks otherwise, which moves
    # roundings by ~1e-16 even where the masks are exact)
    assert _max_rel([o, ht, *d.values()], [o0, ht0, *d0.values()]) <= 1e-14
    if exact and not h0:  # the forward and the backward each in a program of its own: bitwise
        fw = lambda P: jax.jit(lambda *a: P.forward(*a, **opts))(*pos)
        (_, _, res), (_, _, res0) = fw(pipe), fw(ref)
        _assert_bitwise(res.cache, res0.cache, "forward cache")
        bw = lambda P, r: jax.jit(lambda r: P.backward(r, do, dht))(r)
        _assert_bitwise(bw(pipe, res), bw(ref, res0), "gradients")


@pytest.mark.parametrize("field,stage,exact,reported", FALSE_RESETS, ids=_IDS)
def test_false_reset_of_kda_stage_is_reported(field, stage, exact, reported):
    # Shared chunks whose G runs on through the earlier sequence (F1's floor left out:
    # e^floor alone hides a dropped reset below rounding), and F1's own on the floored ones.
    cu = (0, 7, 23, 40)
    case = Case("shared f64", B=1, T=40, cu=cu, share=True, h0=False, floor=field == "gate")
    report = check_stage(stage, field, cases=(case,))
    assert not report.ok and reported <= report.names_failed, str(report)
    # the reference check reports it on the tile of those chunks too (F1-F5)
    if field != "intra_bwd":
        assert any(c.case == "shared f64 tile" and c.passed is False for c in report.checks), str(report)


def test_false_declarations_of_other_math_change_no_number():
    # A stage of other math runs on the per-sequence layout and whole, whatever it
    # declares: the numbers of the same stage with the routes turned off, to the bit.
    from .test_testing import MisreadsResetGate, ZeroStartState

    x = make_inputs(B=1, T=40, H=2, K=8, V=8, N=3, h0=False)
    do, dht = _cotangents(x, 3)
    opts = dict(cu_seqlens=_CU, chunk_size=16, output_final_state=True)
    pipe = eqx.tree_at(lambda p: p.gate, kdax.KDAPipeline.reference(), MisreadsResetGate())
    pos, kw = split_args(x)
    plan = pipe.plan(*pos, **kw, **opts)
    assert plan.layout == "per-sequence" and plan.not_tile_safe == ("gate",)
    assert any("MisreadsResetGate" in n and "declares reset, tile_safe" in n for n in plan.notes), str(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        got = _grads(pipe, x, do, dht, **opts)
        want = _grads(dataclasses.replace(pipe, share_chunks=False, tile=None), x, do, dht, **opts)
    _assert_bitwise(got, want, "MisreadsResetGate")

    # ZeroStartState ignores h0 and declares tile_safe: the forward runs whole.
    x = make_inputs(B=2, T=80, H=2, K=8, V=8)
    do, dht = _cotangents(x, 2)
    pipe = eqx.tree_at(lambda p: p.state, kdax.KDAPipeline.reference(), ZeroStartState())
    tiled = dataclasses.replace(pipe, tile=4)  # tiles of one chunk, if it were tiled
    pos, kw = split_args(x)
    assert tiled.plan(*pos, **kw, chunk_size=16).tile is None
    whole = pipe.untiled()
    opts = dict(chunk_size=16, output_final_state=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        _assert_bitwise(run(tiled, x, opts), run(whole, x, opts), "ZeroStartState forward")
        _assert_bitwise(_grads(tiled, x, do, dht, **opts), _grads(whole, x, do, dht, **opts), "ZeroStartState")
    # (kdax.testing reports both declarations: tests/test_testing.py's test_false_reset_fails and
    # test_false_tile_safe_fails check these two stages)


_B2_CALLS = []


class CountedDhu(AbstractDhu):
    """The reference B2 without ``dh_start``, noting each call (at trace time)."""

    transposes: ClassVar = {"state": KDA, "output": KDA}
    accepts: ClassVar[frozenset] = frozenset({"reset"})

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout, reset=None, **kw):
        _B2_CALLS.append(sorted(kw))
        return ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout, reset, **kw)


class CountedDhuStart(CountedDhu):
    accepts: ClassVar[frozenset] = frozenset({"reset", "dh_start"})


@pytest.mark.parametrize("initial", [False, True], ids=["final-states", "both"])
def test_b2_takes_the_final_states_cotangents_in_its_own_pass(initial):
    """Packed sequences sharing chunks, a loss on the final states (with and without initial
    states entering): a B2 declaring ``dh_start`` runs once, given the chunk-start states'
    cotangents; one without it runs twice (again on those alone); the gradients agree to
    float64 rounding and with the oracle's."""
    cu = jnp.asarray([0, 9, 40, 41, 77, 150], jnp.int32)
    x = make_inputs(seed=4, B=1, T=150, H=2, N=5, h0=initial)
    opts = dict(cu_seqlens=cu, chunk_size=16, output_final_state=True)
    r = np.random.default_rng(5)
    do = jnp.asarray(r.normal(size=x["v"].shape))
    dht = jnp.asarray(r.normal(size=(5, 2, 16, 16)))
    got = {}
    for stage, passes in ((CountedDhuStart(), 1), (CountedDhu(), 2)):
        pipe = eqx.tree_at(lambda p: p.dhu, kdax.KDAPipeline.reference(), stage)
        _B2_CALLS.clear()
        got[passes] = outputs_and_grads(lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw), x, opts, do, dht)
        assert len(_B2_CALLS) == passes and _B2_CALLS[0] == ["dh_start"] * (passes == 1), _B2_CALLS
    o_ref, ht_ref, want = outputs_and_grads(oracle_kda, x, opts, do, dht)
    for n in want:
        assert_close(got[1][2][n], got[2][2][n], 1e-12, f"d{n}: one pass vs two")
        assert_close(got[1][2][n], want[n], 1e-10, f"d{n} vs the oracle")
