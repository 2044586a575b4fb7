"""Stage arrays under differentiation (kdax/_runner/stage_grads.py): F1 and F5 arrays get their
exact gradients (float64, against autodiff of an oracle of the modified algorithm), the
backward stages' arrays an exact zero; F2-F4 arrays of a stage declaring KDA's math (the
hand-written backward runs) a named error at trace time, and of a stage of other math
their exact gradients through the derived backward (kdax/_runner/routes.py); never a silent
zero."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import kdax
from kdax.stages import (
    KDA, AbstractDhu, AbstractOutput, AbstractWY, ReferenceDhu, ReferenceOutput, ReferenceWY,
)

from ._util import assert_close, make_inputs, oracle_kda, split_args


class GainOutput(AbstractOutput):
    """F5 of the reference, times a learnable per-head gain."""

    gain: Float[Array, " HV"]
    tile_safe: ClassVar[bool] = True

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return o * self.gain[None, :, None, None, None].astype(o.dtype)


class ScaledWY(AbstractWY):
    """F3 with an array, ``u <- a u``; declaring KDA's math (true at a = 1), the six-stage
    backward runs and the array's gradient is refused."""

    a: Float[Array, ""]
    tile_safe: ClassVar[bool] = True
    math: ClassVar[str] = KDA

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None):
        out = ReferenceWY()(q, k, v, beta, G, Akk, G_lo=G_lo)
        return eqx.tree_at(lambda o: o.u, out, out.u * self.a)


class ScaledDhu(AbstractDhu):
    """B2 holding an array: the forward does not read it, so its gradient is exactly zero."""

    a: Float[Array, ""]

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout):
        return ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout)


GAIN = jnp.array([0.6, -1.3, 2.0])


def _loss(o, ht):
    return jnp.sum(o * jnp.sin(o)) + jnp.sum(ht * jnp.cos(ht))


@pytest.mark.parametrize("packed", [False, True])
def test_output_stage_array_gets_its_exact_gradient(packed):
    x = make_inputs(B=1 if packed else 2, T=37, H=3, K=8, V=8, N=3 if packed else None)
    pos, kw = split_args(x)
    opts = dict(output_final_state=True, chunk_size=16, initial_state=kw["initial_state"])
    if packed:
        opts["cu_seqlens"] = jnp.array([0, 5, 21, 37], jnp.int32)
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), GainOutput(GAIN))

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(diff):
        p, q = diff
        return _loss(*kdax.chunk_kda(q, *pos[1:], pipeline=p, **opts))

    d_pipe, dq = grads((pipe, pos[0]))

    def oracle(gain, q):
        o, ht = oracle_kda(q, *pos[1:], **opts)
        return _loss(o * gain[None, None, :, None], ht)

    dgain_ref, dq_ref = jax.grad(oracle, argnums=(0, 1))(GAIN, pos[0])
    assert_close(d_pipe.output.gain, dgain_ref, 1e-11, "d gain (F5)")
    # The input gradients are those of the modified algorithm (the gain's F5 declares no
    # math, so the backward is derived from the forward stages: kdax._runner.routes).
    assert_close(dq, dq_ref, 1e-10, "dq (modified algorithm)")


def test_forward_stage_without_exact_gradient_is_refused_by_name():
    pos, kw = split_args(make_inputs(B=1, T=20, H=2, K=4, V=4))
    pipe = eqx.tree_at(lambda p: p.wy, kdax.KDAPipeline.reference(), ScaledWY(jnp.array(1.0)))
    loss = lambda p: jnp.sum(kdax.chunk_kda(*pos, chunk_size=16, pipeline=p)[0])
    with pytest.raises(kdax.StageGradientError, match=r"pipeline\.wy\.a: .*F3 stage `wy` \(ScaledWY\)"):
        eqx.filter_grad(loss)(pipe)
    # Held as configuration, it is not differentiated: no error, and the forward runs.
    d = eqx.filter_grad(lambda p: loss(jax.tree.map(jax.lax.stop_gradient, p)))(pipe)
    assert float(d.wy.a) == 0.0
    o, _ = kdax.chunk_kda(*pos, chunk_size=16, pipeline=pipe)
    assert_close(o, oracle_kda(*pos)[0], 1e-10, "o")


class FreeWY(AbstractWY):
    """``u <- a u`` as a stage of its own math (none declared): the derived backward."""

    a: Float[Array, ""]

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None):
        out = ReferenceWY()(q, k, v, beta, G, Akk, G_lo=G_lo)
        return eqx.tree_at(lambda o: o.u, out, out.u * self.a)


def test_forward_stage_of_other_math_gets_exact_gradients():
    # u <- a u is KDA at (a v): the oracle's gradients, the array's included.
    pos, _ = split_args(make_inputs(B=1, T=20, H=2, K=4, V=4))
    a = jnp.array(1.7)
    pipe = eqx.tree_at(lambda p: p.wy, kdax.KDAPipeline.reference(), FreeWY(a))
    loss = lambda p, v: _loss(kdax.chunk_kda(pos[0], pos[1], v, *pos[3:], chunk_size=16, pipeline=p)[0], 0.0)
    with pytest.warns(kdax.FallbackWarning, match="derived from the forward stages"):
        d_pipe, dv = eqx.filter_jit(eqx.filter_grad(lambda diff: loss(*diff)))((pipe, pos[2]))
    oracle = lambda a_, v: _loss(oracle_kda(pos[0], pos[1], a_ * v, *pos[3:])[0], 0.0)
    da_ref, dv_ref = jax.grad(oracle, argnums=(0, 1))(a, pos[2])
    assert_close(d_pipe.wy.a, da_ref, 1e-10, "d a (F3)")
    assert_close(dv, dv_ref, 1e-10, "dv")


def test_backward_stage_array_gets_exact_zero():
    pos, _ = split_args(make_inputs(B=1, T=20, H=2, K=4, V=4))
    pipe = eqx.tree_at(lambda p: p.dhu, kdax.KDAPipeline.reference(), ScaledDhu(jnp.array(2.0)))
    loss = lambda p, q: jnp.sum(kdax.chunk_kda(q, *pos[1:], chunk_size=16, pipeline=p)[0] ** 2)
    d, dq = eqx.filter_jit(eqx.filter_grad(lambda diff: loss(*diff)))((pipe, pos[0]))
    assert float(d.dhu.a) == 0.0
    ref = jax.jit(jax.grad(lambda q: jnp.sum(oracle_kda(q, *pos[1:])[0] ** 2)))(pos[0])
    assert_close(dq, ref, 1e-10, "dq")
    assert np.all(np.isfinite(np.asarray(dq)))
