"""``kdax._layouts.ragged``: the per-sequence products over token spans against a plain per-token
loop, float64, and their hand-made VJPs against ``jax.vjp`` of that loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax._layouts import ragged as _ragged

from ._util import assert_close

# Spans: empty ones (also first and last), one token, exactly WIDE, longer than two
# blocks, gaps between spans (tokens in no span).
STARTS = [0, 0, 1, 3, 3, 20, 40, 90, 90]
COUNTS = [0, 1, 2, 0, 16, 19, 37, 0, 0]
# Short spans only (at most 2 tokens): every one fits a narrow block of 2.
SHORT = [0, 1, 2, 0, 1, 2, 1, 0, 0]
TT, HV, K, V = 96, 2, 5, 3
# Block widths tried first: none (WIDE), 1 (only the WIDE path fits the long spans, and
# a span of 2 does not fit), 2.
NARROW = (_ragged.WIDE, 1, 2)


def _spans(counts=COUNTS):
    return _ragged.Spans(jnp.asarray(STARTS, jnp.int32), jnp.asarray(counts, jnp.int32))


def _owner(counts=COUNTS):
    """Per token: its span or -1."""
    own = -np.ones(TT, int)
    for n, (s, c) in enumerate(zip(STARTS, counts)):
        own[s:s + c] = n
    return own


def test_narrow_width():
    assert [_ragged.narrow_width(T, N) for T, N in ((1000, 1000), (1000, 100), (1000, 10), (5, 0))] == [1, 16, 16, 8]
    assert _ragged.narrow_width(1000, 500) == 2 and _ragged.narrow_width(1000, 300) == 4


def _matvec_loop(A, Y, counts=COUNTS):
    own = _owner(counts)
    rows = [jnp.einsum("hk,hkv->hv", A[:, t], Y[own[t]]) if own[t] >= 0 else jnp.zeros((HV, Y.shape[-1])) for t in range(TT)]
    return jnp.stack(rows, 1)


def _outer_loop(U, X, counts=COUNTS):
    own = _owner(counts)
    S = [jnp.zeros((HV, U.shape[-1], X.shape[-1])) for _ in STARTS]
    for t in range(TT):
        if own[t] >= 0:
            S[own[t]] = S[own[t]] + U[:, t, :, None] * X[:, t, None, :]
    return jnp.stack(S)


@pytest.mark.parametrize("counts", [COUNTS, SHORT], ids=["long", "short"])
@pytest.mark.parametrize("narrow", NARROW)
def test_matvec_and_outer_against_a_token_loop(narrow, counts):
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(0)
    A, U = (jnp.asarray(r.normal(size=(HV, TT, K))) for _ in range(2))
    X = jnp.asarray(r.normal(size=(HV, TT, V)))
    Y = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    sp = _spans(counts)
    mv = jax.jit(_ragged.matvec, static_argnums=3)
    assert_close(mv(A, Y, sp, narrow), _matvec_loop(A, Y, counts), 1e-14, "matvec")
    assert_close(jax.jit(_ragged.outer, static_argnums=(3, 4))(U, X, sp, len(STARTS), narrow),
                 _outer_loop(U, X, counts), 1e-14, "outer")
    # every token outside the spans is exactly zero
    out = np.asarray(mv(A, Y, sp, narrow))
    assert np.all(out[:, _owner(counts) < 0] == 0)
    # a tuple of token arrays: each one's product
    got = mv((A, U), Y, sp, narrow)
    assert_close(got[0], _matvec_loop(A, Y, counts), 1e-14, "matvec stacked 0")
    assert_close(got[1], _matvec_loop(U, Y, counts), 1e-14, "matvec stacked 1")


# (narrow = 2 runs both paths: the WIDE one for the spans that do not fit; WIDE alone and
# narrow = 1 are slow, test_outer_vjp_with_a_folded_value_axis runs one-row blocks)
@pytest.mark.parametrize("narrow", [pytest.param(w, marks=pytest.mark.slow) for w in (_ragged.WIDE, 1)] + [2])
def test_vjps_against_autodiff_of_the_loop(narrow):
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(1)
    A = jnp.asarray(r.normal(size=(HV, TT, K)))
    Y = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    X = jnp.asarray(r.normal(size=(HV, TT, V)))
    sp = _spans()
    dout = jnp.asarray(r.normal(size=(HV, TT, V)))
    got = jax.vjp(lambda a, y: _ragged.matvec(a, y, sp, narrow), A, Y)[1](dout)
    want = jax.vjp(_matvec_loop, A, Y)[1](dout)
    for g, w, n in zip(got, want, ("dA", "dY")):
        assert_close(g, w, 1e-14, "matvec " + n)
    dS = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    got = jax.vjp(lambda u, x: _ragged.outer(u, x, sp, len(STARTS), narrow), A, X)[1](dS)
    want = jax.vjp(_outer_loop, A, X)[1](dS)
    for g, w, n in zip(got, want, ("dU", "dX")):
        assert_close(g, w, 1e-14, "outer " + n)
    # stacked: one cotangent of Y, the sum of both products'
    U = jnp.asarray(r.normal(size=(HV, TT, K)))
    dout2 = jnp.asarray(r.normal(size=(HV, TT, V)))
    got = jax.vjp(lambda a, u, y: _ragged.matvec((a, u), y, sp, narrow), A, U, Y)[1]((dout, dout2))
    want = jax.vjp(lambda a, u, y: (_matvec_loop(a, y), _matvec_loop(u, y)), A, U, Y)[1]((dout, dout2))
    for g, w, n in zip(got, want, ("dA", "dU", "dY")):
        assert_close(g, w, 1e-14, "stacked matvec " + n)


@pytest.mark.parametrize("narrow, counts", [(1, [min(c, 1) for c in COUNTS]), (2, SHORT)], ids=["one-row", "two-rows"])
def test_outer_vjp_in_one_and_two_row_blocks(narrow, counts):
    """``outer``'s VJP (products of the states' cotangent per sequence) against the loop,
    V = 16, one-token spans in one-row blocks and two-token ones in two-row blocks."""
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(2)
    U, X = jnp.asarray(r.normal(size=(HV, TT, K))), jnp.asarray(r.normal(size=(HV, TT, 16)))
    dS = jnp.asarray(r.normal(size=(len(STARTS), HV, K, 16)))
    sp = _spans(counts)
    got = jax.jit(jax.vjp(lambda u, x: _ragged.outer(u, x, sp, len(STARTS), narrow), U, X)[1])(dS)
    want = jax.vjp(lambda u, x: _outer_loop(u, x, counts), U, X)[1](dS)
    for g, w, n in zip(got, want, ("dU", "dX")):
        assert_close(g, w, 1e-14, "outer " + n)


def test_matvec_ok_mask_keeps_non_finite_states_out():
    """``ok``: a head whose state holds NaN/inf reads as zero, in the product and in
    ``A``'s cotangent, for its own tokens; every other token is unchanged."""
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(2)
    A = jnp.asarray(r.normal(size=(HV, TT, K)))
    Y = np.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    Y[5, 1, 2, 0], Y[6, 0] = np.nan, np.inf
    ok = np.all(np.isfinite(Y), axis=(-2, -1))
    Yc = jnp.asarray(np.where(ok[..., None, None], Y, 0.0))
    sp = _spans()
    dout = jnp.asarray(r.normal(size=(HV, TT, V)))
    for narrow in NARROW:
        out, vjp = jax.vjp(lambda a: _ragged.matvec(a, jnp.asarray(Y), sp, narrow, jnp.asarray(ok)), A)
        want, want_vjp = jax.vjp(lambda a: _matvec_loop(a, Yc), A)
        assert_close(out, want, 1e-14, "matvec with ok")
        assert_close(vjp(dout)[0], want_vjp(dout)[0], 1e-14, "dA with ok")


@pytest.mark.parametrize("longest", [None, max(COUNTS)], ids=["tokens", "exact"])
def test_second_order_against_autodiff_of_the_loop(longest):
    """Issue 39 item 6: the loop over blocks has a static length (``longest``: a bound on
    the spans' lengths, None the token count), so a Hessian-vector product differentiates
    the hand-made VJPs, reverse over reverse and forward over reverse, exact against
    autodiff of the token loop (narrow = 2: both block widths)."""
    jax.config.update("jax_enable_x64", True)
    r = np.random.default_rng(3)
    A, U = (jnp.asarray(r.normal(size=(HV, TT, K))) for _ in range(2))
    X = jnp.asarray(r.normal(size=(HV, TT, V)))
    Y = jnp.asarray(r.normal(size=(len(STARTS), HV, K, V)))
    N = len(STARTS)

    def loss(mv, out):
        def f(a, u, x, y):  # nonlinear in each product, so the Hessian has every term
            return jnp.sum(jnp.sin(mv(a, y))) + jnp.sum(jnp.cos(out(u, x)))
        return f

    got_f = loss(lambda a, y: _ragged.matvec(a, y, _spans(), 2, longest=longest),
                 lambda u, x: _ragged.outer(u, x, _spans(), N, 2, longest=longest))
    want_f = loss(_matvec_loop, _outer_loop)
    primals = (A, U, X, Y)
    tangents = tuple(jnp.asarray(r.normal(size=p.shape)) for p in primals)
    rev = lambda f: jax.grad(lambda *p: sum(jnp.vdot(g, t) for g, t in zip(jax.grad(f, (0, 1, 2, 3))(*p), tangents)),
                             (0, 1, 2, 3))(*primals)
    fwd = lambda f: jax.jvp(jax.grad(f, (0, 1, 2, 3)), primals, tangents)[1]
    want = jax.jit(lambda: rev(want_f))()
    for how, got in (("reverse", jax.jit(lambda: rev(got_f))()), ("forward", jax.jit(lambda: fwd(got_f))())):
        for g, w, n in zip(got, want, ("A", "U", "X", "Y")):
            assert_close(g, w, 1e-13, f"{how}-over-reverse HVP d{n}")
