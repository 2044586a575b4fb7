"""Weight names and shapes: Moonshot's Kimi-Linear checkpoints and FLA's layer."""

import os
from typing import Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np

NAMINGS = ("moonshot", "fla")


def _entries(naming: str, H: int, HV: int, K: int, V: int, D: int, W: int, conv: bool, bias: bool):
    """``{external name: (layer field, external shape, to external, from external)}``."""
    ident = (lambda a: a, lambda a: a)
    e = {
        "q_proj.weight": ("q_proj", (H * K, D)) + ident,
        "k_proj.weight": ("k_proj", (H * K, D)) + ident,
        "v_proj.weight": ("v_proj", (HV * V, D)) + ident,
    }
    if conv:
        to3, from3 = (lambda a: a[:, None, :]), (lambda a: a[:, 0, :])
        e["q_conv1d.weight"] = ("q_conv", (H * K, 1, W), to3, from3)
        e["k_conv1d.weight"] = ("k_conv", (H * K, 1, W), to3, from3)
        e["v_conv1d.weight"] = ("v_conv", (HV * V, 1, W), to3, from3)
    if naming == "moonshot":
        e["A_log"] = ("A_log", (1, 1, HV, 1), lambda a: a.reshape(1, 1, HV, 1), lambda a: a.reshape(HV))
        names = dict(f_a="f_a_proj.weight", f_b="f_b_proj.weight", g_a="g_a_proj.weight", g_b="g_b_proj.weight")
    else:
        e["A_log"] = ("A_log", (HV,)) + ident
        names = dict(f_a="f_proj.0.weight", f_b="f_proj.1.weight", g_a="g_proj.0.weight", g_b="g_proj.1.weight")
        if bias:
            e["g_proj.1.bias"] = ("g_b_bias", (HV * V,)) + ident
    e["dt_bias"] = ("dt_bias", (HV * K,)) + ident
    e[names["f_a"]] = ("f_a", (V, D)) + ident
    e[names["f_b"]] = ("f_b", (HV * K, V)) + ident
    e["b_proj.weight"] = ("b_proj", (HV, D)) + ident
    e[names["g_a"]] = ("g_a", (V, D)) + ident
    e[names["g_b"]] = ("g_b", (HV * V, V)) + ident
    e["o_norm.weight"] = ("o_norm", (V,)) + ident
    e["o_proj.weight"] = ("o_proj", (D, HV * V)) + ident
    return e


def weight_shapes(naming: str, *, num_heads: int, head_dim: int, hidden_size: int,
                  num_v_heads: Optional[int] = None, head_v_dim: Optional[int] = None,
                  conv_size: int = 4, use_short_conv: bool = True) -> dict:
    """``{name: shape}`` of a layer's weights under ``naming`` ("moonshot": Kimi Linear's
    ``modeling_kimi.py``, no output-gate bias; "fla": FLA's ``KimiDeltaAttention``, with
    ``g_proj.1.bias``)."""
    _check_naming(naming)
    HV = num_heads if num_v_heads is None else num_v_heads
    V = head_dim if head_v_dim is None else head_v_dim
    e = _entries(naming, num_heads, HV, head_dim, V, hidden_size, conv_size, use_short_conv, True)
    return {k: v[1] for k, v in e.items()}


def _check_naming(naming):
    if naming not in NAMINGS:
        raise ValueError(f"naming: expected one of {NAMINGS}, got {naming!r}.")


def load_safetensors(path) -> dict:
    """``{name: numpy array}`` from a ``.safetensors`` file (needs the ``safetensors``
    package: ``pip install kdax[nn]``)."""
    try:
        from safetensors.numpy import load_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Loading .safetensors files needs the safetensors package (pip install 'kdax[nn]').") from e
    return load_file(os.fspath(path))


def layer_state_dict(layer, naming: str, prefix: str = "") -> dict:
    _check_naming(naming)
    if naming == "moonshot" and layer.g_b_bias is not None:
        raise ValueError("state_dict(naming='moonshot'): Kimi Linear's g_b_proj has no bias, but this layer has "
                         "g_b_bias; use naming='fla' or a layer built with gate_bias=False.")
    e = _entries(naming, layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim,
                 layer.hidden_size, layer.conv_size, layer.use_short_conv, True)
    out = {}
    for name, (field, _, to_ext, _) in e.items():
        a = getattr(layer, field)
        if a is None:  # FLA always has the gate bias: a layer without one has zeros there.
            a = np.zeros((layer.num_v_heads * layer.head_v_dim,), np.asarray(layer.g_a).dtype)
        out[prefix + name] = np.asarray(to_ext(np.asarray(a)))
    return out


def layer_from_state_dict(cls, state_dict, *, naming, num_heads, head_dim, prefix="", **options):
    _check_naming(naming)
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = load_safetensors(state_dict)
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    def shape(name, axis, default):
        try:
            return np.shape(sd[name])[axis]
        except (KeyError, IndexError):
            return default

    conv = options.pop("use_short_conv", "q_conv1d.weight" in sd)
    D = options.pop("hidden_size", shape("q_proj.weight", 1, None))
    if D is None:
        raise ValueError("from_state_dict: 'q_proj.weight' is missing, so hidden_size is unknown; pass hidden_size=.")
    V = options.pop("head_v_dim", shape("o_norm.weight", 0, head_dim))
    HV = options.pop("num_v_heads", shape("b_proj.weight", 0, num_heads))
    W = options.pop("conv_size", shape("q_conv1d.weight", -1, 4) if conv else 4)
    param_dtype = options.pop("param_dtype", jnp.float32)
    bias = naming == "fla"
    e = _entries(naming, num_heads, HV, head_dim, V, D, W, conv, bias)
    missing = [f"{n} {s}" for n, (_, s, _, _) in e.items() if n not in sd]
    unexpected = [n for n in sd if n not in e]
    misshaped = [f"{n}: expected {s}, got {tuple(np.shape(sd[n]))}" for n, (_, s, _, _) in e.items()
                 if n in sd and tuple(np.shape(sd[n])) != s]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing keys (expected shape): " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected keys: " + ", ".join(prefix + n for n in unexpected))
        if misshaped:
            parts.append("mis-shaped keys: " + "; ".join(misshaped))
        raise ValueError(f"from_state_dict(naming={naming!r}, num_heads={num_heads}, head_dim={head_dim}, "
                         f"hidden_size={D}, num_v_heads={HV}, head_v_dim={V}, conv_size={W}): " + ". ".join(parts) + ".")
    layer = cls(D, num_heads, head_dim, key=None, num_v_heads=HV, expand_v=V / head_dim,
                conv_size=W, use_short_conv=conv, gate_bias=bias, param_dtype=param_dtype, **options)
    fields = [f for _, (f, _, _, _) in e.items()]
    values = [jnp.asarray(from_ext(np.asarray(sd[n])), param_dtype) for n, (_, _, _, from_ext) in e.items()]
    return eqx.tree_at(lambda m: [getattr(m, f) for f in fields], layer, values)
