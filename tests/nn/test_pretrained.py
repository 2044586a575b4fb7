"""``from_pretrained``: tiny FLA- and Moonshot-format checkpoint directories written here
(config.json + single-file or sharded safetensors with an index, in the published key
names) load with the path alone and equal the layer built explicitly."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdax.nn import KimiDeltaAttention, load_pretrained, read_config

from .._util import assert_close
from ._oracle import numpy_layer

st = pytest.importorskip("safetensors.numpy")

D, H, K, HV = 24, 2, 8, 4


def same(a, b) -> bool:
    """Same structure, static fields (hyper-parameters), shapes, dtypes and values."""
    return bool(eqx.tree_equal(a, b))


def write_checkpoint(folder, config, tensors, shards=1):
    """config.json and the tensors as model.safetensors, or ``shards`` files with
    model.safetensors.index.json (as transformers' save_pretrained writes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        st.save_file(tensors, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        st.save_file(part, str(folder / fname))
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def other_tensors(prefix, r):
    """A block's tensors that are not KDA's (norms, MLP), and a softmax-attention layer's."""
    return {prefix + "attn_norm.weight": np.ones(D, np.float32),
            prefix + "mlp.gate_proj.weight": r.normal(size=(48, D)).astype(np.float32)}


FLA_CONFIG = dict(model_type="kda", hidden_size=D, num_heads=H, head_dim=K, num_v_heads=HV, conv_size=3,
                  norm_eps=1e-3, allow_neg_eigval=True, conv_bias=True, num_hidden_layers=3,
                  attn={"layers": [1], "num_heads": 2}, vocab_size=50)


def fla_checkpoint(folder, config=FLA_CONFIG, shards=1, conv_bias=True):
    """Layers 0 and 2 KDA (FLA's names under model.layers.{i}.attn.), layer 1 softmax
    attention; returns the explicitly built layers and the folder."""
    r = np.random.default_rng(0)
    tensors = {"model.embeddings.weight": r.normal(size=(50, D)).astype(np.float32)}
    layers = {}
    for i in (0, 2):
        layers[i] = KimiDeltaAttention(D, H, K, key=jax.random.key(i), num_v_heads=HV, conv_size=3,
                                       conv_bias=conv_bias, norm_eps=config.get("norm_eps", 1e-6),
                                       allow_neg_eigval=True, layer_idx=i)
        tensors.update(layers[i].state_dict("fla", prefix=f"model.layers.{i}.attn."))
        tensors.update(other_tensors(f"model.layers.{i}.", r))
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):  # FLA's softmax Attention has these names too
        tensors[f"model.layers.1.attn.{n}.weight"] = r.normal(size=(D, D)).astype(np.float32)
    return layers, write_checkpoint(folder, config, tensors, shards)


@pytest.mark.parametrize("shards", [1, 3])
def test_fla_checkpoint_loads_from_the_path_alone(tmp_path, shards):
    layers, folder = fla_checkpoint(tmp_path / "fla", shards=shards)
    loaded = KimiDeltaAttention.from_pretrained(folder, layer_idx=2)
    # every array and every hyper-parameter (static fields) equal to the explicit layer
    assert same(loaded, layers[2])
    assert (loaded.norm_eps, loaded.conv_size, loaded.allow_neg_eigval) == (1e-3, 3, True)
    assert loaded.q_conv_bias is not None and loaded.layer_idx == 2
    again = KimiDeltaAttention.from_pretrained(folder / "config.json", layer_idx=0)
    assert same(again, layers[0])
    every = load_pretrained(folder)
    assert sorted(every) == [0, 2] and all(same(every[i], layers[i]) for i in (0, 2))


def test_fla_layer_with_conv_bias_matches_numpy(tmp_path):
    """The loaded layer (conv biases before SiLU, the config's norm_eps) against the
    float64 numpy transcription of FLA's layer, on the checkpoint's own tensors."""
    _, folder = fla_checkpoint(tmp_path / "fla")
    layer = KimiDeltaAttention.from_pretrained(folder, layer_idx=0, param_dtype=jnp.float64)
    sd = {k: np.asarray(v, np.float64) for k, v in layer.state_dict("fla").items()}
    assert "q_conv1d.bias" in sd and np.any(sd["q_conv1d.bias"] != 0)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 9, D)))
    ref, _ = numpy_layer(sd, np.asarray(x), naming="fla", num_heads=H, head_dim=K, norm_eps=1e-3,
                         allow_neg_eigval=True)
    for mode in ("recurrent", "chunk"):
        y, _ = jax.jit(lambda l, x: l(x, mode=mode, chunk_size=16))(layer, x)
        assert_close(y, ref, 1e-12, f"conv_bias layer, {mode}")
    no_bias = dict(sd, **{f"{c}_conv1d.bias": np.zeros_like(sd[f"{c}_conv1d.bias"]) for c in "qkv"})
    ref0, _ = numpy_layer(no_bias, np.asarray(x), naming="fla", num_heads=H, head_dim=K, norm_eps=1e-3,
                          allow_neg_eigval=True)
    assert np.sqrt(np.mean((ref - ref0) ** 2)) > 1e-3 * np.sqrt(np.mean(ref**2))  # the biases matter


def test_fla_defaults_and_tensors_decide(tmp_path):
    # config.json as save_pretrained writes it: keys equal to KDAConfig's defaults left out
    cfg = {k: v for k, v in FLA_CONFIG.items() if k not in ("norm_eps", "conv_bias")}
    layers, folder = fla_checkpoint(tmp_path / "a", config=cfg)
    loaded = KimiDeltaAttention.from_pretrained(folder, layer_idx=2)
    assert loaded.norm_eps == 1e-6  # FLA's KDAConfig default (its layer's own default is 1e-5)
    assert loaded.q_conv_bias is not None  # no conv_bias key: the tensors decide
    assert same(loaded, layers[2])
    assert read_config(folder).layer_options["norm_eps"] == 1e-6
    # config says conv_bias=True, the tensors have none: refused, naming the keys
    _, folder = fla_checkpoint(tmp_path / "b", conv_bias=False)
    with pytest.raises(ValueError, match="missing keys.*q_conv1d.bias"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)


def test_layers_that_are_not_kda_raise(tmp_path):
    _, folder = fla_checkpoint(tmp_path / "fla")
    with pytest.raises(ValueError, match=r"layer 1 .* softmax-attention layer.*\[0, 2\]"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=1)
    with pytest.raises(ValueError, match=r"layer_idx: expected an integer in \[0, 3\)"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=3)
    with pytest.raises(TypeError, match="only param_dtype and dtype"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0, norm_eps=1e-5)
    with pytest.raises(FileNotFoundError, match="config.json"):
        KimiDeltaAttention.from_pretrained(tmp_path / "nowhere", layer_idx=0)


KIMI_CONFIG = dict(model_type="kimi_linear", hidden_size=D, num_hidden_layers=4, rms_norm_eps=1e-4,
                   num_attention_heads=2,
                   linear_attn_config=dict(kda_layers=[1, 2, 4], full_attn_layers=[3], num_heads=H, head_dim=K,
                                           short_conv_kernel_size=4))


@pytest.mark.parametrize("shards", [1, 2])
def test_moonshot_checkpoint_in_bfloat16_loads(tmp_path, shards):
    """Kimi Linear's config (linear_attn_config, 1-based kda_layers, rms_norm_eps), keys
    model.layers.{i}.self_attn.*, weights in bfloat16 (A_log, dt_bias float32) as published."""
    r = np.random.default_rng(1)
    tensors, layers = {}, {}
    for i in (0, 1, 3):
        layer = KimiDeltaAttention(D, H, K, key=jax.random.key(10 + i), gate_bias=False, norm_eps=1e-4, layer_idx=i)
        keep = ("A_log", "dt_bias")  # float32 in the checkpoint
        layer = eqx.tree_at(lambda l: [getattr(l, f) for f in ("q_proj", "v_conv", "o_proj", "f_a", "g_b")], layer,
                            [getattr(layer, f).astype(jnp.bfloat16).astype(jnp.float32)
                             for f in ("q_proj", "v_conv", "o_proj", "f_a", "g_b")])
        sd = layer.state_dict("moonshot", prefix=f"model.layers.{i}.self_attn.")
        for k, v in sd.items():
            exact = v.astype(ml_dtypes.bfloat16).astype(np.float32)
            tensors[k] = v if k.endswith(keep) or not np.array_equal(exact, v) else v.astype(ml_dtypes.bfloat16)
        layers[i] = layer
        tensors.update(other_tensors(f"model.layers.{i}.", r))
    tensors["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] = r.normal(size=(8, D)).astype(np.float32)
    folder = write_checkpoint(tmp_path / "kimi", KIMI_CONFIG, tensors, shards)
    assert any(v.dtype == ml_dtypes.bfloat16 for v in tensors.values())
    loaded = KimiDeltaAttention.from_pretrained(folder, layer_idx=3)
    assert same(loaded, layers[3])
    assert loaded.norm_eps == 1e-4 and loaded.g_b_bias is None
    assert sorted(load_pretrained(folder)) == [0, 1, 3]
    with pytest.raises(ValueError, match=r"layer 2 .* softmax-attention.*\[0, 1, 3\]"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=2)


def test_unknown_configs_are_refused(tmp_path):
    cfg = json.loads(json.dumps(KIMI_CONFIG))
    cfg["linear_attn_config"]["use_full_rank_gate"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_full_rank_gate"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gated_deltanet", hidden_size=D)))
    with pytest.raises(ValueError, match="model_type 'gated_deltanet' is neither"):
        read_config(tmp_path / "config.json")
