"""The readable chunked oracle equals the naive recurrence exactly (float64)."""

import numpy as np
import pytest

from kdax.ref import naive_chunk_kda, naive_recurrent_kda

from .._util import assert_close, make_inputs, split_args


@pytest.mark.parametrize(
    "T,H,HV,chunk,strong",
    [(70, 2, 2, 16, False), (100, 1, 3, 32, False), (130, 2, 4, 64, True), (200, 2, 2, 128, True), (1, 1, 1, 16, False)],
)
def test_naive_chunk_equals_recurrent(T, H, HV, chunk, strong):
    x = make_inputs(seed=T, B=2, T=T, H=H, HV=HV, K=16, V=8, strong=strong)
    pos, kw = split_args(x)
    o_r, h_r = naive_recurrent_kda(*pos, **kw, output_final_state=True)
    o_c, h_c = naive_chunk_kda(*pos, **kw, output_final_state=True, chunk_size=chunk)
    assert_close(o_c, o_r, 1e-12, "o")
    assert_close(h_c, h_r, 1e-12, "ht")
    if strong:
        assert np.any(np.asarray(x["g"]) == -1000.0)
