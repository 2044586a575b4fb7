"""The layer's computation on dense rows or one packed row: projections, short
convolutions, decay and beta, the KDA kernel, the output gate, norm and projection."""

import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._numerics.arrays import ranked
from .._numerics.short_conv import causal_conv, conv_tail, token_segments
from .._errors import HeadFirstLayoutWarning
from .._chunk_kda import chunk_kda
from ..parallel import conv_halo, sp_conv_tail, sp_token_segments
from ..pipeline import KDAPipeline
from ..recurrent import fused_recurrent_kda
from ._cache import KDACache
from ._norm import gated_rms_norm


class _Segments(NamedTuple):
    """Where each of the ``n`` sequences lies: every token's sequence and position
    (``seq``, ``pos`` ``[Bp, Tp]``), each sequence's row, start and length (``[n]``)."""

    seq: Int[Array, "Bp Tp"]
    pos: Int[Array, "Bp Tp"]
    rows: Int[Array, " n"]
    starts: Int[Array, " n"]
    lens: Int[Array, " n"]
    n: int


def layer_forward(layer, xs: Float[Array, "Bp Tp D"], cu: Optional[Int[Array, " N1"]],
                  rows: Optional[KDACache], mode: str, inter_states: bool, chunk_size: int,
                  pipeline: Optional[KDAPipeline], seq_axis: Optional[str] = None):
    """``(y [Bp, Tp, D], new rows, intermediate)``: the layer on ``xs`` (dense rows, or one
    packed row with ``cu``; ``seq_axis``: this device's tokens, ``cu`` global), in xs's
    dtype; ``rows`` the cache's rows of its sequences (or None); ``intermediate`` the
    cache at every chunk start (``inter_states``), else None."""
    Bp, Tp, D = xs.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim
    seg = _segments(Bp, Tp, cu)
    pre = (_linear(xs, layer.q_proj), _linear(xs, layer.k_proj), _linear(xs, layer.v_proj))
    q, k, v, tails = short_convolutions(layer, pre, cu, rows, seg, seq_axis)
    g = _linear(_linear(xs, layer.f_a), layer.f_b)
    beta = _linear(xs, layer.b_proj)
    q, k = q.reshape(Bp, Tp, H, K), k.reshape(Bp, Tp, H, K)
    v, g = v.reshape(Bp, Tp, HV, V), g.reshape(Bp, Tp, HV, K)
    o, final, h = _kda(layer, q, k, v, g, beta, cu, rows, mode, inter_states, chunk_size, pipeline, seq_axis)
    inter = None if h is None else KDACache(*_chunk_start_conv_states(layer, pre, rows, seg, h.shape[1],
                                                                      chunk_size), h)
    y = output(layer, xs, o)
    if rows is not None:  # (the cache keeps its dtypes, as FLA's in place: a decode loop's carry)
        final = final.astype(rows.state.dtype)
        tails = tuple(None if t is None else t.astype(r.dtype) for t, r in zip(tails, rows._fields()))
    return y, KDACache(*tails, final), inter


def _linear(a, w):
    # PyTorch's [out, in] weights; every activation here is already in the compute dtype.
    # One 2-D product: with the rows in [B, T], the weight's gradient contracted two axes and
    # XLA:CPU stored a transposed copy of each output gradient (the step 1.17x the time).
    y = a.reshape(-1, a.shape[-1]) @ w.astype(a.dtype).T
    return y.reshape(*a.shape[:-1], w.shape[0])


def _segments(Bp: int, Tp: int, cu: Optional[Int[Array, " N1"]]) -> _Segments:
    seq, pos = token_segments(Bp, Tp, cu)
    if cu is None:
        n = Bp
        return _Segments(seq, pos, jnp.arange(n), jnp.zeros((n,), jnp.int32), jnp.full((n,), Tp, jnp.int32), n)
    n = cu.shape[0] - 1
    return _Segments(seq, pos, jnp.zeros((n,), jnp.int32), cu[:-1], cu[1:] - cu[:-1], n)


def short_convolutions(layer, pre: tuple, cu: Optional[Int[Array, " N1"]],
                       rows: Optional[KDACache], seg: _Segments, seq_axis: Optional[str]):
    """``(q, k, v, tails)``: SiLU of the depthwise causal convolutions (and their biases)
    of the projections ``pre``, continuing each sequence from its cache row; ``tails`` the
    new convolution states (None without short convolutions: SiLU alone)."""
    if not layer.use_short_conv:
        q, k, v = (jax.nn.silu(p) for p in pre)
        return q, k, v, (None, None, None)
    Bp, Tp, _ = pre[0].shape
    W, dt = layer.conv_size, pre[0].dtype
    states = (None, None, None) if rows is None else (rows.conv_q, rows.conv_k, rows.conv_v)
    weights = (layer.q_conv, layer.k_conv, layer.v_conv)
    biases = (layer.q_conv_bias, layer.k_conv_bias, layer.v_conv_bias)
    if seq_axis is not None:
        # [halo | local tokens]: the previous device's last W - 1 inputs (one ppermute each)
        xx = tuple(jnp.concatenate([conv_halo(p, W, seq_axis), p], axis=1) for p in pre)
        sseq, spos = sp_token_segments(Bp, Tp, W, seq_axis, cu)
        q, k, v = (jax.nn.silu(_conv_bias(causal_conv(p, w.astype(dt), sseq, spos, s)[:, W - 1:], b))
                   for p, w, s, b in zip(xx, weights, states, biases))
        return q, k, v, tuple(sp_conv_tail(p, W, seq_axis, cu, s) for p, s in zip(xx, states))
    q, k, v = (jax.nn.silu(_conv_bias(causal_conv(p, w.astype(dt), seg.seq, seg.pos, s), b))
               for p, w, s, b in zip(pre, weights, states, biases))
    return q, k, v, tuple(conv_tail(p, seg.rows, seg.starts, seg.lens, s, W) for p, s in zip(pre, states))


def _conv_bias(y, b):
    """The short convolution's bias (FLA: nn.Conv1d's, before the activation)."""
    return y if b is None else y + b.astype(y.dtype)


def _kda(layer, q, k, v, g, beta, cu, rows: Optional[KDACache], mode: str, inter_states: bool,
         chunk_size: int, pipeline: Optional[KDAPipeline], seq_axis: Optional[str]):
    """``(o, final state, state at every chunk start or None)``: the kernel with the
    layer's gate, beta and l2norm in kernel, from the cache rows' states."""
    opts = dict(
        initial_state=None if rows is None else rows.state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias,
        lower_bound=layer.lower_bound, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=layer.allow_neg_eigval,
        cu_seqlens=cu,
    )
    if mode == "recurrent":
        return (*fused_recurrent_kda(q, k, v, g, beta, **opts), None)
    with warnings.catch_warnings():
        # (The layer builds [B, T, H, K] itself: a prompt shorter than the head count is no
        # head-first mistake.)
        warnings.simplefilter("ignore", HeadFirstLayoutWarning)
        out = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, pipeline=pipeline, seq_axis_name=seq_axis,
                        safe_gate=layer.safe_gate, return_intermediate_states=inter_states, **opts)
    return out if inter_states else (*out, None)


def _chunk_start_conv_states(layer, pre: tuple, rows: Optional[KDACache], seg: _Segments,
                             NC: int, chunk_size: int) -> tuple:
    """The convolution states at the start of every chunk, ``[n, NC, W - 1, channels]``
    each (None without short convolutions)."""
    if not layer.use_short_conv:
        return None, None, None
    W, n = layer.conv_size, seg.n
    at = jnp.arange(NC, dtype=jnp.int32) * chunk_size
    rep = lambda a: None if a is None else jnp.repeat(a, NC, axis=0)
    conv_states = (None, None, None) if rows is None else (rows.conv_q, rows.conv_k, rows.conv_v)
    return tuple(conv_tail(p, jnp.repeat(seg.rows, NC), jnp.zeros((n * NC,), jnp.int32), jnp.tile(at, n), rep(s),
                           W).reshape(n, NC, W - 1, -1)
                 for p, s in zip(pre, conv_states))


def output(layer, xs: Float[Array, "Bp Tp D"], o: Float[Array, "Bp Tp HV V"]
           ) -> Float[Array, "Bp Tp D"]:
    """``o_proj(rmsnorm(o) * o_norm * sigmoid(gate(xs)))`` per head, in xs's dtype: the
    low-rank gate ``g_b(g_a(xs)) + g_b_bias`` or Kimi K3's full-rank ``g_proj(xs)``."""
    Bp, Tp, _ = xs.shape
    HV, V = layer.num_v_heads, layer.head_v_dim
    gate = _linear(xs, layer.g_proj) if layer.g_proj is not None else _linear(_linear(xs, layer.g_a), layer.g_b)
    if layer.g_b_bias is not None:
        gate = gate + ranked(layer.g_b_bias.astype(xs.dtype), gate)
    o = gated_rms_norm(o.astype(xs.dtype), gate.reshape(Bp, Tp, HV, V), layer.o_norm, layer.norm_eps)
    return _linear(o.reshape(Bp, Tp, HV * V), layer.o_proj)
