"""``chunk_kda`` in a jitted function that captures its inputs: arrays the function closes
over are constants of its program, and so is the cotangent ``do`` of a loss
``sum(o * w)`` whose ``w`` is captured. XLA folds what is computed from constants at
compile time; without ``kdax._runner.vjp.behind_barriers`` it folded kdax's input checks,
packing and much of F1-F2 (22 more large constants at the shape below; 2-2.5 s more
compile at B=1 T=1024-4096 H=8 K=V=128, benchmarks/NOTES.md), and the folded part rounded
otherwise than the compiled one (a quarter of the gradients off in the last bits). Compile
time is not asserted here (no timing in tests): the compiled program's constants and the
numbers are."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

B, T, H, K = 1, 256, 2, 32
C = 64  # chunk_kda's default chunk size


def _inputs():
    r = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(4))
    g = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)  # the raw gate (in-kernel)
    beta = jnp.asarray(r.normal(size=(B, T, H)), jnp.float32)
    A_log, dt_bias = jnp.asarray(r.normal(size=H), jnp.float32), jnp.asarray(r.normal(size=H * K), jnp.float32)
    return q, k, v, g, beta, w, A_log, dt_bias


OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _large_constants(f, *args) -> list:
    """The shapes of the compiled program's constants of at least ``C * C`` elements."""
    text = jax.jit(f).lower(*args).compile().as_text()
    shapes = [tuple(int(d) for d in m.group(1).split(",") if d)
              for m in re.finditer(r"= \w+\[([\d,]*)\][^ ]* constant\(", text)]
    return [s for s in shapes if int(np.prod(s)) >= C * C]


def _losses():
    """name: (loss of the traced arguments, their values, the same loss with every array an argument)."""
    q, k, v, g, beta, w, A_log, dt_bias = _inputs()

    def loss(q, k, v, g, beta, w, A_log, dt_bias):
        o, _ = kdax.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **OPTS)
        return jnp.sum(o * w)

    every = (q, k, v, g, beta, w, A_log, dt_bias)
    return {
        # a weight the loss captured: do is a constant
        "w captured": (lambda q, k, v, g, beta: loss(q, k, v, g, beta, w, A_log, dt_bias), every[:5]),
        # every input captured, the gate's parameters traced
        "inputs captured": (lambda A_log, dt_bias: loss(q, k, v, g, beta, w, A_log, dt_bias), every[6:]),
        "_every": (loss, every),
    }


@pytest.mark.parametrize("name", ["w captured", "inputs captured"])
def test_captured_arrays_are_not_folded(name):
    """The compiled training step's large constants are the captured arrays themselves
    (``[B, T, H, K]``) and kdax's own ``[C, C]`` masks, none folded from them (before
    ``behind_barriers``: packed, transposed and per-level copies of them too)."""
    f, args = _losses()[name]
    shapes = _large_constants(jax.grad(f, argnums=tuple(range(len(args)))), *args)
    folded = [s for s in shapes if s != (B, T, H, K) and int(np.prod(s)) > C * C]
    assert not folded, f"constants XLA folded from the captured arrays: {folded}"
    assert (B, T, H, K) in shapes  # (the test sees the captured ones)


@pytest.mark.parametrize("name", ["w captured", "inputs captured"])
def test_captured_arrays_give_the_arguments_numbers(name):
    """The same loss and gradients, bitwise, whether the arrays are captured or arguments
    (folded, a quarter of the gradients differed in the last bits)."""
    f, args = _losses()[name]
    loss, every = _losses()["_every"]
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.value_and_grad(f, argnums=argnums))(*args)
    at = (0, 1, 2, 3, 4) if name == "w captured" else (6, 7)
    want = jax.jit(jax.value_and_grad(loss, argnums=at))(*every)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_intermediate_states_with_captured_inputs():
    """``return_intermediate_states`` (FLA's forward-only option, ``kdax._chunk_states``) in a
    jitted function that captures q, k, v, g and beta: no constant folded from them, the
    outputs and states bitwise those of the arguments' program."""
    q, k, v, g, beta, _, A_log, dt_bias = _inputs()
    run = lambda q, k, v, g, beta, A_log: kdax.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **OPTS,
                                                         return_intermediate_states=True)
    captured = lambda A_log: run(q, k, v, g, beta, A_log)
    shapes = _large_constants(captured, A_log)
    assert not [s for s in shapes if s != (B, T, H, K) and int(np.prod(s)) > C * C], shapes
    for a, b in zip(jax.tree.leaves(jax.jit(captured)(A_log)), jax.tree.leaves(jax.jit(run)(q, k, v, g, beta, A_log))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
