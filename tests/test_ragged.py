"""``kdax._ragged``: the per-sequence products over token spans against a plain per-token
loop, float64, and their hand-made VJPs against ``jax.vjp`` of that loop."""

import jax
import jax.numpy as jnp
import numpy as np

from kdax import _ragged

from ._util import assert_close

# Spans: empty ones (also first and last), one token, exactly W, longer than two blocks,
# gaps between spans (tokens in no span).
STARTS = [0, 0, 1, 3, 3, 20, 40, 90, 90]
COUNTS = [0, 1, 2, 0, 16, 19, 37, 0, 0]
TT, HV, K, V = 96, 2, 5, 3


def _spans():
    return _ragged.Spans(jnp.asarray(STARTS, jnp.int32), jnp.asarray(COUNTS, jnp.int32))


def _owner():
    """Per token: its span or -1."""
    own = -np.ones(TT, int)
    for n, (s, c) in enumerate(zip(STARTS, COUNTS)):
        own[s:s + c] = n
    return own


def _matvec_loop(A, Y):
    own = _owner()
    rows = [jnp.einsum("hk,hkv->hv", A[:, t], Y[own[t]]) if own[t] >= 0 else jnp.zeros((HV, Y.shape[-1])) for t in range(TT)]
    return jnp.stack(rows, 1)


def _outer_loop(U, X):
    own = _owner()
    S = [jnp.zeros((HV, U.shape[-1], X.shape[-1])) for _ in STARTS]
    for t in range(TT):
        if own[t] >= 0:
            S[own[t]] = S[own[t]] + U[:, t, :, None] * X[:, t, None, :]
    return jnp.stack(S)


def test_matvec_and_outer_against_a_token_loop():
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(0)
    A, U = (jnp.asarray(r.normal(size=(HV, TT, K))) for _ in range(2))
    X = jnp.asarray(r.normal(size=(HV, TT, V)))
    Y = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    sp = _spans()
    assert_close(jax.jit(_ragged.matvec)(A, Y, sp), _matvec_loop(A, Y), 1e-14, "matvec")
    assert_close(jax.jit(_ragged.outer, static_argnums=3)(U, X, sp, len(STARTS)), _outer_loop(U, X), 1e-14, "outer")
    # every token outside the spans is exactly zero
    out = np.asarray(_ragged.matvec(A, Y, sp))
    assert np.all(out[:, _owner() < 0] == 0)


def test_vjps_against_autodiff_of_the_loop():
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(1)
    A = jnp.asarray(r.normal(size=(HV, TT, K)))
    Y = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    X = jnp.asarray(r.normal(size=(HV, TT, V)))
    sp = _spans()
    dout = jnp.asarray(r.normal(size=(HV, TT, V)))
    got = jax.vjp(lambda a, y: _ragged.matvec(a, y, sp), A, Y)[1](dout)
    want = jax.vjp(_matvec_loop, A, Y)[1](dout)
    for g, w, n in zip(got, want, ("dA", "dY")):
        assert_close(g, w, 1e-14, "matvec " + n)
    dS = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    got = jax.vjp(lambda u, x: _ragged.outer(u, x, sp, len(STARTS)), A, X)[1](dS)
    want = jax.vjp(_outer_loop, A, X)[1](dS)
    for g, w, n in zip(got, want, ("dU", "dX")):
        assert_close(g, w, 1e-14, "outer " + n)
