"""Gated DeltaNet (Qwen3-Next's linear attention) composed from kdax's stages: one new F1.

Gated DeltaNet is KDA with one decay per head instead of one per key channel:

    g_t = -exp(A_log[h]) * softplus(a_t + dt_bias[h])          (a scalar per token and head)
    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = scale * S_t^T q_t

with ``beta = sigmoid(b)`` and l2-normalised q and k. Only the gate differs, so only F1
changes: ``ScalarDecayGate`` reads the raw gate ``a`` (channel 0 of the ``g`` argument:
pass ``a[..., None]`` broadcast over K) and the per-head ``A_log``/``dt_bias`` (``dt_bias``
as ``[HV * K]``, each head's value on its first channel), activates it once per head, and
hands KDA's reference F1 the broadcast log decay (which also does the l2 norm, the beta
sigmoid and the chunk cumsum). It declares other math (``math = "gdn-scalar-gate"``), so
the pipeline keeps its hand-written B0-B4 (they never read the gate's form) and gets B5 as
the VJP of this F1 by ``jax.vjp`` (``kdax.stages.GateVjpBackward``): exact, and nothing
else derived. Sequence parallel works as is (F2-F5 are KDA's).

The script checks the output and every gradient (q, k, v, a, b, A_log, dt_bias) against
``jax.grad`` of ``plain_gdn``, a plain-JAX token-by-token recurrence written here without
kdax, in float64, and raises ``GDNMismatch`` beyond 1e-10 relative RMS. Run from the
repository root::

    python examples/gated_deltanet.py
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import kdax
from kdax.stages import AbstractGate, ReferenceGate


class ScalarDecayGate(AbstractGate):
    """F1 of Gated DeltaNet: one log decay per token and head from channel 0 of the raw
    gate (``-exp(A_log) * softplus(a + dt_bias)``), broadcast over the key channels, then
    KDA's F1 on it (l2 norm, beta sigmoid, chunk cumsum)."""

    math: ClassVar[str] = "gdn-scalar-gate"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        HV, K = g.shape[1], g.shape[-1]
        x = g[..., :1]
        if dt_bias is not None:
            x = x + dt_bias.reshape(HV, K)[None, :, None, None, :1]
        decay = -jnp.exp(A_log).reshape(1, HV, 1, 1, 1) * jax.nn.softplus(x)
        plain = dataclasses.replace(config, use_gate_in_kernel=False, lower_bound=None)
        return ReferenceGate()(plain, q, k, jnp.broadcast_to(decay, g.shape), beta, None, None, valid)


def gdn_pipeline(base=None) -> kdax.KDAPipeline:
    """``base`` (default: the reference pipeline) with Gated DeltaNet's F1."""
    base = kdax.KDAPipeline.reference() if base is None else base
    return eqx.tree_at(lambda p: p.gate, base, ScalarDecayGate())


def gated_deltanet(q, k, v, a, b, A_log, dt_bias, *, pipeline=None, **options):
    """Gated DeltaNet through ``kdax.chunk_kda``: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    the raw gate ``a`` and beta input ``b`` ``[B, T, HV]``; ``A_log``, ``dt_bias`` ``[HV]``.
    Other options are ``chunk_kda``'s (``seq_axis_name``, ``cu_seqlens``, states, ...)."""
    K = q.shape[-1]
    g = jnp.broadcast_to(a[..., None], a.shape + (K,))
    dt = jnp.zeros(A_log.shape + (K,), dt_bias.dtype).at[:, 0].set(dt_bias).reshape(-1)
    return kdax.chunk_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt, use_gate_in_kernel=True,
                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                          pipeline=gdn_pipeline() if pipeline is None else pipeline, **options)


def plain_gdn(q, k, v, a, b, A_log, dt_bias, scale=None):
    """Gated DeltaNet token by token in plain JAX (the oracle): ``o [B, T, HV, V]``."""
    HV, K = v.shape[2], q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    rep = lambda x: jnp.repeat(x, HV // x.shape[2], axis=2)
    q, k = rep(norm(q)), rep(norm(k))
    g = -jnp.exp(A_log) * jax.nn.softplus(a + dt_bias)  # [B, T, HV]
    beta = jax.nn.sigmoid(b)

    def step(S, x):
        q_t, k_t, v_t, g_t, b_t = x  # [B, HV, ...]
        S = jnp.exp(g_t)[..., None, None] * S
        err = v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * err)
        return S, scale * jnp.einsum("bhkv,bhk->bhv", S, q_t)

    S0 = jnp.zeros(q.shape[:1] + (HV, K, v.shape[-1]), v.dtype)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    return jnp.moveaxis(jax.lax.scan(step, S0, xs)[1], 0, 1)


class GDNMismatch(AssertionError):
    """kdax's Gated DeltaNet disagrees with the plain recurrence."""


def inputs(seed=0, B=2, T=96, H=2, HV=4, K=16, V=16, dtype=jnp.float64):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    return dict(q=f(B, T, H, K), k=f(B, T, H, K), v=f(B, T, HV, V), a=f(B, T, HV), b=f(B, T, HV),
                A_log=jnp.asarray(r.uniform(-1.0, 0.5, HV), dtype), dt_bias=f(HV) * 0.5)


def compare(x, fn=gated_deltanet, tol=1e-10, **options) -> dict:
    """Relative RMS errors of ``fn`` (kdax's GDN) against ``plain_gdn``: output and the
    gradient of every input of ``sum(o * w)``; raises ``GDNMismatch`` beyond ``tol``."""
    names = tuple(x)
    w = jnp.asarray(np.random.default_rng(9).normal(size=x["v"].shape), x["v"].dtype)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    ours = lambda *a: fn(*a, chunk_size=16, **options)[0]
    o, o_ref = jax.jit(ours)(*x.values()), plain_gdn(*x.values())
    grads = jax.jit(jax.grad(loss(ours), argnums=tuple(range(len(names)))))(*x.values())
    want = jax.jit(jax.grad(loss(plain_gdn), argnums=tuple(range(len(names)))))(*x.values())
    rel = lambda u, r: float(jnp.sqrt(jnp.mean((u - r) ** 2)) / jnp.sqrt(jnp.mean(r**2)))
    errs = {"o": rel(o, o_ref)} | {f"d{n}": rel(gu, gr) for n, gu, gr in zip(names, grads, want)}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    if bad:
        raise GDNMismatch(f"Gated DeltaNet through kdax disagrees with the plain recurrence: {bad} (budget {tol:g})")
    return errs


def main():
    jax.config.update("jax_enable_x64", True)
    for name, e in compare(inputs()).items():
        print(f"{name:>9}: rel-RMS {e:.2e} against plain_gdn (float64)")
    print("ok: Gated DeltaNet = KDA's pipeline with one F1 swapped; B5 is that F1's VJP, B0-B4 hand-written")


if __name__ == "__main__":
    main()
