"""Weight names and shapes: Moonshot's Kimi-Linear checkpoints and FLA's layer; arrays from
numpy, JAX or torch (without importing torch)."""

import os
from typing import Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np

NAMINGS = ("moonshot", "fla")

# Keys that only one naming has (the low-rank gate projections): how ``naming`` is detected.
_MARKS = {
    "moonshot": ("f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight"),
    "fla": ("f_proj.0.weight", "f_proj.1.weight", "g_proj.0.weight", "g_proj.1.weight"),
}

# Hyper-parameters a state dict does not record and whose wrong value changes the output
# without any error (FLA's KDAConfig has norm_eps=1e-6, its layer 1e-5).
REQUIRED = ("norm_eps", "allow_neg_eigval", "lower_bound")
_MISSING = object()


def _entries(naming: str, H: int, HV: int, K: int, V: int, D: int, W: int, conv: bool, bias: bool,
             conv_bias: bool = False):
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
        if conv_bias:
            e["q_conv1d.bias"] = ("q_conv_bias", (H * K,)) + ident
            e["k_conv1d.bias"] = ("k_conv_bias", (H * K,)) + ident
            e["v_conv1d.bias"] = ("v_conv_bias", (HV * V,)) + ident
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
                  conv_size: int = 4, use_short_conv: bool = True, conv_bias: bool = False) -> dict:
    """``{name: shape}`` of a layer's weights under ``naming`` ("moonshot": Kimi Linear's
    ``modeling_kimi.py``, no output-gate bias; "fla": FLA's ``KimiDeltaAttention``, with
    ``g_proj.1.bias``; ``conv_bias``: the short convolutions' ``*_conv1d.bias``)."""
    _check_naming(naming)
    HV = num_heads if num_v_heads is None else num_v_heads
    V = head_dim if head_v_dim is None else head_v_dim
    e = _entries(naming, num_heads, HV, head_dim, V, hidden_size, conv_size, use_short_conv, naming == "fla",
                 conv_bias)
    return {k: v[1] for k, v in e.items()}


def _check_naming(naming):
    if naming not in NAMINGS:
        raise ValueError(f"naming: expected one of {NAMINGS} (or None to detect it from the keys), got {naming!r}.")


def detect_naming(keys) -> Optional[str]:
    """The naming whose gate-projection keys appear among ``keys`` ("moonshot": ``f_a_proj``,
    ``g_b_proj``, ...; "fla": ``f_proj.0``, ``g_proj.1``, ...), or None when neither or both do."""
    keys = set(keys)
    found = [n for n, marks in _MARKS.items() if any(m in keys for m in marks)]
    return found[0] if len(found) == 1 else None


def to_numpy(value) -> np.ndarray:
    """``value`` as a numpy array, without importing torch: numpy and JAX arrays as they
    are; torch-like tensors (``detach()``/``numpy()``) detached, moved to the host and, when
    numpy cannot hold their dtype (bfloat16), widened with ``.float()`` (exact); other
    objects through ``__dlpack__`` or ``np.asarray``."""
    a = value
    if hasattr(a, "detach") and hasattr(a, "numpy") and not isinstance(a, np.ndarray):
        t = a.detach()
        if hasattr(t, "cpu"):
            t = t.cpu()
        try:
            a = t.numpy()
        except (TypeError, RuntimeError):  # torch's bfloat16 has no numpy dtype: float32 holds it exactly
            if not hasattr(t, "float"):
                raise
            a = t.float().numpy()
    elif hasattr(a, "__dlpack__") and not isinstance(a, (np.ndarray, jnp.ndarray)):
        try:
            a = np.from_dlpack(a)
        except (TypeError, RuntimeError, BufferError):  # e.g. bfloat16, which numpy's DLPack import lacks
            import jax.dlpack

            a = jax.dlpack.from_dlpack(a)
    return np.asarray(a)


def as_numpy(value, name: str, what: str = "weights") -> np.ndarray:
    """``to_numpy(value)``, refusing complex, integer, boolean and non-finite values with an
    error naming ``name``."""
    a = to_numpy(value)
    if not (np.issubdtype(a.dtype, np.floating) or jnp.issubdtype(a.dtype, jnp.floating)):
        raise TypeError(f"{name}: expected real floating-point {what}, got dtype {a.dtype}.")
    if not np.all(np.isfinite(a.astype(np.float64))):
        raise ValueError(f"{name}: the {what} contain NaN or infinity.")
    return a


def load_safetensors(path, keys=None) -> dict:
    """``{name: numpy array}`` from a ``.safetensors`` file (all tensors, or only ``keys``;
    bfloat16 as ml_dtypes' bfloat16). Needs the ``safetensors`` package
    (``pip install kdax[nn]``)."""
    with _safe_open(path) as f:
        return {k: f.get_tensor(k) for k in (f.keys() if keys is None else keys)}


def safetensors_keys(path) -> list:
    """The tensor names of a ``.safetensors`` file (nothing read but its header)."""
    with _safe_open(path) as f:
        return list(f.keys())


def _safe_open(path):
    # safetensors is an optional dependency (the nn extra): imported on first use.
    try:
        import safetensors
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Loading .safetensors files needs the safetensors package (pip install 'kdax[nn]').") from e
    return safetensors.safe_open(os.fspath(path), framework="numpy")


def layer_state_dict(layer, naming: str, prefix: str = "") -> dict:
    _check_naming(naming)
    if naming == "moonshot" and layer.g_b_bias is not None:
        raise ValueError("state_dict(naming='moonshot'): Kimi Linear's g_b_proj has no bias, but this layer has "
                         "g_b_bias; use naming='fla' or a layer built with gate_bias=False.")
    e = _entries(naming, layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim,
                 layer.hidden_size, layer.conv_size, layer.use_short_conv, naming == "fla",
                 layer.q_conv_bias is not None)
    out = {}
    for name, (field, _, to_ext, _) in e.items():
        a = getattr(layer, field)
        if a is None:  # FLA always has the gate bias: a layer without one has zeros there.
            a = np.zeros((layer.num_v_heads * layer.head_v_dim,), np.asarray(layer.g_a).dtype)
        out[prefix + name] = np.asarray(to_ext(np.asarray(a)))
    return out


def layer_from_state_dict(cls, state_dict, *, naming=None, num_heads, head_dim, prefix="", **options):
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = load_safetensors(state_dict)
    sd = {k[len(prefix):]: to_numpy(v) for k, v in state_dict.items() if k.startswith(prefix)}
    seen = detect_naming(sd)
    if naming is None:
        if seen is None:
            raise ValueError(f"naming: cannot tell from the keys{' under prefix ' + repr(prefix) if prefix else ''} "
                             f"whether they are Moonshot's (f_a_proj.weight, g_b_proj.weight, ...) or FLA's "
                             f"(f_proj.0.weight, g_proj.1.weight, ...); found {sorted(sd)[:12]}. "
                             f"Pass naming='moonshot' or naming='fla' (and prefix= if the keys have one).")
        naming = seen
    _check_naming(naming)
    missing_hp = [n for n in REQUIRED if options.get(n, _MISSING) is _MISSING]
    if missing_hp:
        raise TypeError(
            f"from_state_dict: pass {', '.join(missing_hp)}: a state dict does not record "
            f"{'them' if len(missing_hp) > 1 else 'it'}, and a wrong value changes the layer's output without "
            f"any error (FLA's KDAConfig: norm_eps=1e-6, allow_neg_eigval=False, lower_bound=None; its layer's "
            f"own default norm_eps=1e-5; Kimi Linear: norm_eps = config.rms_norm_eps). "
            f"KimiDeltaAttention.from_pretrained(path, layer_idx=i) reads them from the checkpoint's config.json.")

    def shape(name, axis, default):
        try:
            return np.shape(sd[name])[axis]
        except (KeyError, IndexError):
            return default

    conv = options.pop("use_short_conv", "q_conv1d.weight" in sd)
    conv_bias = options.pop("conv_bias", conv and "q_conv1d.bias" in sd)
    D = options.pop("hidden_size", shape("q_proj.weight", 1, None))
    if D is None:
        raise ValueError("from_state_dict: 'q_proj.weight' is missing, so hidden_size is unknown; pass hidden_size=.")
    V = options.pop("head_v_dim", shape("o_norm.weight", 0, head_dim))
    HV = options.pop("num_v_heads", shape("b_proj.weight", 0, num_heads))
    W = options.pop("conv_size", shape("q_conv1d.weight", -1, 4) if conv else 4)
    param_dtype = options.pop("param_dtype", jnp.float32)
    bias = naming == "fla"  # FLA's g_proj.1 always has its bias; Kimi Linear's g_b_proj has none
    e = _entries(naming, num_heads, HV, head_dim, V, D, W, conv, bias, conv_bias)
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
        hint = ""
        if seen is not None and seen != naming:
            hint = f" The keys look like naming={seen!r}."
        elif any(n.endswith("conv1d.bias") for n in unexpected):
            hint = " The checkpoint's short convolutions have biases: pass conv_bias=True (or leave it out)."
        raise ValueError(f"from_state_dict(naming={naming!r}, num_heads={num_heads}, head_dim={head_dim}, "
                         f"hidden_size={D}, num_v_heads={HV}, head_v_dim={V}, conv_size={W}, conv_bias={conv_bias}): "
                         + ". ".join(parts) + "." + hint)
    arrays = {n: as_numpy(sd[n], prefix + n) for n in e}
    layer = cls(D, num_heads, head_dim, key=None, num_v_heads=HV, expand_v=V / head_dim,
                conv_size=W, use_short_conv=conv, conv_bias=conv_bias, gate_bias=bias, param_dtype=param_dtype,
                **options)
    fields = [f for _, (f, _, _, _) in e.items()]
    values = [jnp.asarray(from_ext(arrays[n]), param_dtype) for n, (_, _, _, from_ext) in e.items()]
    return eqx.tree_at(lambda m: [getattr(m, f) for f in fields], layer, values)
