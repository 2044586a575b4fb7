"""Independent transcriptions of Kimi Linear's KDA layer forward (no kdax code).

``numpy_layer``: float64 numpy, from a state dict in either naming, token-by-token
recurrence. ``jnp_layer``: the same in jax.numpy on the layer's own fields (lax.scan
recurrence), differentiated by JAX autodiff as the gradient oracle.
"""

import jax
import jax.numpy as jnp
import numpy as np

L2_EPS = 1e-6  # FLA's in-kernel l2norm: x / sqrt(sum(x^2) + 1e-6)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def numpy_layer(sd, x, *, naming, num_heads, head_dim, norm_eps, allow_neg_eigval=False, lower_bound=None,
                cache=None):
    """Kimi Linear's layer forward on ``x [B, T, D]`` (Kimi K3's: ``lower_bound`` its
    ``gate_lower_bound``, the gate ``lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) +
    dt_bias))``; a ``g_proj.weight`` key its full-rank output gate). ``cache``: None (zero history) or
    a dict of numpy arrays ``conv_q, conv_k, conv_v [B, W - 1, C]`` (the inputs before
    x, oldest first) and ``state [B, HV, K, V]``. Returns ``(y, new cache dict)``."""
    B, T, D = x.shape
    H, K = num_heads, head_dim
    V = sd["o_norm.weight"].shape[0]
    HV = sd["b_proj.weight"].shape[0]
    fa, fb, ga, gb = (("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj") if naming == "moonshot"
                      else ("f_proj.0", "f_proj.1", "g_proj.0", "g_proj.1"))
    lin = lambda a, name: a @ sd[name + ".weight"].T

    new = {}

    def short_conv(a, w, name, bias):  # a [B, T, C], w [C, 1, W]: causal depthwise (+ bias), then SiLU
        W = w.shape[-1]
        hist = np.zeros((B, W - 1, a.shape[-1])) if cache is None else cache[name]
        padded = np.concatenate([hist, a], axis=1)
        new[name] = padded[:, -(W - 1):]
        out = sum(padded[:, i:i + T] * w[:, 0, i] for i in range(W))
        if bias is not None:  # nn.Conv1d's bias, before the activation
            out = out + bias
        return out * _sigmoid(out)

    conv = lambda p, name: short_conv(lin(x, p + "_proj"), sd[p + "_conv1d.weight"], name, sd.get(p + "_conv1d.bias"))
    q = conv("q", "conv_q").reshape(B, T, H, K)
    k = conv("k", "conv_k").reshape(B, T, H, K)
    v = conv("v", "conv_v").reshape(B, T, HV, V)
    graw = lin(lin(x, fa), fb).reshape(B, T, HV, K) + sd["dt_bias"].reshape(HV, K)
    A = np.exp(sd["A_log"].reshape(HV))[:, None]
    if lower_bound is None:
        g = -A * np.logaddexp(0.0, graw)  # softplus gate
    else:
        g = lower_bound * _sigmoid(A * graw)
    beta = _sigmoid(lin(x, "b_proj"))
    if allow_neg_eigval:
        beta = 2.0 * beta
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + L2_EPS)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + L2_EPS)
    q, k = np.repeat(q, HV // H, axis=2), np.repeat(k, HV // H, axis=2)  # value head i reads head i // (HV/H)
    scale = K ** -0.5
    S = np.zeros((B, HV, K, V)) if cache is None else np.array(cache["state"])
    o = np.zeros((B, T, HV, V))
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S
        err = v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * np.einsum("bhk,bhv->bhkv", k[:, t], err)
        o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    if naming == "moonshot" and "g_proj.weight" in sd:  # Kimi K3's full-rank output gate
        gate = lin(x, "g_proj").reshape(B, T, HV, V)
    else:
        gate = lin(lin(x, ga), gb).reshape(B, T, HV, V)
    if gb + ".bias" in sd:
        gate = gate + sd[gb + ".bias"].reshape(HV, V)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + norm_eps) * sd["o_norm.weight"] * _sigmoid(gate)
    new["state"] = S
    return o.reshape(B, T, HV * V) @ sd["o_proj.weight"].T, new


def jnp_layer(p, x, *, H, K, eps, allow_neg_eigval=False):
    """The layer in plain jax.numpy on a dict of the layer's fields (zero history)."""
    B, T, D = x.shape
    HV = p["b_proj"].shape[0]
    V = p["o_norm"].shape[0]
    lin = lambda a, w: a @ w.T

    def short_conv(a, w):  # w [C, W]
        W = w.shape[-1]
        padded = jnp.concatenate([jnp.zeros((B, W - 1, a.shape[-1]), a.dtype), a], axis=1)
        return jax.nn.silu(sum(padded[:, i:i + T] * w[:, i] for i in range(W)))

    q = short_conv(lin(x, p["q_proj"]), p["q_conv"]).reshape(B, T, H, K)
    k = short_conv(lin(x, p["k_proj"]), p["k_conv"]).reshape(B, T, H, K)
    v = short_conv(lin(x, p["v_proj"]), p["v_conv"]).reshape(B, T, HV, V)
    graw = lin(lin(x, p["f_a"]), p["f_b"]).reshape(B, T, HV, K) + p["dt_bias"].reshape(HV, K)
    g = -jnp.exp(p["A_log"])[:, None] * jax.nn.softplus(graw)
    beta = jax.nn.sigmoid(lin(x, p["b_proj"])) * (2.0 if allow_neg_eigval else 1.0)
    q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + L2_EPS)
    k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + L2_EPS)
    q, k = jnp.repeat(q, HV // H, axis=2), jnp.repeat(k, HV // H, axis=2)

    def step(S, inp):
        qt, kt, vt, gt, bt = inp
        S = jnp.exp(gt)[..., None] * S
        err = vt - jnp.einsum("bhkv,bhk->bhv", S, kt)
        S = S + bt[..., None, None] * jnp.einsum("bhk,bhv->bhkv", kt, err)
        return S, K ** -0.5 * jnp.einsum("bhkv,bhk->bhv", S, qt)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    _, o = jax.lax.scan(step, jnp.zeros((B, HV, K, V), x.dtype), xs)
    o = jnp.moveaxis(o, 0, 1)
    gate = lin(lin(x, p["g_a"]), p["g_b"]).reshape(B, T, HV, V) + p["g_b_bias"].reshape(HV, V)
    o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * p["o_norm"] * jax.nn.sigmoid(gate)
    return lin(o.reshape(B, T, HV * V), p["o_proj"])


def random_state_dict(naming, *, num_heads, head_dim, hidden_size, num_v_heads=None, head_v_dim=None,
                      conv_size=4, conv_bias=False, seed=0):
    """Random weights of realistic scale under ``naming``'s names and shapes (float64)."""
    from kdax.nn import weight_shapes

    r = np.random.default_rng(seed)
    shapes = weight_shapes(naming, num_heads=num_heads, head_dim=head_dim, hidden_size=hidden_size,
                           num_v_heads=num_v_heads, head_v_dim=head_v_dim, conv_size=conv_size,
                           conv_bias=conv_bias)
    sd = {}
    for name, s in shapes.items():
        if name == "A_log":
            sd[name] = np.log(r.uniform(1.0, 16.0, size=s))
        elif name == "dt_bias":
            sd[name] = r.normal(-3.0, 1.0, size=s)
        elif name == "o_norm.weight":
            sd[name] = r.uniform(0.5, 1.5, size=s)
        elif name.endswith("bias"):
            sd[name] = r.normal(size=s) * 0.5
        else:
            sd[name] = r.normal(size=s) / np.sqrt(s[-1])
    return sd
