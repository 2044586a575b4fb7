"""Stage capabilities (kdax/_runner/capabilities.py, through the stage runner kdax/_runner/runner.py):
declared in ``accepts`` (never read from the signature); the runner passes ``G_lo`` /
``reset`` only where accepted and refuses (or falls back on) a layout a stage cannot run."""

import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import kdax
from kdax._runner.capabilities import Capabilities, capabilities
from kdax.stages import KDA, AbstractGate, AbstractIntra, ReferenceGate, ReferenceIntra

from ._util import assert_close, make_inputs, oracle_kda, split_args


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
