"""kdax on one CPU device, as a user's CPU program runs it. The suite simulates eight
(tests/conftest.py), and ``chunk_kda`` takes other paths there: with one CPU device the
inputs' non-finite tests are made one after another (``kdax._numerics.isolation._in_turn``)
and the in-program input check rides on the outputs' NaN masks
(``kdax._validate.domain_flag``); with several, the tests are made at once and each value
out of its domain reads as NaN. So none of the suite's in-process calls runs the
one-device paths. Here the same calls run in a fresh one-device process (the suite's other
XLA flags kept) and in this one: the outputs and every gradient must be bitwise equal,
NaN where isolation puts it and nowhere else. (The one-device errors are
tests/test_input_checks.py's.)"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kdax

from ._util import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (B, T, H, HV, K, V, cu_seqlens, (row, token, value head) of a NaN in v, of a NaN in
# the raw gate, of a raw gate +inf: a hard decay, the token forgets exactly, no NaN)
CASES = {
    "dense": (2, 40, 2, 2, 16, 8, None, (1, 21, 1), (1, 30, 0), (0, 9, 1)),
    "packed": (1, 70, 2, 4, 16, 8, (0, 17, 17, 40, 70), (0, 20, 1), (0, 50, 2), (0, 5, 3)),
}


def battery() -> dict:
    """``{name: numpy array}``: per case, ``jit(value_and_grad)`` of ``chunk_kda`` in float32
    with FLA's in-kernel options and the input check, and the eager forward (the one-device
    paths both run only with the check; without it the non-finite tests alone differ);
    two sequences hold a NaN (in v, in the raw gate), another a raw gate of +inf."""
    out = {}
    for name, (B, T, H, HV, K, V, cu, nan_at, g_nan_at, inf_at) in CASES.items():
        r = np.random.default_rng(0)
        f = lambda *s: r.normal(size=s).astype(np.float32)
        q, k, v, g, beta = f(B, T, H, K), f(B, T, H, K), f(B, T, HV, V), f(B, T, HV, K), f(B, T, HV)
        v[nan_at] = g[g_nan_at] = np.nan
        g[inf_at] = np.inf
        N = B if cu is None else len(cu) - 1
        h0, dt_bias, w = 0.3 * f(N, HV, K, V), f(HV * K), f(B, T, HV, V)
        A_log = np.log(r.uniform(1, 16, HV)).astype(np.float32)
        opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                    output_final_state=True, chunk_size=16, cu_seqlens=None if cu is None else np.array(cu, np.int32))

        def loss(x, h0, A_log, dt_bias):
            o, ht = kdax.chunk_kda(*x, initial_state=h0, A_log=A_log, dt_bias=dt_bias, **opts)
            return jnp.nansum(o * w) + jnp.nansum(ht), (o, ht)

        x = tuple(map(jnp.asarray, (q, k, v, g, beta)))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, (o, ht)), grads = step(x, h0, A_log, dt_bias)
        for i, a in enumerate([o, ht, *jax.tree.leaves(grads)]):
            out[f"{name} jit {i}"] = np.asarray(a)
        o, ht = kdax.chunk_kda(*x, initial_state=h0, A_log=A_log, dt_bias=dt_bias, **opts)
        out[f"{name} eager o"], out[f"{name} eager ht"] = np.asarray(o), np.asarray(ht)
    return out


_CHILD = """
import sys
import jax
jax.config.update("jax_enable_x64", True)  # (as the suite's conftest: float32 inputs still compute in float32)
assert jax.device_count() == 1, jax.device_count()
sys.path.insert(0, {root!r})
import numpy as np
from tests.test_one_device import battery
np.savez({path!r}, **battery())
"""


def test_one_device_paths_give_the_suites_numbers(tmp_path):
    path = str(tmp_path / "one_device.npz")
    run = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT, path=path)], env=one_device_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert jax.device_count() > 1  # (this process: the suite's simulated devices)
    here, there = battery(), dict(np.load(path))
    assert sorted(here) == sorted(there)
    for name, a in here.items():
        b = there[name]
        assert a.dtype == b.dtype == np.float32, (name, a.dtype, b.dtype)
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{name}: NaN at other places on one device"
        assert np.array_equal(a, b, equal_nan=True), f"{name}: max |diff| {np.nanmax(np.abs(a - b)):.3e} on one device"
    # isolation: NaN in the outputs of the two poisoned sequences only, from their NaN on
    for name, (B, T, H, HV, K, V, cu, nan_at, g_nan_at, _) in CASES.items():
        o = here[f"{name} jit 0"]
        bad = np.zeros((B, T), bool)
        for row, t, _ in (nan_at, g_nan_at):
            end = T if cu is None else next(c for c in cu if c > t)
            bad[row, t:end] = True
        assert np.array_equal(np.isnan(o).any(axis=(2, 3)), bad), name
