"""``Tokens`` views of the call's inputs (kdax/_layouts/tokens.py): what they stand for is exactly
the chunked copy ``pack_inputs`` makes (cast, cleaned, heads repeated), and the stage
runner hands a stage without the ``tokens`` capability that copy."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._numerics import isolation as _isolation
from kdax._layouts.layout import make_layout, pack_inputs
from kdax._runner.runner import recording
from kdax._layouts.tokens import Tokens, as_chunked, token_inputs
from kdax.stages import KDA, AbstractGate, ReferenceGate

from ._util import make_inputs, run


def _raw(dtype, B=2, T=48, H=2, HV=4, K=16, V=8):
    x = make_inputs(seed=3, B=B, T=T, H=H, HV=HV, K=K, V=V, gate="raw", beta_raw=True, dtype=dtype)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    # Elements that each input's cleaning kind reads as zero, and some it keeps (a gate of
    # -inf is a full reset when the gate is not in-kernel; ±inf raw gates and betas are
    # valid when their activation is finite there).
    q = q.at[0, 5, 1, 2].set(jnp.nan).at[1, 40, 0, 0].set(jnp.inf)
    k = k.at[1, 7, 0, 3].set(-jnp.inf)
    g = g.at[0, 9, 2, 1].set(jnp.nan).at[0, 10, 3, 4].set(-jnp.inf).at[1, 11, 0, 5].set(jnp.inf)
    beta = beta.at[1, 12, 1].set(jnp.nan).at[0, 13, 2].set(jnp.inf)
    return q, k, v, g, beta


@pytest.mark.parametrize("in_dtype,dt", [(jnp.float64, jnp.float64), (jnp.float32, jnp.float32),
                                         (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("gate_in_kernel,beta_sigmoid", [(False, False), (True, True)])
def test_views_stand_for_the_packed_inputs(in_dtype, dt, gate_in_kernel, beta_sigmoid):
    raw = _raw(in_dtype)
    B, T, _, _ = raw[0].shape
    HV, C = raw[2].shape[2], 16
    for clean in (False, True):
        kinds = _isolation.input_kinds(gate_in_kernel, beta_sigmoid) if clean else None
        cleaner = _isolation.cleaner(gate_in_kernel, beta_sigmoid) if clean else None
        want = pack_inputs(make_layout(B, T, C), raw, HV, dt, cleaner)
        views = token_inputs(raw, HV, C, dt, kinds)
        for name, view, w in zip("q k v g beta".split(), views, want):
            got = view.chunked()
            assert (view.shape, view.ndim, view.dtype) == (w.shape, w.ndim, w.dtype), name
            assert got.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w), err_msg=name)


def test_views_need_whole_chunks_and_head_groups():
    assert kdax.typing.Tokens is Tokens  # (the public name of what "tokens" stages receive)
    x = jnp.zeros((1, 40, 2, 16))
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        Tokens(x, 2, 16, np.dtype(np.float32))
    with pytest.raises(ValueError, match="heads"):
        Tokens(x, 3, 8, np.dtype(np.float32))
    assert as_chunked(x) is x


class RecordingGate(AbstractGate):
    """The reference gate, declaring no views: the runner must hand it chunked arrays."""

    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})
    math: ClassVar[str] = KDA  # (the reference's own formula: the six-stage backward runs)

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        assert all(isinstance(x, jax.Array) for x in (q, k, g, beta))
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


def test_only_stages_that_read_tokens_get_views():
    """The Pallas gate family reads views on dense input whose T is a multiple of the chunk
    size; with a gate that does not declare ``tokens``, every stage gets arrays (and B5 a
    chunked g); a ragged tail or packed input makes no views."""
    x = make_inputs(seed=0, B=1, T=64, H=2, K=16, V=16, gate="raw", A_log=True, dtype=jnp.float32)
    opts = dict(chunk_size=16, use_gate_in_kernel=True, output_final_state=True)
    pal = kdax.KDAPipeline.pallas("triton", interpret=True)

    def seen(pipe, x):
        with recording() as rec:
            jax.jit(jax.grad(lambda q: run(pipe, dict(x, q=q), opts)[0].sum()))(x["q"])
        return type(rec.inputs["gate"]["q"]), type(rec.inputs["gate_bwd"]["g"])

    assert seen(pal, x) == (Tokens, Tokens)
    assert not any(issubclass(t, Tokens) for t in seen(dataclasses.replace(pal, gate=RecordingGate()), x))
    short = {n: a[:, :60] if a.ndim >= 3 else a for n, a in x.items()}
    assert not any(issubclass(t, Tokens) for t in seen(pal, short))
