"""What chunk_kda is timed against: the plain ``lax.scan`` recurrence, the readable oracle,
XLA autodiff of the chunked forward, ``fused_recurrent_kda``; and the training step that
every gradient path runs."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._annotations import Beta, Gate, QK, Values
from .._config import KDAOptions
from .._validate import prepare_options
from ..pipeline import KDAPipeline
from ..recurrent import fused_recurrent_kda
from ..ref import naive_recurrent_kda
from ._shape import Shape, per_device


def plain_scan_kda(q: QK, k: QK, v: Values, g: Gate, beta: Beta) -> tuple[
        Float[Array, "B T HV V"], Float[Array, "B HV K V"]]:
    """KDA as a careful user writes it in plain JAX (the honest baseline; kdax.ref keeps the
    readable oracle): one ``lax.scan`` over time that reads the state once for both
    products and once to update it: the decay folded into k and q (``k^T (a S) = (a k)^T S``),
    the output from the old state (``q^T S' = (a q)^T S + (q . k) u``); value head i reads q/k
    head i // (HV // H), default scale. Returns ``(o, final state)``. (Until session 59 it
    stored the decayed state and read it three times: 2.5x the time at the main job's shape.)"""
    HV = v.shape[2]
    q, k = (jnp.repeat(x, HV // x.shape[2], axis=2) for x in (q, k))
    scale = q.shape[-1] ** -0.5
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q * scale, k, v, jnp.exp(g), beta))

    def step(S, x):
        q_t, k_t, v_t, a_t, b_t = x
        P = jnp.einsum("bhik,bhkv->bhiv", jnp.stack([a_t * k_t, a_t * q_t], 2), S)
        pred, o_old = P[:, :, 0], P[:, :, 1]
        u = b_t[..., None] * (v_t - pred)
        S = S * a_t[..., None] + k_t[..., None] * u[..., None, :]
        return S, o_old + jnp.sum(q_t * k_t, -1, keepdims=True) * u

    B, _, H, K = q.shape
    S, o = jax.lax.scan(step, jnp.zeros((B, H, K, v.shape[-1]), q.dtype), xs)
    return jnp.moveaxis(o, 0, 1), S


class _TrainStep:
    """A training step: the loss ``sum(o * w)`` and every input gradient, called with the
    five inputs. ``w`` (``cotangent``) is an argument of the compiled program, as a real
    loss's cotangent is: with ``sum(o)`` XLA would see a constant ``do`` of ones, which it
    can fold into each path differently. Returning the loss keeps the whole forward in the
    program (``jax.grad`` alone would let XLA drop the parts of a custom VJP's forward that
    only produce ``o``)."""

    def __init__(self, fn, w):
        def loss(q, k, v, g, beta, w):
            return jnp.sum(fn(q, k, v, g, beta)[0].astype(w.dtype) * w)

        self.step, self.w = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))), w

    def __call__(self, *args):
        return self.step(*args, self.w)

    def lower(self, *args):
        return self.step.lower(*args, self.w)


def _autodiff_chunk(pipeline: KDAPipeline, chunk_size: int):
    def fwd(q, k, v, g, beta):
        config, args, _ = prepare_options(q, k, v, g, beta, KDAOptions(chunk_size=chunk_size))
        o, final, _ = pipeline.run_forward(config, *args)
        return o, final

    return fwd


def pipelines() -> dict:
    """``{name: KDAPipeline}`` that ``--pipelines`` chooses from."""
    pipes = {"reference": KDAPipeline.reference()}
    if hasattr(KDAPipeline, "pallas"):
        pipes["pallas"] = KDAPipeline.pallas()
        pipes["mixed"] = KDAPipeline.mixed()
    return pipes


def baseline_paths(s: Shape, w: Float[Array, "B T HV V"], slow_baselines: bool = False, devices: int = 1) -> list:
    """The baselines at shape ``s``: ``(name, kind, function, heavy)``; heavy ones (GBs,
    seconds a call) are timed alone. The scan's gradient (the readable oracle's, the
    slowest) only with ``slow_baselines``; no scan gradient above T=4096 (autodiff of a
    scan keeps every step's state: 6 GB at T=4096). Each on ``devices`` host devices as
    chunk_kda (``per_device``)."""
    # The stages whole, as chunk_kda's own training step runs its forward.
    whole = KDAPipeline.reference().untiled()
    on = lambda fn: per_device(fn, devices)
    fwd = lambda fn: jax.jit(lambda *a: on(fn)(*a)[0])
    paths = [("scan", "fwd", fwd(naive_recurrent_kda), False)]
    if slow_baselines and s.T <= 4096:
        paths.append(("scan", "fwd+bwd", _TrainStep(on(naive_recurrent_kda), w), True))
    paths += [("autodiff_chunk", "fwd+bwd", _TrainStep(on(_autodiff_chunk(whole, s.chunk_size)), w), True),
              ("fused_recurrent", "fwd", fwd(fused_recurrent_kda), False),
              ("plain_scan", "fwd", fwd(plain_scan_kda), False)]
    if s.T <= 4096:
        paths.append(("plain_scan", "fwd+bwd", _TrainStep(on(plain_scan_kda), w), True))
    return paths
