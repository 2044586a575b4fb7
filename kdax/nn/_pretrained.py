"""Hugging Face checkpoints as published: FLA's ``KDAConfig`` models and Moonshot's Kimi
Linear, single-file or sharded safetensors."""

import dataclasses
import json
import os

from ._weights import load_safetensors, safetensors_keys

# FLA's KDAConfig defaults (fla/models/kda/configuration_kda.py) for the keys that shape a
# KDA layer: ``save_pretrained`` leaves out values equal to the class's defaults.
FLA_DEFAULTS = dict(hidden_size=2048, expand_v=1.0, use_short_conv=True, allow_neg_eigval=False, safe_gate=False,
                    lower_bound=None, conv_size=4, head_dim=128, num_heads=16, num_v_heads=None,
                    num_hidden_layers=24, norm_eps=1e-6, attn=None)
# Kimi Linear's config (configuration_kimi.py): rms_norm_eps defaults to 1e-6; the KDA layer
# reads num_heads, head_dim and short_conv_kernel_size from linear_attn_config.
KIMI_NORM_EPS = 1e-6
_KIMI_LINEAR_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")


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


def _config_path(path) -> str:
    path = os.fspath(path)
    cfg = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"path: expected a checkpoint directory holding config.json (or the config.json "
                                f"itself), got {path!r}.")
    return cfg


def read_config(path) -> KDACheckpointConfig:
    """The KDA hyper-parameters of a checkpoint (directory or ``config.json``), FLA's
    ``KDAConfig`` or Moonshot's Kimi Linear (``linear_attn_config``), with the config
    classes' defaults for left-out keys."""
    with open(_config_path(path)) as f:
        cfg = json.load(f)
    if cfg.get("linear_attn_config") is not None:
        return _kimi_linear(cfg)
    if cfg.get("model_type") == "kda":
        return _fla(cfg)
    raise ValueError(f"config.json: model_type {cfg.get('model_type')!r} is neither FLA's KDA ('kda') nor "
                     f"Kimi Linear (a config with linear_attn_config); for other checkpoints load the layer's "
                     f"tensors with KimiDeltaAttention.from_state_dict.")


def _fla(cfg) -> KDACheckpointConfig:
    c = {**FLA_DEFAULTS, **{k: v for k, v in cfg.items() if k in FLA_DEFAULTS}}
    L = int(c["num_hidden_layers"])
    attn = c["attn"]
    specs = [] if attn is None else ([attn] if isinstance(attn, dict) else list(attn))
    softmax = {int(i) for spec in specs for i in spec.get("layers", ())}
    opts = dict(hidden_size=c["hidden_size"], num_heads=c["num_heads"], head_dim=c["head_dim"],
                num_v_heads=c["num_v_heads"], expand_v=float(c["expand_v"]), use_short_conv=bool(c["use_short_conv"]),
                conv_size=c["conv_size"], allow_neg_eigval=bool(c["allow_neg_eigval"]),
                lower_bound=c["lower_bound"], safe_gate=bool(c["safe_gate"]), norm_eps=float(c["norm_eps"]))
    if "conv_bias" in cfg:  # not a KDAConfig field, but a config may carry it; then it must hold
        opts["conv_bias"] = bool(cfg["conv_bias"])
    return KDACheckpointConfig("fla", tuple(i for i in range(L) if i not in softmax), L, opts, "attn")


def _kimi_linear(cfg) -> KDACheckpointConfig:
    lac = dict(cfg["linear_attn_config"])
    # Keys kdax does not know would change the layer (a full-rank gate, a gate bound, ...):
    # refuse them rather than load a different layer.
    unknown = {k: v for k, v in lac.items() if k not in _KIMI_LINEAR_KEYS and v not in (None, False)}
    if unknown:
        raise ValueError(f"config.json: linear_attn_config has keys kdax's layer does not implement: {unknown}. "
                         f"Kimi Linear's layer has {', '.join(_KIMI_LINEAR_KEYS)}.")
    missing = [k for k in ("kda_layers", "num_heads", "head_dim", "short_conv_kernel_size") if k not in lac]
    if missing or "hidden_size" not in cfg or "num_hidden_layers" not in cfg:
        raise ValueError(f"config.json: Kimi Linear's config needs hidden_size, num_hidden_layers and "
                         f"linear_attn_config's kda_layers, num_heads, head_dim, short_conv_kernel_size; missing "
                         f"{missing + [k for k in ('hidden_size', 'num_hidden_layers') if k not in cfg]}.")
    L = int(cfg["num_hidden_layers"])
    opts = dict(hidden_size=cfg["hidden_size"], num_heads=lac["num_heads"], head_dim=lac["head_dim"],
                num_v_heads=lac["num_heads"], expand_v=1.0, use_short_conv=True,
                conv_size=lac["short_conv_kernel_size"], allow_neg_eigval=False, lower_bound=None, safe_gate=False,
                norm_eps=float(cfg.get("rms_norm_eps", KIMI_NORM_EPS)))
    # linear_attn_config's kda_layers are 1-based (as Kimi Linear's is_kda_layer reads them).
    return KDACheckpointConfig("moonshot", tuple(sorted(int(i) - 1 for i in lac["kda_layers"])), L, opts,
                               "self_attn")


class _Weights:
    """The tensor names of a checkpoint directory and lazy reads of a few of them."""

    def __init__(self, folder: str):
        single = os.path.join(folder, "model.safetensors")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            self.where = {k: single for k in safetensors_keys(single)}
        else:
            found = sorted(os.listdir(folder))
            raise FileNotFoundError(
                f"path: {folder!r} has neither model.safetensors nor model.safetensors.index.json (found "
                f"{found[:10]}). kdax reads safetensors only; save with safe_serialization=True "
                f"(transformers' default).")

    def read(self, keys) -> dict:
        by_file = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        out = {}
        for fname, ks in by_file.items():
            if not os.path.isfile(fname):
                raise FileNotFoundError(f"model.safetensors.index.json names {os.path.basename(fname)!r} for "
                                        f"{ks[0]!r}, but the file is missing.")
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
    (``KimiDeltaAttention``). See ``kdax.nn.load_pretrained``."""
    bad = sorted(set(options) - {"param_dtype", "dtype"})
    if bad:
        raise TypeError(f"from_pretrained: unexpected option(s) {bad}: every layer hyper-parameter comes from the "
                        f"checkpoint's config.json; only param_dtype and dtype may be given.")
    cfg = read_config(path)
    want = cfg.kda_layers if layers is None else tuple(layers)
    for i in want:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_hidden_layers:
            raise ValueError(f"layer_idx: expected an integer in [0, {cfg.num_hidden_layers}), got {i!r}.")
        if i not in cfg.kda_layers:
            raise ValueError(f"layer_idx: layer {i} of this {cfg.format} checkpoint is a softmax-attention layer, "
                             f"not a KDA layer; its KDA layers are {list(cfg.kda_layers)}.")
    folder = os.path.dirname(_config_path(path))
    weights = _Weights(folder)
    out = {}
    for i in want:
        prefix = _layer_prefix(weights.where, i, cfg.key_name)
        keys = [k for k in weights.where if k.startswith(prefix)]
        o = dict(cfg.layer_options)
        H, K = o.pop("num_heads"), o.pop("head_dim")
        HV = o.pop("num_v_heads")
        HV = H if HV is None else HV
        V = K * o.pop("expand_v")
        if V != int(V):
            raise ValueError(f"config.json: head_dim * expand_v = {V} is not an integer.")
        out[i] = cls.from_state_dict(weights.read(keys), naming=cfg.format, num_heads=H, head_dim=K, prefix=prefix,
                                     num_v_heads=HV, head_v_dim=int(V), layer_idx=i, **o, **options)
    return out
