"""config.json's values range-checked by name (issue 50): every value ``read_config`` reads
is in its range or a ``ValueError`` names the key, the value and the range; a config saved
with a UTF-8 byte-order mark reads; the A_log shape error lists every accepted shape."""

import json

import numpy as np
import pytest

from kdax.nn import KimiDeltaAttention, read_config

from ._oracle import random_state_dict
from .test_pretrained import FLA_CONFIG, KIMI_CONFIG, fla_checkpoint, same

NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN / Infinity, which json.loads (and HF) read


def write(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def lac(**change):
    return dict(KIMI_CONFIG, linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], **change))


# FLA_CONFIG: hidden_size 24, num_heads 2, head_dim 8, num_v_heads 4, num_hidden_layers 3, attn layers [1].
@pytest.mark.parametrize("change,want", [
    (dict(norm_eps=-1e-5), r"norm_eps must be a finite number > 0, got -1e-05\."),
    (dict(norm_eps=0.0), r"norm_eps must be a finite number > 0, got 0\.0\."),
    (dict(norm_eps=NAN), r"norm_eps must be a finite number > 0, got nan\."),
    (dict(norm_eps=INF), r"norm_eps must be a finite number > 0, got inf\."),
    (dict(hidden_size=0), r"hidden_size must be an integer >= 1, got 0\."),
    (dict(num_heads=0), r"num_heads must be an integer >= 1, got 0\."),
    (dict(num_heads=-2), r"num_heads must be an integer >= 1, got -2\."),
    (dict(head_dim=0), r"head_dim must be an integer >= 1, got 0\."),
    (dict(num_hidden_layers=0), r"num_hidden_layers must be an integer >= 1, got 0\."),
    (dict(conv_size=1), r"conv_size must be an integer >= 2, got 1\."),
    (dict(num_v_heads=3), r"num_v_heads must be null or a positive multiple of num_heads = 2 .*, got 3\."),
    (dict(num_v_heads=0), r"num_v_heads must be null or a positive multiple of num_heads = 2 .*, got 0\."),
    (dict(expand_v=0), r"expand_v must be a number > 0 with head_dim \* expand_v a whole number \(head_dim = 8\), "
                       r"got 0\."),
    (dict(expand_v=0.3), r"expand_v must be .*, got 0\.3\."),
    (dict(expand_v=NAN), r"expand_v must be .*, got nan\."),
    (dict(lower_bound=0.5), r"lower_bound must be a finite number < 0 .*, got 0\.5\."),
    (dict(lower_bound=-INF), r"lower_bound must be a finite number < 0 .*, got -inf\."),
    (dict(safe_gate=True, lower_bound=-8.0), r"lower_bound must lie in \[-5, 0\) \(safe_gate is true.*got -8\.0\."),
    (dict(safe_gate=True, lower_bound=NAN), r"lower_bound must lie in \[-5, 0\) .*got nan\."),
    (dict(safe_gate=True), r"safe_gate is true, which needs lower_bound"),
    (dict(attn={"layers": [3]}), r"attn\.layers must hold 0-based layer indices in 0\.\.2 \(num_hidden_layers = 3\), "
                                 r"got \[3\] \(out of range: \[3\]\)\."),
    (dict(attn={"layers": [-1]}), r"attn\.layers must hold 0-based layer indices in 0\.\.2 .*out of range: \[-1\]"),
    (dict(attn=[{"layers": [1]}, {"layers": [1]}]), r"attn\.layers must hold each layer index once, got \[1, 1\] "
                                                    r"\(repeated: \[1\]\)\."),
])
def test_fla_config_values_out_of_range_are_named(tmp_path, change, want):
    write(tmp_path, dict(FLA_CONFIG, **change))
    with pytest.raises(ValueError, match=r"config\.json: " + want):
        read_config(tmp_path)


@pytest.mark.parametrize("change,want", [
    (dict(hidden_size=0), r"hidden_size, num_heads, head_dim, num_v_heads and head_dim \* expand_v must be positive "
                          r"integers, got 0, 2, 8, 2, 8\.0\."),
    (dict(num_heads=0), r"hidden_size, .* must be positive integers, got 24, 0, 8, 0, 8\.0\."),
    (dict(expand_v=0.3), r"hidden_size, .* must be positive integers, got 24, 2, 8, 2, 2\.4\."),
    (dict(num_v_heads=3), r"num_v_heads=3 must be a multiple of num_heads=2\."),
    (dict(conv_size=1), r"conv_size must be >= 2, got 1\."),
    (dict(norm_eps=-1e-5), r"norm_eps: must be a finite number > 0 \(the output norm's epsilon\), got -1e-05\."),
    (dict(norm_eps=0.0), r"norm_eps: must be a finite number > 0 .*, got 0\.0\."),
    (dict(norm_eps=NAN), r"norm_eps: must be a finite number > 0 .*, got nan\."),
    (dict(norm_eps="1e-5"), r"norm_eps: must be a finite number > 0 .*, got '1e-5'\."),
    (dict(lower_bound=0.5), r"lower_bound: must be a number < 0 .*, got 0\.5\."),
    (dict(lower_bound=NAN), r"lower_bound: must be a number < 0 .*, got nan\."),
    (dict(lower_bound="-5"), r"lower_bound: must be a number < 0 .*, got '-5'\."),
    (dict(safe_gate=True, lower_bound=-8.0), r"lower_bound: safe_gate=True needs -5 <= lower_bound < 0 \(as FLA\), "
                                             r"got -8\.0\."),
    (dict(safe_gate=True), r"safe_gate: True needs lower_bound"),
    (dict(mode="parallel"), r"mode: expected 'chunk' or 'fused_recurrent', got 'parallel'\."),
])
def test_constructor_arguments_out_of_range_are_named(change, want):
    """``KimiDeltaAttention(...)``'s arguments, checked when the layer is built (``norm_eps``
    in ``read_config``'s range; ``lower_bound`` as ``chunk_kda`` takes it, -inf included): a
    negative ``norm_eps`` built a layer whose every output was NaN, a positive ``lower_bound``
    one that failed at its first call."""
    import jax

    args = dict(dict(hidden_size=24, num_heads=2, head_dim=8), **change)
    with pytest.raises(ValueError, match="^" + want):
        KimiDeltaAttention(**args, key=jax.random.key(0))



@pytest.mark.parametrize("change,name", [
    (dict(num_heads=2.0), "num_heads"), (dict(hidden_size=24.0), "hidden_size"), (dict(conv_size=2.5), "conv_size"),
    (dict(conv_size=4.0), "conv_size"), (dict(num_v_heads=4.0), "num_v_heads"), (dict(head_dim="8"), "head_dim"),
    (dict(num_heads=True), "num_heads"), (dict(expand_v="1"), "expand_v"),
])
def test_constructor_sizes_of_another_type_are_named(change, name):
    """A float size (FLA's positional order, expand_v second, gives one) reached JAX's
    "Shapes must be 1D sequences of concrete values of integer type"; a string size
    Python's "can't multiply sequence". Numpy integers are sizes."""
    import jax

    args = dict(dict(hidden_size=24, num_heads=2, head_dim=8), **change)
    with pytest.raises(TypeError, match=f"^{name}: expected "):
        KimiDeltaAttention(**args, key=jax.random.key(0))
    layer = KimiDeltaAttention(np.int64(24), np.int32(2), np.int16(8), key=jax.random.key(0), conv_size=np.int8(3))
    assert (layer.hidden_size, layer.num_heads, layer.head_dim, layer.conv_size) == (24, 2, 8, 3)
    assert all(type(n) is int for n in (layer.hidden_size, layer.num_heads, layer.head_dim, layer.conv_size))


# KIMI_CONFIG: num_hidden_layers 4, kda_layers [1, 2, 4] (1-based), full_attn_layers [3], rms_norm_eps 1e-4.
@pytest.mark.parametrize("change,want", [
    (dict(rms_norm_eps=-1e-5), r"rms_norm_eps must be a finite number > 0, got -1e-05\."),
    (dict(rms_norm_eps=0), r"rms_norm_eps must be a finite number > 0, got 0\."),
    (dict(rms_norm_eps=NAN), r"rms_norm_eps must be a finite number > 0, got nan\."),
    (dict(rms_norm_eps=INF), r"rms_norm_eps must be a finite number > 0, got inf\."),
    (dict(hidden_size=0), r"hidden_size must be an integer >= 1, got 0\."),
    (dict(num_hidden_layers=0), r"num_hidden_layers must be an integer >= 1, got 0\."),
    (lac(num_heads=0), r"linear_attn_config\.num_heads must be an integer >= 1, got 0\."),
    (lac(head_dim=-8), r"linear_attn_config\.head_dim must be an integer >= 1, got -8\."),
    (lac(short_conv_kernel_size=1), r"linear_attn_config\.short_conv_kernel_size must be an integer >= 2, got 1\."),
    (lac(kda_layers=[0, 1, 2]), r"linear_attn_config\.kda_layers must hold 1-based layer indices in 1\.\.4 "
                                r"\(num_hidden_layers = 4\), got \[0, 1, 2\] \(out of range: \[0\]\)\."),
    (lac(kda_layers=[1, 2, 5]), r"linear_attn_config\.kda_layers must hold 1-based .*out of range: \[5\]"),
    (lac(kda_layers=[1, 2, 2]), r"linear_attn_config\.kda_layers must hold each layer index once, got \[1, 2, 2\] "
                                r"\(repeated: \[2\]\)\."),
    (lac(full_attn_layers=[5]), r"linear_attn_config\.full_attn_layers must hold 1-based .*out of range: \[5\]"),
    (lac(full_attn_layers=[3, 4]), r"linear_attn_config's kda_layers and full_attn_layers must not share a layer, "
                                   r"got \[4\] in both\."),
    (lac(gate_lower_bound=NAN), r"linear_attn_config\.gate_lower_bound must lie in \[-5, 0\) .*got nan\."),
    (lac(gate_lower_bound=0.0), r"linear_attn_config\.gate_lower_bound must lie in \[-5, 0\) .*got 0\.0\."),
])
def test_kimi_config_values_out_of_range_are_named(tmp_path, change, want):
    write(tmp_path, dict(KIMI_CONFIG, **change))
    with pytest.raises(ValueError, match=r"config\.json: " + want):
        read_config(tmp_path)


def test_kimi_k3_text_config_is_range_checked(tmp_path):
    """Kimi K3 nests the same keys in text_config: the error says so."""
    text = dict(lac(kda_layers=[0, 1]), num_hidden_layers=3)
    write(tmp_path, dict(model_type="kimi_k3", text_config=text))
    with pytest.raises(ValueError, match=r"config\.json: text_config: linear_attn_config\.kda_layers must hold "
                                         r"1-based layer indices in 1\.\.3 .*out of range: \[0\]"):
        read_config(tmp_path)


@pytest.mark.parametrize("key,value", [("allow_neg_eigval", "true"), ("safe_gate", 1), ("conv_bias", 0),
                                       ("use_short_conv", None)])
def test_fla_booleans_must_be_booleans(tmp_path, key, value):
    write(tmp_path, dict(FLA_CONFIG, **{key: value}))
    with pytest.raises(TypeError, match=rf"config\.json: {key} must be a boolean \(true or false\), got "):
        read_config(tmp_path)


def test_values_at_the_ends_of_their_ranges_read(tmp_path):
    """The checks refuse only what is out of range: the last layer, a tiny eps, grouped value
    heads, a lower bound of -5 with safe_gate, no full_attn_layers key."""
    kimi = lac(kda_layers=[4, 1], full_attn_layers=None)
    cfg = read_config(write(tmp_path / "kimi", dict(kimi, rms_norm_eps=1e-12)))
    assert cfg.kda_layers == (0, 3) and cfg.layer_options["norm_eps"] == 1e-12
    fla = dict(FLA_CONFIG, num_v_heads=6, expand_v=0.5, safe_gate=True, lower_bound=-5, attn={"layers": [0, 2]})
    cfg = read_config(write(tmp_path / "fla", fla))
    assert cfg.kda_layers == (1,)
    assert cfg.layer_options["lower_bound"] == -5.0 and cfg.layer_options["expand_v"] == 0.5


def test_config_json_with_a_byte_order_mark_reads(tmp_path):
    """An editor on Windows may save config.json with a UTF-8 BOM: it reads as without one,
    and the checkpoint loads."""
    for name, config in (("kimi", KIMI_CONFIG), ("fla", FLA_CONFIG)):
        plain, bom = write(tmp_path / name / "plain", config), tmp_path / name / "bom"
        bom.mkdir()
        (bom / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(config).encode("utf-8"))
        assert (bom / "config.json").read_bytes()[:3] == b"\xef\xbb\xbf"
        assert read_config(bom) == read_config(plain)
    layers, folder = fla_checkpoint(tmp_path / "ckpt")
    (folder / "config.json").write_bytes(b"\xef\xbb\xbf" + (folder / "config.json").read_bytes())
    assert same(KimiDeltaAttention.from_pretrained(folder, layer_idx=2), layers[2])


KW = dict(num_heads=2, head_dim=8)
HP = dict(norm_eps=1e-6, allow_neg_eigval=False, lower_bound=None)


def test_a_log_shape_error_lists_every_accepted_shape():
    """Moonshot's naming takes A_log as Kimi Linear stores it, [1, 1, HV, 1], or as Kimi K3
    declares it, [HV]: a wrong or missing A_log names both; FLA's takes [HV] alone."""
    sd = random_state_dict("moonshot", hidden_size=24, **KW)
    assert np.shape(sd["A_log"]) == (1, 1, 2, 1)  # Kimi Linear's layout
    for shape in ((1, 1, 2, 1), (2,)):  # both accepted
        layer = KimiDeltaAttention.from_state_dict(dict(sd, A_log=sd["A_log"].reshape(shape)), naming="moonshot",
                                                   **KW, **HP)
        assert np.array_equal(layer.A_log, sd["A_log"].reshape(2).astype(np.float32))
    with pytest.raises(ValueError, match=r"mis-shaped keys: A_log: expected \(1, 1, 2, 1\) or \(2,\), got \(3,\)"):
        KimiDeltaAttention.from_state_dict(dict(sd, A_log=np.zeros(3)), naming="moonshot", **KW, **HP)
    no_a = {k: v for k, v in sd.items() if k != "A_log"}
    with pytest.raises(ValueError, match=r"missing keys \(expected shape\): A_log \(1, 1, 2, 1\) or \(2,\)"):
        KimiDeltaAttention.from_state_dict(no_a, naming="moonshot", **KW, **HP)
    fla = random_state_dict("fla", hidden_size=24, **KW)
    with pytest.raises(ValueError, match=r"mis-shaped keys: A_log: expected \(2,\), got \(1, 1, 2, 1\)"):
        KimiDeltaAttention.from_state_dict(dict(fla, A_log=fla["A_log"].reshape(1, 1, 2, 1)), naming="fla", **KW,
                                           **HP)
