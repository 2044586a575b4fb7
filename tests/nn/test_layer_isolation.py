"""Issue 25 in the layer: a row (or packed sequence) gets what it gets alone whatever
another holds (x1e30, NaN, inf at one token), through ``attention_mask`` and
``cu_seqlens``; duplicate pool slots refused."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .._util import assert_close
from .test_layer import D, make_layer, rand

BAD = {"x1e30": None, "nan": np.nan, "inf": np.inf}


def _poke(x, at, value):
    return x.at[at].set(x[at] * 1e30 if value is None else value)


@eqx.filter_jit
def _row_and_grad(layer, x, row, **kw):
    """``(y[row], cache state of ``row``, d sum(y[row]^2) / dx[row])``."""

    def f(x):
        y, cache = layer(x, **kw)
        return jnp.sum(y[row] ** 2), (y[row], cache.state[row])

    dx, (y, state) = jax.grad(f, has_aux=True)(x)
    return y, state, dx[row]


@eqx.filter_jit
def _packed_second(layer, xp):
    """As ``_row_and_grad`` for the second of two packed sequences of 12 tokens."""

    def f(xp):
        y, cache = layer(xp, cu_seqlens=jnp.asarray([0, 12, 24]))
        return jnp.sum(y[0, 12:] ** 2), (y[0, 12:], cache.state[1])

    dx, (y, state) = jax.grad(f, has_aux=True)(xp)
    return y, state, dx[0, 12:]


@pytest.mark.parametrize("packing", ["attention_mask", "cu_seqlens"])
def test_other_sequence_as_alone(packing):
    layer, _, _ = make_layer(3)
    x = rand(4, 2, 12, D)
    alone = _row_and_grad(layer, x[1:], 0)
    for label, value in BAD.items():
        if packing == "attention_mask":
            got = _row_and_grad(layer, _poke(x, (0, 5, 0), value), 1, attention_mask=jnp.ones((2, 12), jnp.int32))
        else:  # the two rows packed as two sequences of one row; row 1 -> tokens 12..23
            got = _packed_second(layer, _poke(x, (0, 5, 0), value).reshape(1, 24, D))
        for name, a, b in zip(("y", "state", "dx"), got, alone):
            assert_close(a, b, 1e-10, f"{packing} {label}: {name}")


def test_duplicate_state_indices_refused():
    layer, _, _ = make_layer(0)
    x = rand(0, 2, 1, D)
    pool = layer.init_cache(4)
    with pytest.raises(Exception, match="state_indices: every slot must be distinct"):
        layer(x, cache=pool, state_indices=jnp.asarray([2, 2]), mode="recurrent")
    with pytest.raises(Exception, match="state_indices: every slot must be distinct"):
        eqx.filter_jit(lambda l, x, c, i: l(x, cache=c, state_indices=i, mode="recurrent"))(
            layer, x, pool, jnp.asarray([1, 1]))
    y, _ = layer(x, cache=pool, state_indices=jnp.asarray([3, 1]), mode="recurrent")  # distinct: fine
    assert np.all(np.isfinite(np.asarray(y)))
