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


# -- what a user coming from FLA or Hugging Face passes ------------------------------------

class FakeTensor:
    """The part of a torch.Tensor the loaders use (torch need not be installed):
    ``numpy()`` refuses while it requires grad and for bfloat16, as torch does."""

    def __init__(self, a, requires_grad=True, bf16=False):
        self.a, self.requires_grad, self.bf16 = a, requires_grad, bf16

    def detach(self):
        return FakeTensor(self.a, False, self.bf16)

    def cpu(self):
        return self

    def float(self):
        return FakeTensor(self.a.astype(np.float32), self.requires_grad)

    def numpy(self):
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        if self.bf16:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.a


class DLPackOnly:
    """An array from another framework that offers only the DLPack protocol."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, *args, **kwargs):
        return self.a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def fla_sd(seed=0):
    return {k: v.astype(np.float32) for k, v in
            random_state_dict("fla", hidden_size=24, num_v_heads=4, seed=seed, **KW).items()}


def test_torch_like_tensors_load_without_torch():
    sd = fla_sd()
    want = KimiDeltaAttention.from_state_dict(sd, **KW, **HP).state_dict("fla")
    # named_parameters() as it comes: every tensor requires grad
    got = KimiDeltaAttention.from_state_dict({k: FakeTensor(v) for k, v in sd.items()}, **KW, **HP).state_dict("fla")
    assert all(np.array_equal(got[k], want[k]) for k in want)
    # bfloat16 tensors: widened to float32 by .float(), exactly
    import ml_dtypes

    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in sd.items()}
    layer = KimiDeltaAttention.from_state_dict({k: FakeTensor(v, bf16=True) for k, v in rounded.items()}, **KW, **HP)
    assert layer.q_proj.dtype == jnp.float32
    assert all(np.array_equal(v, rounded[k]) for k, v in layer.state_dict("fla").items())
    # the DLPack protocol alone
    got = KimiDeltaAttention.from_state_dict({k: DLPackOnly(v) for k, v in sd.items()}, **KW, **HP).state_dict("fla")
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_from_state_dict_requires_what_a_state_dict_does_not_record():
    sd = fla_sd()
    with pytest.raises(TypeError) as e:
        KimiDeltaAttention.from_state_dict(sd, **KW)
    msg = str(e.value)
    for part in ("norm_eps", "allow_neg_eigval", "lower_bound", "1e-6", "1e-5", "from_pretrained"):
        assert part in msg, (part, msg)
    with pytest.raises(TypeError, match="pass lower_bound: a state dict"):
        KimiDeltaAttention.from_state_dict(sd, **KW, norm_eps=1e-6, allow_neg_eigval=False)
    layer = KimiDeltaAttention.from_state_dict(sd, **KW, norm_eps=1e-3, allow_neg_eigval=True, lower_bound=None)
    assert (layer.norm_eps, layer.allow_neg_eigval, layer.lower_bound) == (1e-3, True, None)


def test_naming_is_detected_from_the_keys():
    for naming in ("fla", "moonshot"):
        sd = random_state_dict(naming, hidden_size=24, **KW)
        layer = KimiDeltaAttention.from_state_dict(sd, **KW, **HP)  # no naming=
        assert (layer.g_b_bias is not None) == (naming == "fla")
    with pytest.raises(ValueError, match="The keys look like naming='fla'"):
        KimiDeltaAttention.from_state_dict(fla_sd(), naming="moonshot", **KW, **HP)
    with pytest.raises(ValueError, match="cannot tell from the keys.*naming='moonshot' or naming='fla'"):
        KimiDeltaAttention.from_state_dict({"q_proj.weight": np.zeros((16, 24))}, **KW, **HP)


@pytest.mark.parametrize("bad,what", [
    (lambda a: a.astype(np.int32), "expected real floating-point weights, got dtype int32"),
    (lambda a: a.astype(np.complex64), "expected real floating-point weights, got dtype complex64"),
    (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 3, np.nan, a), "the weights contain NaN or infinity"),
    (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 3, np.inf, a), "the weights contain NaN or infinity"),
])
def test_loaders_refuse_bad_weights_naming_the_key(bad, what):
    sd = {"model.layers.0.attn." + k: v for k, v in fla_sd().items()}
    sd["model.layers.0.attn.f_proj.1.weight"] = bad(sd["model.layers.0.attn.f_proj.1.weight"])
    with pytest.raises((TypeError, ValueError), match=r"model\.layers\.0\.attn\.f_proj\.1\.weight: " + what):
        KimiDeltaAttention.from_state_dict(sd, prefix="model.layers.0.attn.", **KW, **HP)


def test_fla_constructor_arguments():
    import jax

    key = jax.random.key(0)
    layer = KimiDeltaAttention(24, 2, 8, key=key, conv_bias=True, safe_gate=True, lower_bound=-5.0, layer_idx=7,
                               mode="fused_recurrent")
    assert layer.q_conv_bias.shape == (16,) and layer.v_conv_bias.shape == (16,)
    assert (layer.safe_gate, layer.layer_idx, layer.mode) == (True, 7, "recurrent")
    plain = KimiDeltaAttention(24, 2, 8, key=key)
    assert np.array_equal(plain.q_proj, layer.q_proj)  # conv_bias draws keys of its own
    with pytest.raises(ValueError, match="safe_gate: True needs lower_bound"):
        KimiDeltaAttention(24, 2, 8, key=key, safe_gate=True)
    with pytest.raises(ValueError, match="mode: expected 'chunk' or 'fused_recurrent'"):
        KimiDeltaAttention(24, 2, 8, key=key, mode="parallel")
    with pytest.raises(TypeError, match="unexpected argument.*use_output_gate.*from_pretrained"):
        KimiDeltaAttention(24, 2, 8, key=key, use_output_gate=True)
    # round trip of the convolution biases through FLA's names
    sd = layer.state_dict("fla")
    assert np.array_equal(sd["k_conv1d.bias"], layer.k_conv_bias)
    again = KimiDeltaAttention.from_state_dict(sd, **KW, norm_eps=1e-5, allow_neg_eigval=False, lower_bound=-5.0)
    assert np.array_equal(again.v_conv_bias, layer.v_conv_bias)


@pytest.mark.parametrize("build", [dict(), dict(gate_bias=False), dict(use_full_rank_gate=True)])
def test_default_naming_round_trips_a_default_layer(build):
    """``layer.state_dict()`` with the default naming on a layer built with defaults (issue
    39 item 7): FLA's names when the output gate has a bias (Kimi Linear's g_b_proj has
    none), Moonshot's otherwise; ``from_state_dict`` detects it and gives the layer back."""
    import jax

    layer = KimiDeltaAttention(24, key=jax.random.key(0), norm_eps=1e-5, **KW, **build)
    sd = layer.state_dict()
    assert ("g_proj.1.bias" in sd) == (layer.g_b_bias is not None)
    again = KimiDeltaAttention.from_state_dict(sd, **KW, norm_eps=1e-5, allow_neg_eigval=False, lower_bound=None)
    for k, v in again.state_dict().items():
        assert np.array_equal(v, sd[k]), k
    x = jax.random.normal(jax.random.key(1), (1, 8, 24))
    assert np.array_equal(layer(x)[0], again(x)[0])
