"""Per-sequence products over spans of packed tokens, the two that shared chunks need
(``kdax._shared_states``): each sequence n owns one span of tokens (``start[n]``,
``count[n]``; spans disjoint and in sequence order) and a state ``[K, V]``.

- ``matvec(A, Y, spans)``: ``out_t = A_t Y_n`` for each token t of span n (a row vector
  times the sequence's state), zero outside the spans;
- ``outer(U, X, spans, N)``: ``S_n = sum_t U_t^T X_t`` over span n's tokens.

Each is the other's transpose, which gives both VJPs. Both run over blocks of ``W`` tokens
counted from each span's start, ``[N, W, K] x [N, K, V]`` batched products, as many
blocks as the longest span needs (a loop of dynamic length: one block for short
sequences), reading each state once per block and never forming a ``[T, K, V]`` array. A
token's result is gathered from its block (no scatter).

Layouts: token arrays ``[HV, TT, D]`` (token t at t), states ``[N, HV, K, V]``.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Tokens per block.
W = 16


class Spans(NamedTuple):
    """Per sequence ``[N]`` int32: the first token of its span and the span's length."""

    start: jax.Array
    count: jax.Array


def _blocks(spans: Spans):
    return (jnp.max(spans.count, initial=0) + W - 1) // W


def _gather_block(x, spans: Spans, b):
    """``x [HV, TT, D]`` at tokens ``start + b W + (0..W-1)`` of each span: ``[N, HV, W, D]``
    (positions past a span read a clipped token; callers mask them)."""
    t = jnp.clip(spans.start[:, None] + b * W + jnp.arange(W)[None], 0, x.shape[1] - 1)
    return jnp.moveaxis(x[:, t], 0, 1)


def _in_block(spans: Spans, b):
    """``[N, W]``: the block's positions inside each span."""
    return (b * W + jnp.arange(W))[None] < spans.count[:, None]


def token_slots(spans: Spans, TT: int):
    """Per token: its span n, its offset d in it, whether it is in one."""
    t = jnp.arange(TT)
    n = jnp.clip(jnp.searchsorted(spans.start, t, side="right") - 1, 0, spans.start.shape[0] - 1)
    d = t - spans.start[n]
    return n, d, (d >= 0) & (d < spans.count[n])


def _matvec(A, Y, spans: Spans):
    HV, TT = A.shape[:2]
    n, d, inside = token_slots(spans, TT)

    def block(b, out):
        R = jnp.einsum("nhwk,nhkv->nhwv", _gather_block(A, spans, b), Y)  # [N, HV, W, V]
        mine = inside & (d // W == b)
        got = R[n, :, jnp.clip(d - b * W, 0, W - 1)]  # [TT, HV, V]
        return out + jnp.where(mine[None, :, None], jnp.moveaxis(got, 0, 1), jnp.zeros((), out.dtype))

    out = jnp.zeros((HV, TT, Y.shape[-1]), jnp.result_type(A, Y))
    return jax.lax.fori_loop(0, _blocks(spans), block, out)


def _outer(U, X, spans: Spans, N: int):
    def block(b, S):
        ok = _in_block(spans, b)[:, None, :, None]
        Ub = jnp.where(ok, _gather_block(U, spans, b), jnp.zeros((), U.dtype))
        return S + jnp.einsum("nhwk,nhwv->nhkv", Ub, _gather_block(X, spans, b))

    S = jnp.zeros((N, U.shape[0], U.shape[-1], X.shape[-1]), jnp.result_type(U, X))
    return jax.lax.fori_loop(0, _blocks(spans), block, S)


@jax.custom_vjp
def matvec(A, Y, spans: Spans):
    """``out [HV, TT, V]``: ``A_t Y_n`` (``A [HV, TT, K]``, ``Y [N, HV, K, V]``) for each
    token t of span n, zero elsewhere."""
    return _matvec(A, Y, spans)


def _matvec_fwd(A, Y, spans):
    return _matvec(A, Y, spans), (A, Y, spans)


def _matvec_bwd(res, dout):
    A, Y, spans = res
    dA = _matvec(dout, jnp.swapaxes(Y, -1, -2), spans)
    dY = _outer(A, dout, spans, Y.shape[0])
    return dA.astype(A.dtype), dY.astype(Y.dtype), None


matvec.defvjp(_matvec_fwd, _matvec_bwd)


def outer(U, X, spans: Spans, N: int):
    """``S [N, HV, K, V]``: ``sum_t U_t^T X_t`` over the tokens t of span n (``U [HV, TT,
    K]``, ``X [HV, TT, V]``); zero for an empty span."""
    return _outer_vjp(U, X, spans, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _outer_vjp(U, X, spans: Spans, N: int):
    return _outer(U, X, spans, N)


def _outer_fwd(U, X, spans, N):
    return _outer(U, X, spans, N), (U, X, spans)


def _outer_bwd(N, res, dS):
    U, X, spans = res
    dU = _matvec(X, jnp.swapaxes(dS, -1, -2), spans)
    dX = _matvec(U, dS, spans)
    return dU.astype(U.dtype), dX.astype(X.dtype), None


_outer_vjp.defvjp(_outer_fwd, _outer_bwd)
