"""``KimiDeltaAttention.__call__``'s arguments checked, normalised and the path chosen,
before any array work."""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._numerics.arrays import varying_axes
from .._validate import check_cu_seqlens
from ..parallel import check_axis
from ._cache import KDACache

# Longest call that the recurrent path takes by default (with a cache; FLA's threshold).
RECURRENT_MAX_T = 64


def check_call(layer, shape: tuple, attention_mask, cu_seqlens, cache: Optional[KDACache],
               state_indices, mode: Optional[str], inter_states: bool, seq_axis_name: Optional[str]):
    """``(attention_mask, cu_seqlens, mode)`` for ``x`` of ``shape [B, T, D]``: this call's
    mask ``[B, T]`` (or None), the checked packed offsets (an int32 array, or None) and
    the path, "chunk" or "recurrent"; anything the layer cannot run raises, naming the
    argument."""
    B, T, D = shape
    if D != layer.hidden_size:
        raise ValueError(f"x: expected last dimension hidden_size={layer.hidden_size}, got shape {shape}.")
    if T < 1:
        raise ValueError(f"x: expected at least one token per row, got shape {shape}.")
    if mode not in (None, "chunk", "recurrent", "fused_recurrent"):
        raise ValueError(f"mode: expected None, 'chunk' or 'recurrent' ('fused_recurrent'), got {mode!r}.")
    mode = "recurrent" if mode == "fused_recurrent" else mode
    if seq_axis_name is not None:  # (first: what it does not support, before that argument's own checks)
        _check_sequence_parallel(seq_axis_name, attention_mask, mode, inter_states)
    attention_mask = _this_calls_mask(attention_mask, cu_seqlens, B, T, cache)
    if cu_seqlens is not None and seq_axis_name is None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, "x")  # kdax.chunk_kda's checks and messages
    elif cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: packed variable-length input needs B == 1 (x.shape[0]), got B={B}.")
    if cu_seqlens is not None and not isinstance(cu_seqlens, jax.Array):
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)  # a list or numpy array, as kdax.chunk_kda takes
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if state_indices is not None:
        if cache is None:
            raise ValueError("state_indices: needs a cache (the pool) to index.")
        if tuple(state_indices.shape) != (N,):
            raise ValueError(f"state_indices: expected shape [N] = ({N},), got {tuple(state_indices.shape)}.")
    if cache is not None:
        check_cache(layer, cache, None if state_indices is not None else N)
    if inter_states and (attention_mask is not None or cu_seqlens is not None or mode == "recurrent"):
        raise ValueError("return_intermediate_states: needs dense input (no attention_mask or cu_seqlens) "
                         "and the chunked path.")
    if seq_axis_name is not None:
        mode = "chunk"
    if mode is None:
        decode = cache is not None and T <= RECURRENT_MAX_T
        mode = "chunk" if inter_states else ("recurrent" if decode else layer.mode)
    return attention_mask, cu_seqlens, mode


def _this_calls_mask(attention_mask, cu_seqlens, B: int, T: int, cache: Optional[KDACache]):
    """The mask's columns of this call's tokens, ``[B, T]`` (FLA's rule: the last T of a
    whole-history mask ``[B, S]``, which needs the cache of the earlier tokens)."""
    if attention_mask is not None and cu_seqlens is not None:
        raise ValueError("attention_mask and cu_seqlens: pass at most one of them.")
    if attention_mask is None:
        return None
    attention_mask = _checked_mask_values(attention_mask)
    if tuple(attention_mask.shape) == (B, T):
        return attention_mask
    S = attention_mask.shape[1]
    if attention_mask.shape[0] != B or S < T:
        raise ValueError(f"attention_mask: expected shape [B, T] = {(B, T)} (or, with a cache, FLA's "
                         f"whole-history mask [B, S >= T]), got {tuple(attention_mask.shape)}.")
    if cache is None:
        raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} covers {S} tokens but x has "
                         f"{T} and no cache holds the history; pass this call's mask, shape {(B, T)} (or "
                         f"pass the cache of the earlier tokens).")
    return attention_mask[:, S - T:]


_MASK = ("attention_mask: expected 1 (a token) or 0 (padding) in every entry, or booleans; an additive mask (0 "
         "for tokens, a large negative number for padding) reads as its inverse: pass (mask == 0)")


def _checked_mask_values(mask):
    """``mask`` with every value 0 or 1 (FLA reads any other as a token: an additive
    mask's padding would run as tokens, silently): concrete, a ``ValueError`` naming the
    first other value; traced, inside the program (one device; ``eqx.error_if``)."""
    if not isinstance(mask, jax.core.Tracer):
        m = np.asarray(mask)
        if m.dtype != bool and (bad := m[~((m == 0) | (m == 1))]).size:
            raise ValueError(f"{_MASK}, got {bad.flat[0]!r}.")
        return mask
    if mask.dtype == bool or jax.device_count() != 1 or varying_axes(mask):  # (an error would abort the process)
        return mask
    return eqx.error_if(mask, jnp.any((mask != 0) & (mask != 1)), f"{_MASK} (checked inside the compiled program).")


def check_cache(layer, cache: KDACache, N: Optional[int]) -> None:
    """Refuse a cache whose fields do not have ``layer``'s shapes with ``N`` rows (None:
    a pool, any number of rows)."""
    H, HV, K, V, W = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim, layer.conv_size
    n = cache.state.shape[0] if N is None else N
    want = dict(state=(n, HV, K, V))
    if layer.use_short_conv:
        want.update(conv_q=(n, W - 1, H * K), conv_k=(n, W - 1, H * K), conv_v=(n, W - 1, HV * V))
    bad = [f"{f}: expected {s}, got {None if getattr(cache, f) is None else tuple(getattr(cache, f).shape)}"
           for f, s in want.items() if getattr(cache, f) is None or tuple(getattr(cache, f).shape) != s]
    if bad:
        raise ValueError("cache: " + "; ".join(bad) + " (N = sequences, or pool slots with state_indices).")


def _check_sequence_parallel(seq_axis_name, attention_mask, mode, inter_states):
    check_axis(seq_axis_name)
    if attention_mask is not None:
        raise ValueError("attention_mask: not supported with seq_axis_name; pack the sequences with cu_seqlens "
                         "(global offsets) instead.")
    if mode == "recurrent":
        raise ValueError("mode: 'recurrent' (the decode path) is not supported with seq_axis_name; "
                         "sequence parallelism runs the chunked path (mode None or 'chunk').")
    if inter_states:
        raise ValueError("return_intermediate_states: not supported with seq_axis_name.")
