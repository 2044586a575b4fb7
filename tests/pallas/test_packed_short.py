"""Packed short sequences sharing chunks (issue 18, item 8) in the Pallas pipelines
(interpret mode): every Pallas stage runs the reset table (``plan``: no fallback), the
Triton and TPU state kernels the shared layout's one-entry state table; outputs and every
gradient exact against the float64 oracle."""

import dataclasses

import jax.numpy as jnp
import pytest

import kdax

from ..test_packed_short import MIX, _check, _fn, _inputs, check_float32_sweep

# Three chunks of 16: one-token and empty sequences, one straddling a chunk boundary, a
# start on a chunk boundary.
SMALL = [0, 1, 1, 2, 19, 32, 33, 48]
from .._util import split_args

PIPELINES = {
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
    "pallas_tpu": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
    "mixed": lambda: kdax.KDAPipeline.mixed("tpu", interpret=True),
}


@pytest.mark.filterwarnings("ignore::kdax.FallbackWarning")
@pytest.mark.parametrize("pipe", [p if p != "mixed" else pytest.param(p, marks=pytest.mark.slow) for p in PIPELINES])
def test_shared_chunks_exact(pipe):
    pipeline = PIPELINES[pipe]()
    x = _inputs(SMALL)
    options = dict(cu_seqlens=jnp.asarray(SMALL, jnp.int32))
    pos, kw = split_args(x)
    plan = pipeline.plan(*pos, chunk_size=16, **kw, **options)
    assert plan.layout == "shared"
    assert not plan.fallbacks, plan.fallbacks
    _check(_fn(pipeline), x, options, 1e-10)


@pytest.mark.parametrize("pipe", ["pallas_triton", "pallas_tpu"])
def test_without_fallback_shares_chunks(pipe):
    """Every Pallas stage takes ``reset``, so a pipeline without fallback shares chunks too
    (a stage without it would keep one sequence per chunk: tests/test_capabilities.py);
    ``share_chunks=False`` keeps one sequence per chunk."""
    strict = dataclasses.replace(PIPELINES[pipe](), fallback=False)
    x = _inputs(MIX)
    pos, _ = split_args(x)
    plan = strict.plan(*pos, chunk_size=16, cu_seqlens=jnp.asarray(MIX))
    assert plan.layout == "shared" and not plan.fallbacks, plan
    apart = dataclasses.replace(strict, share_chunks=False)
    assert apart.plan(*pos, chunk_size=16, cu_seqlens=jnp.asarray(MIX)).layout == "per-sequence"


SWEEP = [pytest.param(p, l2, marks=() if (p, l2) == ("pallas_triton", True) else pytest.mark.slow)
         for p in PIPELINES for l2 in (True, False)]


@pytest.mark.parametrize("pipe,l2", SWEEP)
def test_float32_sweep_random_packed_lengths(pipe, l2):
    """Issue 39 item 0 in the Pallas pipelines (shared chunks, ``fallback=False``: every
    stage runs itself): float32 against the float64 oracle on random packed lengths 0..3C,
    gates down to -1e4, initial states, a loss on o and the final states, every gradient
    within 1e-4 (``check_float32_sweep``)."""
    check_float32_sweep(dataclasses.replace(PIPELINES[pipe](), fallback=False), l2, seeds=range(2))


@pytest.mark.slow
@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "no_l2norm"])
def test_float32_sweep_one_sequence_per_chunk(l2):
    """The same sweep with one sequence per chunk (``share_chunks=False``, every stage a
    Pallas kernel)."""
    strict = dataclasses.replace(PIPELINES["pallas_triton"](), fallback=False, share_chunks=False)
    check_float32_sweep(strict, l2, seeds=range(2))
