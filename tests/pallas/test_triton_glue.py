"""Work folded into the Triton kernels instead of XLA ops around them (issue 53 item 2):
the state kernels (F4, B2) read each chunk's last row of G themselves (no sliced copy of
G handed to them), the gate kernels (F1, B5) take no ``valid`` mask where the
pipeline hands them ``Tokens`` views (dense input, T a multiple of the chunk: no padding),
B3, B5 write the call's gradients (tests/pallas/test_final_grads.py), and F4 (and B0's
F4) start from zero states unread where the call gives none (``zero_h0``).
The kernels against the reference stages in interpret mode; the candidate's training step
lowered for CUDA, its glue counted (``benchmarks/gpu_cost_model.py``'s ``count_glue``)."""

import jax.numpy as jnp
import pytest

from kdax import pallas as P
from kdax import stages as S
from kdax._layouts.layout import make_layout
from kdax.pallas._state import _gamma

from .._util import jitted
from ..stages._chunked import chunked, intra_chunk, rand_like, wy_chunk
from .test_stages import _close


def test_gamma_operand_kinds():
    """G itself (its last rows read by the kernel) on Triton for K a power of 2 without
    resets; the sliced column elsewhere (TPU, padded K, shared chunks' resets)."""
    G = jnp.zeros((1, 2, 3, 16, 32))
    assert _gamma(G, "triton", None)[1]
    assert not _gamma(G, "tpu", None)[1]
    assert not _gamma(G[..., :12], "triton", None)[1]
    assert not _gamma(G, "triton", jnp.zeros((1, 3, 16), bool))[1]


@pytest.mark.parametrize("block_k", [None, 16])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_kernels_read_last_rows_of_G(packed, block_k):
    """K = 32 (no padding: the kernels read G's last rows through a block of them), dense
    and packed (lengths 10, 0, 1, 20), the state whole or as 16-row tiles: F4 and B2 equal
    the reference stages."""
    cu = jnp.array([0, 10, 10, 11, 31], jnp.int32) if packed else None
    layout = make_layout(1, 31, 16, cu)
    N = 4 if packed else 1
    x = chunked(8, R=1, HV=2, NC=layout.num_chunks, C=16, K=32, V=24)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    h0 = rand_like(jnp.zeros((N, 2, 32, 24)), 1)
    args = (w, u, kg, x["G"], h0, layout)
    kw = dict(target="triton", interpret=True, block_v=16, block_k=block_k)
    _close(jitted(P.PallasState(**kw))(*args), jitted(S.ReferenceState())(*args), 1e-12, "state")
    do, dv, dht = rand_like(u, 2), rand_like(u, 3), rand_like(h0, 4)
    bargs = (x["scale"], qg, kg, w, x["G"], do, dv, dht, layout)
    _close(jitted(P.PallasDhu(**kw))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_kernel_starts_from_zero_unread(packed):
    """``zero_h0`` (no initial states given): the Triton F4 starts from zeros without an
    ``h0`` operand, bit for bit what it computes reading the zeros, and equal to the
    reference (dense; packed with lengths 10, 0, 1, 20: the empty sequence's final state
    zero); B0 (``PallasRecompute``) passes it on to its F4. A stage that does not declare
    ``zero_h0`` is not given it (``negotiated``)."""
    from kdax._stage_protocol.capabilities import capabilities, negotiated

    cu = jnp.array([0, 10, 10, 11, 31], jnp.int32) if packed else None
    layout = make_layout(1, 31, 16, cu)
    N = 4 if packed else 1
    x = chunked(9, R=1, HV=2, NC=layout.num_chunks, C=16, K=32, V=24)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    h0 = jnp.zeros((N, 2, 32, 24))
    args = (w, u, kg, x["G"], h0, layout)
    f4 = P.PallasState(target="triton", interpret=True, block_v=16)
    fields = lambda st: (st.h, st.v_new, st.final)  # noqa: E731
    got, read = f4(*args, zero_h0=True), f4(*args)
    assert all(jnp.array_equal(a, b) for a, b in zip(fields(got), fields(read)))
    _close(got, jitted(S.ReferenceState())(*args), 1e-12, "state")
    b0 = P.PallasRecompute(target="triton", interpret=True)
    bargs = (x["q"], x["k"], x["v"], x["beta"], x["G"], Akk, h0, layout)
    got, read = b0(*bargs, state=f4, zero_h0=True)[1], b0(*bargs, state=f4)[1]
    assert all(jnp.array_equal(a, b) for a, b in zip(fields(got), fields(read)))
    assert capabilities(P.PallasState).zero_h0 and capabilities(P.PallasRecompute).zero_h0
    assert not capabilities(S.ReferenceState).zero_h0 and not capabilities(S.ReferenceRecompute).zero_h0
    assert "zero_h0" not in negotiated(S.ReferenceState(), dict(h0=h0, zero_h0=True))
    assert negotiated(f4, dict(h0=h0, zero_h0=True))["zero_h0"] is True


@pytest.fixture(scope="module")
def glue():
    from tests.benchmarks._load import load_benchmark
    from tests.pallas._triton import lower_step, skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    m = load_benchmark("gpu_cost_model")
    from triton_resources import training_step

    fn, args, _ = training_step(m.CANDIDATE, 1, 256, 2)
    lowered, records = lower_step(fn, args)
    return m.count_glue(lowered.as_text())


def test_step_glue_folded(glue):
    """The candidate's training step at B=1 T=256 H=2: no slice of G (F4, B2 and B2's
    forward recompute read its last rows), no mask handed to F1 (kernel 1), no zero
    initial states to F4 or B0's F4 (kernels 4 and 7: ``zero_h0``); B5 (kernel 12) takes
    dbeta's partial sums and the poison columns alone, and no gradient is returned
    through XLA glue (B3 and B5, kernels 10 and 12, write the call's gradients, NaN put in:
    ``final_grads``). 74 ops and 4 values handed on at most (75 and 5 before the zero
    states, 109 and 9 before the gradients, 119 and 14 before the last ones; 0.77 MiB
    fused, was 0.89, 2.39)."""
    g = glue
    assert g.kernels == 12, g
    assert "slice" not in g.ops, g.ops
    takers = [to for _, _, to in g.handed]
    assert not any("kernel 1" in t.split(", ") for t in takers), g.handed
    assert not any({"kernel 4", "kernel 7"} & set(t.split(", ")) for t in takers), g.handed
    assert not any("returned" in t for t in takers), g.handed
    to_b5 = sorted(kinds for _, kinds, to in g.handed if "kernel 12" in to)
    assert len(to_b5) == 2 and "concatenate" in to_b5[0] and to_b5[1] == "add+reduce", g.handed
    assert [to for _, kinds, to in g.handed if "concatenate" in kinds] == ["kernel 10, kernel 12"], g.handed
    assert g.total_ops <= 74 and g.launches_fused <= 4 and g.bytes_fused <= 803840, g
