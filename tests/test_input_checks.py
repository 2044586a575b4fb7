"""A newcomer's traps (issue 50): g and beta outside KDA's domain raise under ``jit`` too,
FLA's head-first layout and float64 without x64 are named, unnormalised keys warned about,
shape errors given in one line."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import kdax

B, T, H, K = 1, 32, 2, 8


def _inputs(seed=0):
    r = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(r[0], (B, T, H, K))
    k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    v = jax.random.normal(r[2], (B, T, H, K))
    g = jax.random.normal(r[3], (B, T, H, K))  # what one tries first: half of it > 0
    beta = jax.random.normal(r[4], (B, T, H))
    return q, k, v, g, beta


def _good(g, beta):
    return jax.nn.log_sigmoid(g), jax.nn.sigmoid(beta)


def _jitted(fn, **opts):
    return jax.jit(lambda q, k, v, g, beta: fn(q, k, v, g, beta, **opts)[0])


FNS = [kdax.chunk_kda, kdax.fused_recurrent_kda]
IDS = ["chunk", "recurrent"]


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_bad_gate_under_jit_raises_naming_g(fn):
    q, k, v, g, beta = _inputs()
    _, good_beta = _good(g, beta)
    with pytest.raises(Exception, match=r"g: must be a log decay <= 0.*check_inputs=False"):
        jax.block_until_ready(_jitted(fn)(q, k, v, g, good_beta))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_bad_beta_under_jit_raises_naming_beta(fn):
    q, k, v, g, beta = _inputs()
    good_g, _ = _good(g, beta)
    with pytest.raises(Exception, match=r"beta: must lie in \[0, 1\].*check_inputs=False"):
        jax.block_until_ready(_jitted(fn)(q, k, v, good_g, beta))


def test_bad_inputs_under_jit_grad_raise():
    q, k, v, g, beta = _inputs()
    _, good_beta = _good(g, beta)
    step = jax.jit(jax.grad(lambda q, g: kdax.chunk_kda(q, k, v, g, good_beta)[0].sum(), argnums=(0, 1)))
    with pytest.raises(Exception, match=r"g: must be a log decay"):
        jax.block_until_ready(step(q, g))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_good_inputs_under_jit_unchanged_by_the_check(fn):
    """The check adds an error branch, not arithmetic: outputs bit for bit as without it."""
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    a = _jitted(fn)(q, k, v, g, beta)
    b = _jitted(fn, check_inputs=False)(q, k, v, g, beta)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(a)))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_check_inputs_false_skips_the_check_under_jit(fn):
    q, k, v, g, beta = _inputs()
    out = _jitted(fn, check_inputs=False)(q, k, v, g, jax.nn.sigmoid(beta))
    assert out.shape == v.shape  # (garbage, as documented: nothing checked)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_in_kernel_activations_take_raw_values_under_jit(fn):
    q, k, v, g, beta = _inputs()
    out = _jitted(fn, use_gate_in_kernel=True, A_log=jnp.zeros(H), use_beta_sigmoid_in_kernel=True)(q, k, v, g, beta)
    assert np.all(np.isfinite(np.asarray(out)))


def test_non_finite_values_are_isolation_not_domain_errors():
    """NaN/inf inputs stay in their own sequence (isolation); the domain check ignores them,
    eagerly and under jit alike, and -inf gates are exact forgets."""
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    g = g.at[0, 3, 0, 0].set(-jnp.inf)
    beta = beta.at[0, 5, 1].set(jnp.nan)
    eager = kdax.chunk_kda(q, k, v, g, beta)[0]
    jitted = _jitted(kdax.chunk_kda)(q, k, v, g, beta)
    np.testing.assert_array_equal(np.isnan(np.asarray(eager)), np.isnan(np.asarray(jitted)))


def test_sequence_parallel_under_jit_checks_inputs():
    """Inside shard_map (seq_axis_name) too: the flag is made the same on every device, and
    a bad value on one device only (the last) stops the call."""
    q, k, v, g, beta = _inputs()
    good_g, good_beta = _good(g, beta)
    bad_g = good_g.at[0, T - 1, 1, 3].set(0.5)
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    spec = jax.P(None, "sp")
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec))
    f = jax.jit(jax.shard_map(lambda q, k, v, g, b: kdax.chunk_kda(q, k, v, g, b, seq_axis_name="sp")[0],
                              mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    with pytest.raises(Exception, match=r"g: must be a log decay"):
        jax.block_until_ready(f(*map(put, (q, k, v, bad_g, good_beta))))
    ok = f(*map(put, (q, k, v, good_g, good_beta)))
    assert np.all(np.isfinite(np.asarray(ok)))


def test_head_first_layout_warns():
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    # FLA's old [B, H, T, K] with T=32 tokens, H=2 heads, passed as [B, T, H, K]:
    hf = lambda x: jnp.swapaxes(x, 1, 2)
    with pytest.warns(kdax.HeadFirstLayoutWarning, match=r"T=2 tokens < H=32 heads.*head-first layout \[B, H, T, K\]"):
        kdax.chunk_kda(hf(q), hf(k), hf(v), hf(g), hf(beta[..., None])[..., 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.HeadFirstLayoutWarning)
        kdax.chunk_kda(q, k, v, g, beta)  # T >= H: no warning


def test_float64_without_x64_warns():
    """In a fresh process with JAX's 64-bit mode off (the suite's is on)."""
    code = """
import warnings, numpy as np, jax, kdax
warnings.simplefilter("error", kdax.Float64Warning)
r = np.random.default_rng(0)
q = r.normal(size=(1, 32, 2, 8)); k = q / np.linalg.norm(q, axis=-1, keepdims=True)
g, b = -r.uniform(0.1, 1, size=q.shape), r.uniform(0.1, 0.9, size=(1, 32, 2))
for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
    try:
        fn(q, k, q, g, b)
    except kdax.Float64Warning as w:
        print(fn.__name__, "|", w)
    else:
        print(fn.__name__, "| no warning")
"""
    env = dict(os.environ, JAX_ENABLE_X64="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "q, k, v, g, beta: float64 inputs with JAX's 64-bit mode off compute in float32" in line, line


def test_unnormalised_keys_warn():
    q, _, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    k = q * 3.0  # |k|^2 ~ 72 at K = 8
    with pytest.warns(kdax.UnstableDeltaRuleWarning, match=r"k, beta: beta \* \|k\|\^2 reaches .* > 2"):
        kdax.chunk_kda(q, k, v, g, beta)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.UnstableDeltaRuleWarning)
        kdax.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)  # normalised in the kernel: no warning
        kdax.chunk_kda(q, q / jnp.linalg.norm(q, axis=-1, keepdims=True), v, g, beta)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("case, first_line", [
    ("beta axis", r"^beta: expected layout \[B, T, HV\]( or \[B, T, HV, V\])?, got shape \(1, 32, 3\): axis 2 \(HV\) is 3, expected 2 "
                  r"\(from the arguments before it: HV=2\)\.$"),
    ("beta rank", r"^beta: expected layout \[B, T, HV\]( or \[B, T, HV, V\])? \(3( or 4)? axes\), got shape \(1, 32\)\.$"),
    ("k tokens", r"^k: expected layout \[B, T, H, K\], got shape \(1, 31, 2, 8\): axis 1 \(T\) is 31, expected 32 "
                 r"\(from the arguments before it: T=32\)\.$"),
    ("g dtype", r"^g: expected a float array of layout \[B, T, HV, K\], got i32\[1, 32, 2, 8\]\.$"),
])
def test_shape_errors_in_one_line(fn, case, first_line):
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    if case == "beta axis":
        beta = jnp.ones((B, T, 3)) * 0.5
    elif case == "beta rank":
        beta = beta[..., 0]
    elif case == "k tokens":
        k = k[:, 1:]
    else:
        g = g.astype(jnp.int32)
    with pytest.raises(TypeCheckError) as err:
        fn(q, k, v, g, beta)
    lines = str(err.value).splitlines()
    assert lines[0] == lines[0].strip() and __import__("re").match(first_line, lines[0]), lines[0]
    assert "The current values for each jaxtyping axis annotation" in str(err.value)  # jaxtyping's detail kept
