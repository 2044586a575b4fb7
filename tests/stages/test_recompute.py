"""B0 recompute rebuilds exactly the forward cache."""

import numpy as np
import pytest

import kdax

from .._util import make_inputs, split_args


def test_recompute_equals_forward_cache():
    x = make_inputs(B=2, T=50, H=2, HV=4, K=8, V=8)
    pos, kw = split_args(x)
    pipe = kdax.KDAPipeline.reference()
    _, _, res = pipe.forward(*pos, **kw, chunk_size=16, use_qk_l2norm_in_kernel=True)
    a, L = res.act, res.layout
    wy, st = pipe.recompute(a.q, a.k, res.v, a.beta, a.G, res.Akk, res.h0, L)
    c = res.cache
    for name, got in (("w", wy.w), ("u", wy.u), ("qg", wy.qg), ("kg", wy.kg), ("h", st.h), ("v_new", st.v_new)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(c, name)), err_msg=name)


def test_stage_as_module():
    """``pipe.stage_as_module`` (docs/stages.md, B0: what a B0 of your own recomputes with):
    F3 and F4 as the pipeline runs them give what the forward kept; another name is
    refused, naming the two."""
    pos, kw = split_args(make_inputs(B=2, T=40, H=2, HV=2, K=8, V=8))
    pipe = kdax.KDAPipeline.reference()
    _, _, res = pipe.forward(*pos, **kw, chunk_size=16)
    a, c = res.act, res.cache
    wy = pipe.stage_as_module("wy")(a.q, a.k, res.v, a.beta, a.G, res.Akk)
    st = pipe.stage_as_module("state")(c.w, c.u, c.kg, a.G, res.h0, res.layout)
    assert isinstance(wy, kdax.stages.WYOut) and isinstance(st, kdax.stages.StateOut)
    for name, got in (("w", wy.w), ("u", wy.u), ("qg", wy.qg), ("kg", wy.kg), ("h", st.h), ("v_new", st.v_new)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(c, name)), err_msg=name)
    with pytest.raises(ValueError, match=r"^name: expected 'wy' or 'state', got 'gate'\.$"):
        pipe.stage_as_module("gate")
