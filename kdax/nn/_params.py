"""The layer's constructor arguments checked and its parameters initialised (FLA's
initialisation), as ``{field: array}``."""

import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ._weights import check_dtype_option


def check_layer_options(hidden_size: int, num_heads: int, head_dim: int, num_v_heads: Optional[int],
                        expand_v: float, conv_size: int, lower_bound: Optional[float], safe_gate: bool,
                        mode: str, dtype, param_dtype, fla_options: dict, norm_eps: float) -> tuple[int, int]:
    """Refuse, naming the argument, what ``KimiDeltaAttention`` cannot build; returns the
    value heads and value head dimension ``(HV, V)``."""
    if fla_options:
        raise TypeError(
            f"KimiDeltaAttention: unexpected argument(s) {', '.join(sorted(fla_options))}. kdax's layer takes "
            "FLA's hidden_size, num_heads, head_dim, num_v_heads, expand_v, mode, use_short_conv, "
            "allow_neg_eigval, safe_gate, lower_bound, conv_size, conv_bias, layer_idx and norm_eps (and "
            "key, gate_bias, use_full_rank_gate, dtype, param_dtype); to load a checkpoint use "
            "KimiDeltaAttention.from_pretrained(path, layer_idx=i).")
    check_dtype_option("param_dtype", param_dtype)
    check_dtype_option("dtype", dtype)
    if mode not in ("chunk", "fused_recurrent", "recurrent"):
        raise ValueError(f"mode: expected 'chunk' or 'fused_recurrent', got {mode!r}.")
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate: True needs lower_bound (FLA's recommendation: -5).")
    # (chunk_kda's checks, when the layer is built: a negative norm_eps made every output
    # NaN, a positive lower_bound failed at the first call; -inf: every token forgets)
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)
    if lower_bound is not None and not (real(lower_bound) and lower_bound < 0):
        raise ValueError(f"lower_bound: must be a number < 0 (the gate is lower_bound * sigmoid(...)), got "
                         f"{lower_bound!r}.")
    if safe_gate and not -5 <= lower_bound < 0:
        raise ValueError(f"lower_bound: safe_gate=True needs -5 <= lower_bound < 0 (as FLA), got {lower_bound}.")
    if not (real(norm_eps) and 0 < norm_eps < math.inf):
        raise ValueError(f"norm_eps: must be a finite number > 0 (the output norm's epsilon), got {norm_eps!r}.")
    sizes = dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, num_v_heads=num_v_heads,
                 conv_size=conv_size)
    for name, n in sizes.items():
        if n is not None and not (isinstance(n, numbers.Integral) and not isinstance(n, bool)):
            raise TypeError(f"{name}: expected an integer, got {n!r}. kdax's layer takes (hidden_size, "
                            f"num_heads, head_dim) positionally; FLA's order differs (expand_v second): pass "
                            f"sizes by name.")
    if not real(expand_v):
        raise TypeError(f"expand_v: expected a number (head_v_dim = head_dim * expand_v), got {expand_v!r}.")
    H, K = num_heads, head_dim
    HV = num_heads if num_v_heads is None else num_v_heads
    V = int(round(head_dim * expand_v))
    if min(hidden_size, H, K, HV, V) < 1 or not math.isclose(V, head_dim * expand_v):
        raise ValueError(f"hidden_size, num_heads, head_dim, num_v_heads and head_dim * expand_v must be "
                         f"positive integers, got {hidden_size}, {H}, {K}, {HV}, {head_dim * expand_v}.")
    if HV % H:
        raise ValueError(f"num_v_heads={HV} must be a multiple of num_heads={H}.")
    if conv_size < 2:
        raise ValueError(f"conv_size must be >= 2, got {conv_size}.")
    return HV, V


def init_params(key: Optional[PRNGKeyArray], D: int, H: int, HV: int, K: int, V: int, W: int, *,
                use_short_conv: bool, conv_bias: bool, gate_bias: bool, use_full_rank_gate: bool,
                param_dtype) -> dict[str, Optional[Array]]:
    """``{field: array or None}`` for every parameter of ``KimiDeltaAttention`` (shapes in
    its class docstring; ``W`` the convolution width), FLA's initialisation;
    ``key=None``: every weight zero (``o_norm`` ones)."""
    keys = iter(jax.random.split(key, 16)) if key is not None else None

    def _uniform(shape, bound, lo=None, hi=None):
        if keys is None:
            return jnp.zeros(shape, param_dtype)
        lo, hi = (-bound, bound) if lo is None else (lo, hi)
        return jax.random.uniform(next(keys), shape, param_dtype, lo, hi)

    # The keys are drawn in field order below: a given key makes the same layer as ever.
    lin = lambda o, i: _uniform((o, i), 1 / math.sqrt(i))
    p = dict(q_proj=lin(H * K, D), k_proj=lin(H * K, D), v_proj=lin(HV * V, D))
    conv = (lambda c: _uniform((c, W), 1 / math.sqrt(W))) if use_short_conv else (lambda c: None)
    p.update(q_conv=conv(H * K), k_conv=conv(H * K), v_conv=conv(HV * V))
    p.update(_conv_biases(key, H * K, HV * V, W, param_dtype) if use_short_conv and conv_bias
             else dict(q_conv_bias=None, k_conv_bias=None, v_conv_bias=None))
    p.update(f_a=lin(V, D), f_b=lin(HV * K, V), b_proj=lin(HV, D))
    if keys is None:
        p.update(A_log=jnp.zeros((HV,), param_dtype), dt_bias=jnp.zeros((HV * K,), param_dtype))
    else:
        p["A_log"] = jnp.log(_uniform((HV,), None, 1.0, 16.0))
        step = jnp.exp(_uniform((HV * K,), None, math.log(1e-3), math.log(0.1)))
        step = jnp.maximum(step, 1e-4)
        p["dt_bias"] = step + jnp.log(-jnp.expm1(-step))  # inverse softplus
    if use_full_rank_gate:
        p.update(g_a=None, g_b=None, g_proj=lin(HV * V, D))
    else:
        p.update(g_a=lin(V, D), g_b=lin(HV * V, V), g_proj=None)
    fan_in = D if use_full_rank_gate else V
    p["g_b_bias"] = _uniform((HV * V,), 1 / math.sqrt(fan_in)) if gate_bias else None
    p["o_norm"] = jnp.ones((V,), param_dtype)
    p["o_proj"] = lin(D, HV * V)
    return p


def _conv_biases(key: Optional[PRNGKeyArray], DK: int, DV: int, W: int, param_dtype) -> dict[str, Array]:
    # nn.Conv1d's bound 1/sqrt(fan_in), fan_in = 1 channel x W taps; keys of their own, so
    # the other weights of a given key are those of a layer without conv_bias.
    bkeys = None if key is None else iter(jax.random.split(jax.random.fold_in(key, 1), 3))
    b = 1 / math.sqrt(W)
    cb = lambda c: (jnp.zeros((c,), param_dtype) if bkeys is None
                    else jax.random.uniform(next(bkeys), (c,), param_dtype, -b, b))
    return dict(q_conv_bias=cb(DK), k_conv_bias=cb(DK), v_conv_bias=cb(DV))
