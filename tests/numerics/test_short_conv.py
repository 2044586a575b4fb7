"""The segment-aware short convolution against a per-sequence numpy loop."""

import jax.numpy as jnp
import numpy as np

from kdax._numerics.short_conv import causal_conv, conv_tail, token_segments

from .._util import assert_close


def test_packed_conv_with_history_matches_per_sequence_loop():
    r = np.random.default_rng(0)
    W, C = 4, 5
    cu = np.array([0, 2, 2, 9, 10, 16])  # lengths 2, 0, 7, 1, 6: shorter than W - 1 too
    x = r.normal(size=(1, 16, C))
    w = r.normal(size=(C, W))
    hist = r.normal(size=(5, W - 1, C))
    seq, pos = token_segments(1, 16, jnp.asarray(cu, jnp.int32))
    y = causal_conv(jnp.asarray(x), jnp.asarray(w), seq, pos, jnp.asarray(hist))
    tail = conv_tail(jnp.asarray(x), jnp.zeros(5, jnp.int32), jnp.asarray(cu[:-1]), jnp.asarray(np.diff(cu)),
                     jnp.asarray(hist), W)
    for n in range(5):
        a, b = cu[n], cu[n + 1]
        ext = np.concatenate([hist[n], x[0, a:b]])  # the sequence's history, then its tokens
        ref = np.stack([sum(ext[t + i] * w[:, i] for i in range(W)) for t in range(b - a)]) if b > a else None
        if ref is not None:
            assert_close(y[0, a:b], ref, 1e-14, f"sequence {n}")
        assert_close(tail[n], ext[-(W - 1):], 0.0, f"tail {n}")
    # bitwise: other sequences' tokens never enter a sequence's outputs
    x2 = x.copy()
    x2[0, 2:9] = r.normal(size=(7, C))
    y2 = causal_conv(jnp.asarray(x2), jnp.asarray(w), seq, pos, jnp.asarray(hist))
    keep = np.r_[0:2, 9:16]
    assert np.array_equal(np.asarray(y)[0, keep], np.asarray(y2)[0, keep])


def test_bfloat16_conv_sums_in_float32():
    """bfloat16 inputs are summed in float32 and rounded once (as FLA's kernel accumulates),
    with a history read from the state: the float32 call's result, rounded."""
    r = np.random.default_rng(1)
    W, C, T = 4, 6, 11
    x = jnp.asarray(r.normal(size=(1, T, C)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(C, W)), jnp.bfloat16)
    hist = jnp.asarray(r.normal(size=(2, W - 1, C)), jnp.bfloat16)
    seq, pos = token_segments(1, T, jnp.asarray([0, 4, T], jnp.int32))
    y = causal_conv(x, w, seq, pos, hist)
    f32 = lambda a: a.astype(jnp.float32)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(causal_conv(f32(x), f32(w), seq, pos, f32(hist))
                                                            .astype(jnp.bfloat16)))
