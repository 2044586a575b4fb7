"""Segment-split recurrences (``SegmentedState``, ``SegmentedDhu``): exact in float64
against the unsplit stages and, through the pipeline, against the oracle; dense and
packed, with sequence starts and ends inside segments."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import pytest

import kdax
from kdax.pallas import PallasDhu, PallasState
from kdax.stages import (
    KDA, AbstractDhu, ReferenceDAv, ReferenceDhu, ReferenceState, SegmentedDhu, SegmentedState, segmented,
)

from .._util import assert_close, make_inputs, oracle_kda, output_shapes, outputs_and_grads, jitted
from ._chunked import chunked, intra_chunk, layout_of, rand_like, wy_chunk

TOL = 1e-12


def _jit(stage):
    """The stage under one jit (eager calls dispatch and compile op by op)."""
    return eqx.filter_jit(lambda *a: stage(*a))


def _inputs(seed, R, NC, N=None):
    x = chunked(seed, R=R, HV=2, NC=NC, C=8, K=8, V=4, strong=True)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    N = R if N is None else N
    h0 = rand_like(jnp.zeros((N,) + x["h0"].shape[1:]), seed + 1)
    return x, Aqk, w, u, qg, kg, h0


# One packed row of 10 chunks: sequence 2 (chunks 0-2), 0 (chunk 3), 3 (empty), 1 (chunks
# 4-7), then two unused chunks; segments of 2, 3, 4 chunks put starts and ends inside them.
PACKED = dict(first=[[2, -1, -1, 0, 1, -1, -1, -1, -1, -1]], last=[[-1, -1, 2, 0, -1, -1, -1, 1, -1, -1]],
              empty=[False, False, False, True])


def _layout(packed, x, R):
    if packed:
        return layout_of(jnp.asarray(PACKED["first"], jnp.int32), jnp.asarray(PACKED["last"], jnp.int32),
                         PACKED["empty"])
    return x["layout"]


def _close_out(got, want):
    for name in got.__dataclass_fields__:
        assert_close(getattr(got, name), getattr(want, name), TOL, name)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("segments", [3, 4, 64])
def test_segmented_state_equals_unsplit(segments, packed):
    R, NC = (1, 10) if packed else (2, 7)
    x, Aqk, w, u, qg, kg, h0 = _inputs(3, R, NC, 4 if packed else None)
    layout = _layout(packed, x, R)
    want = _jit(ReferenceState(unroll=0))(w, u, kg, x["G"], h0, layout)
    got = _jit(SegmentedState(ReferenceState(unroll=0), segments))(w, u, kg, x["G"], h0, layout)
    _close_out(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("segments", [3, 4])
def test_segmented_dhu_equals_unsplit(segments, packed):
    R, NC = (1, 10) if packed else (2, 7)
    x, Aqk, w, u, qg, kg, h0 = _inputs(4, R, NC, 4 if packed else None)
    layout = _layout(packed, x, R)
    st = jitted(ReferenceState())(w, u, kg, x["G"], h0, layout)
    do = rand_like(u, 5)
    _, dv_intra = jitted(ReferenceDAv())(st.v_new, Aqk, do)
    dht = rand_like(h0, 6)
    args = (x["scale"], qg, kg, w, x["G"], do, dv_intra, dht, layout)
    _close_out(_jit(SegmentedDhu(ReferenceDhu(), segments))(*args), _jit(ReferenceDhu())(*args))


def test_segmented_pallas_triton_inner():
    """The Triton state kernels (interpret mode) as the inner stages: packed rows are
    what they already take."""
    x, Aqk, w, u, qg, kg, h0 = _inputs(7, 1, 10, 4)
    layout = _layout(True, x, 1)
    kw = dict(target="triton", interpret=True)
    _close_out(SegmentedState(PallasState(**kw), 3)(w, u, kg, x["G"], h0, layout),
               jitted(ReferenceState())(w, u, kg, x["G"], h0, layout))
    do, dht = rand_like(u, 8), rand_like(h0, 9)
    args = (x["scale"], qg, kg, w, x["G"], do, rand_like(u, 10), dht, layout)
    _close_out(SegmentedDhu(PallasDhu(**kw), 3)(*args), jitted(ReferenceDhu())(*args))


class StateOnlyOutputDhu(AbstractDhu):
    """A B2 declaring it transposes KDA's F5 but not F4: the split reverse recurrence would
    join its segments with KDA's summaries regardless."""

    transposes: ClassVar = {"output": KDA}

    def __call__(self, *args, **kwargs):
        return ReferenceDhu()(*args, **kwargs)


def test_segments_argument_checked():
    with pytest.raises(ValueError, match="segments"):
        SegmentedState(ReferenceState(), 0)
    with pytest.raises(ValueError, match="segments"):
        segmented(kdax.KDAPipeline.reference(), 1.5)
    with pytest.raises(ValueError, match=r"^segments: expected an int >= 1, got True"):  # (bool is an int)
        segmented(kdax.KDAPipeline.reference(), True)
    other = eqx.tree_at(lambda p: p.dhu, kdax.KDAPipeline.reference(), StateOnlyOutputDhu())
    with pytest.raises(ValueError, match=r"^segments: the split reverse recurrence is exact only for a B2 that "
                                         r"transposes KDA's F4; B2 `dhu` \(StateOnlyOutputDhu\) declares transposes "
                                         r"\{'output': 'kda'\}\. If it does, declare transposes = \{'state'"):
        segmented(other, 2)


@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "packed"])
def test_segmented_pipeline_against_oracle(packed):
    """chunk_kda through ``segmented(pipeline, 3)``: the output, final states and every
    gradient against the float64 oracle (in-kernel gate, strong decays); packed with an
    initial state per sequence (each sequence from a chunk boundary, B0 recomputing
    through the segmented F4); and the plan names the segmented stages."""
    N = 3 if packed else 2
    x = make_inputs(seed=11, B=1 if packed else 2, T=100, H=1, K=8, V=8, N=N, strong=True)
    opts = dict(chunk_size=16, output_final_state=True)
    if packed:
        opts["cu_seqlens"] = jnp.asarray([0, 40, 41, 100], jnp.int32)
    pipe = segmented(kdax.KDAPipeline.reference().untiled(), 3)
    fn = lambda *a, **kw: kdax.chunk_kda(*a, pipeline=pipe, **kw)
    do, dht = (rand_like(s, i) for s, i in zip(output_shapes(oracle_kda, x, opts), (1, 2)))
    o, ht, grads = outputs_and_grads(fn, x, opts, do, dht)
    o_ref, ht_ref, want = outputs_and_grads(oracle_kda, x, opts, do, dht)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")
    for n, g in grads.items():
        assert_close(g, want[n], 1e-9, "d" + n)
    plan = pipe.plan(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                     cu_seqlens=opts.get("cu_seqlens"))
    rows = {r.field: r for r in plan.rows}
    assert rows["state"].runs == "SegmentedState" and rows["dhu"].runs == "SegmentedDhu"
    assert "3 segments" in str(plan)
