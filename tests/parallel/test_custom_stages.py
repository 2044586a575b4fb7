"""Custom stages in sequence parallel and under ``segmented`` (issue 49): exact against one
device (float64) or a named error, never silent; the forward under ``value_and_grad``
equals the plain forward bit for bit.

The cases a user met: an F5 of other math (``o + bias``) with B1-B3 declared as its
transposes (the training step added the bias twice); an F4 that is not affine in its entry
state (clips ``h0``); undeclared no-op wrappers of F1 (holding an array), F4 and F5 (the
backward derived by ``jax.vjp`` through the sequence-parallel forward)."""

import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import kdax
from kdax.stages import (
    KDA,
    AbstractDAv,
    AbstractDhu,
    AbstractGate,
    AbstractOutput,
    AbstractState,
    AbstractWYDqkg,
    ReferenceDAv,
    ReferenceDhu,
    ReferenceGate,
    ReferenceOutput,
    ReferenceState,
    ReferenceWYDqkg,
)
from tests._util import assert_close, make_inputs, split_args

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices: see tests/conftest.py")

BIAS = "kda+bias"


class BiasOutput(AbstractOutput):
    """F5 plus a constant: ``o + 0.25`` (other math, declared)."""

    math: ClassVar = BIAS

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new) + 0.25


class BiasDAv(AbstractDAv):
    transposes: ClassVar = MappingProxyType({"output": BIAS})

    def __call__(self, v_new, Aqk, do):
        return ReferenceDAv()(v_new, Aqk, do)


class BiasDhu(AbstractDhu):
    transposes: ClassVar = MappingProxyType({"output": BIAS, "state": KDA})

    def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout):
        return ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout)


class BiasWYDqkg(AbstractWYDqkg):
    transposes: ClassVar = MappingProxyType({"output": BIAS, "state": KDA, "wy": KDA})

    def __call__(self, scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new):
        return ReferenceWYDqkg()(scale, q, k, v, beta, G, Akk, qg, kg, h, dh, v_new, do, dv_new)


class ClippedState(AbstractState):
    """F4 from ``clip(h0, -0.2, 0.2)``: not affine in its entry state (undeclared math)."""

    def __call__(self, w, u, kg, G, h0, layout):
        return ReferenceState()(w, u, kg, G, jnp.clip(h0, -0.2, 0.2), layout)


class WrappedGate(AbstractGate):
    """An undeclared no-op wrapper of F1 holding an array (a user's hook)."""

    marker: Float[Array, " n"]

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class WrappedState(AbstractState):
    def __call__(self, w, u, kg, G, h0, layout):
        return ReferenceState()(w, u, kg, G, h0, layout)


class WrappedOutput(AbstractOutput):
    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


def _pipe(case):
    ref = kdax.KDAPipeline.reference().untiled()
    if case == "bias F5 with transposes":
        return eqx.tree_at(lambda p: (p.output, p.dav, p.dhu, p.wy_dqkg), ref,
                           (BiasOutput(), BiasDAv(), BiasDhu(), BiasWYDqkg()))
    if case == "non-affine F4":
        return eqx.tree_at(lambda p: p.state, ref, ClippedState())
    if case == "undeclared F1 wrapper":
        return eqx.tree_at(lambda p: p.gate, ref, WrappedGate(jnp.ones(3)))
    if case == "undeclared F4 wrapper":
        return eqx.tree_at(lambda p: p.state, ref, WrappedState())
    assert case == "undeclared F5 wrapper"
    return eqx.tree_at(lambda p: p.output, ref, WrappedOutput())


CASES = ["bias F5 with transposes", "undeclared F1 wrapper", "undeclared F5 wrapper"]


def _setup(packed):
    x = make_inputs(B=1 if packed else 2, T=64, H=2, K=8, V=8, N=3 if packed else None)
    pos, kw = split_args(x)
    opts = dict(chunk_size=16, initial_state=kw["initial_state"], output_final_state=True)
    if packed:
        opts["cu_seqlens"] = jnp.array([0, 5, 40, 64], jnp.int32)
    w = jax.random.normal(jax.random.key(3), pos[2].shape, jnp.float64)
    return pos, opts, w


def _loss(fn, pos, opts, w):
    """The loss's value, ``(o, final state)`` and gradients of q, k, v, g, beta and h0."""
    rest = {n: x for n, x in opts.items() if n != "initial_state"}

    def f(*a):
        o, ht = fn(*a[:5], initial_state=a[5], **rest)
        return jnp.sum(o * w) + jnp.sum(ht * jnp.cos(ht)), (o, ht)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))(*pos, opts["initial_state"])


@pytest.mark.filterwarnings("ignore::kdax.FallbackWarning")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_custom_stages_exact(case, packed):
    pos, opts, w = _setup(packed)
    pipe = _pipe(case)
    mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
    sp = lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, pipeline=pipe, **k)
    one = lambda *a, **k: kdax.chunk_kda(*a, pipeline=pipe, **k)
    (l_sp, (o_sp, ht_sp)), g_sp = _loss(sp, pos, opts, w)
    (l_one, (o_one, ht_one)), g_one = _loss(one, pos, opts, w)
    assert_close(o_sp, o_one, 1e-10, f"{case}: o under value_and_grad")
    assert_close(ht_sp, ht_one, 1e-10, f"{case}: final state")
    assert abs(float(l_sp) - float(l_one)) <= 1e-10 * max(1.0, abs(float(l_one)))
    # (dh0: the derived backward's was P times the true one, summed twice over the devices)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_sp, g_one):
        assert_close(a, b, 1e-10, f"{case}: {name}")
    # The forward under value_and_grad is the plain forward's route (the case: the
    # bias added twice, 0.6 off): equal to float64 rounding under this suite's XLA flags,
    # which fuse the forward's last sums differently when the loss's backward shares the
    # program (1 ulp in a few elements); bit for bit with XLA's defaults (the test below).
    o_plain, ht_plain = jax.jit(lambda *a: sp(*a, **opts))(*pos)
    assert_close(o_sp, o_plain, 1e-14, f"{case}: o, value_and_grad vs plain")
    assert_close(ht_sp, ht_plain, 1e-14, f"{case}: final state, value_and_grad vs plain")


@pytest.mark.filterwarnings("ignore::kdax.FallbackWarning")
@pytest.mark.parametrize("case", ["reference", "undeclared F5 wrapper"], ids=["six-stage", "derived"])
def test_sequence_parallel_bad_cotangent_as_one_device(case):
    """A NaN in ``do`` on device 2 of sequence 1 (tokens 5-39, devices 0-2): every gradient
    NaN where one device's is (that sequence's tokens up to it, on devices 0 and 1 too, and
    its dh0 head) and equal elsewhere. Before: the earlier devices' tokens and dh0 stayed
    finite, and the derived backward's dh0 was 4 times the true one (every device's marked
    copy of JAX's summed cotangent summed again)."""
    pos, opts, _ = _setup(True)
    pipe = kdax.KDAPipeline.reference().untiled() if case == "reference" else _pipe(case)
    mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
    h0 = opts.pop("initial_state")
    nan_at = np.zeros(pos[2].shape, bool)
    nan_at[0, 36, 1, 0] = True

    def grads(fn):
        def run(*a):
            (o, ht), vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], pipeline=pipe, **opts), *a)
            return vjp((jnp.where(nan_at, jnp.nan, jnp.ones_like(o)), jnp.cos(ht)))

        return jax.jit(run)(*pos, h0)

    g_sp = grads(lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, **k))
    g_one = grads(kdax.chunk_kda)
    bad = np.isnan(np.asarray(g_one[5]))
    assert bad[1, 1].all() and bad.sum() == bad[1, 1].size, "dh0: sequence 1's head 1 alone"
    assert np.isnan(np.asarray(g_one[1]))[0, 5:37, 1].all(), "dk: sequence 1 up to the bad token"
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_sp, g_one):
        nan = np.isnan(np.asarray(b))
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), nan, err_msg=f"{name}: where NaN")
        assert_close(jnp.where(nan, 0.0, a), jnp.where(nan, 0.0, b), 1e-10, f"{name} elsewhere")


_BIT_FOR_BIT = """
import os, sys
sys.path.insert(0, os.getcwd())
import jax, numpy as np, warnings
jax.config.update("jax_enable_x64", True)
warnings.simplefilter("ignore")
import kdax
from tests.parallel.test_custom_stages import CASES, _loss, _pipe, _setup
mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
for case in CASES:
    for packed in (False, True):
        pos, opts, w = _setup(packed)
        pipe = _pipe(case)
        sp = lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, pipeline=pipe, **k)
        (_, (o, ht)), _ = _loss(sp, pos, opts, w)
        o_plain, ht_plain = jax.jit(lambda *a: sp(*a, **opts))(*pos)
        same = np.array_equal(o, o_plain) and np.array_equal(ht, ht_plain)
        print(case, "packed" if packed else "dense", "equal" if same else "DIFFERENT")
"""


@pytest.mark.slow  # (a minute of XLA's full optimisation in a subprocess; the core checks 1e-14 above)
def test_sequence_parallel_value_and_grad_forward_bit_for_bit():
    # With XLA's default flags (a user's), the forward under value_and_grad is the plain
    # forward bit for bit, every case and layout above on 4 devices. (This suite's faster-
    # compiling flags, conftest.py, fuse the forward's last sums differently when the
    # backward shares the program: 1 ulp in a few elements, hence 1e-14 above.)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _BIT_FOR_BIT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 * len(CASES) and all(line.endswith(" equal") for line in lines), run.stdout


@pytest.mark.parametrize("case", ["non-affine F4", "undeclared F4 wrapper"])
def test_sequence_parallel_refuses_an_f4_of_undeclared_math(case):
    """An F4 that reads its entry state otherwise than KDA's (clips it) computes other
    numbers for each split, so no split is exact: a named error before anything runs,
    forward and gradient alike; declaring KDA's math on the wrapper makes it run, exact."""
    pos, opts, w = _setup(False)
    pipe = _pipe(case)
    name = type(pipe.state).__qualname__
    mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
    sp = lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, pipeline=pipe, **k)
    msg = rf"pipeline: sequence parallel .*F4 `state` \({name}\) declares math None.*math = kdax\.stages\.KDA"
    with pytest.raises(ValueError, match=msg):
        sp(*pos, **opts)
    with pytest.raises(ValueError, match=msg):
        _loss(sp, pos, opts, w)


def test_sequence_parallel_declared_f4_wrapper_exact():
    class DeclaredState(WrappedState):
        math: ClassVar = KDA

    pos, opts, w = _setup(True)
    pipe = eqx.tree_at(lambda p: p.state, kdax.KDAPipeline.reference().untiled(), DeclaredState())
    mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4])
    (l_sp, (o_sp, ht_sp)), g_sp = _loss(lambda *a, **k: kdax.parallel.chunk_kda(mesh, "sp", *a, pipeline=pipe, **k),
                                        pos, opts, w)
    (l_one, (o_one, ht_one)), g_one = _loss(lambda *a, **k: kdax.chunk_kda(*a, pipeline=pipe, **k), pos, opts, w)
    assert_close(o_sp, o_one, 1e-10, "o")
    assert_close(ht_sp, ht_one, 1e-10, "final state")
    # (dh0: the derived backward's was P times the true one, summed twice over the devices)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_sp, g_one):
        assert_close(a, b, 1e-10, name)


@pytest.mark.parametrize("case", ["non-affine F4", "undeclared F4 wrapper"])
def test_segmented_refuses_an_f4_of_undeclared_math(case):
    pos, opts, _ = _setup(False)
    pipe = _pipe(case)
    name = type(pipe.state).__qualname__
    with pytest.raises(ValueError, match=rf"segments: .*F4 `state` \({name}\).*math = kdax\.stages\.KDA"):
        kdax.stages.segmented(pipe, 2)


def test_segmented_keeps_exact_custom_stages_elsewhere():
    """An F5 of other math (with its declared transposes) and an undeclared F1 wrapper:
    the split recurrences see only KDA's F4 and B2, exact against the unsplit pipeline."""
    pos, opts, w = _setup(True)
    for case in ("bias F5 with transposes", "undeclared F1 wrapper"):
        pipe = _pipe(case)
        (l_a, (o_a, ht_a)), g_a = _loss(lambda *a, **k: kdax.chunk_kda(*a, pipeline=kdax.stages.segmented(pipe, 2), **k),
                                        pos, opts, w)
        (l_b, (o_b, ht_b)), g_b = _loss(lambda *a, **k: kdax.chunk_kda(*a, pipeline=pipe, **k), pos, opts, w)
        assert_close(o_a, o_b, 1e-10, f"{case}: o")
        assert_close(ht_a, ht_b, 1e-10, f"{case}: final state")
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g_a, g_b):
            assert_close(a, b, 1e-10, f"{case}: {name}")
