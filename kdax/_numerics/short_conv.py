"""Depthwise causal short convolution over padded, packed or cached sequences.

Every token knows its sequence (``seq``, a row of the cache) and its position inside it
(``pos``); the W - 1 inputs before a sequence's first token come from that sequence's
cache row (zeros without a cache), never from the token stream, so packed sequences
never mix and a call continues exactly where the cache left off.
"""

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .arrays import at_least_float32, ranked


def token_segments(B: int, T: int, cu_seqlens: Optional[Int[Array, " N1"]]):
    """``(seq [B, T], pos [B, T])``: each token's sequence index and in-sequence position.
    Dense input: sequence b is row b. Packed (B == 1): from ``cu_seqlens`` (data, not
    shape)."""
    t = jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:
        seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
        return seq, jnp.broadcast_to(t[None], (B, T))
    cu = cu_seqlens.astype(jnp.int32)
    n = cu.shape[0] - 1
    # side="right" puts a token after any empty sequences that share its start.
    s = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, n - 1).astype(jnp.int32)
    return s[None], (t - cu[s])[None]


def causal_conv(
    x: Float[Array, "B T D"],
    weight: Float[Array, "D W"],
    seq: Int[Array, "B T"],
    pos: Int[Array, "B T"],
    state: Optional[Float[Array, "N Wm1 D"]],
) -> Float[Array, "B T D"]:
    """``y[t] = sum_i weight[:, i] * x[t - (W - 1) + i]`` within each sequence (no
    activation), summed in float32 at least and returned in x's dtype; inputs before a
    sequence's start come from ``state[seq]`` (oldest first) or are zero."""
    W = weight.shape[1]
    T = x.shape[1]
    # (bfloat16 sums made XLA:CPU store each tap's weight-gradient product as a float32
    # copy before reducing it: 12 passes of 16 MiB in the layer's training step)
    out, acc = x.dtype, at_least_float32(x.dtype)
    x, weight = x.astype(acc), weight.astype(acc)
    y = x * ranked(weight[:, W - 1], x)
    # One padded copy read at every shift: a pad per shift was a stored copy each (kept for
    # the weight's gradient).
    xp = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
    for j in range(1, W):
        shifted = xp[:, W - 1 - j:W - 1 - j + T]
        inside = (pos >= j)[..., None]
        if state is None:
            src = jnp.where(inside, shifted, jnp.zeros((), x.dtype))
        else:
            prev = state[seq, jnp.clip(W - 1 + pos - j, 0, W - 2)].astype(x.dtype)
            src = jnp.where(inside, shifted, prev)
        y = y + src * ranked(weight[:, W - 1 - j], src)
    return y.astype(out)


def conv_tail(
    x: Float[Array, "B T D"],
    rows: Int[Array, " N"],
    starts: Int[Array, " N"],
    lens: Int[Array, " N"],
    state: Optional[Float[Array, "N Wm1 D"]],
    W: int,
) -> Float[Array, "N Wm1 D"]:
    """The last ``W - 1`` inputs of each sequence (oldest first) after its ``lens[n]``
    tokens ``x[rows[n], starts[n]:starts[n] + lens[n]]``, reaching into ``state[n]``
    (or zeros) when the sequence is shorter than ``W - 1``."""
    T = x.shape[1]
    tau = lens[:, None] - (W - 1) + jnp.arange(W - 1, dtype=lens.dtype)[None]  # [N, W - 1]
    from_x = x[rows[:, None], jnp.clip(starts[:, None] + tau, 0, max(T - 1, 0))]
    if state is None:
        old = jnp.zeros_like(from_x)
    else:
        old = state[jnp.arange(lens.shape[0])[:, None], jnp.clip(W - 1 + tau, 0, W - 2)].astype(x.dtype)
    return jnp.where((tau >= 0)[..., None], from_x, old)
