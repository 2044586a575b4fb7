"""``from_pretrained``: tiny FLA- and Moonshot-format checkpoint directories written here
(config.json + single-file or sharded safetensors with an index, in the published key
names) load with the path alone and equal the layer built explicitly."""

import json
import os
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdax.nn import KimiDeltaAttention, load_pretrained, read_config
from kdax.nn import _pretrained

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


def _eps_of(config) -> float:
    """The layers' norm_eps: the config's, or FLA's default where it is not a number (a
    config written wrong on purpose, for the reader's checks)."""
    eps = config.get("norm_eps", 1e-6)
    return eps if isinstance(eps, float) and 0 < eps < float("inf") else 1e-6


def fla_checkpoint(folder, config=FLA_CONFIG, shards=1, conv_bias=True):
    """Layers 0 and 2 KDA (FLA's names under model.layers.{i}.attn.), layer 1 softmax
    attention; returns the explicitly built layers and the folder."""
    r = np.random.default_rng(0)
    tensors = {"model.embeddings.weight": r.normal(size=(50, D)).astype(np.float32)}
    layers = {}
    for i in (0, 2):
        layers[i] = KimiDeltaAttention(D, H, K, key=jax.random.key(i), num_v_heads=HV, conv_size=3,
                                       conv_bias=conv_bias, norm_eps=_eps_of(config),
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
    cfg["linear_attn_config"]["safe_gate"] = True  # GLM-5-Next's reference reads it; Kimi's code does not
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="linear_attn_config has keys kdax's layer does not implement.*safe_gate"):
        read_config(tmp_path)
    # another model's linear_attn_config (GLM-5-Next's nests it in text_config too): refused by model_type
    glm = dict(model_type="glm5_next", text_config=dict(model_type="glm5_next_text", hidden_size=D,
                                                         num_hidden_layers=4, linear_attn_config=dict(
                                                             num_heads=H, head_dim=K, short_conv_kernel_size=4,
                                                             gate_lower_bound=-5.0)))
    (tmp_path / "config.json").write_text(json.dumps(glm))
    with pytest.raises(ValueError, match=r"model_type 'glm5_next' has a linear_attn_config, but kdax reads "
                                         r"Moonshot's layouts only"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="gated_deltanet", hidden_size=D)))
    with pytest.raises(ValueError, match="model_type 'gated_deltanet' is neither"):
        read_config(tmp_path / "config.json")



# ---- the front door: every problem named, before any tensor is read --------------------------------------------


@pytest.fixture
def no_reads(monkeypatch):
    """Any tensor read fails the test: the errors below must come from names, headers and
    config.json alone."""

    def read(*a, **k):
        raise AssertionError("a tensor was read before the error")

    monkeypatch.setattr(_pretrained, "load_safetensors", read)


def test_a_safetensors_path_means_its_directory(tmp_path):
    layers, folder = fla_checkpoint(tmp_path / "one")
    assert same(KimiDeltaAttention.from_pretrained(folder / "model.safetensors", layer_idx=2), layers[2])
    layers, folder = fla_checkpoint(tmp_path / "three", shards=3)
    assert same(KimiDeltaAttention.from_pretrained(folder / "model-00002-of-00003.safetensors", layer_idx=0),
                layers[0])
    assert same(KimiDeltaAttention.from_pretrained(folder / "model.safetensors.index.json", layer_idx=0), layers[0])
    # a weights file of another name, alone beside config.json: that file is read
    (tmp_path / "one" / "model.safetensors").rename(tmp_path / "one" / "weights.safetensors")
    loaded = KimiDeltaAttention.from_pretrained(tmp_path / "one" / "weights.safetensors", layer_idx=0)
    assert loaded.layer_idx == 0
    # no config.json beside it: named, with what to do instead
    lone = tmp_path / "lone"
    lone.mkdir()
    (tmp_path / "one" / "weights.safetensors").rename(lone / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"is a weights file.*has no config\.json.*from_state_dict"):
        KimiDeltaAttention.from_pretrained(lone / "model.safetensors", layer_idx=0)


def test_float8_weights_are_named(tmp_path, no_reads):
    r = np.random.default_rng(0)
    layer = KimiDeltaAttention(D, H, K, key=jax.random.key(0), num_v_heads=HV, norm_eps=1e-6)
    tensors = layer.state_dict("fla", prefix="model.layers.0.attn.")
    tensors["model.layers.0.attn.q_proj.weight"] = tensors["model.layers.0.attn.q_proj.weight"].astype(
        ml_dtypes.float8_e4m3fn)
    tensors["model.layers.0.attn.q_proj.weight_scale_inv"] = r.uniform(size=(1, 1)).astype(np.float32)
    cfg = dict(model_type="kda", hidden_size=D, num_heads=H, head_dim=K, num_v_heads=HV, num_hidden_layers=1)
    folder = write_checkpoint(tmp_path / "f8", cfg, tensors)
    with pytest.raises(TypeError, match=r"model\.safetensors: .*model\.layers\.0\.attn\.q_proj\.weight \(F8_E4M3\)"
                                        r".*quantized.*Dequantize"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)


def test_float8_arrays_and_files_are_named_by_from_state_dict(tmp_path):
    layer = KimiDeltaAttention(D, H, K, key=jax.random.key(0), norm_eps=1e-6)
    sd = layer.state_dict("fla")
    sd["k_proj.weight"] = sd["k_proj.weight"].astype(ml_dtypes.float8_e5m2)
    opts = dict(num_heads=H, head_dim=K, norm_eps=1e-6, allow_neg_eigval=False, lower_bound=None)
    with pytest.raises(TypeError, match=r"k_proj\.weight: dtype float8_e5m2 .*quantized.*Dequantize"):
        KimiDeltaAttention.from_state_dict(sd, **opts)
    st.save_file(sd, str(tmp_path / "w.safetensors"))
    with pytest.raises(TypeError, match=r"w\.safetensors: .*k_proj\.weight \(F8_E5M2\)"):
        KimiDeltaAttention.from_state_dict(tmp_path / "w.safetensors", **opts)


def test_config_json_that_is_not_json_or_not_an_object(tmp_path, no_reads):
    _, folder = fla_checkpoint(tmp_path / "fla")
    (folder / "config.json").write_text('{"model_type": "kda",\n "hidden_size": 24,,}')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON: Expecting property name .* at line 2, "
                                         r"column 20 \(character 41\)") as e:
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    assert os.fspath(folder / "config.json") in str(e.value)
    (folder / "config.json").write_text(json.dumps([FLA_CONFIG]))
    with pytest.raises(TypeError, match=r"config\.json: expected a JSON object at the top level .* got a list"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    (folder / "config.json").write_bytes(b"\x89\xff\x00binary")
    with pytest.raises(ValueError, match=r"config\.json is not a UTF-8 text file"):
        read_config(folder)


def test_broken_checkpoint_files_are_named(tmp_path, no_reads):
    """A checkpoint whose files do not hold what its index or config.json say: each problem
    named, with the file, before any tensor is read."""
    _, folder = fla_checkpoint(tmp_path / "shard", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"^model\.safetensors\.index\.json names "
                                                r"'model-00002-of-00003\.safetensors' for '.*', but the file is missing"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    _, folder = fla_checkpoint(tmp_path / "misplaced", shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.0.attn.q_proj.weight"
    index["weight_map"][name] = next(f for f in sorted(set(index["weight_map"].values()))
                                     if f != index["weight_map"][name])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"^model\.safetensors\.index\.json places \['{name}'\] in "
                                         rf"'{index['weight_map'][name]}', whose header does not have it"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weights": index["weight_map"]}))
    with pytest.raises(ValueError, match=r"index\.json: expected an object with a 'weight_map' object"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    _, folder = fla_checkpoint(tmp_path / "none")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json "
                                                r"\(found \['config\.json'\]\)\. kdax reads safetensors only"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    for junk, why in ((b"\x10" + b"\x00" * 7 + b"not json at all!", "Expecting value"), (b"abc", "no safetensors header")):
        (folder / "model.safetensors").write_bytes(junk)
        with pytest.raises(ValueError, match=rf"model\.safetensors: not a readable \.safetensors file \({why}"):
            KimiDeltaAttention.from_pretrained(folder, layer_idx=0)
    for call in (lambda: KimiDeltaAttention.from_pretrained(3, layer_idx=0), lambda: read_config(3)):
        with pytest.raises(TypeError, match=r"^path: expected a checkpoint directory \(str or os\.PathLike\), got int"):
            call()


def test_use_short_conv_true_without_conv_tensors(tmp_path, no_reads):
    """config.json says the layers have short convolutions (or leaves it to KDAConfig's
    default, True), the tensors have none: the disagreement named, not a layer built
    without them."""
    folder = tmp_path / "noconv"
    layer = KimiDeltaAttention(D, H, K, key=jax.random.key(0), num_v_heads=HV, use_short_conv=False, norm_eps=1e-6)
    cfg = dict(model_type="kda", hidden_size=D, num_heads=H, head_dim=K, num_v_heads=HV, num_hidden_layers=1)
    write_checkpoint(folder, cfg, layer.state_dict("fla", prefix="model.layers.0.attn."))
    with pytest.raises(ValueError, match=r"^config\.json: use_short_conv is true \(or left out: KDAConfig's default\), "
                                         r"but the checkpoint has no short-convolution weights under "
                                         r"'model\.layers\.0\.attn\.'"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)


def test_use_short_conv_false_with_conv_tensors(tmp_path, no_reads):
    _, folder = fla_checkpoint(tmp_path / "fla", config=dict(FLA_CONFIG, use_short_conv=False))
    with pytest.raises(ValueError, match=r"config\.json: use_short_conv is false, but the checkpoint has this layer's "
                                         r"short-convolution weights \(model\.layers\.0\.attn\.k_conv1d\.weight"):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)


def test_use_short_conv_false_hint_in_from_state_dict():
    sd = KimiDeltaAttention(D, H, K, key=jax.random.key(0), norm_eps=1e-6, conv_bias=True).state_dict("fla")
    with pytest.raises(ValueError, match=r"unexpected keys: q_conv1d\.weight.*but use_short_conv=False: pass "
                                         r"use_short_conv=True"):
        KimiDeltaAttention.from_state_dict(sd, num_heads=H, head_dim=K, norm_eps=1e-6, allow_neg_eigval=False,
                                           lower_bound=None, use_short_conv=False)


def test_whole_model_dict_without_prefix_asks_for_the_prefix(tmp_path):
    _, folder = fla_checkpoint(tmp_path / "fla")
    model = st.load_file(str(folder / "model.safetensors"))
    opts = dict(num_heads=H, head_dim=K, norm_eps=1e-3, allow_neg_eigval=True, lower_bound=None)
    for naming in (None, "fla"):
        with pytest.raises(ValueError, match=r"prefix: no KDA layer tensor .* at the top level .* Pass prefix= one of "
                                             r"the KDA layers' prefixes found: 'model\.layers\.0\.attn\.', "
                                             r"'model\.layers\.2\.attn\.'"):
            KimiDeltaAttention.from_state_dict(model, naming=naming, **opts)
    layer = KimiDeltaAttention.from_state_dict(model, prefix="model.layers.2.attn.", **opts)
    assert layer.hidden_size == D


def test_data_parallel_dict_suggests_the_prefix(tmp_path):
    _, folder = fla_checkpoint(tmp_path / "fla")
    wrapped = {"module." + k: v for k, v in st.load_file(str(folder / "model.safetensors")).items()}
    opts = dict(num_heads=H, head_dim=K, norm_eps=1e-3, allow_neg_eigval=True, lower_bound=None)
    with pytest.raises(ValueError, match=r"prefix: no key starts with 'model\.layers\.0\.attn\.'; the \d+ keys begin "
                                         r"\['module\..*Did you mean prefix='module\.model\.layers\.0\.attn\.'\?"):
        KimiDeltaAttention.from_state_dict(wrapped, prefix="model.layers.0.attn.", **opts)
    single = {"module." + k: v for k, v in KimiDeltaAttention(D, H, K, key=jax.random.key(1)).state_dict("fla").items()}
    with pytest.raises(ValueError, match=r"at the top level.*Pass prefix= one of the KDA layers' prefixes found: "
                                         r"'module\.'"):
        KimiDeltaAttention.from_state_dict(single, **opts)


@pytest.mark.parametrize("key,value,want", [
    ("norm_eps", "1e-5", r"config\.json: norm_eps must be a number, got a string \('1e-5'\) \(a JSON string"),
    ("num_hidden_layers", "3", r"config\.json: num_hidden_layers must be an integer, got a string \('3'\)"),
    ("num_hidden_layers", 3.0, r"num_hidden_layers must be an integer, got a number \(3\.0\)"),
    ("head_dim", True, r"head_dim must be an integer, got a boolean \(True\)"),
    ("use_short_conv", "false", r"use_short_conv must be a boolean \(true or false\), got a string"),
    ("attn", {"layers": ["1"]}, r"attn\.layers must be a list of integers"),
])
def test_fla_config_values_of_the_wrong_type_are_refused(tmp_path, no_reads, key, value, want):
    _, folder = fla_checkpoint(tmp_path / "fla", config=dict(FLA_CONFIG, **{key: value}))
    with pytest.raises(TypeError, match=want):
        KimiDeltaAttention.from_pretrained(folder, layer_idx=0)


@pytest.mark.parametrize("change,want", [
    (dict(rms_norm_eps="1e-5"), r"config\.json: rms_norm_eps must be a number, got a string \('1e-5'\)"),
    (dict(num_hidden_layers="4"), r"config\.json: num_hidden_layers must be an integer, got a string"),
    (dict(linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], num_heads="2")),
     r"linear_attn_config\.num_heads must be an integer, got a string \('2'\)"),
    (dict(linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], gate_lower_bound="-5")),
     r"linear_attn_config\.gate_lower_bound must be a number or null, got a string"),
    (dict(linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], use_full_rank_gate=1)),
     r"linear_attn_config\.use_full_rank_gate must be a boolean"),
    (dict(linear_attn_config=[1, 2]), r"linear_attn_config must be an object, got a list"),
])
def test_kimi_config_values_of_the_wrong_type_are_refused(tmp_path, change, want):
    (tmp_path / "config.json").write_text(json.dumps(dict(KIMI_CONFIG, **change)))
    with pytest.raises(TypeError, match=want):
        read_config(tmp_path)


def test_float64_without_x64_is_refused_first(tmp_path, no_reads):
    _, folder = fla_checkpoint(tmp_path / "fla")
    jax.config.update("jax_enable_x64", False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an error, not JAX's warning per array
            with pytest.raises(ValueError, match=r"param_dtype=float64 needs JAX's 64-bit mode.*jax_enable_x64"):
                KimiDeltaAttention.from_pretrained(folder, layer_idx=0, param_dtype=jnp.float64)
            with pytest.raises(ValueError, match=r"dtype=float64 needs JAX's 64-bit mode"):
                load_pretrained(folder, dtype="float64")
            with pytest.raises(ValueError, match=r"param_dtype=float64 needs JAX's 64-bit mode"):
                KimiDeltaAttention(D, H, K, key=jax.random.key(0), param_dtype=jnp.float64)
            with pytest.raises(TypeError, match=r"param_dtype: expected a floating-point dtype .* got int32"):
                KimiDeltaAttention.from_pretrained(folder, layer_idx=0, param_dtype=jnp.int32)
    finally:
        jax.config.update("jax_enable_x64", True)


# ---- Kimi K3's linear_attn_config: gate_lower_bound and use_full_rank_gate --------------------------------------
#
# Moonshot's modeling_kimi_linear.py (moonshotai/Kimi-K3), KimiDeltaAttention:
#   gate_lower_bound = linear_attn_config.get("gate_lower_bound", None), passed to FLA as
#     chunk_kda(..., use_gate_in_kernel=True, safe_gate=gate_lower_bound is not None, lower_bound=gate_lower_bound)
#     and fused_recurrent_kda(..., lower_bound=gate_lower_bound): g = lb * sigmoid(exp(A_log) * (f + dt_bias));
#   use_full_rank_gate: g_proj = nn.Linear(hidden, num_heads * head_dim, bias=False) in place of g_a_proj/g_b_proj,
#     o = o_norm(o, g_proj(x)) (FusedRMSNormGated, sigmoid);
#   A_log: nn.Parameter of shape [num_heads]; dt_bias [num_heads * head_dim].
# The config is nested: model_type "kimi_k3", the language model's config in text_config; the weights are under
# language_model.model.layers.{i}.self_attn.


def k3_checkpoint(folder, lower_bound=-5.0, full_rank=True, shards=1):
    """A tiny Kimi K3 checkpoint made by the published modelling code's conventions (names,
    shapes, bf16 projections, float32 A_log/dt_bias), written with numpy alone; layers 0,
    1 KDA, layer 2 MLA. Returns ``{layer: float64 state dict without prefix}``."""
    r = np.random.default_rng(7)
    P, W = H * K, 4
    lac = dict(kda_layers=[1, 2], full_attn_layers=[3], num_heads=H, head_dim=K, short_conv_kernel_size=W)
    if lower_bound is not None:
        lac["gate_lower_bound"] = lower_bound
    if full_rank:
        lac["use_full_rank_gate"] = True
    config = dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"],
                  text_config=dict(model_type="kimi_linear", hidden_size=D, num_hidden_layers=3, rms_norm_eps=1e-5,
                                   linear_attn_config=lac, mla_use_output_gate=True),
                  vision_config=dict(hidden_size=16))
    bf = lambda a: a.astype(ml_dtypes.bfloat16)
    tensors, layers = {"language_model.model.embed_tokens.weight": bf(r.normal(size=(50, D)))}, {}
    for i in (0, 1):
        sd = {"q_proj.weight": r.normal(size=(P, D)) / np.sqrt(D), "k_proj.weight": r.normal(size=(P, D)) / np.sqrt(D),
              "v_proj.weight": r.normal(size=(P, D)) / np.sqrt(D),
              "q_conv1d.weight": r.normal(size=(P, 1, W)) / 2, "k_conv1d.weight": r.normal(size=(P, 1, W)) / 2,
              "v_conv1d.weight": r.normal(size=(P, 1, W)) / 2,
              "A_log": np.log(r.uniform(1, 16, size=H)), "f_a_proj.weight": r.normal(size=(K, D)) / np.sqrt(D),
              "f_b_proj.weight": r.normal(size=(P, K)) / np.sqrt(K), "dt_bias": r.normal(size=P),
              "b_proj.weight": r.normal(size=(H, D)) / np.sqrt(D), "o_norm.weight": r.uniform(0.5, 1.5, size=K),
              "o_proj.weight": r.normal(size=(D, P)) / np.sqrt(P)}
        if full_rank:
            sd["g_proj.weight"] = r.normal(size=(P, D)) / np.sqrt(D)
        else:
            sd["g_a_proj.weight"] = r.normal(size=(K, D)) / np.sqrt(D)
            sd["g_b_proj.weight"] = r.normal(size=(P, K)) / np.sqrt(K)
        stored = {n: (a.astype(np.float32) if n in ("A_log", "dt_bias") else bf(a)) for n, a in sd.items()}
        tensors.update({f"language_model.model.layers.{i}.self_attn.{n}": a for n, a in stored.items()})
        tensors[f"language_model.model.layers.{i}.input_layernorm.weight"] = bf(np.ones(D))
        layers[i] = {n: np.asarray(a, np.float64) for n, a in stored.items()}
    # the MLA layer (q-LoRA, gated output): other names, and its own g_proj
    for n, shp in (("q_a_proj", (16, D)), ("q_b_proj", (32, 16)), ("kv_a_proj_with_mqa", (16, D)),
                   ("g_proj", (32, D)), ("o_proj", (D, 32))):
        tensors[f"language_model.model.layers.2.self_attn.{n}.weight"] = bf(r.normal(size=shp))
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = bf(r.normal(size=(48, 16)))
    write_checkpoint(folder, config, tensors, shards)
    return layers


@pytest.mark.parametrize("lower_bound,full_rank", [(-5.0, True), (-5.0, False), (None, True), (-2.5, True)])
def test_kimi_k3_layers_equal_the_published_formula(tmp_path, lower_bound, full_rank):
    sds = k3_checkpoint(tmp_path / "k3", lower_bound, full_rank, shards=2)
    cfg = read_config(tmp_path / "k3")
    assert cfg.kda_layers == (0, 1) and cfg.format == "moonshot"
    assert cfg.layer_options["lower_bound"] == lower_bound
    assert cfg.layer_options["safe_gate"] == (lower_bound is not None)
    assert cfg.layer_options["use_full_rank_gate"] == full_rank
    every = load_pretrained(tmp_path / "k3", param_dtype=jnp.float64)
    assert sorted(every) == [0, 1]
    x = np.random.default_rng(5).normal(size=(2, 11, D))
    for i, layer in every.items():
        assert (layer.g_proj is not None) == full_rank and layer.g_b_bias is None
        assert layer.lower_bound == lower_bound and layer.safe_gate == (lower_bound is not None)
        ref, _ = numpy_layer(sds[i], x, naming="moonshot", num_heads=H, head_dim=K, norm_eps=1e-5,
                             lower_bound=lower_bound)
        for mode in ("recurrent", "chunk"):
            y, _ = jax.jit(lambda l, x: l(x, mode=mode, chunk_size=16))(layer, jnp.asarray(x))
            assert_close(y, ref, 1e-12, f"K3 layer {i}, {mode}, lower_bound={lower_bound}, full_rank={full_rank}")


def test_kimi_k3_gate_bound_and_full_rank_gate_change_the_output(tmp_path):
    sds = k3_checkpoint(tmp_path / "k3")
    x = np.random.default_rng(5).normal(size=(1, 9, D))
    ref, _ = numpy_layer(sds[0], x, naming="moonshot", num_heads=H, head_dim=K, norm_eps=1e-5, lower_bound=-5.0)
    softplus, _ = numpy_layer(sds[0], x, naming="moonshot", num_heads=H, head_dim=K, norm_eps=1e-5)
    assert np.abs(softplus - ref).max() > 1e-3 * np.abs(ref).max()
    layer = KimiDeltaAttention.from_pretrained(tmp_path / "k3", layer_idx=0, param_dtype=jnp.float64)
    y, _ = layer(jnp.asarray(x))
    assert_close(y, ref, 1e-12, "K3 layer 0")


def test_kimi_k3_state_dicts_round_trip_and_refusals(tmp_path):
    layer = KimiDeltaAttention(D, H, K, key=jax.random.key(3), use_full_rank_gate=True, lower_bound=-5.0,
                               safe_gate=True, norm_eps=1e-5)
    assert layer.g_proj.shape == (H * K, D) and layer.g_a is None and layer.g_b_bias is None
    sd = layer.state_dict("moonshot", prefix="p.")
    assert "p.g_proj.weight" in sd and not any("g_a_proj" in k or "g_b_proj" in k for k in sd)
    back = KimiDeltaAttention.from_state_dict(sd, prefix="p.", num_heads=H, head_dim=K, norm_eps=1e-5,
                                              allow_neg_eigval=False, lower_bound=-5.0, safe_gate=True)
    assert same(back, layer)
    # A_log as Kimi K3's code declares it, [num_heads], or as Kimi Linear stores it, [1, 1, HV, 1]
    flat = dict(sd, **{"p.A_log": sd["p.A_log"].reshape(H)})
    assert same(KimiDeltaAttention.from_state_dict(flat, prefix="p.", num_heads=H, head_dim=K, norm_eps=1e-5,
                                                   allow_neg_eigval=False, lower_bound=-5.0, safe_gate=True), layer)
    with pytest.raises(ValueError, match=r"use_full_rank_gate: Kimi K3's full-rank output gate .* Moonshot's names "
                                         r"only"):
        layer.state_dict("fla")
    with pytest.raises(ValueError, match=r"g_proj\.weight is Kimi K3's full-rank output gate: pass "
                                         r"use_full_rank_gate=True"):
        KimiDeltaAttention.from_state_dict(sd, prefix="p.", num_heads=H, head_dim=K, norm_eps=1e-5,
                                           allow_neg_eigval=False, lower_bound=-5.0, use_full_rank_gate=False)
    # config and tensors disagree: named before any read
    k3_checkpoint(tmp_path / "k3", full_rank=False)
    cfg = json.loads((tmp_path / "k3" / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["use_full_rank_gate"] = True
    (tmp_path / "k3" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"use_full_rank_gate is true, but layer 'language_model\.model\.layers\.0\."
                                         r"self_attn\.' has the low-rank output gate"):
        KimiDeltaAttention.from_pretrained(tmp_path / "k3", layer_idx=0)
    cfg["text_config"]["linear_attn_config"].update(use_full_rank_gate=False, gate_lower_bound=-8.0)
    (tmp_path / "k3" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_lower_bound must lie in \[-5, 0\).*got -8\.0"):
        read_config(tmp_path / "k3")
