"""Parametrised stages swapped into a pipeline, used inside a model under
``eqx.filter_jit`` + ``eqx.filter_grad``, their intermediates read out.

The modified algorithm: KDA with a per-head query gain, ``q <- gain * q`` after F1's
activations. ``QGainGate`` (F1) applies it; ``QGainGateBackward`` (B5) applies its
transpose to ``dq``, so that the six-stage backward stays the exact gradient of the
modified forward. Both say so: F1 declares the math it computes (``math``), B5 that it
transposes that math (``transposes``), and the pipeline keeps its hand-written backward.
Without ``QGainGateBackward`` (or without the declarations) the gradient is still exact:
the pipeline derives it from the forward stages by ``jax.vjp``, slower, with a
``FallbackWarning`` (``kdax._runner.routes``). The gain is an array field of both stages; differentiated, F1's copy
gets its exact gradient (the gate's own VJP at the backward's cotangent of its output)
and B5's copy zero, which is exact: the forward never reads it.

The script checks what it claims: the output and every gradient (``k_scale``, F1's gain,
``q``, ``k``, ``v``, ``g``, ``beta``) against ``jax.grad`` of ``plain_kda``, a plain-JAX
token-by-token recurrence of the modified algorithm written here without kdax, in the run's
dtype; it prints each relative RMS error (and max-abs) and raises ``GradientMismatch`` if
one exceeds the budget (1e-10 in float64, 1e-5 for the float32 output, 1e-4 for float32
gradients). Run from the repository root::

    python examples/custom_stage.py
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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


def plain_kda(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
              g: Float[Array, "B T H K"], beta: Float[Array, "B T H"]) -> Float[Array, "B T H V"]:
    """KDA as the recurrence it is, in plain JAX (no kdax), token by token from a zero state:
    ``S <- Diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = K**-0.5 S^T q_t``."""

    def step(S, x):  # S [B, H, K, V]
        q_t, k_t, v_t, g_t, b_t = x
        S = S * jnp.exp(g_t)[..., None]
        err = v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + b_t[..., None, None] * k_t[..., :, None] * err[..., None, :]
        return S, q.shape[-1] ** -0.5 * jnp.einsum("bhkv,bhk->bhv", S, q_t)

    S0 = jnp.zeros(q.shape[:1] + q.shape[2:] + v.shape[-1:], q.dtype)
    _, o = jax.lax.scan(step, S0, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1)


def plain_layer(k_scale, gain, q, k, v, g, beta):
    """``Layer`` in plain JAX: the gain on q (per head; H == HV here), the key scale, KDA."""
    return plain_kda(q * gain[None, None, :, None], k * k_scale, v, g, beta)


class GradientMismatch(AssertionError):
    """kdax's output or gradient differs from plain JAX's beyond the dtype's budget."""


# Relative RMS budgets (docs/DESIGN.md section 4): (output, gradients) per dtype.
TOLERANCE = {jnp.dtype(jnp.float64): (1e-10, 1e-10), jnp.dtype(jnp.float32): (1e-5, 1e-4)}


@eqx.filter_jit
@eqx.filter_grad
def model_grads(args):
    """Gradients of ``sum(layer(*x) ** 2)`` w.r.t. ``args = (layer, q, k, v, g, beta)``: the
    layer's arrays through the pipeline's six-stage backward, and the inputs'."""
    layer, *x = args
    return jnp.sum(layer(*x) ** 2)


def check_against_plain_jax(layer: Layer, x: tuple, o, d_layer: Layer, d_x: tuple, verbose: bool = True) -> dict:
    """Compare kdax's output ``o`` and gradients (``d_layer`` for the layer, ``d_x`` for
    ``x = (q, k, v, g, beta)``) with ``plain_layer`` and ``jax.grad`` of its loss, in ``x``'s
    dtype; print the errors, raise ``GradientMismatch`` naming any that exceeds
    ``TOLERANCE``. Returns ``{name: relative RMS error}``."""
    dtype = jnp.dtype(x[0].dtype)
    if dtype not in TOLERANCE:
        raise ValueError(f"x: expected float32 or float64 inputs to check, got {dtype}.")
    tol_o, tol_g = TOLERANCE[dtype]
    gain = layer.pipeline.gate.gain
    if not np.array_equal(np.asarray(gain), np.asarray(layer.pipeline.gate_bwd.gain)):
        raise ValueError("layer: F1's and B5's gains differ; plain_layer has one gain (see gain_pipeline).")
    plain_loss = lambda *a: jnp.sum(plain_layer(*a) ** 2)
    want_d = jax.grad(plain_loss, argnums=tuple(range(7)))(layer.k_scale, gain, *x)
    pairs = [("o", o, plain_layer(layer.k_scale, gain, *x), tol_o),
             ("d k_scale", d_layer.k_scale, want_d[0], tol_g),
             ("d gain (F1's copy)", d_layer.pipeline.gate.gain, want_d[1], tol_g)]
    pairs += [(f"d {n}", got, want, tol_g) for n, got, want in zip(("q", "k", "v", "g", "beta"), d_x, want_d[2:])]
    errors, bad = {}, []
    if verbose:
        print(f"checked against plain JAX (plain_kda: a lax.scan recurrence, jax.grad of sum(o**2)), {dtype.name}; "
              f"relative RMS (max-abs), budget:")
    for name, got, want, tol in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        den = np.sqrt(np.mean(want**2))
        err = float(np.sqrt(np.mean((got - want) ** 2)) / (den if den > 0 else 1.0))
        errors[name] = err
        ok = err <= tol  # NaN fails
        if not ok:
            bad.append(f"{name}: relative RMS {err:.3e} > {tol:.0e}")
        if verbose:
            print(f"  {name:20s} {err:.2e} ({float(np.max(np.abs(got - want))):.2e}), {tol:.0e}  "
                  f"{'ok' if ok else 'MISMATCH'}")
    # B5's copy of the gain is never read by the forward: its gradient is exactly zero.
    if np.any(np.asarray(d_layer.pipeline.gate_bwd.gain) != 0):
        bad.append(f"d gain (B5's copy): expected exactly 0, got {d_layer.pipeline.gate_bwd.gain}")
    if bad:
        raise GradientMismatch("kdax and plain JAX disagree: " + "; ".join(bad) + ".")
    return errors


def main(dtype=jnp.float32, verbose: bool = True):
    q, k, v, g, beta = inputs(jax.random.key(0), dtype=dtype)
    layer = Layer(jnp.ones((q.shape[-1],), dtype), gain_pipeline(jnp.array([0.5, 2.0], dtype)))

    d, *d_x = model_grads((layer, q, k, v, g, beta))

    # Intermediates in the user's layout, from the forward's residuals, under jit.
    @eqx.filter_jit
    def intermediates(pipe, *x):
        o, _, res = pipe.forward(*x, chunk_size=16)
        return o, res.read("q"), res.read("v_new"), res.read("h")

    o, q_act, v_new, h = intermediates(layer.pipeline, q, k, v, g, beta)
    check_against_plain_jax(layer, (q, k, v, g, beta), o, d, tuple(d_x), verbose)
    if verbose:
        print("d k_scale:", d.k_scale)
        print("d gain (F1's copy, exact):", d.pipeline.gate.gain)
        print("o", o.shape, "q after F1 [B, T, HV, K]", q_act.shape, "v_new [B, T, HV, V]", v_new.shape,
              "h [B, NC, HV, K, V]", h.shape)
        print(layer.pipeline.plan(q, k, v, g, beta, chunk_size=16))
    return layer, d, (o, q_act, v_new, h)


if __name__ == "__main__":
    main()
