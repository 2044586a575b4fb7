"""Weight naming: Moonshot (Kimi Linear) and FLA state dicts, round trips, errors, safetensors."""

import jax.numpy as jnp
import numpy as np
import pytest

from kdax.nn import KimiDeltaAttention, load_safetensors, weight_shapes

from ._oracle import random_state_dict

KW = dict(num_heads=2, head_dim=8)
HP = dict(norm_eps=1e-6, allow_neg_eigval=False, lower_bound=None)  # what a state dict does not record


@pytest.mark.parametrize("naming,hv", [("moonshot", 2), ("fla", 4)])
def test_round_trip_exact(naming, hv):
    sd = {k: v.astype(np.float32) for k, v in
          random_state_dict(naming, hidden_size=24, num_v_heads=hv, **KW).items()}
    layer = KimiDeltaAttention.from_state_dict(sd, naming=naming, **KW, **HP)
    assert layer.num_v_heads == hv and layer.hidden_size == 24 and layer.q_proj.dtype == jnp.float32
    out = layer.state_dict(naming)
    assert sorted(out) == sorted(sd)
    for k in sd:
        assert out[k].dtype == np.float32 and out[k].shape == sd[k].shape
        assert np.array_equal(out[k], sd[k]), k
    # and through the other naming (Moonshot has no output-gate bias, FLA writes it)
    other = "fla" if naming == "moonshot" else None
    if other:
        again = KimiDeltaAttention.from_state_dict(layer.state_dict(other), naming=other, **KW, **HP)
        assert np.all(again.g_b_bias == 0) and np.array_equal(again.state_dict("fla")["A_log"], sd["A_log"].reshape(-1))
    else:
        with pytest.raises(ValueError, match="no bias"):
            layer.state_dict("moonshot")


def test_moonshot_shapes_are_kimi_linears():
    s = weight_shapes("moonshot", num_heads=3, head_dim=4, hidden_size=10)
    assert s == {
        "q_proj.weight": (12, 10), "k_proj.weight": (12, 10), "v_proj.weight": (12, 10),
        "q_conv1d.weight": (12, 1, 4), "k_conv1d.weight": (12, 1, 4), "v_conv1d.weight": (12, 1, 4),
        "A_log": (1, 1, 3, 1), "dt_bias": (12,), "f_a_proj.weight": (4, 10), "f_b_proj.weight": (12, 4),
        "b_proj.weight": (3, 10), "g_a_proj.weight": (4, 10), "g_b_proj.weight": (12, 4),
        "o_norm.weight": (4,), "o_proj.weight": (10, 12),
    }


def test_bad_keys_name_every_offender():
    sd = random_state_dict("fla", hidden_size=24, num_v_heads=4, **KW)
    del sd["A_log"], sd["g_proj.1.bias"]
    sd["dt_bias"] = np.zeros(5)
    sd["o_proj.weight"] = np.zeros((24, 7))
    sd["rotary.inv_freq"] = np.zeros(3)
    sd["q_conv1d.bias"] = np.zeros(16)  # a bias on one convolution: conv_bias, the others' are missing
    with pytest.raises(ValueError) as e:
        KimiDeltaAttention.from_state_dict(sd, naming="fla", **KW, **HP)
    msg = str(e.value)
    for part in ("A_log (4,)", "g_proj.1.bias (32,)", "dt_bias: expected (32,), got (5,)",
                 "o_proj.weight: expected (24, 32), got (24, 7)", "rotary.inv_freq", "k_conv1d.bias (16,)",
                 "v_conv1d.bias (32,)"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="naming"):
        KimiDeltaAttention.from_state_dict(sd, naming="hf", **KW, **HP)


def test_prefix_and_safetensors(tmp_path):
    sd = {k: v.astype(np.float32) for k, v in random_state_dict("moonshot", hidden_size=16, **KW).items()}
    full = {"model.layers.3.self_attn." + k: v for k, v in sd.items()}
    full["model.embed_tokens.weight"] = np.zeros((5, 16), np.float32)  # other layers' keys are ignored
    layer = KimiDeltaAttention.from_state_dict(full, naming="moonshot", prefix="model.layers.3.self_attn.", **KW, **HP)
    assert np.array_equal(layer.state_dict("moonshot", prefix="p.")["p.o_proj.weight"], sd["o_proj.weight"])
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "kda.safetensors"
    st.save_file(full, str(path))
    assert sorted(load_safetensors(path)) == sorted(full)
    again = KimiDeltaAttention.from_state_dict(path, naming="moonshot", prefix="model.layers.3.self_attn.", **KW, **HP)
    for k, v in again.state_dict("moonshot").items():
        assert np.array_equal(v, sd[k]), k
