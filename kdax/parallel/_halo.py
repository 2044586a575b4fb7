"""The short convolution across devices: each device needs the last ``W - 1`` input rows
of the previous device (its halo), one ``ppermute``, and none across a sequence start."""

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._numerics.short_conv import causal_conv, conv_tail
from .._annotations import typecheck


def _seq_start(cu, pos):
    """The start offset of the sequence holding each global token position ``pos``."""
    i = jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, cu.shape[0] - 2)
    return cu[i]


@typecheck
def conv_halo(
    x: Float[Array, "B Tl D"],
    conv_size: int,
    axis_name: str,
    cu_seqlens: Optional[Int[Array, " N1"]] = None,
) -> Float[Array, "B W1 D"]:
    """Inside ``jax.shard_map`` with the token axis of ``x`` split over ``axis_name``: the
    last ``conv_size - 1`` rows of the previous device's ``x`` (one ``ppermute``); zeros on
    the first device and for every row before the start of the sequence that holds this
    device's first token (``cu_seqlens``: global offsets; dense: one sequence per row)."""
    W1 = conv_size - 1
    B, Tl, D = x.shape
    if conv_size < 1:
        raise ValueError(f"conv_size: expected >= 1, got {conv_size}.")
    if W1 > Tl:
        raise ValueError(f"x: the local token count {Tl} must be at least conv_size - 1 = {W1} (the halo comes from one device).")
    if W1 == 0:
        return jnp.zeros((B, 0, D), x.dtype)
    P = jax.lax.axis_size(axis_name)
    d = jax.lax.axis_index(axis_name)
    halo = jax.lax.ppermute(x[:, Tl - W1:], axis_name, [(i, i + 1) for i in range(P - 1)])
    if cu_seqlens is None:
        return halo  # the first device receives zeros
    s = d * Tl
    pos = s - W1 + jnp.arange(W1)
    keep = pos >= _seq_start(jnp.asarray(cu_seqlens, jnp.int32), s)
    return jnp.where(keep[None, :, None], halo, jnp.zeros((), halo.dtype))


@typecheck
def causal_conv1d(
    x: Float[Array, "B T D"],
    weight: Float[Array, "D W"],
    bias: Optional[Float[Array, " D"]] = None,
    *,
    cu_seqlens: Optional[Int[Array, " N1"]] = None,
    activation: Optional[str] = None,
    halo: Optional[Float[Array, "B W1 D"]] = None,
    offset=0,
) -> Float[Array, "B T D"]:
    """Causal depthwise convolution ``y[t] = sum_i weight[:, i] x[t - (W - 1) + i]`` (+
    ``bias``), never reaching before the start of ``t``'s sequence (``cu_seqlens``, packed
    B == 1). ``activation``: None or ``"silu"``. ``halo``: the ``W - 1`` rows before
    ``x`` (zeros when None), and ``offset`` the global position of ``x``'s first token
    (sequence parallel: see ``sp_causal_conv1d``)."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}.")
    # The packed-aware convolution on [halo | x], each token's position within its
    # sequence telling which taps reach before its start.
    B, T, D = x.shape
    W = weight.shape[1]
    if halo is None:
        halo = jnp.zeros((B, W - 1, D), x.dtype)
    xx = jnp.concatenate([halo.astype(x.dtype), x], axis=1)
    t = offset + jnp.arange(T)
    pos = t if cu_seqlens is None else t - _seq_start(jnp.asarray(cu_seqlens, jnp.int32), t)
    pos = jnp.broadcast_to(jnp.concatenate([jnp.zeros((W - 1,), pos.dtype), pos])[None], (B, T + W - 1))
    y = causal_conv(xx, weight, jnp.zeros_like(pos), pos, None)[:, W - 1:]
    if bias is not None:
        y = y + bias
    return jax.nn.silu(y) if activation == "silu" else y


@typecheck
def sp_causal_conv1d(
    x: Float[Array, "B Tl D"],
    weight: Float[Array, "D W"],
    bias: Optional[Float[Array, " D"]] = None,
    *,
    axis_name: str,
    cu_seqlens: Optional[Int[Array, " N1"]] = None,
    activation: Optional[str] = None,
) -> Float[Array, "B Tl D"]:
    """``causal_conv1d`` inside ``jax.shard_map`` on this device's tokens of a sequence
    split over ``axis_name`` (``cu_seqlens``: global offsets): equal to the convolution of
    the whole sequence on one device, with one ``ppermute`` of ``W - 1`` rows."""
    W = weight.shape[1]
    halo = conv_halo(x, W, axis_name, cu_seqlens)
    offset = jax.lax.axis_index(axis_name) * x.shape[1]
    return causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens, activation=activation, halo=halo, offset=offset)


def sp_token_segments(B: int, Tl: int, W: int, axis_name: str, cu_seqlens=None):
    """``(seq [B, W - 1 + Tl], pos [B, W - 1 + Tl])`` inside ``jax.shard_map``: the
    sequence and in-sequence position of every row of ``[halo | x]`` (the ``W - 1`` rows
    before this device's tokens, then its ``Tl`` tokens), from the global offsets
    ``cu_seqlens`` (dense: row b is sequence b). ``kdax.nn``'s ``causal_conv`` on
    ``[halo | x]`` with these reads a sequence's cache row before its start; the halo
    rows' own outputs are dropped."""
    t = jax.lax.axis_index(axis_name) * Tl - (W - 1) + jnp.arange(W - 1 + Tl, dtype=jnp.int32)
    if cu_seqlens is None:
        seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, t.shape[0]))
        return seq, jnp.broadcast_to(t[None], (B, t.shape[0]))
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    s = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, cu.shape[0] - 2).astype(jnp.int32)
    return s[None], (t - cu[s])[None]


def sp_conv_tail(xx, W: int, axis_name: str, cu_seqlens=None, state=None):
    """Each sequence's last ``W - 1`` convolution inputs (oldest first; ``state`` rows, or
    zeros, where the sequence is shorter), identical on every device: from ``xx = [halo |
    x]`` ``[B, W - 1 + Tl, D]`` of the device where the sequence ends, then one ``psum``.
    ``[N, W - 1, D]`` (dense: N = B)."""
    B, Tl = xx.shape[0], xx.shape[1] - (W - 1)
    d, P = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    s = d * Tl
    if cu_seqlens is None:
        rows = jnp.arange(B, dtype=jnp.int32)
        start, lens = jnp.zeros((B,), jnp.int32), jnp.full((B,), P * Tl, jnp.int32)
        owns = jnp.full((B,), d == P - 1)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        start, lens = cu[:-1], cu[1:] - cu[:-1]
        rows = jnp.zeros_like(start)
        owns = jnp.clip((cu[1:] - 1) // Tl, 0, P - 1) == d  # empty sequences: one device too
    # starts inside xx, whose row 0 is global position s - (W - 1)
    tail = conv_tail(xx, rows, start - s + (W - 1), lens, state, W)
    return jax.lax.psum(jnp.where(owns[:, None, None], tail, jnp.zeros((), tail.dtype)), axis_name)
