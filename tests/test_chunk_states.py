"""``chunk_kda(..., return_intermediate_states=True)`` (kdax/_chunk_states.py): FLA's ``h``,
the state entering each chunk, checked in float64 against the token-by-token recurrence
run up to each chunk's start; dense and packed (FLA's flat chunk order, empty sequences
included), every state layout, jit and eager alike; a non-finite input stays in its
sequence; differentiating it is refused, as FLA refuses it outside inference mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from tests._util import assert_close, make_inputs

jax.config.update("jax_enable_x64", True)

PIPE = kdax.KDAPipeline.reference().untiled()


def _inputs(seed, **kw):
    x = make_inputs(seed, **kw)
    return dict(x, k=x["k"] / jnp.linalg.norm(x["k"], axis=-1, keepdims=True))  # (a stable delta rule)


def _states_before(x, row: int, a: int, b: int, h0):
    """``[b - a + 1, HV, K, V]``: the state before each token ``a .. b - 1`` of ``row``, and
    after the last: the gated delta rule token by token in numpy float64 (log decays g,
    beta in [0, 1]; each q/k head read by its group of value heads)."""
    k, v, g, beta = (np.asarray(x[n][row], np.float64) for n in ("k", "v", "g", "beta"))
    group = v.shape[1] // k.shape[1]
    S = np.array(h0, np.float64)
    out = [S.copy()]
    for t in range(a, b):
        kt = np.repeat(k[t], group, axis=0)  # [HV, K]
        S = S * np.exp(g[t])[:, :, None]
        err = v[t] - np.einsum("hk,hkv->hv", kt, S)
        S = S + beta[t][:, None, None] * kt[:, :, None] * err[:, None, :]
        out.append(S.copy())
    return np.stack(out)


def _call(x, **kw):
    return kdax.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                          return_intermediate_states=True, pipeline=PIPE, **kw)


@pytest.mark.parametrize("C,T,H,HV", [(16, 45, 2, 2), (64, 64, 1, 2), (32, 100, 2, 4)])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_dense_start_states_are_the_recurrence(C, T, H, HV, state_v_first):
    x = _inputs(0, B=2, T=T, H=H, HV=HV, K=8, V=4)
    h0 = x["initial_state"]
    given = jnp.swapaxes(h0, -1, -2) if state_v_first else h0
    o, ht, h = _call(x, initial_state=given, chunk_size=C, state_v_first=state_v_first)
    NC = -(-T // C)
    assert h.shape == (2, NC, HV) + given.shape[2:] and h.dtype == jnp.float64
    h = jnp.swapaxes(h, -1, -2) if state_v_first else h
    for b in range(2):
        assert_close(h[b], _states_before(x, b, 0, T, h0[b])[::C][:NC], 1e-12, f"h[{b}]")
    # o and the final state are chunk_kda's own
    o2, ht2 = kdax.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=given, output_final_state=True,
                             chunk_size=C, state_v_first=state_v_first, pipeline=PIPE)
    assert_close(o, o2, 1e-13, "o")
    assert_close(ht, ht2, 1e-13, "ht")


def test_in_kernel_options():
    # The raw gate and beta activated in the kernel, l2-normalised q and k, a custom scale.
    x = _inputs(4, B=1, T=50, H=1, HV=2, K=8, V=4, gate="raw", A_log=True, dt_bias=True, beta_raw=True)
    opts = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True,
                use_qk_l2norm_in_kernel=True, scale=0.3, initial_state=x["initial_state"])
    o, ht, h = _call(x, chunk_size=16, **opts)
    args = lambda t: (x["q"][:, :t], x["k"][:, :t], x["v"][:, :t], x["g"][:, :t], x["beta"][:, :t])
    want = [x["initial_state"][0]] + [kdax.fused_recurrent_kda(*args(16 * c), output_final_state=True, **opts)[1][0]
                                      for c in (1, 2, 3)]
    assert_close(h[0], np.stack(want), 1e-12, "h")


def _packed_reference(x, cu, C, h0):
    rows = []
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        rows += list(_states_before(x, 0, a, b, h0[s])[::C][:-(-(b - a) // C)])
    return np.stack(rows)


@pytest.mark.parametrize("with_h0", [True, False])
def test_packed_start_states_in_flas_order(with_h0):
    # Sequences of 40, 0, 67 and 43 tokens at C=32: 2 + 0 + 3 + 2 = 7 chunks, FLA's NT.
    C, cu = 32, np.array([0, 40, 40, 107, 150])
    x = _inputs(1, B=1, T=150, H=2, HV=2, K=8, V=4)
    h0 = jax.random.normal(jax.random.key(3), (4, 2, 8, 4), jnp.float64) if with_h0 else jnp.zeros((4, 2, 8, 4))
    kw = dict(initial_state=h0) if with_h0 else {}
    o, ht, h = _call(x, cu_seqlens=cu, chunk_size=C, **kw)
    want = _packed_reference(x, cu, C, h0)
    assert h.shape[:1] == (1,) and h.shape[1] >= len(want), h.shape
    assert_close(h[0, :len(want)], want, 1e-12, "h")
    np.testing.assert_array_equal(np.asarray(h[0, len(want):]), 0)  # (past the last sequence's chunks)
    o2, ht2 = kdax.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, output_final_state=True,
                             chunk_size=C, pipeline=PIPE, **kw)
    assert_close(o, o2, 1e-13, "o")
    assert_close(ht, ht2, 1e-13, "ht")
    # jit, cu_seqlens traced: the same numbers
    f = jax.jit(lambda x, cu: _call(x, cu_seqlens=cu, chunk_size=C, **kw))
    for a, b in zip(f(x, jnp.asarray(cu, jnp.int32)), (o, ht, h)):
        assert_close(a, b, 1e-13, "jit")


@pytest.mark.parametrize("packed", [False, True])
def test_non_finite_input_stays_in_its_sequence(packed):
    # A NaN value at token 70 (head 1) of one sequence: that head's start states of the
    # chunks after it are NaN, every other number is the clean call's, bit for bit.
    C = 32
    if packed:
        cu = np.array([0, 50, 150, 200])
        x = _inputs(2, B=1, T=200, H=2, HV=2, K=8, V=4)
        kw, at = dict(cu_seqlens=cu), (0, 70)
        bad_chunks = [(0, 3), (0, 4), (0, 5)]  # sequence 1 owns flat chunks 2..5, starting at 50, 82, 114, 146
    else:
        x = _inputs(2, B=2, T=150, H=2, HV=2, K=8, V=4)
        kw, at = {}, (1, 70)
        bad_chunks = [(1, 3), (1, 4)]  # row 1's chunks starting at 96 and 128
    clean = _call(x, chunk_size=C, **kw)
    x = dict(x, v=x["v"].at[at[0], at[1], 1, 2].set(jnp.nan))
    o, ht, h = _call(x, chunk_size=C, **kw)
    nan_h = np.isnan(np.asarray(h)).any((-1, -2))  # [R, NC, HV]
    want = np.zeros_like(nan_h)
    for r, c in bad_chunks:
        want[r, c, 1] = True
    np.testing.assert_array_equal(nan_h, want)
    ok = ~want[..., None, None] & np.ones(h.shape, bool)
    np.testing.assert_array_equal(np.asarray(h)[ok], np.asarray(clean[2])[ok])
    end = 150  # (the bad sequence's end)
    nan_o = np.isnan(np.asarray(o)).any(-1)
    assert nan_o[at[0], at[1]:end, 1].all() and nan_o.sum() == end - at[1], nan_o.sum()


def test_differentiating_is_refused():
    x = _inputs(0, B=1, T=20, H=1, HV=1, K=8, V=4)
    for name in ("q", "k", "initial_state"):
        def loss(a):
            y = dict(x, **{name: a})
            return _call(y, initial_state=y["initial_state"], chunk_size=16)[0].sum()

        with pytest.raises(ValueError, match="return_intermediate_states: forward only"):
            jax.grad(loss)(x[name])
    # Not differentiated: any transformation that leaves the inputs without tangents runs.
    h = jax.jit(jax.vmap(lambda q: _call(dict(x, q=q[None]), chunk_size=16)[2][0]))(x["q"])
    assert h.shape == (1, 2, 1, 8, 4)


def test_zero_tokens():
    x = _inputs(0, B=2, T=0, H=1, HV=1, K=8, V=4)
    o, ht, h = _call(x, initial_state=x["initial_state"], chunk_size=16)
    assert o.shape == (2, 0, 1, 4) and h.shape == (2, 0, 1, 8, 4)
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(x["initial_state"]))


def test_sequence_parallel_is_refused():
    x = _inputs(0, B=1, T=16, H=1, HV=1, K=8, V=4)
    with pytest.raises(ValueError, match="return_intermediate_states: not supported with seq_axis_name"):
        kdax.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], return_intermediate_states=True,
                       seq_axis_name="sp")
