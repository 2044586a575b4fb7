"""Parametrised stages swapped into a pipeline, used inside a model under
``eqx.filter_jit`` + ``eqx.filter_grad``, their intermediates read out.

The modified algorithm: KDA with a per-head query gain, ``q <- gain * q`` after F1's
activations. ``QGainGate`` (F1) applies it; ``QGainGateBackward`` (B5) applies its
transpose to ``dq``, so that the six-stage backward stays the exact gradient of the
modified forward. Both say so: F1 declares the math it computes (``math``), B5 that it
transposes that math (``transposes``), and the pipeline keeps its hand-written backward.
Without ``QGainGateBackward`` (or without the declarations) the gradient is still exact:
the pipeline derives it from the forward stages by ``jax.vjp``, slower, with a
``FallbackWarning`` (``kdax._runner.derived``). The gain is an array field of both stages; differentiated, F1's copy
gets its exact gradient (the gate's own VJP at the backward's cotangent of its output)
and B5's copy zero, which is exact: the forward never reads it. Run from the repository
root::

    python examples/custom_stage.py
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import kdax
from kdax.stages import Activated, AbstractGate, AbstractGateBackward, RawGrads, ReferenceGate, ReferenceGateBackward
from kdax.typing import ChunkK, ChunkScalar, typecheck


def _per_head(gain, x):
    """``gain [HV]`` broadcast over the chunked layout ``[R, HV, NC, C, K]``."""
    return gain[None, :, None, None, None].astype(x.dtype)


class QGainGate(AbstractGate):
    """F1 of the reference, then ``q <- gain * q`` per value head."""

    gain: Float[Array, " HV"]
    # Elementwise per token: correct on any tile of chunks (docs/stages.md); checked by
    # kdax.testing.check_stage, though a pipeline tiles only stages of KDA's math.
    tile_safe: ClassVar[bool] = True
    # Not KDA's F1 (that is kdax.stages.KDA): a name for this math, which B5 transposes.
    math: ClassVar[str] = "kda+qgain"

    @typecheck  # shapes checked when traced (kdax.typing: the chunked layout's aliases)
    def __call__(self, config, q: ChunkK, k: ChunkK, g: ChunkK, beta: ChunkScalar, A_log, dt_bias, valid) -> Activated:
        if config.use_qk_l2norm_in_kernel:
            # (a case a stage cannot run: UnsupportedCase, so the pipeline says which stage and why)
            raise kdax.UnsupportedCase("QGainGate: this example does not combine the gain with the in-kernel l2norm")
        act = ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)
        return dataclasses.replace(act, q=act.q * _per_head(self.gain, act.q))


class QGainGateBackward(AbstractGateBackward):
    """B5 of the reference, after ``dq <- gain * dq`` (the transpose of the gain)."""

    gain: Float[Array, " HV"]
    # The transpose of QGainGate's math (the other backward stages transpose KDA's F2-F5).
    transposes: ClassVar[dict] = {"gate": "kda+qgain"}

    @typecheck
    def __call__(self, config, act: Activated, g, A_log, dt_bias, valid, dq: ChunkK, dk: ChunkK, dbeta: ChunkScalar,
                 dG: ChunkK) -> RawGrads:
        dq = dq * _per_head(self.gain, dq)
        return ReferenceGateBackward()(config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG)


def gain_pipeline(gain) -> kdax.KDAPipeline:
    """The reference pipeline with the gain in F1 and B5."""
    pipe = kdax.KDAPipeline.reference()
    return eqx.tree_at(lambda p: (p.gate, p.gate_bwd), pipe, (QGainGate(gain), QGainGateBackward(gain)))


class Layer(eqx.Module):
    """A toy layer: a learnable key scale, then KDA with the gain pipeline."""

    k_scale: Float[Array, " K"]
    pipeline: kdax.KDAPipeline

    def __call__(self, q, k, v, g, beta):
        o, _ = kdax.chunk_kda(q, k * self.k_scale, v, g, beta, chunk_size=16, pipeline=self.pipeline)
        return o


def inputs(key, B=1, T=40, H=2, K=8, V=8, dtype=jnp.float32):
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (B, T, H, K), dtype)
    k = jax.random.normal(kk, (B, T, H, K), dtype) / K**0.5
    v = jax.random.normal(kv, (B, T, H, V), dtype)
    g = -jax.nn.softplus(jax.random.normal(kg, (B, T, H, K), dtype))
    beta = jax.nn.sigmoid(jax.random.normal(kb, (B, T, H), dtype))
    return q, k, v, g, beta


def main(dtype=jnp.float32, verbose: bool = True):
    q, k, v, g, beta = inputs(jax.random.key(0), dtype=dtype)
    layer = Layer(jnp.ones((q.shape[-1],), dtype), gain_pipeline(jnp.array([0.5, 2.0], dtype)))

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(layer, *x):
        return jnp.sum(layer(*x) ** 2)

    d = grads(layer, q, k, v, g, beta)

    # Intermediates in the user's layout, from the forward's residuals, under jit.
    @eqx.filter_jit
    def intermediates(pipe, *x):
        o, _, res = pipe.forward(*x, chunk_size=16)
        return o, res.read("q"), res.read("v_new"), res.read("h")

    o, q_act, v_new, h = intermediates(layer.pipeline, q, k, v, g, beta)
    if verbose:
        print("d k_scale:", d.k_scale)
        print("d gain (F1's copy, exact):", d.pipeline.gate.gain)
        print("o", o.shape, "q after F1 [B, T, HV, K]", q_act.shape, "v_new [B, T, HV, V]", v_new.shape,
              "h [B, NC, HV, K, V]", h.shape)
        print(layer.pipeline.plan(q, k, v, g, beta, chunk_size=16))
    return layer, d, (o, q_act, v_new, h)


if __name__ == "__main__":
    main()
