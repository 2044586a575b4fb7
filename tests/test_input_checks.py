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

from ._util import one_device_env

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


def _one_device(code: str) -> str:
    """``code`` in a fresh process with one CPU device (the suite has 8 simulated ones) and
    JAX's defaults: its stdout; the process must exit cleanly."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=one_device_env(),
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


_RAISES = """
import re
import jax, jax.numpy as jnp, kdax
assert jax.device_count() == 1
r = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(r[0], (1, 32, 2, 8)); k = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
v = jax.random.normal(r[2], (1, 32, 2, 8)); g = jax.random.normal(r[3], (1, 32, 2, 8))
b = jax.random.normal(r[4], (1, 32, 2))
good_g, good_b = jax.nn.log_sigmoid(g), jax.nn.sigmoid(b)
cases = {
    "chunk g": lambda: jax.jit(lambda g: kdax.chunk_kda(q, k, v, g, good_b)[0])(g),
    "chunk beta": lambda: jax.jit(lambda b: kdax.chunk_kda(q, k, v, good_g, b)[0])(b),
    "recurrent g": lambda: jax.jit(lambda g: kdax.fused_recurrent_kda(q, k, v, g, good_b)[0])(g),
    "recurrent beta": lambda: jax.jit(lambda b: kdax.fused_recurrent_kda(q, k, v, good_g, b)[0])(b),
    "chunk grad g": lambda: jax.jit(jax.grad(lambda g: kdax.chunk_kda(q, k, v, g, good_b)[0].sum()))(g),
    "chunk off": lambda: jax.jit(lambda g: kdax.chunk_kda(q, k, v, g, good_b, check_inputs=False)[0])(g),
    # The check rides on the outputs' and gradients' NaN masks (kdax._validate.domain_flag):
    # whichever output a program keeps, it stays.
    "chunk final only": lambda: jax.jit(lambda g: kdax.chunk_kda(q, k, v, g, good_b, output_final_state=True)[1])(g),
    "chunk grad final": lambda: jax.jit(jax.grad(
        lambda b: kdax.chunk_kda(q, k, v, good_g, b, output_final_state=True)[1].sum()))(b),
    "chunk packed g": lambda: jax.jit(lambda g: kdax.chunk_kda(q, k, v, g, good_b, cu_seqlens=jnp.array([0, 9, 32]))[0])(g),
}
for name, f in cases.items():
    try:
        jax.block_until_ready(f())
        print(name, "| no error")
    except Exception as e:
        m = re.search(r"((?:g|beta): must[^\\n]*)", str(e))
        print(name, "|", m.group(1) if m else "other: " + type(e).__name__)
"""


def test_bad_inputs_under_jit_raise_naming_the_argument():
    """One device: g and beta outside their domain under jit (forward, gradient, both
    front doors) raise a runtime error naming the argument; check_inputs=False does not."""
    got = dict(line.split(" | ", 1) for line in _one_device(_RAISES).strip().splitlines())
    for name in ("chunk g", "recurrent g", "chunk grad g", "chunk final only", "chunk packed g"):
        assert got[name].startswith("g: must be a log decay <= 0") and "check_inputs=False" in got[name], got
    for name in ("chunk beta", "recurrent beta", "chunk grad final"):
        assert got[name].startswith("beta: must lie in [0, 1]") and "check_inputs=False" in got[name], got
    assert got["chunk off"] == "no error"


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_bad_inputs_under_jit_with_several_devices_are_nan_in_their_sequence(fn):
    """Several devices (the suite's 8): an error raised on one device would abort the
    process while the others wait, so each out-of-domain value is read as NaN, kept in its
    own sequence: the bad row NaN from the bad token on, the other row exactly as if the
    bad value were never there."""
    assert jax.device_count() > 1
    q, k, v, g, beta = (jnp.concatenate([x, x], 0) for x in _inputs())
    g, beta = _good(g, beta)
    bad_g = g.at[1, 9, 0, 2].set(0.7)
    out = np.asarray(_jitted(fn)(q, k, v, bad_g, beta))
    clean = np.asarray(_jitted(fn)(q, k, v, g, beta))
    np.testing.assert_array_equal(out[0], clean[0])
    assert np.all(np.isfinite(out[1, :9])) and np.all(np.isnan(out[1, 9:, 0]))
    bad_beta = beta.at[0, 20, 1].set(1.5)
    out = np.asarray(_jitted(fn)(q, k, v, g, bad_beta))
    np.testing.assert_array_equal(out[1], clean[1])
    assert np.all(np.isnan(out[0, 20:, 1])) and np.all(np.isfinite(out[0, :20]))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_traced_offsets_in_a_program_over_several_devices_are_nan(fn):
    """cu_seqlens traced in a program partitioned over a mesh (Auto axes, ``jax.set_mesh``):
    the in-program error's callback ran on one device while the others waited at a
    collective, and the process aborted after 40 s; now invalid offsets make every output
    NaN, and valid ones give the one-device numbers."""
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    mesh = jax.make_mesh((2,), ("h",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    f = jax.jit(lambda q, k, v, g, beta, cu: fn(q, k, v, g, beta, cu_seqlens=cu)[0])
    ok, bad = jnp.asarray([0, 5, T], jnp.int32), jnp.asarray([0, 5, T - 2], jnp.int32)
    want = np.asarray(f(q, k, v, g, beta, ok))
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "h")))
    with jax.set_mesh(mesh):
        args = [put(x) for x in (q, k, v, g, beta)]
        got, nan = np.asarray(f(*args, ok)), np.asarray(f(*args, bad))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.all(np.isnan(nan))


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
    """check_inputs=False leaves the values as they are (the suite's 8 devices: the check
    would read each bad value as NaN): the program is the algorithm on the raw g, no NaN
    of the check's, and fewer comparisons traced than with the check."""
    q, k, v, g, beta = _inputs()
    beta = jax.nn.sigmoid(beta)
    g = jnp.clip(g, -4.0, 0.05)  # a few small positive log decays: finite garbage, no overflow
    assert jax.device_count() > 1 and bool(jnp.any(g > 0))
    off = np.asarray(_jitted(fn, check_inputs=False)(q, k, v, g, beta))
    on = np.asarray(_jitted(fn)(q, k, v, g, beta))
    assert np.all(np.isfinite(off)) and np.any(np.isnan(on))
    count = lambda check: str(jax.make_jaxpr(lambda g: fn(q, k, v, g, beta, check_inputs=check)[0])(g)).count(" gt ")
    assert count(False) < count(True)


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
    # No finite beta at all (eagerly this once read as a domain error "got -inf"): isolation too.
    nan_beta = jnp.full_like(beta, jnp.nan)
    eager = kdax.chunk_kda(q, k, v, g, nan_beta)[0]
    assert np.all(np.isnan(np.asarray(eager)))
    jitted = _jitted(kdax.chunk_kda)(q, k, v, g, nan_beta)
    np.testing.assert_array_equal(np.isnan(np.asarray(eager)), np.isnan(np.asarray(jitted)))


def test_inside_shard_map_bad_values_are_nan_in_their_sequence():
    """Inside shard_map (sequence parallel) too: the bad value read as NaN on its device,
    its sequence NaN from there on across the devices, no collective added; eager calls
    still raise."""
    q, k, v, g, beta = _inputs()
    good_g, good_beta = _good(g, beta)
    bad_g = good_g.at[0, 12, 1, 3].set(0.5)
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    spec = jax.P(None, "sp")
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec))
    f = jax.jit(jax.shard_map(lambda q, k, v, g, b: kdax.chunk_kda(q, k, v, g, b, seq_axis_name="sp")[0],
                              mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    out = np.asarray(f(*map(put, (q, k, v, bad_g, good_beta))))
    assert np.all(np.isfinite(out[0, :12])) and np.all(np.isnan(out[0, 12:, 1]))
    assert np.all(np.isfinite(np.asarray(f(*map(put, (q, k, v, good_g, good_beta))))))
    with pytest.raises(ValueError, match=r"g: must be a log decay"):
        kdax.parallel.chunk_kda(mesh, "sp", q, k, v, bad_g, good_beta)


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


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("kw, first_line", [
    (dict(scale="1"), "scale: expected a real number or a 0-d real array or None, got str '1'."),
    (dict(output_final_state=1), "output_final_state: expected bool, got int 1."),
    (dict(lower_bound="-5"), "lower_bound: expected a real number or a 0-d real array or None, got str '-5'."),
    (dict(cu_seqlens={0: 32}), "cu_seqlens: expected an integer array [N1] or list or tuple or None, got dict {0: 32}."),
])
def test_non_array_argument_errors_in_one_line(fn, kw, first_line):
    """An argument of the wrong Python type (not an array of the wrong shape) is named on
    the first line with what it takes and what it got, before jaxtyping's report."""
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    with pytest.raises(TypeCheckError) as err:
        fn(q, k, v, g, beta, **kw)
    assert str(err.value).splitlines()[0] == first_line
    assert "Called with parameters" in str(err.value)  # jaxtyping's detail kept


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_numbers_and_offsets_in_any_real_or_integer_type(fn):
    """``lower_bound`` as a numpy or 0-d JAX scalar (as ``scale`` takes it) and ``cu_seqlens``
    in an unsigned type run as the Python values do, to the bit (both were refused)."""
    q, k, v, g, beta = _inputs()
    q, k, v, g, beta = (x[:1] for x in (q, k, v, g, jax.nn.sigmoid(beta)))  # (g: the raw gate)
    kw = dict(use_gate_in_kernel=True, A_log=jnp.zeros(v.shape[2]))
    want = fn(q, k, v, g, beta, lower_bound=-2.0, cu_seqlens=[0, 5, q.shape[1]], **kw)[0]
    for lb in (np.float32(-2.0), jnp.asarray(-2.0)):
        for cu in (np.array([0, 5, q.shape[1]], np.uint8), jnp.array([0, 5, q.shape[1]], jnp.uint32)):
            np.testing.assert_array_equal(fn(q, k, v, g, beta, lower_bound=lb, cu_seqlens=cu, **kw)[0], want)
    with pytest.raises(TypeError, match=r"^lower_bound: must be a concrete number"):
        jax.jit(lambda lb: fn(q, k, v, g, beta, lower_bound=lb, **kw))(-2.0)


def test_wrong_pipeline_type_is_named():
    q, k, v, g, beta = _inputs()
    g, beta = _good(g, beta)
    with pytest.raises(TypeCheckError, match=r"^pipeline: expected KDAPipeline or None, got str 'reference'\."):
        kdax.chunk_kda(q, k, v, g, beta, pipeline="reference")


def test_stage_inputs_refuses_inputs_out_of_their_domain():
    """``kdax.stage_inputs`` raises the front door's errors before any stage runs (a version
    compiled as one program returned stage arguments for a positive ``g``: its in-program
    check, off the recorded arrays' path, was dead code)."""
    q, k, v, g, beta = _inputs()
    good_g, good_beta = _good(g, beta)
    pipe = kdax.KDAPipeline.reference()
    with pytest.raises(ValueError, match=r"^g: must be a log decay <= 0"):
        kdax.stage_inputs(pipe, q, k, v, jnp.abs(g), good_beta, chunk_size=16)
    with pytest.raises(ValueError, match=r"^beta: must lie in \[0, 1\]"):
        kdax.stage_inputs(pipe, q, k, v, good_g, beta, chunk_size=16)
