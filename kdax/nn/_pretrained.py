"""Hugging Face checkpoints as published: FLA's ``KDAConfig`` models, Moonshot's Kimi
Linear and Kimi K3 (its ``text_config``), single-file or sharded safetensors.

The front door names every problem before any tensor is read: the path (a directory, its
``config.json``, or one of its ``.safetensors`` files), ``config.json`` (valid JSON, an
object, every key of the expected type: a number written as a string is refused, never
guessed; every value in its range, or a ``ValueError`` names the key, the value and the
range), the option dtypes, the tensors' dtypes (from the safetensors headers) and the
config's agreement with the tensor names."""

import dataclasses
import json
import math
import os

from ._weights import check_dtype_option, check_float_tensors, load_safetensors, safetensors_header

# FLA's KDAConfig defaults (fla/models/kda/configuration_kda.py) for the keys that shape a
# KDA layer: ``save_pretrained`` leaves out values equal to the class's defaults.
FLA_DEFAULTS = dict(hidden_size=2048, expand_v=1.0, use_short_conv=True, allow_neg_eigval=False, safe_gate=False,
                    lower_bound=None, conv_size=4, head_dim=128, num_heads=16, num_v_heads=None,
                    num_hidden_layers=24, norm_eps=1e-6, attn=None)
# Kimi Linear's config (configuration_kimi.py): rms_norm_eps defaults to 1e-6; the KDA layer
# reads num_heads, head_dim and short_conv_kernel_size from linear_attn_config.
KIMI_NORM_EPS = 1e-6
_KIMI_LINEAR_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")
# Kimi K3's keys (its modeling_kimi_linear.py, KimiDeltaAttention): gate_lower_bound -> FLA's
# chunk_kda(safe_gate=True, lower_bound=...), use_full_rank_gate -> g_proj in place of g_a/g_b.
_KIMI_K3_KEYS = ("gate_lower_bound", "use_full_rank_gate")
# model_type of Moonshot's configs: Kimi Linear's, Kimi K3's (top level) and its text_config's.
_KIMI_MODEL_TYPES = ("kimi_linear", "kimi_k3", "kimi")


@dataclasses.dataclass(frozen=True)
class KDACheckpointConfig:
    """What a checkpoint's ``config.json`` says about its KDA layers.

    ``format``: "fla" or "moonshot" (also the weight ``naming``); ``kda_layers``: the
    0-based indices of the KDA layers; ``num_hidden_layers``; ``layer_options``: the
    layer's hyper-parameters (``KimiDeltaAttention``'s constructor names; ``conv_bias``
    only when the config has the key, else the tensors decide); ``key_name``: the
    attention module's name inside a block ("attn" or "self_attn")."""

    format: str
    kda_layers: tuple
    num_hidden_layers: int
    layer_options: dict
    key_name: str


def _locate(path):
    """``(config.json path, folder, weights file or None)`` for ``path``: a checkpoint
    directory, its ``config.json``, or one of its ``.safetensors`` files (or its index),
    which means the directory (that file is read when the folder has no
    ``model.safetensors`` nor an index)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a checkpoint directory (str or os.PathLike), got {type(path).__name__}.")
    path = os.fspath(path)
    weights = None
    if os.path.isdir(path):
        folder, cfg = path, os.path.join(path, "config.json")
    elif path.endswith((".safetensors", ".safetensors.index.json")) and os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        cfg = os.path.join(folder, "config.json")
        weights = path if path.endswith(".safetensors") else None
        if not os.path.isfile(cfg):
            raise FileNotFoundError(
                f"path: {path!r} is a weights file; from_pretrained reads the checkpoint directory holding it, and "
                f"{folder!r} has no config.json (the layer's hyper-parameters). For a bare .safetensors file use "
                f"KimiDeltaAttention.from_state_dict(path, num_heads=..., head_dim=..., norm_eps=..., "
                f"allow_neg_eigval=..., lower_bound=..., prefix=...).")
    else:
        folder, cfg = os.path.dirname(path), path
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"path: expected a checkpoint directory holding config.json (or the config.json "
                                f"itself, or one of its .safetensors files), got {path!r}.")
    return cfg, folder, weights


def _config_path(path) -> str:
    return _locate(path)[0]


def _load_json(fname, what="config.json"):
    try:
        # utf-8-sig: editors on Windows may save JSON with a byte-order mark, which json.loads refuses.
        with open(fname, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{fname}: {what} is not a UTF-8 text file (is it a weights file?).") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{fname}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                         f"(character {e.pos}).") from None


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _kind(v) -> str:
    """A JSON value's type in words, with the value unless it is an object or a list."""
    if isinstance(v, (dict, list)):
        return _JSON_TYPES[type(v)]
    return f"{_JSON_TYPES.get(type(v), type(v).__name__)} ({v!r})"


def _typed(value, key, want, where="config.json"):
    """``value`` if it is of JSON type ``want`` ("int", "number", "bool", "int or null",
    "number or null", "list of int"), else a ``TypeError`` naming the key, the expected
    and the found type. A number written as a string is refused, not converted."""
    ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    ok_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    check = {"int": ok_int, "number": ok_num, "bool": lambda v: isinstance(v, bool),
             "int or null": lambda v: v is None or ok_int(v), "number or null": lambda v: v is None or ok_num(v),
             "list of int": lambda v: isinstance(v, list) and all(ok_int(i) for i in v)}[want]
    if not check(value):
        hint = " (a JSON string: write the value without quotes)" if isinstance(value, str) else ""
        phrase = {"int": "an integer", "number": "a number", "bool": "a boolean (true or false)",
                  "int or null": "an integer or null", "number or null": "a number or null",
                  "list of int": "a list of integers"}[want]
        raise TypeError(f"{where}: {key} must be {phrase}, got {_kind(value)}{hint}.")
    return value


def _in_range(value, key, ok: bool, expected: str, where="config.json"):
    """``value`` if ``ok``, else a ``ValueError`` naming the key, the value and the range."""
    if not ok:
        raise ValueError(f"{where}: {key} must be {expected}, got {value!r}.")
    return value


def _positive_int(value, key, where, least=1):
    """An integer (type already checked) of at least ``least``."""
    return _in_range(value, key, value >= least, f"an integer >= {least}", where)


def _eps(value, key, where):
    """A normalisation epsilon: finite and > 0 (0, negative, NaN or inf makes the RMSNorm's
    rsqrt NaN or inf on a zero row, or silently wrong)."""
    return _in_range(value, key, math.isfinite(value) and value > 0, "a finite number > 0", where)


def _layer_list(value, key, lo: int, hi: int, where, base: str):
    """Layer indices (type already checked): each in ``[lo, hi]``, none twice."""
    bad = [i for i in value if not lo <= i <= hi]
    if bad:
        raise ValueError(f"{where}: {key} must hold {base} layer indices in {lo}..{hi} (num_hidden_layers = "
                         f"{hi - lo + 1}), got {value!r} (out of range: {bad}).")
    twice = sorted({i for i in value if value.count(i) > 1})
    if twice:
        raise ValueError(f"{where}: {key} must hold each layer index once, got {value!r} (repeated: {twice}).")
    return value


def _lower_bound(lb, key, safe_gate, where):
    """The lower-bound gate ``g = lower_bound * sigmoid(...)``: finite and < 0 (a decay);
    with ``safe_gate`` (a phrase saying why it is on) in [-5, 0), which FLA's chunk_kda
    requires there."""
    if lb is None:
        return None
    if safe_gate and not -5.0 <= lb < 0.0:  # NaN fails both comparisons
        raise ValueError(f"{where}: {key} must lie in [-5, 0) ({safe_gate} FLA's chunk_kda with safe_gate=True, "
                         f"which requires that range), got {lb!r}.")
    return float(_in_range(lb, key, math.isfinite(lb) and lb < 0.0, "a finite number < 0 (the gate's floor: "
                                                                     "g = lower_bound * sigmoid(...) <= 0)", where))


def read_config(path) -> KDACheckpointConfig:
    """The KDA hyper-parameters of a checkpoint (directory, ``config.json``, or one of its
    ``.safetensors`` files), FLA's ``KDAConfig``, Moonshot's Kimi Linear
    (``linear_attn_config``) or Kimi K3 (``model_type`` "kimi_k3": the same under
    ``text_config``), with the config classes' defaults for left-out keys. Every key read
    is type-checked (a ``TypeError`` names it) and range-checked (a ``ValueError`` names
    it, the value and the range: epsilons finite and > 0, sizes and head counts positive
    integers, layer indices within ``num_hidden_layers`` and unique)."""
    fname = _config_path(path)
    cfg = _load_json(fname)
    if not isinstance(cfg, dict):
        raise TypeError(f"{fname}: expected a JSON object at the top level (a Hugging Face config, {{\"model_type\": "
                        f"...}}), got {_kind(cfg)}.")
    text = cfg.get("text_config")
    nested = (cfg.get("linear_attn_config") is None and isinstance(text, dict)
              and text.get("linear_attn_config") is not None)
    if nested or cfg.get("linear_attn_config") is not None:
        # Other models reuse the key with other layouts and gates (GLM-5-Next's KDA layers): Moonshot's only.
        types = [t for t in (cfg.get("model_type"), text.get("model_type") if nested else None) if t is not None]
        other = [t for t in types if t not in _KIMI_MODEL_TYPES]
        if other:
            raise ValueError(f"{fname}: model_type {other[0]!r} has a linear_attn_config, but kdax reads Moonshot's "
                             f"layouts only (model_type {', '.join(map(repr, _KIMI_MODEL_TYPES))}): another model's "
                             f"KDA layer may name, fuse or gate its tensors differently. Load its tensors with "
                             f"KimiDeltaAttention.from_state_dict once they are in Moonshot's or FLA's names.")
        if nested:
            return _kimi_linear(text, f"{fname}: text_config")  # Kimi K3: the language model's config, nested
        return _kimi_linear(cfg, fname)
    if cfg.get("model_type") == "kda":
        return _fla(cfg, fname)
    raise ValueError(f"config.json: model_type {cfg.get('model_type')!r} is neither FLA's KDA ('kda') nor "
                     f"Kimi Linear / Kimi K3 (a config with linear_attn_config, at the top level or in text_config); "
                     f"for other checkpoints load the layer's tensors with KimiDeltaAttention.from_state_dict.")


def _fla(cfg, where="config.json") -> KDACheckpointConfig:
    c = {**FLA_DEFAULTS, **{k: v for k, v in cfg.items() if k in FLA_DEFAULTS}}
    for key, want in (("hidden_size", "int"), ("num_heads", "int"), ("head_dim", "int"), ("num_v_heads", "int or null"),
                      ("expand_v", "number"), ("use_short_conv", "bool"), ("conv_size", "int"),
                      ("allow_neg_eigval", "bool"), ("lower_bound", "number or null"), ("safe_gate", "bool"),
                      ("norm_eps", "number"), ("num_hidden_layers", "int")):
        _typed(c[key], key, want, where)
    for key in ("hidden_size", "num_heads", "head_dim", "num_hidden_layers"):
        _positive_int(c[key], key, where)
    # kdax's layer keeps the last conv_size - 1 inputs of each sequence: a width of 1 has no cache.
    _positive_int(c["conv_size"], "conv_size", where, least=2)
    H, HV = c["num_heads"], c["num_v_heads"]
    if HV is not None:
        _in_range(HV, "num_v_heads", HV >= 1 and HV % H == 0, f"null or a positive multiple of num_heads = {H} "
                  f"(grouped value heads)", where)
    ev = c["expand_v"]
    V = c["head_dim"] * ev
    _in_range(ev, "expand_v", math.isfinite(ev) and ev > 0 and V == int(V),
              f"a number > 0 with head_dim * expand_v a whole number (head_dim = {c['head_dim']})", where)
    _eps(c["norm_eps"], "norm_eps", where)
    if c["safe_gate"] and c["lower_bound"] is None:
        raise ValueError(f"{where}: safe_gate is true, which needs lower_bound (a number in [-5, 0)), got "
                         f"lower_bound null or left out.")
    lb = _lower_bound(c["lower_bound"], "lower_bound", c["safe_gate"] and "safe_gate is true: the layer passes it "
                      "to", where)
    L = c["num_hidden_layers"]
    attn = c["attn"]
    if not (attn is None or isinstance(attn, (dict, list))):
        raise TypeError(f"{where}: attn must be null, an object or a list of objects, got {_kind(attn)}.")
    specs = [] if attn is None else ([attn] if isinstance(attn, dict) else list(attn))
    for spec in specs:
        if not isinstance(spec, dict):
            raise TypeError(f"{where}: attn must be null, an object or a list of objects; an entry is {_kind(spec)}.")
        _typed(spec.get("layers", []), "attn.layers", "list of int", where)
    # FLA's layers read attn['layers'] with 0-based layer_idx.
    _layer_list([i for spec in specs for i in spec.get("layers", ())], "attn.layers", 0, L - 1, where, "0-based")
    softmax = {i for spec in specs for i in spec.get("layers", ())}
    opts = dict(hidden_size=c["hidden_size"], num_heads=c["num_heads"], head_dim=c["head_dim"],
                num_v_heads=c["num_v_heads"], expand_v=float(c["expand_v"]), use_short_conv=c["use_short_conv"],
                conv_size=c["conv_size"], allow_neg_eigval=c["allow_neg_eigval"],
                lower_bound=lb, safe_gate=c["safe_gate"],
                norm_eps=float(c["norm_eps"]))
    if "conv_bias" in cfg:  # not a KDAConfig field, but a config may carry it; then it must hold
        opts["conv_bias"] = _typed(cfg["conv_bias"], "conv_bias", "bool", where)
    return KDACheckpointConfig("fla", tuple(i for i in range(L) if i not in softmax), L, opts, "attn")


def _kimi_linear(cfg, where) -> KDACheckpointConfig:
    lac = cfg["linear_attn_config"]
    if not isinstance(lac, dict):
        raise TypeError(f"{where}: linear_attn_config must be an object, got {_kind(lac)}.")
    # Keys kdax does not know would change the layer: refuse them rather than load a different layer.
    known = _KIMI_LINEAR_KEYS + _KIMI_K3_KEYS
    unknown = {k: v for k, v in lac.items() if k not in known and v not in (None, False)}
    if unknown:
        raise ValueError(f"{where}: linear_attn_config has keys kdax's layer does not implement: {unknown}. "
                         f"Kimi Linear's and Kimi K3's layers have {', '.join(known)}.")
    missing = [k for k in ("kda_layers", "num_heads", "head_dim", "short_conv_kernel_size") if k not in lac]
    if missing or "hidden_size" not in cfg or "num_hidden_layers" not in cfg:
        raise ValueError(f"{where}: Kimi Linear's config needs hidden_size, num_hidden_layers and "
                         f"linear_attn_config's kda_layers, num_heads, head_dim, short_conv_kernel_size; missing "
                         f"{missing + [k for k in ('hidden_size', 'num_hidden_layers') if k not in cfg]}.")
    for key in ("hidden_size", "num_hidden_layers"):
        _positive_int(_typed(cfg[key], key, "int", where), key, where)
    eps = _eps(_typed(cfg.get("rms_norm_eps", KIMI_NORM_EPS), "rms_norm_eps", "number", where), "rms_norm_eps",
               where)
    for key, want in (("kda_layers", "list of int"), ("num_heads", "int"), ("head_dim", "int"),
                      ("short_conv_kernel_size", "int"), ("gate_lower_bound", "number or null"),
                      ("use_full_rank_gate", "bool"), ("full_attn_layers", "list of int")):
        if key in lac and not (key == "full_attn_layers" and lac[key] is None):
            _typed(lac[key], "linear_attn_config." + key, want, where)
    for key in ("num_heads", "head_dim"):
        _positive_int(lac[key], "linear_attn_config." + key, where)
    _positive_int(lac["short_conv_kernel_size"], "linear_attn_config.short_conv_kernel_size", where, least=2)
    L = cfg["num_hidden_layers"]
    # Kimi Linear's is_kda_layer reads kda_layers (and full_attn_layers) 1-based.
    kda = _layer_list(lac["kda_layers"], "linear_attn_config.kda_layers", 1, L, where, "1-based")
    full = lac.get("full_attn_layers")
    if full is not None:
        _layer_list(full, "linear_attn_config.full_attn_layers", 1, L, where, "1-based")
        both = sorted(set(kda) & set(full))
        if both:
            raise ValueError(f"{where}: linear_attn_config's kda_layers and full_attn_layers must not share a layer, "
                             f"got {both} in both.")
    lb = _lower_bound(lac.get("gate_lower_bound"), "linear_attn_config.gate_lower_bound",
                      "Kimi K3's layer passes it to", where)
    opts = dict(hidden_size=cfg["hidden_size"], num_heads=lac["num_heads"], head_dim=lac["head_dim"],
                num_v_heads=lac["num_heads"], expand_v=1.0, use_short_conv=True,
                conv_size=lac["short_conv_kernel_size"], allow_neg_eigval=False,
                lower_bound=lb, safe_gate=lb is not None, norm_eps=float(eps),
                use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)))
    return KDACheckpointConfig("moonshot", tuple(sorted(i - 1 for i in kda)), L, opts, "self_attn")


class _Weights:
    """The tensor names of a checkpoint directory (their dtypes and shapes from the
    safetensors headers) and lazy reads of a few of them."""

    def __init__(self, folder: str, file=None):
        single = os.path.join(folder, "model.safetensors")
        index = os.path.join(folder, "model.safetensors.index.json")
        self.headers = {}
        if os.path.isfile(index):
            idx = _load_json(index, "model.safetensors.index.json")
            if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
                raise ValueError(f"{index}: expected an object with a 'weight_map' object (tensor name -> file).")
            self.where = {k: os.path.join(folder, v) for k, v in idx["weight_map"].items()}
        elif os.path.isfile(single) or file is not None:
            fname = single if os.path.isfile(single) else file
            self.where = {k: fname for k in self._header(fname)}
        else:
            found = sorted(os.listdir(folder))
            raise FileNotFoundError(
                f"path: {folder!r} has neither model.safetensors nor model.safetensors.index.json (found "
                f"{found[:10]}). kdax reads safetensors only; save with safe_serialization=True "
                f"(transformers' default).")

    def _header(self, fname):
        if fname not in self.headers:
            self.headers[fname] = safetensors_header(fname)
        return self.headers[fname]

    def _by_file(self, keys):
        by_file = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        for fname, ks in by_file.items():
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"model.safetensors.index.json names {os.path.basename(fname)!r} for "
                                        f"{ks[0]!r}, but the file is missing.")
        return by_file

    def check(self, keys) -> None:
        """Refuse (naming key, dtype and file) tensors that are not floating point, from
        the headers alone."""
        for fname, ks in self._by_file(keys).items():
            header = self._header(fname)
            absent = [k for k in ks if k not in header]
            if absent:
                raise ValueError(f"model.safetensors.index.json places {absent[:3]} in {os.path.basename(fname)!r}, "
                                 f"whose header does not have {'them' if len(absent) > 1 else 'it'}.")
            check_float_tensors(header, ks, fname)

    def read(self, keys) -> dict:
        out = {}
        for fname, ks in self._by_file(keys).items():
            out.update(load_safetensors(fname, ks))
        return out


def _layer_prefix(names, i: int, key_name: str) -> str:
    tail = f"layers.{i}.{key_name}.q_proj.weight"
    hits = [k for k in names if k == tail or k.endswith("." + tail)]
    if len(hits) != 1:
        raise ValueError(f"checkpoint: expected one tensor named '...{tail}' for layer {i}, found {hits or 'none'}.")
    return hits[0][: -len("q_proj.weight")]


def load_layers(cls, path, layers=None, **options) -> dict:
    """``{layer index: cls}`` for the KDA layers of a checkpoint (all of them, or those in
    ``layers``; a listed layer that is not a KDA layer raises); ``cls``: the layer class
    (``KimiDeltaAttention``). See ``kdax.nn.load_pretrained``. Every check (options, path,
    config.json, tensor names, dtypes and the config's agreement with them) runs before
    any tensor is read."""
    bad = sorted(set(options) - {"param_dtype", "dtype"})
    if bad:
        raise TypeError(f"from_pretrained: unexpected option(s) {bad}: every layer hyper-parameter comes from the "
                        f"checkpoint's config.json; only param_dtype and dtype may be given.")
    for name in ("param_dtype", "dtype"):
        check_dtype_option(name, options.get(name))
    _, folder, file = _locate(path)
    cfg = read_config(path)
    want = cfg.kda_layers if layers is None else tuple(layers)
    for i in want:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_hidden_layers:
            raise ValueError(f"layer_idx: expected an integer in [0, {cfg.num_hidden_layers}), got {i!r}.")
        if i not in cfg.kda_layers:
            raise ValueError(f"layer_idx: layer {i} of this {cfg.format} checkpoint is a softmax-attention layer, "
                             f"not a KDA layer; its KDA layers are {list(cfg.kda_layers)}.")
    weights = _Weights(folder, file)
    plan = {}
    for i in want:
        prefix = _layer_prefix(weights.where, i, cfg.key_name)
        keys = [k for k in weights.where if k.startswith(prefix)]
        _check_agreement(cfg, prefix, keys)
        weights.check(keys)
        plan[i] = prefix, keys
    out = {}
    for i, (prefix, keys) in plan.items():
        o = dict(cfg.layer_options)
        H, K = o.pop("num_heads"), o.pop("head_dim")
        HV = o.pop("num_v_heads")
        HV = H if HV is None else HV
        V = K * o.pop("expand_v")  # a whole number: read_config checked it
        out[i] = cls.from_state_dict(weights.read(keys), naming=cfg.format, num_heads=H, head_dim=K, prefix=prefix,
                                     num_v_heads=HV, head_v_dim=int(V), layer_idx=i, **o, **options)
    return out


def _check_agreement(cfg: KDACheckpointConfig, prefix: str, keys) -> None:
    """config.json's switches that decide which tensors a layer has, against the names."""
    names = {k[len(prefix):] for k in keys}
    o = cfg.layer_options
    conv = sorted(prefix + n for n in names if n.endswith("_conv1d.weight"))
    if not o["use_short_conv"] and conv:
        raise ValueError(f"config.json: use_short_conv is false, but the checkpoint has this layer's short-convolution "
                         f"weights ({', '.join(conv)}): the config and the tensors disagree (FLA's layer with "
                         f"use_short_conv=False has no such weights). Fix config.json's use_short_conv.")
    if o["use_short_conv"] and not conv and cfg.format == "fla":
        raise ValueError(f"config.json: use_short_conv is true (or left out: KDAConfig's default), but the "
                         f"checkpoint has no short-convolution weights under {prefix!r} (q_conv1d.weight, ...): the "
                         f"config and the tensors disagree.")
    if cfg.format == "moonshot":
        full = o.get("use_full_rank_gate", False)
        if full and "g_proj.weight" not in names and "g_a_proj.weight" in names:
            raise ValueError(f"config.json: linear_attn_config.use_full_rank_gate is true, but layer {prefix!r} has "
                             f"the low-rank output gate (g_a_proj.weight, g_b_proj.weight), not g_proj.weight.")
        if not full and "g_proj.weight" in names:
            raise ValueError(f"config.json: linear_attn_config.use_full_rank_gate is false or left out, but layer "
                             f"{prefix!r} has Kimi K3's full-rank output gate g_proj.weight; the config and the "
                             f"tensors disagree.")
