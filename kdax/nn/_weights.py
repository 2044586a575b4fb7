"""Weight names and shapes: Moonshot's Kimi-Linear checkpoints and FLA's layer; arrays from
numpy, JAX or torch (without importing torch)."""

import json
import os
from typing import Optional

import equinox as eqx
import jax
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
             conv_bias: bool = False, full_rank: bool = False):
    """``{external name: (layer field, external shape, to external, from external)}``.
    ``full_rank``: Kimi K3's full-rank output gate ``g_proj.weight [HV*V, D]`` (no bias) in
    place of the low-rank ``g_a_proj``/``g_b_proj`` pair (Moonshot's naming only)."""
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
    if full_rank:
        e["g_proj.weight"] = ("g_proj", (HV * V, D)) + ident
    else:
        e[names["g_a"]] = ("g_a", (V, D)) + ident
        e[names["g_b"]] = ("g_b", (HV * V, V)) + ident
    e["o_norm.weight"] = ("o_norm", (V,)) + ident
    e["o_proj.weight"] = ("o_proj", (D, HV * V)) + ident
    return e


def weight_shapes(naming: str, *, num_heads: int, head_dim: int, hidden_size: int,
                  num_v_heads: Optional[int] = None, head_v_dim: Optional[int] = None,
                  conv_size: int = 4, use_short_conv: bool = True, conv_bias: bool = False,
                  use_full_rank_gate: bool = False) -> dict:
    """``{name: shape}`` of a layer's weights under ``naming`` ("moonshot": Kimi Linear's
    ``modeling_kimi.py``, no output-gate bias; "fla": FLA's ``KimiDeltaAttention``, with
    ``g_proj.1.bias``; ``conv_bias``: the short convolutions' ``*_conv1d.bias``;
    ``use_full_rank_gate``: Kimi K3's ``g_proj.weight [HV*V, hidden]`` in place of
    ``g_a_proj``/``g_b_proj``, Moonshot's naming only)."""
    _check_naming(naming)
    _check_full_rank(naming, use_full_rank_gate)
    HV = num_heads if num_v_heads is None else num_v_heads
    V = head_dim if head_v_dim is None else head_v_dim
    e = _entries(naming, num_heads, HV, head_dim, V, hidden_size, conv_size, use_short_conv, naming == "fla",
                 conv_bias, use_full_rank_gate)
    return {k: v[1] for k, v in e.items()}


def _check_naming(naming):
    if naming not in NAMINGS:
        raise ValueError(f"naming: expected one of {NAMINGS} (or None to detect it from the keys), got {naming!r}.")


def _check_full_rank(naming, full_rank):
    if full_rank and naming != "moonshot":
        raise ValueError("use_full_rank_gate: Kimi K3's full-rank output gate (g_proj.weight [HV*V, hidden], no "
                         "bias) has Moonshot's names only; FLA's layer has no such gate (its g_proj.0/g_proj.1 are "
                         "the low-rank pair). Use naming='moonshot'.")


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
    if a.dtype.itemsize < 2:  # ml_dtypes' float8/float4: a quantized checkpoint's codes, not values
        raise TypeError(f"{name}: dtype {a.dtype} ({a.dtype.itemsize * 8}-bit floats) is a quantized checkpoint's "
                        f"storage: its values need the checkpoint's scales (weight_scale_inv / weight_scale). "
                        f"Dequantize to bfloat16, float16 or float32 first.")
    if not np.all(np.isfinite(a.astype(np.float64))):
        raise ValueError(f"{name}: the {what} contain NaN or infinity.")
    return a


# safetensors' dtype names that hold real values numpy (with ml_dtypes' bfloat16) reads.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def load_safetensors(path, keys=None) -> dict:
    """``{name: numpy array}`` from a ``.safetensors`` file (all tensors, or only ``keys``;
    bfloat16 as ml_dtypes' bfloat16). Needs the ``safetensors`` package
    (``pip install kdax[nn]``). Tensors that are not float64/32/16 or bfloat16 (float8 and
    other quantized storage, integers) are refused before anything is read, naming the key
    and the file."""
    header = safetensors_header(path)
    keys = list(header) if keys is None else list(keys)
    missing = [k for k in keys if k not in header]
    if missing:
        raise KeyError(f"{os.fspath(path)!r} has no tensor(s) {missing[:5]}.")
    check_float_tensors(header, keys, path)
    with _safe_open(path) as f:
        return {k: f.get_tensor(k) for k in keys}


def check_float_tensors(header: dict, keys, path) -> None:
    """Refuse, naming key, dtype and file, any of ``keys`` that ``header`` (see
    ``safetensors_header``) stores in a dtype other than float64/32/16 or bfloat16."""
    bad = [(k, header[k][0]) for k in keys if header[k][0] not in _FLOAT_DTYPES]
    if not bad:
        return
    listed = ", ".join(f"{k} ({d})" for k, d in bad[:6]) + (f", ... ({len(bad)} in all)" if len(bad) > 6 else "")
    quant = any(d.startswith(("F8", "F6", "F4")) for _, d in bad)
    hint = (" float8/float4 weights are a quantized checkpoint's storage: their values need the checkpoint's "
            "scales (weight_scale_inv / weight_scale), which kdax does not apply. Dequantize to bfloat16 or "
            "float32 first (e.g. load with transformers and save_pretrained the dequantized model)." if quant else "")
    raise TypeError(f"{os.fspath(path)}: expected floating-point weights (F32, F16, BF16, F64), got {listed}.{hint}")


def safetensors_header(path) -> dict:
    """``{name: (dtype, shape)}`` of a ``.safetensors`` file, from its JSON header alone
    (no tensor read, no safetensors package needed); a file that is not safetensors raises
    a ``ValueError`` naming it."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= 100_000_000:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable .safetensors file ({e}).") from None


def safetensors_keys(path) -> list:
    """The tensor names of a ``.safetensors`` file (nothing read but its header)."""
    return list(safetensors_header(path))


def _safe_open(path):
    # safetensors is an optional dependency (the nn extra): imported on first use.
    try:
        import safetensors
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Loading .safetensors files needs the safetensors package (pip install 'kdax[nn]').") from e
    return safetensors.safe_open(os.fspath(path), framework="numpy")


def check_dtype_option(name: str, value) -> None:
    """``param_dtype``/``dtype``: None or a floating dtype; a 64-bit one needs JAX's x64
    mode (without it JAX silently makes float32 arrays, with a warning per array)."""
    if value is None:
        return
    try:
        dt = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{name}: expected a floating-point dtype (jnp.float32, jnp.bfloat16, ...), got "
                        f"{value!r}.") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name}: expected a floating-point dtype (jnp.float32, jnp.bfloat16, ...), got {dt}.")
    if dt.itemsize == 8 and not jax.config.read("jax_enable_x64"):
        raise ValueError(f"{name}={dt.name} needs JAX's 64-bit mode, which is off (JAX would make float32 arrays "
                         f"instead, warning once per array): call jax.config.update('jax_enable_x64', True) at "
                         f"startup, before any array is made (or set JAX_ENABLE_X64=1).")


def layer_state_dict(layer, naming: Optional[str], prefix: str = "") -> dict:
    full_rank = layer.g_proj is not None
    if naming is None:  # the naming that holds every weight: FLA's g_proj.1 has the gate's bias
        naming = "fla" if layer.g_b_bias is not None and not full_rank else "moonshot"
    _check_naming(naming)
    _check_full_rank(naming, full_rank)
    if naming == "moonshot" and layer.g_b_bias is not None:
        raise ValueError("state_dict(naming='moonshot'): Kimi Linear's g_b_proj has no bias, but this layer has "
                         "g_b_bias; use naming='fla' or a layer built with gate_bias=False.")
    e = _entries(naming, layer.num_heads, layer.num_v_heads, layer.head_dim, layer.head_v_dim,
                 layer.hidden_size, layer.conv_size, layer.use_short_conv, naming == "fla",
                 layer.q_conv_bias is not None, full_rank)
    out = {}
    for name, (field, _, to_ext, _) in e.items():
        a = getattr(layer, field)
        if a is None:  # FLA always has the gate bias: a layer without one has zeros there.
            a = np.zeros((layer.num_v_heads * layer.head_v_dim,), np.asarray(layer.o_proj).dtype)
        out[prefix + name] = np.asarray(to_ext(np.asarray(a)))
    return out


def _layer_prefixes(keys) -> list:
    """The prefixes under which ``keys`` hold a KDA layer (the part before ``dt_bias``,
    which only a KDA layer has)."""
    return sorted({k[: -len("dt_bias")] for k in keys
                   if isinstance(k, str) and (k == "dt_bias" or k.endswith(".dt_bias"))})


def _check_prefix(state_dict, sd, prefix) -> None:
    """Refuse, naming ``prefix`` and the candidates, a state dict with no layer tensor under
    ``prefix`` (a whole model's without prefix=, a DataParallel ``module.`` one, ...)."""
    if any(n in sd for n in ("q_proj.weight", "dt_bias", "b_proj.weight", "o_proj.weight")):
        return
    keys = [k for k in state_dict]
    found = _layer_prefixes(keys)
    shown = ", ".join(repr(c) for c in found[:8]) + (f", ... ({len(found)} in all)" if len(found) > 8 else "")
    if not sd:
        msg = (f"prefix: no key starts with {prefix!r}; the {len(keys)} keys begin "
               f"{[str(k) for k in keys[:4]]}.")
    else:
        where = f"under prefix {prefix!r}" if prefix else "at the top level (prefix='')"
        msg = (f"prefix: no KDA layer tensor (q_proj.weight, dt_bias, ...) {where}: the keys are those of a model "
               f"or of a wrapped layer, e.g. {[str(k) for k in list(sd)[:4]]}.")
    near = [c for c in found if prefix and c.endswith(prefix)]
    if near:
        msg += f" Did you mean prefix={near[0]!r}? (keys saved from a wrapped model, e.g. DataParallel's 'module.')"
    elif found:
        msg += f" Pass prefix= one of the KDA layers' prefixes found: {shown}."
    else:
        msg += " No KDA layer (a key ending in 'dt_bias') was found among them."
    raise ValueError(msg)


def _layer_arrays(state_dict, prefix, naming):
    """``(arrays, naming, detected naming)``: the numpy arrays under ``prefix`` (the prefix
    stripped) and the naming, ``naming`` or the one the keys show."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a string (e.g. 'model.layers.0.self_attn.'), got {prefix!r}.")
    # Names only until the prefix is known to hold a layer: a whole model's tensors are not
    # converted (or copied off a device) to find out that prefix= is missing.
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if isinstance(k, str) and k.startswith(prefix)}
    _check_prefix(state_dict, sd, prefix)
    sd = {k: to_numpy(v) for k, v in sd.items()}
    seen = detect_naming(sd)
    if naming is None:
        if seen is None:
            raise ValueError(f"naming: cannot tell from the keys{' under prefix ' + repr(prefix) if prefix else ''} "
                             f"whether they are Moonshot's (f_a_proj.weight, g_b_proj.weight, ...) or FLA's "
                             f"(f_proj.0.weight, g_proj.1.weight, ...); found {sorted(sd)[:12]}. "
                             f"Pass naming='moonshot' or naming='fla' (and prefix= if the keys have one).")
        naming = seen
    _check_naming(naming)
    return sd, naming, seen


def _check_required(options: dict) -> None:
    """Refuse a call without the hyper-parameters a state dict does not record (``REQUIRED``)."""
    missing_hp = [n for n in REQUIRED if options.get(n, _MISSING) is _MISSING]
    if missing_hp:
        raise TypeError(
            f"from_state_dict: pass {', '.join(missing_hp)}: a state dict does not record "
            f"{'them' if len(missing_hp) > 1 else 'it'}, and a wrong value changes the layer's output without "
            f"any error (FLA's KDAConfig: norm_eps=1e-6, allow_neg_eigval=False, lower_bound=None; its layer's "
            f"own default norm_eps=1e-5; Kimi Linear: norm_eps = config.rms_norm_eps; Kimi K3: lower_bound = "
            f"linear_attn_config's gate_lower_bound). "
            f"KimiDeltaAttention.from_pretrained(path, layer_idx=i) reads them from the checkpoint's config.json.")


def _mismatch_hint(unexpected: list, seen, naming: str, conv: bool, conv_bias: bool, full_rank: bool) -> str:
    """The likely cause of a state dict that does not fit the layer's entries ("" if none)."""
    if seen is not None and seen != naming:
        return f" The keys look like naming={seen!r}."
    if not conv and any(n.endswith("conv1d.weight") for n in unexpected):
        return (" The state dict has short-convolution weights (q_conv1d.weight, ...) but use_short_conv=False: "
                "pass use_short_conv=True (or leave it out: the tensors decide).")
    if conv and not conv_bias and any(n.endswith("conv1d.bias") for n in unexpected):
        return " The checkpoint's short convolutions have biases: pass conv_bias=True (or leave it out)."
    if not full_rank and "g_proj.weight" in unexpected:
        return (" g_proj.weight is Kimi K3's full-rank output gate: pass use_full_rank_gate=True (or leave it "
                "out: the tensors decide).")
    if full_rank and "g_a_proj.weight" in unexpected:
        return " The checkpoint has the low-rank output gate (g_a_proj, g_b_proj): pass use_full_rank_gate=False."
    return ""


def layer_from_state_dict(cls, state_dict, *, naming=None, num_heads, head_dim, prefix="", **options):
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict = load_safetensors(state_dict)
    check_dtype_option("param_dtype", options.get("param_dtype"))
    check_dtype_option("dtype", options.get("dtype"))
    sd, naming, seen = _layer_arrays(state_dict, prefix, naming)
    _check_required(options)

    def shape(name, axis, default):
        try:
            return np.shape(sd[name])[axis]
        except (KeyError, IndexError):
            return default

    conv = options.pop("use_short_conv", "q_conv1d.weight" in sd)
    conv_bias = options.pop("conv_bias", conv and "q_conv1d.bias" in sd)
    full_rank = options.pop("use_full_rank_gate", naming == "moonshot" and "g_proj.weight" in sd)
    _check_full_rank(naming, full_rank)
    D = options.pop("hidden_size", shape("q_proj.weight", 1, None))
    if D is None:
        raise ValueError(f"from_state_dict: '{prefix}q_proj.weight' is missing, so hidden_size is unknown; pass "
                         f"hidden_size= (found {sorted(sd)[:12]}).")
    V = options.pop("head_v_dim", shape("o_norm.weight", 0, head_dim))
    HV = options.pop("num_v_heads", shape("b_proj.weight", 0, num_heads))
    W = options.pop("conv_size", shape("q_conv1d.weight", -1, 4) if conv else 4)
    param_dtype = options.pop("param_dtype", jnp.float32)
    bias = naming == "fla"  # FLA's g_proj.1 always has its bias; Kimi Linear's g_b_proj has none
    e = _entries(naming, num_heads, HV, head_dim, V, D, W, conv, bias, conv_bias, full_rank)

    def accepted(n, s) -> tuple:
        """Every shape ``n`` may have, each named in the errors."""
        # Kimi Linear stores A_log as [1, 1, HV, 1], Kimi K3's modelling code declares it [HV]
        return (s, (HV,)) if naming == "moonshot" and n == "A_log" else (s,)

    shapes = lambda n, s: " or ".join(map(str, accepted(n, s)))
    missing = [f"{n} {shapes(n, s)}" for n, (_, s, _, _) in e.items() if n not in sd]
    unexpected = [n for n in sd if n not in e]
    misshaped = [f"{n}: expected {shapes(n, s)}, got {tuple(np.shape(sd[n]))}" for n, (_, s, _, _) in e.items()
                 if n in sd and tuple(np.shape(sd[n])) not in accepted(n, s)]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append("missing keys (expected shape): " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected keys: " + ", ".join(prefix + n for n in unexpected))
        if misshaped:
            parts.append("mis-shaped keys: " + "; ".join(misshaped))
        hint = _mismatch_hint(unexpected, seen, naming, conv, conv_bias, full_rank)
        raise ValueError(f"from_state_dict(naming={naming!r}, num_heads={num_heads}, head_dim={head_dim}, "
                         f"hidden_size={D}, num_v_heads={HV}, head_v_dim={V}, conv_size={W}, conv_bias={conv_bias}"
                         f"{', use_full_rank_gate=True' if full_rank else ''}): "
                         + ". ".join(parts) + "." + hint)
    arrays = {n: as_numpy(sd[n], prefix + n) for n in e}
    layer = cls(D, num_heads, head_dim, key=None, num_v_heads=HV, expand_v=V / head_dim,
                conv_size=W, use_short_conv=conv, conv_bias=conv_bias, gate_bias=bias,
                use_full_rank_gate=full_rank, param_dtype=param_dtype, **options)
    fields = [f for _, (f, _, _, _) in e.items()]
    values = [jnp.asarray(from_ext(arrays[n]), param_dtype) for n, (_, _, _, from_ext) in e.items()]
    return eqx.tree_at(lambda m: [getattr(m, f) for f in fields], layer, values)
