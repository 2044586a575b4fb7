"""B0 recompute rebuilds exactly the forward cache."""

import numpy as np

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
