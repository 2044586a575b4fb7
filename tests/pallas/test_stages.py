"""Every Pallas stage equals its reference stage, for both targets' kernel bodies and block
layouts (TPU: full-dim blocks; Triton: power-of-2 padded), in interpret mode everywhere and
compiled for the accelerator where one is present (the ``device`` cases)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdax import KDAConfig
from kdax import pallas as P
from kdax import stages as S
from kdax._layouts.layout import make_layout, make_shared_layout
from kdax._layouts.resets import segments, state_passes
from kdax.pallas._common import column_blocks
from kdax.ref import log_decay_floor
from kdax.stages import ChunkGrads

from .._util import ON_DEVICE, assert_close, jitted
from ..stages._chunked import chunked, in_kernel_decay, intra_chunk, layout_of, rand_like, state_scan, wy_chunk

# (target, interpret): both layouts interpreted on any machine; the present accelerator's
# target compiled for real where there is one (skipped elsewhere).
MODES = [
    pytest.param("tpu", True, id="tpu-interpret"),
    pytest.param("triton", True, id="triton-interpret"),
    pytest.param(P.default_target(), False, id="device", marks=pytest.mark.skipif(not ON_DEVICE, reason="no accelerator")),
]
CASES = [  # (dtype, tol, C, K, V)
    (jnp.float64, 1e-12, 16, 8, 4),
    (jnp.float64, 1e-12, 32, 12, 6),  # K, V not powers of 2: Triton pads them
    (jnp.float32, 1e-5, 64, 16, 16),
]


def _x(dtype, C, K, V, seed=0):
    x = chunked(seed, R=2, HV=2, NC=2, C=C, K=K, V=V, strong=True)
    x = {n: (a.astype(dtype) if hasattr(a, "dtype") and a.dtype.kind == "f" else a) for n, a in x.items()}
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    h, v_new, _ = state_scan(w, u, kg, x["G"], x["h0"])
    x.update(Aqk=Aqk, Akk=Akk, w=w, u=u, qg=qg, kg=kg, h=h, v_new=v_new)
    return x


def _close(got, want, tol, name):
    if isinstance(want, tuple):
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, tol, f"{name}[{i}]")
        return
    if hasattr(want, "__dataclass_fields__"):
        for f in want.__dataclass_fields__:
            a, b = getattr(got, f), getattr(want, f)
            if b is None or not hasattr(b, "shape"):
                assert a is None or not hasattr(a, "shape"), f"{name}.{f}"
            else:
                _close(a, b, tol, f"{name}.{f}")
        return
    assert got.dtype == want.dtype, name
    assert_close(got, want, tol, name)


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("dtype,tol,C,K,V", CASES)
def test_forward_stages(target, interpret, dtype, tol, C, K, V):
    x = _x(dtype, C, K, V)
    kw = dict(target=target, interpret=interpret)
    sc = x["scale"]
    pairs = [
        ("intra", P.PallasIntra(**kw), S.ReferenceIntra(), (sc, x["q"], x["k"], x["beta"], x["G"])),
        ("wy", P.PallasWY(**kw), S.ReferenceWY(), (x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"])),
        ("state", P.PallasState(**kw), S.ReferenceState(), (x["w"], x["u"], x["kg"], x["G"], x["h0"], x["layout"])),
        ("output", P.PallasOutput(**kw), S.ReferenceOutput(), (sc, x["qg"], x["h"], x["Aqk"], x["v_new"])),
        ("recompute", P.PallasRecompute(**kw), S.ReferenceRecompute(),
         (x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"], x["h0"], x["layout"])),
    ]
    pairs = [(name, jitted(pal), jitted(ref), args) for name, pal, ref, args in pairs]
    for name, pal, ref, args in pairs:
        _close(pal(*args), ref(*args), tol, name)
    if dtype == jnp.float32 and target == "triton":  # G + G_lo (kdax._numerics.hilo): F2 and F3 (bodies shared by both targets)
        _with_G_lo(pairs[:2], x["G"], tol)


def _G_lo(G):
    """A low part of G, far larger than F1's (below G's rounding) so that a kernel that
    dropped it, or used it with the wrong sign, would fail (``_with_G_lo``); non-increasing
    along the chunk, as G is, so that ``G + G_lo`` is a cumsum of log decays and no
    exponent needs the clamp at 0 (which depends on where a stage anchors its products)."""
    r = np.random.default_rng(99)
    return jnp.asarray(-np.cumsum(r.uniform(0.0, 0.002, G.shape), axis=-2), G.dtype)


def _with_G_lo(pairs, G, tol):
    lo = _G_lo(G)
    for name, pal, ref, args in pairs:
        got = pal(*args, G_lo=lo)
        _close(got, ref(*args, G_lo=lo), tol, name + " with G_lo")
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(pal(*args))))
        assert diff > 100 * tol, f"{name}: G_lo changed nothing ({diff})"


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("dtype,tol,C,K,V", CASES)
def test_backward_stages(target, interpret, dtype, tol, C, K, V):
    x = _x(dtype, C, K, V, seed=1)
    kw = dict(target=target, interpret=interpret)
    sc = x["scale"]
    do = rand_like(x["v"], 3)
    dht = rand_like(x["h0"], 4)
    dh = rand_like(x["h"], 5)
    dv_new = rand_like(x["v"], 6)
    dL = jnp.tril(rand_like(x["Aqk"], 7), -1)
    grads = ChunkGrads(rand_like(x["q"], 8), rand_like(x["k"], 9), rand_like(x["v"], 10),
                       rand_like(x["beta"], 11), rand_like(x["G"], 12), dL)
    pairs = [
        ("dav", P.PallasDAv(**kw), S.ReferenceDAv(), (x["v_new"], x["Aqk"], do)),
        ("dhu", P.PallasDhu(**kw), S.ReferenceDhu(),
         (sc, x["qg"], x["kg"], x["w"], x["G"], do, dv_new, dht, x["layout"])),
        ("wy_dqkg", P.PallasWYDqkg(**kw), S.ReferenceWYDqkg(),
         (sc, x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"], x["qg"], x["kg"], x["h"], dh, x["v_new"], do, dv_new)),
        ("intra_bwd", P.PallasIntraBackward(**kw), S.ReferenceIntraBackward(),
         (sc, x["q"], x["k"], x["beta"], x["G"], jnp.tril(rand_like(x["Aqk"], 13)), grads)),
    ]
    pairs = [(name, jitted(pal), jitted(ref), args) for name, pal, ref, args in pairs]
    for name, pal, ref, args in pairs:
        _close(pal(*args), ref(*args), tol, name)
    if dtype == jnp.float32 and target == "triton":  # with G_lo (kdax._numerics.hilo): B3 and B4
        _with_G_lo(pairs[2:], x["G"], tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_triton_chunk_kernels_over_column_blocks(dtype, tol):
    """The Triton F2, F3, B3 and B4 take K = 72 and V = 40 (padded to 128 and 64) 16 columns
    at a time (``block_k``, ``block_v``; B4 one program per 16 columns): equal to the
    reference stages, with G_lo too; a NaN in k at one token makes
    F3's w NaN from that token on, in the columns of its block, and in no earlier row."""
    x = _x(dtype, 32, 72, 40, seed=5)
    kw = dict(target="triton", interpret=True, block_k=16)
    assert len(column_blocks("triton", 128, 16)) == 8
    sc = x["scale"]
    dh, do, dv_new = rand_like(x["h"], 5), rand_like(x["v"], 3), rand_like(x["v"], 6)
    grads = ChunkGrads(rand_like(x["q"], 8), rand_like(x["k"], 9), rand_like(x["v"], 10),
                       rand_like(x["beta"], 11), rand_like(x["G"], 12), jnp.tril(rand_like(x["Aqk"], 7), -1))
    pairs = [
        ("wy", P.PallasWY(**kw), S.ReferenceWY(), (x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"])),
        ("intra", P.PallasIntra(**kw), S.ReferenceIntra(), (sc, x["q"], x["k"], x["beta"], x["G"])),
        ("wy_dqkg", P.PallasWYDqkg(**kw, block_v=16), S.ReferenceWYDqkg(),
         (sc, x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"], x["qg"], x["kg"], x["h"], dh, x["v_new"], do,
          dv_new)),
        ("intra_bwd", P.PallasIntraBackward(**kw), S.ReferenceIntraBackward(),
         (sc, x["q"], x["k"], x["beta"], x["G"], jnp.tril(rand_like(x["Aqk"], 13)), grads)),
    ]
    pairs = [(name, jitted(pal), jitted(ref), args) for name, pal, ref, args in pairs]
    for name, pal, ref, args in pairs:
        _close(pal(*args), ref(*args), tol, name)
    _with_G_lo(pairs, x["G"], tol)
    # NaN in k at row 5, column 50 (the fourth block) of chunk 1, head 0 of row 0
    k_bad = x["k"].at[0, 0, 1, 5, 50].set(jnp.nan)
    w = np.asarray(pairs[0][1](x["q"], k_bad, x["v"], x["beta"], x["G"], x["Akk"]).w)
    w_ok = np.asarray(pairs[0][1](*pairs[0][3]).w)
    hit = w[0, 0, 1]
    assert np.isnan(hit[5:, 48:64]).all() and not np.isnan(hit[:5]).any()
    assert not np.isnan(np.delete(hit, np.s_[48:64], axis=1)).any()
    others = np.isnan(w).copy()
    others[0, 0, 1] = False
    assert not others.any()
    np.testing.assert_array_equal(np.delete(hit, np.s_[48:64], axis=1), np.delete(w_ok[0, 0, 1], np.s_[48:64], axis=1))


GATE_CONFIGS = [
    dict(),
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    dict(use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
]


@pytest.mark.parametrize("opts", GATE_CONFIGS[1:], ids=["softplus_l2_sigmoid", "lower_bound_neg"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_triton_gate_kernels_over_column_blocks(opts, dtype, tol):
    """The Triton F1 and B5 take K = 72 (padded to 128) 16 columns at a time, the row
    statistics (l2 norms, B5's <dy, y>) over every block first, and B5 the chunk's rows in
    reverse: equal to the reference stages; a non-finite gate in one column makes its row
    and the rows after it NaN in every column of G (as the reference's), in no other row."""
    cfg = KDAConfig(scale=1.0, **opts)
    R, HV, NC, C, K = 1, 2, 2, 16, 72
    r = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    q, k, g, beta = f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C)
    A_log, dt_bias = f(HV) * 0.3, f(HV * K)
    valid = make_layout(R, NC * C - 3, C).valid
    kw = dict(target="triton", interpret=True)
    assert len(column_blocks("triton", 128, P._gate.GATE_BLOCK)) == 8
    args = (cfg, q, k, g, beta, A_log, dt_bias, valid)
    act_p, act_r = jitted(P.PallasGate(**kw))(*args), jitted(S.ReferenceGate())(*args)
    _close(act_p, act_r, tol, "gate")
    bargs = (cfg, act_r, g, A_log, dt_bias, valid, f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C),
             f(R, HV, NC, C, K))
    _close(jitted(P.PallasGateBackward(**kw))(*bargs), jitted(S.ReferenceGateBackward())(*bargs), tol, "gate_bwd")
    # NaN in column 50 (the fourth block) of row 5 of chunk 1, head 0
    bad = g.at[0, 0, 1, 5, 50].set(jnp.nan)
    G_p = np.asarray(jitted(P.PallasGate(**kw))(cfg, q, k, bad, beta, A_log, dt_bias, valid).G)
    G_r = np.asarray(jitted(S.ReferenceGate())(cfg, q, k, bad, beta, A_log, dt_bias, valid).G)
    np.testing.assert_array_equal(np.isnan(G_p), np.isnan(G_r))
    assert np.isnan(G_p[0, 0, 1, 5:]).all() and not np.isnan(G_p[0, 0, 1, :5]).any()
    assert not np.isnan(np.delete(G_p.reshape(-1, C, K), 1, axis=0)).any()  # (head 0, chunk 1) is block 1
    ok = ~np.isnan(G_r)
    assert_close(G_p[ok], G_r[ok], tol, "G beside the NaN")


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("opts", GATE_CONFIGS, ids=["plain", "softplus_l2_sigmoid", "lower_bound_neg"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_gate_stages(target, interpret, opts, dtype, tol):
    cfg = KDAConfig(scale=1.0, **opts)
    R, HV, NC, C, K = 2, 2, 2, 16, 12
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    gate = cfg.use_gate_in_kernel
    q, k, beta = f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C)
    g = f(R, HV, NC, C, K) if gate else -jnp.abs(f(R, HV, NC, C, K))
    A_log, dt_bias = (f(HV) * 0.3, f(HV * K)) if gate else (None, None)
    valid = make_layout(R, NC * C - 5, C).valid
    kw = dict(target=target, interpret=interpret)
    args = (cfg, q, k, g, beta, A_log, dt_bias, valid)
    # split (the default): in float32 G as G + G_lo, bit for bit the reference's; else G alone
    for split in (True, False):
        act_p, act_r = jitted(P.PallasGate(**kw, split=split))(*args), jitted(S.ReferenceGate(split=split))(*args)
        _close(act_p, act_r, tol, f"gate split={split}")
        assert (act_p.G_lo is None) == (act_r.G_lo is None) == (not split or dtype == jnp.float64)
        if act_r.G_lo is not None:
            np.testing.assert_array_equal(np.asarray(act_p.G), np.asarray(act_r.G))
            np.testing.assert_array_equal(np.asarray(act_p.G_lo), np.asarray(act_r.G_lo))
    bargs = (cfg, act_r, g if gate else None, A_log, dt_bias, valid, f(R, HV, NC, C, K), f(R, HV, NC, C, K),
             f(R, HV, NC, C), f(R, HV, NC, C, K))
    _close(jitted(P.PallasGateBackward(**kw))(*bargs), jitted(S.ReferenceGateBackward())(*bargs), tol, "gate_bwd")


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("lower_bound", [None, -2000.0, "given"], ids=["softplus", "lower-bound", "log-decays"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_gate_backward_below_the_floor(target, interpret, lower_bound, dtype, tol):
    """In-kernel gates down to about -2000, or log decays given directly from -1 to about
    -1e10 and -inf (below both dtypes' floors): where F1 clamps the activated decay, B5's dg is 0 to
    the bit, as the reference's (tests/stages/test_gate.py)."""
    given = lower_bound == "given"
    cfg = KDAConfig(scale=1.0) if given else KDAConfig(scale=1.0, use_gate_in_kernel=True, lower_bound=lower_bound)
    R, HV, NC, C, K = 2, 2, 2, 16, 12
    r = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    q, k, beta, g = f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C), f(R, HV, NC, C, K) * 40.0
    A_log, dt_bias = jnp.full((HV,), 3.0, dtype), f(HV * K)
    if given:
        g, A_log, dt_bias = -jnp.exp(0.2 * jnp.abs(g)).at[1, 0, 1, 2, :3].set(jnp.inf), None, None  # (-1 to ~-1e10)
    valid = make_layout(R, NC * C - 5, C).valid
    act = jitted(S.ReferenceGate())(cfg, q, k, g, beta, A_log, dt_bias, valid)
    bargs = (cfg, act, g, A_log, dt_bias, valid, f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C),
             f(R, HV, NC, C, K))
    got = jitted(P.PallasGateBackward(target=target, interpret=interpret))(*bargs)
    _close(got, jitted(S.ReferenceGateBackward())(*bargs), tol, "gate_bwd")
    deep = (g if given else in_kernel_decay(g, A_log, dt_bias, lower_bound)) < log_decay_floor(dtype)
    assert 0.05 < float(jnp.mean(deep)) < 0.9
    np.testing.assert_array_equal(np.asarray(got.dg)[np.asarray(deep)], 0.0)


# Shared chunks of 16 for the reset cases: sequences starting inside a chunk, one on a chunk
# boundary (16), a one-token one (5..6), an empty one (6..6), a chunk holding three.
SHARED_CU = [0, 5, 6, 6, 16, 29, 45]


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("opts", GATE_CONFIGS, ids=["plain", "softplus_l2_sigmoid", "lower_bound_neg"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_gate_stages_with_resets(target, interpret, opts, dtype, tol):
    """Shared chunks (``reset``: sequences starting inside a chunk, one of them on a chunk
    boundary, a one-token one, an empty one): F1 gives each first token the reset log
    decay, B5 sums ``dG`` within each sequence and gives a first token no gradient, as the
    reference stages; a log decay of -inf at a first token, too."""
    cfg = KDAConfig(scale=1.0, **opts)
    C, K, HV = 16, 12, 2
    cu = jnp.asarray(SHARED_CU, jnp.int32)
    L = make_shared_layout(45, C, cu)
    R, NC = L.valid.shape[:2]
    assert L.reset is not None and int(L.reset.sum()) == 5  # (every non-empty sequence's first token)
    r = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    gate = cfg.use_gate_in_kernel
    q, k, beta = f(R, HV, NC, C, K), f(R, HV, NC, C, K), f(R, HV, NC, C)
    g = f(R, HV, NC, C, K) if gate else -jnp.abs(f(R, HV, NC, C, K))
    if not gate:  # a log decay of -inf at a first token (token 5), too
        g = g.at[0, 1, 0, 5, 3].set(-jnp.inf)
    A_log, dt_bias = (f(HV) * 0.3, f(HV * K)) if gate else (None, None)
    kw = dict(target=target, interpret=interpret)
    args = (cfg, q, k, g, beta, A_log, dt_bias, L.valid)
    for split in (True, False):
        act_p = jitted(P.PallasGate(**kw, split=split))(*args, reset=L.reset)
        act_r = jitted(S.ReferenceGate(split=split))(*args, reset=L.reset)
        _close(act_p, act_r, tol, f"gate split={split}")
        if act_r.G_lo is not None:
            np.testing.assert_array_equal(np.asarray(act_p.G), np.asarray(act_r.G))
    bargs = (cfg, act_r, g if gate else None, A_log, dt_bias, L.valid, f(R, HV, NC, C, K), f(R, HV, NC, C, K),
             f(R, HV, NC, C), f(R, HV, NC, C, K))
    got = jitted(P.PallasGateBackward(**kw))(*bargs, reset=L.reset)
    want = jitted(S.ReferenceGateBackward())(*bargs, reset=L.reset)
    _close(got, want, tol, "gate_bwd")
    first = np.broadcast_to(np.asarray(L.reset)[:, None, :, :, None], got.dg.shape)
    assert np.all(np.asarray(got.dg)[first] == 0)


@pytest.mark.parametrize("target,interpret", MODES)
@pytest.mark.parametrize("dtype,tol,lo", [(jnp.float64, 1e-12, False), (jnp.float32, 1e-5, False),
                                          (jnp.float32, 1e-5, True)], ids=["f64", "f32", "f32-G_lo"])
def test_wy_stages_with_resets(target, interpret, dtype, tol, lo):
    """Shared chunks (``reset``: sequences starting inside a chunk, one on a chunk boundary,
    a one-token one, an empty one, a chunk holding three): F3, B0 (with the state kernel)
    and B3 equal the reference stages: ``e^G`` only where the chunk's start state reaches,
    ``e^(Γ - G)`` only for the chunk's last sequence, no decay of the state through a chunk
    in which a sequence starts, ``dL`` zero between sequences; float32 with ``G_lo`` too.
    Strong gates (log decay -1000 at 5% of the entries)."""
    C, K, V, HV = 16, 12, 6, 2
    cu = jnp.asarray(SHARED_CU, jnp.int32)
    L = make_shared_layout(45, C, cu)
    R, NC = L.valid.shape[:2]
    x = chunked(3, R=R, HV=HV, NC=NC, C=C, K=K, V=V, strong=True)
    x = {n: (a.astype(dtype) if hasattr(a, "dtype") and a.dtype.kind == "f" else a) for n, a in x.items()}
    r = np.random.default_rng(4)
    f = lambda *s: jnp.asarray(r.normal(size=s), dtype)
    g = -jnp.abs(f(R, HV, NC, C, K)) * 0.3
    g = jnp.where(jnp.asarray(r.uniform(size=g.shape) < 0.05), -1000.0, g).astype(dtype)
    act = jitted(S.ReferenceGate(split=lo))(KDAConfig(scale=1.0), x["q"], x["k"], g, x["beta"], None, None, L.valid,
                                    reset=L.reset)
    G, G_lo = act.G, act.G_lo
    assert (G_lo is not None) == lo
    Akk = jitted(S.ReferenceIntra())(x["scale"], x["q"], x["k"], x["beta"], G, G_lo=G_lo, reset=L.reset).Akk
    kw = dict(target=target, interpret=interpret)
    fwd = (x["q"], x["k"], x["v"], x["beta"], G, Akk)
    opt = dict(G_lo=G_lo, reset=L.reset)
    wy = jitted(S.ReferenceWY())(*fwd, **opt)
    got = jitted(P.PallasWY(**kw))(*fwd, **opt)
    _close(got, wy, tol, "wy")
    # (e^-60 between sequences would pass any tolerance: the masks give exact zeros)
    seg = np.asarray(segments(L.reset))[:, None, :, :, None]
    later, before_last = np.broadcast_to(seg != 0, got.w.shape), np.broadcast_to(seg != seg[..., -1:, :], got.w.shape)
    assert later.any() and before_last.any()
    assert np.all(np.asarray(got.w)[later] == 0) and np.all(np.asarray(got.qg)[later] == 0)
    assert np.all(np.asarray(got.kg)[before_last] == 0)
    h0 = f(1, HV, K, V) * 0.3  # (the shared layout's state table: one entry, entered at its start)
    got = jitted(P.PallasRecompute(**kw))(*fwd, h0, L, **opt)
    # (the entry is named at chunks 0 and 2 as last, 0 and 1 as first: final and dh0 are the
    # latest / earliest chunk's, as the kernels write them; a GPU's scatter picked either)
    _close(got, jitted(S.ReferenceRecompute())(*fwd, h0, L, **opt), tol, "recompute")
    h, v_new = got[1].h, got[1].v_new
    dargs = (x["scale"], wy.qg, wy.kg, wy.w, G, f(*v_new.shape), f(*v_new.shape), f(*h0.shape), L)
    _close(jitted(P.PallasDhu(**kw))(*dargs, reset=L.reset), jitted(S.ReferenceDhu())(*dargs, reset=L.reset), tol, "dhu")
    bwd = (x["scale"], x["q"], x["k"], x["v"], x["beta"], G, Akk, wy.qg, wy.kg, h, f(*h.shape), v_new,
           f(*v_new.shape), f(*v_new.shape))
    got, want = jitted(P.PallasWYDqkg(**kw))(*bwd, **opt), jitted(S.ReferenceWYDqkg())(*bwd, **opt)
    _close(got, want, tol, "wy_dqkg")
    assert np.all(np.asarray(got.dq)[later] == 0) and np.all(np.asarray(got.dk)[later & before_last] == 0)
    # A huge start state in each chunk where a sequence starts after its first token changes
    # nothing at the later sequences' tokens (its decay to the chunk's end is zero, not
    # e^-60 in float64 or e^-20 in float32)
    stops = ~np.asarray(state_passes(L.reset))[..., None]  # [R, 1, NC, 1, 1]
    assert stops.any()
    big = list(bwd)
    big[9] = jnp.where(stops, h * (1e30 if dtype == jnp.float32 else 1e100), h)  # (e^-60 * 1e100: plain to see)
    got2 = jitted(P.PallasWYDqkg(**kw))(*big, **opt)
    for name in ("dq", "dk", "dG"):
        assert_close(np.asarray(getattr(got2, name))[later], np.asarray(getattr(got, name))[later], tol, name)
    across = seg != np.swapaxes(seg, -1, -2)
    assert across.any() and np.all(np.asarray(got.dL)[np.broadcast_to(across, got.dL.shape)] == 0)


def _shared_chunk_inputs(seed):
    """``(layout, chunked inputs, G, F2's outputs)``: sequences ``SHARED_CU`` sharing chunks
    of 16 (HV=2, K=12, V=6, float32), G and F2's outputs from the reference stages."""
    C, K, V, HV = 16, 12, 6, 2
    L = make_shared_layout(45, C, jnp.asarray(SHARED_CU, jnp.int32))
    R, NC = L.valid.shape[:2]
    x = {n: (a.astype(jnp.float32) if hasattr(a, "dtype") and a.dtype.kind == "f" else a)
         for n, a in chunked(seed, R=R, HV=HV, NC=NC, C=C, K=K, V=V).items()}
    G = jitted(S.ReferenceGate())(KDAConfig(scale=1.0), x["q"], x["k"], -jnp.abs(x["q"]) * 0.1, x["beta"], None,
                                  None, L.valid, reset=L.reset).G
    return L, x, G, jitted(S.ReferenceIntra())(x["scale"], x["q"], x["k"], x["beta"], G, reset=L.reset)


@pytest.mark.parametrize("target,interpret", MODES[:2])
def test_forward_products_keep_an_overflow_in_its_sequence(target, interpret):
    """Shared chunks: inf in one sequence's keys, values, ``v_new`` rows and start state
    (what float32 overflow leaves there) reaches F3's ``w``, ``u`` and F5's ``o`` only at
    that sequence's own tokens from it on, as in the reference stages (F5: the same entries
    non-finite; the finite ones close); every other sequence's entries are bit-identical to those of a
    call without the inf (``lower_dot(..., seg)``: the zeros between sequences never meet
    it). Before: the rows after it in the chunk, of every sequence, were NaN."""
    L, x, G, intra = _shared_chunk_inputs(5)
    (R, HV, NC, C, K), V = x["q"].shape, x["v"].shape[-1]
    Aqk, Akk = intra.Aqk, intra.Akk
    tok = np.arange(NC * C).reshape(1, 1, NC, C, 1)
    ours = jnp.asarray((tok >= 16) & (tok < 29))  # sequence 4 (tokens 16..28): its own chunk's start, then chunk 1
    rest = np.broadcast_to(~np.asarray(ours) & np.asarray(L.valid)[:, None, :, :, None], (R, HV, NC, C, V))
    inf = lambda a, where: jnp.where(where & (jnp.arange(a.shape[-1]) % 2 == 0), jnp.inf, a)
    kw = dict(target=target, interpret=interpret)
    wy_in = lambda k, v: (x["q"], k, v, x["beta"], G, Akk)
    base = jitted(P.PallasWY(**kw))(*wy_in(x["k"], x["v"]), reset=L.reset)
    big = wy_in(inf(x["k"], ours & (tok == 20)), inf(x["v"], ours & (tok == 18)))
    got = jitted(P.PallasWY(**kw))(*big, reset=L.reset)
    want = jitted(S.ReferenceWY())(*big, reset=L.reset)
    for name, at in (("w", 20), ("u", 18)):  # (the reference makes w's and u's rows NaN together: one product)
        a, b, ref = (np.asarray(getattr(o, name)) for o in (got, base, want))
        keep = np.broadcast_to(rest[..., :1], a.shape)
        np.testing.assert_array_equal(a[keep], b[keep], err_msg=name)
        reached = np.broadcast_to(np.asarray(ours) & (tok >= at), a.shape)
        np.testing.assert_array_equal(~np.isfinite(a), reached, err_msg=name)
        both = np.isfinite(a) & np.isfinite(ref)
        assert_close(np.where(both, a, 0), np.where(both, ref, 0), 1e-5, name)
    # F5: inf in v_new at token 20 and in the state entering chunk 1 (which sequence 4 runs through)
    h = rand_like(jnp.zeros((R, HV, NC, K, V), jnp.float32), 6)
    f5_in = lambda v_new, h: (x["scale"], base.qg, h, Aqk, v_new)
    h_big = jnp.where((jnp.arange(NC)[:, None, None] == 1) & (jnp.arange(V) % 2 == 0), jnp.inf, h)
    base_o = jitted(P.PallasOutput(**kw))(*f5_in(base.u, h), reset=L.reset)
    big = f5_in(inf(base.u, ours & (tok == 20)), h_big)
    got = np.asarray(jitted(P.PallasOutput(**kw))(*big, reset=L.reset))
    ref = np.asarray(jitted(S.ReferenceOutput())(*big, reset=L.reset))
    np.testing.assert_array_equal(got[rest], np.asarray(base_o)[rest])
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    assert not np.isfinite(got).all()
    assert_close(np.where(np.isfinite(ref), got, 0), np.where(np.isfinite(ref), ref, 0), 1e-5, "o")


@pytest.mark.parametrize("target,interpret", MODES[:2])
def test_wy_dqkg_finds_a_dw_row_that_overflows_from_finite_operands(target, interpret):
    """Shared chunks: B3's ``dw = -dv_new h^T`` overflows in one row from finite ``dv_new``
    and ``h`` (1e20 each). The kernel takes a non-finite row of ``dw`` as zero within its
    sequence, as it does every non-finite row, so the stage finds the row outside it: its
    outputs are non-finite exactly where the reference stage's are (the rows of ``dk``,
    ``dbeta``, ``dG`` and ``dL`` the row reaches in its own sequence), the finite ones close,
    and every other sequence's entries bit-identical to those of a call without it.
    Before: those rows came back finite (the row read as zero)."""
    L, x, G, intra = _shared_chunk_inputs(7)
    (R, HV, NC, C, K), V, Akk = x["q"].shape, x["v"].shape[-1], intra.Akk
    wy = jitted(S.ReferenceWY())(x["q"], x["k"], x["v"], x["beta"], G, Akk, reset=L.reset)
    h, dh = (rand_like(jnp.zeros((R, HV, NC, K, V), jnp.float32), s) for s in (1, 2))
    v_new, do, dv_new = (rand_like(x["v"], s) for s in (3, 4, 5))
    tok = np.arange(NC * C).reshape(1, 1, NC, C, 1)
    ours = (tok >= 16) & (tok < 29)  # sequence 4 (tokens 16..28), the first of chunk 1
    # chunk 1's start state and dv_new at 1e20: dw's row 20 overflows (V terms of 1e40)
    h_big = jnp.where(jnp.arange(NC)[:, None, None] == 1, 1e20, h)
    dv_big = jnp.where(jnp.asarray(ours & (tok == 20)), 1e20, dv_new)
    call = lambda stage, h, dv_new: jitted(stage)(x["scale"], x["q"], x["k"], x["v"], x["beta"], G, Akk, wy.qg,
                                                  wy.kg, h, dh, v_new, do, dv_new, reset=L.reset)
    kw = dict(target=target, interpret=interpret)
    base = call(P.PallasWYDqkg(**kw), h, dv_new)
    got = call(P.PallasWYDqkg(**kw), h_big, dv_big)
    want = call(S.ReferenceWYDqkg(), h_big, dv_big)
    rest = ~ours & np.asarray(L.valid)[:, None, :, :, None]  # [R, 1, NC, C, 1]
    for name in ("dq", "dk", "dv", "dbeta", "dG", "dL"):
        a, b, ref = (np.asarray(getattr(o, name)) for o in (got, base, want))
        a_, b_, ref_ = (y.reshape(y.shape[:4] + (-1,)) if y.ndim > 4 else y[..., None] for y in (a, b, ref))
        keep = np.broadcast_to(rest, a_.shape[:4] + (1,))[..., 0]
        np.testing.assert_array_equal(a_[keep], b_[keep], err_msg=f"{name}: the other sequences")
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(ref), err_msg=f"{name}: where it is not finite")
        both = np.isfinite(a) & np.isfinite(ref)
        assert_close(np.where(both, a, 0), np.where(both, ref, 0), 1e-5, name)
    for name in ("dk", "dbeta", "dG", "dL"):  # rows 16..20 of sequence 4: reached
        assert not np.isfinite(np.asarray(getattr(got, name))).all(), name


@pytest.mark.parametrize("fields", [dict(num_warps=16), dict(rows=16), dict(rows=32)],
                         ids=["16-warps", "rows16", "rows32"])
def test_intra_inverse_overflow_stays_in_its_sequence_without_the_selects(fields):
    """Triton's F2 at 16 warps or on smaller programs (the ``fastest-modelled`` and
    ``candidate-rows16-f2`` tunings) inverts without selecting the doubling's products by
    sequence. Shared chunks, one sequence's keys at 1e19 (``L`` finite, its inverse
    overflows): every other sequence's ``Aqk`` and ``Akk`` entries are bit-identical to
    those of a call without it, and ``Akk``'s non-finite entries those of the whole-chunk
    kernel with the selects (8 warps), a superset of the reference's; the stage ran the
    kernel again with the selects (``_isolated``). A dense call has no such second kernel."""
    L, x, G, _ = _shared_chunk_inputs(5)
    (R, HV, NC, C, K) = x["q"].shape
    tok = np.arange(NC * C).reshape(1, 1, NC, C, 1)
    ours = (tok >= 16) & (tok < 29)  # sequence 4 (tokens 16..28): chunk 0's end, then chunk 1
    big = jnp.where(jnp.asarray(ours & (tok >= 18)), x["k"] * 1e19, x["k"])
    call = lambda stage, k: jitted(stage)(x["scale"], x["q"], k, x["beta"], G, reset=L.reset)  # noqa: E731
    stage = P.PallasIntra(target="triton", interpret=True, **fields)
    base, got = call(stage, x["k"]), call(stage, big)
    selected = call(P.PallasIntra(target="triton", interpret=True), big)
    want = call(S.ReferenceIntra(), big)
    rest = np.broadcast_to(~ours & np.asarray(L.valid)[:, None, :, :, None], (R, HV, NC, C, 1))[..., 0]
    for name in ("Aqk", "Akk"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(base, name))
        np.testing.assert_array_equal(a[rest], b[rest], err_msg=f"{name}: the other sequences")
    a, ref = np.asarray(got.Akk), np.asarray(want.Akk)
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(np.asarray(selected.Akk)))
    assert not np.isfinite(a).all() and (np.isfinite(a) <= np.isfinite(ref)).all()
    both = np.isfinite(a) & np.isfinite(ref)
    assert_close(np.where(both, a, 0), np.where(both, ref, 0), 1e-5, "Akk")
    around = lambda **kw: _outside_kernels(jax.make_jaxpr(  # noqa: E731
        lambda *a: stage(x["scale"], *a, **kw))(x["q"], x["k"], x["beta"], G).jaxpr)
    assert "cond" not in around() and around(reset=L.reset).count("cond") == 1


def _outside_kernels(jaxpr) -> list:
    """The primitives of ``jaxpr`` and of the jaxprs it calls, outside Pallas kernels."""
    names = []
    for e in jaxpr.eqns:
        names.append(e.primitive.name)
        if e.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                names += _outside_kernels(sub)
    return names


# Views of the caller's arrays (kdax._layouts.tokens): float64 read as such, bf16 read as float32,
# on Triton (interpreted, and compiled where there is a device); TPU blocks take the copy,
# checked once.
VIEW_CASES = [
    pytest.param(*m.values, *d, id=f"{m.id}-{d[0].__name__}", marks=m.marks)
    for m in MODES if m.id != "tpu-interpret"
    for d in [(jnp.float64, jnp.float64, "highest"), (jnp.bfloat16, jnp.float32, "fast")]
] + [pytest.param("tpu", True, jnp.bfloat16, jnp.float32, "highest", id="tpu-interpret-bfloat16")]


@pytest.mark.parametrize("target,interpret,in_dtype,dt,policy", VIEW_CASES)
def test_gate_kernels_read_the_callers_layout(target, interpret, in_dtype, dt, policy):
    """F1 handed ``Tokens`` views of ``[B, T, H, K]`` inputs (bf16 read as float32, q/k heads
    shared by two value heads, non-finite elements cleaned as chunk_kda cleans them) and
    B5 a view of the raw gate give, bit for bit, what they give on the chunked copies:
    Triton reads the caller's array block by block (``token_operand``); TPU blocks take the
    copy. At K = 24 (not a power of 2) Triton takes the copy too. (``policy`` unused: F1
    and B5 have no products.)"""
    from kdax._numerics import isolation as _isolation
    from kdax._layouts.tokens import token_inputs

    cfg = KDAConfig(scale=1.0, **GATE_CONFIGS[1])
    B, T, H, HV, C = 2, 32, 1, 2, 16
    r = np.random.default_rng(5)
    kinds = _isolation.input_kinds(True, True)
    for K in (32, 24):
        f = lambda *s: jnp.asarray(r.normal(size=s), in_dtype)
        q, k, g, beta = f(B, T, H, K), f(B, T, H, K), f(B, T, HV, K), f(B, T, HV)
        q, g, beta = q.at[1, 3, 0, 5].set(jnp.inf), g.at[0, 20, 1, 2].set(jnp.nan), beta.at[1, 30, 0].set(jnp.nan)
        A_log, dt_bias = jnp.asarray(r.normal(size=HV) * 0.3, dt), jnp.asarray(r.normal(size=HV * K), dt)
        valid = make_layout(B, T, C).valid
        views = token_inputs((q, k, None, g, beta), HV, C, dt, kinds)
        chunked = [None if v is None else v.chunked() for v in views]
        kw = dict(target=target, interpret=interpret)
        got = jitted(P.PallasGate(**kw))(cfg, *views[:2], *views[3:], A_log, dt_bias, valid)
        want = jitted(P.PallasGate(**kw))(cfg, *chunked[:2], *chunked[3:], A_log, dt_bias, valid)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        _close(want, jitted(S.ReferenceGate())(cfg, *chunked[:2], *chunked[3:], A_log, dt_bias, valid),
               1e-12 if dt == jnp.float64 else 1e-5, "gate")
        d = [jnp.asarray(r.normal(size=x.shape), dt) for x in (want.q, want.k, want.beta, want.G)]
        got = jitted(P.PallasGateBackward(**kw))(cfg, want, views[3], A_log, dt_bias, valid, *d)
        ref = jitted(P.PallasGateBackward(**kw))(cfg, want, chunked[3], A_log, dt_bias, valid, *d)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("target,interpret,in_dtype,dt,policy", VIEW_CASES)
def test_values_read_from_the_callers_layout(target, interpret, in_dtype, dt, policy):
    """F3, B0 (its F3) and B3 handed a ``Tokens`` view of ``v [B, T, HV, V]``, B1, B2 and
    B3 one of ``do`` (bf16 read as such: under "fast" B2 takes it as its bf16 product
    operand, cast in the kernel, where the chunked copy was cast outside) give, bit for
    bit, what they give on the chunked copies; Triton reads the caller's arrays (B2 the
    whole sequence of its row and head, chunk by chunk), TPU takes the copies. (Under
    "fast", XLA:CPU may sum a product of bf16 values in another order when it sees them
    come from bf16 in the interpreted kernel: equal to float32 rounding there, rel-RMS
    1e-6. In float64 the interpreted B3 with its last rows read as one-row loads
    (``kdax.pallas._wy.last_rows``) came out one rounding apart in dG, every entry: the two
    programs are compiled by XLA:CPU at backend O0 (tests/conftest.py), the same
    operations evaluated differently; at XLA's default level they agree bit for bit. So
    float64 asks for a rel-RMS within 2 eps (NaN never passes).)"""
    from kdax._layouts.tokens import Tokens

    x = _x(dt, 16, 16, 16)
    R, HV, NC, C, V = x["v"].shape
    r = np.random.default_rng(7)
    raw = lambda: jnp.asarray(r.normal(size=(R, NC * C, HV, V)), in_dtype)
    # (a NaN in v: the view cleans it as the copy does)
    v, do = Tokens(raw().at[0, 5, 1, 3].set(jnp.nan), HV, C, np.dtype(dt), "any"), Tokens(raw(), HV, C, np.dtype(dt))
    dv_new, layout = x["v_new"], x["layout"]
    kw = dict(target=target, interpret=interpret)
    dht = jnp.asarray(r.normal(size=x["h0"].shape), dt)
    assert layout.dense
    calls = [
        ("wy", P.PallasWY(**kw, block_k=16), lambda v, d: (x["q"], x["k"], v, x["beta"], x["G"], x["Akk"])),
        ("recompute", P.PallasRecompute(**kw),
         lambda v, d: (x["q"], x["k"], v, x["beta"], x["G"], x["Akk"], x["h0"], layout)),
        ("dav", P.PallasDAv(**kw), lambda v, d: (dv_new, x["Aqk"], d)),
        ("dhu", P.PallasDhu(**kw),
         lambda v, d: (x["scale"], x["qg"], x["kg"], x["w"], x["G"], d, dv_new, dht, layout)),
        ("wy_dqkg", P.PallasWYDqkg(**kw, block_k=16, block_v=16),
         lambda v, d: (x["scale"], x["q"], x["k"], v, x["beta"], x["G"], x["Akk"], x["qg"], x["kg"], x["h"],
                       x["h"], dv_new, d, dv_new)),
    ]
    calls = [(name, jitted(stage), args) for name, stage, args in calls]
    for name, stage, args in calls:
        got = stage(*args(v, do), precision=policy)
        want = stage(*args(v.chunked(), do.chunked()), precision=policy)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if policy == "fast":
                assert_close(a, b, 1e-6, name)
            else:
                assert_close(a, b, 2 * np.finfo(np.float64).eps, name)


@pytest.mark.parametrize("interpret", [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="device", marks=pytest.mark.skipif(jax.default_backend() != "gpu", reason="no GPU")),
])
@pytest.mark.parametrize("V,block_v", [(6, 64), (40, 16)], ids=["one_value_block", "four_value_blocks"])
def test_state_kernels_varlen(interpret, V, block_v):
    """Packed varlen (lengths 10, 0, 1, 20): the state kernels follow the layout's
    sequence boundaries (an empty sequence keeps h0 / passes dht to dh0): Triton with the
    value columns in one program or split over several (V = 40 padded to 64, blocks of
    16), TPU (interpret mode) through its scalar-prefetched boundaries."""
    layout = make_layout(1, 31, 16, jnp.array([0, 10, 10, 11, 31], jnp.int32))
    NC = layout.num_chunks
    x = chunked(3, R=1, HV=2, NC=NC, C=16, K=12, V=V)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    h0 = rand_like(jnp.zeros((4, 2, 12, V)), 1)
    args = (w, u, kg, x["G"], h0, layout)
    ref = jitted(S.ReferenceState())(*args)
    kw = dict(target="triton", interpret=interpret, block_v=block_v)
    _close(jitted(P.PallasState(**kw))(*args), ref, 1e-12, "state")
    do, dv, dht = rand_like(x["v"], 2), rand_like(x["v"], 3), rand_like(h0, 4)
    bargs = (x["scale"], qg, kg, w, x["G"], do, dv, dht, layout)
    _close(jitted(P.PallasDhu(**kw))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu")
    for stage in (P.PallasState, P.PallasDhu):
        with pytest.raises(ValueError, match="block_v"):
            stage(target="triton", block_v=24)
    tpu = dict(target="tpu", interpret=True)
    _close(jitted(P.PallasState(**tpu))(*args), ref, 1e-12, "state (tpu)")
    _close(jitted(P.PallasDhu(**tpu))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu (tpu)")
    with pytest.raises(ValueError, match="target"):
        P.PallasIntra(target="cuda")


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_dhu_kernels_take_dh_start(target):
    """``dh_start`` (cotangents of the chunk-start states, added to each chunk's start-state
    cotangent in the kernel): the reference B2's numbers, float64 to 1e-12, dense (two
    rows) and packed varlen (lengths 10, 0, 1, 20; Triton's value columns over two
    programs); zeros give what no ``dh_start`` gives, bit for bit."""
    kw = dict(target=target, interpret=True) | ({"block_v": 16} if target == "triton" else {})
    for layout, R, N in ((make_layout(2, 48, 16), 2, 2),
                         (make_layout(1, 31, 16, jnp.array([0, 10, 10, 11, 31], jnp.int32)), 1, 4)):
        NC, V = layout.num_chunks, 24
        x = chunked(9, R=R, HV=2, NC=NC, C=16, K=12, V=V)
        _, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
        w, _, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
        dht = rand_like(jnp.zeros((N, 2, 12, V)), 4)
        bargs = (x["scale"], qg, kg, w, x["G"], rand_like(x["v"], 2), rand_like(x["v"], 3), dht, layout)
        start = rand_like(jnp.zeros((R, 2, NC, 12, V)), 5)
        got = jitted(P.PallasDhu(**kw))(*bargs, dh_start=start)
        _close(got, jitted(S.ReferenceDhu())(*bargs, dh_start=start), 1e-12, f"dhu with dh_start, {N} sequences")
        assert not np.allclose(got.dh, jitted(P.PallasDhu(**kw))(*bargs).dh)
        zero = jitted(P.PallasDhu(**kw))(*bargs, dh_start=jnp.zeros_like(start))
        for a, b in zip(jax.tree.leaves(zero), jax.tree.leaves(jitted(P.PallasDhu(**kw))(*bargs))):
            np.testing.assert_array_equal(a, b)


def test_tpu_state_kernels_follow_any_layout():
    """Two sequences in one row, the second first (``first``/``last`` name sequence 1 in
    chunks 0-1, sequence 0 in chunks 2-3; ``pos`` None, not ``dense``): the TPU state
    kernels start each from its own h0 / dht and leave its final / dh0 in its own entry,
    as the reference stages; and the one-sequence-per-row layout as before."""
    x = chunked(5, R=1, NC=4)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    first, last = jnp.array([[1, -1, 0, -1]], jnp.int32), jnp.array([[-1, 1, -1, 0]], jnp.int32)
    two = layout_of(first, last, [False, False])
    h0 = rand_like(jnp.zeros((2,) + x["h0"].shape[1:]), 9)
    kernel = jitted(P.PallasState(target="tpu", interpret=True))
    args = (w, u, kg, x["G"], h0, two)
    _close(kernel(*args), jitted(S.ReferenceState())(*args), 1e-12, "state")
    dv, dht = rand_like(x["v"], 3), rand_like(h0, 4)
    bargs = (x["scale"], qg, kg, w, x["G"], x["v"], dv, dht, two)
    _close(jitted(P.PallasDhu(target="tpu", interpret=True))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu")
    args = (w, u, kg, x["G"], x["h0"], x["layout"])
    _close(kernel(*args), jitted(S.ReferenceState())(*args), 1e-12, "state (dense)")


@pytest.mark.parametrize("target,interpret", MODES[1:])
def test_wy_dqkg_value_blocks(target, interpret):
    """B3 with the value axis walked in several blocks (Triton layout: V = 40 padded to 64,
    4 blocks of 16) equals the reference; block_v must be a power of 2 of at least 16."""
    x = _x(jnp.float64, 16, 12, 40, seed=2)
    dh, do, dv_new = rand_like(x["h"], 5), rand_like(x["v"], 3), rand_like(x["v"], 6)
    args = (x["scale"], x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"], x["qg"], x["kg"], x["h"], dh,
            x["v_new"], do, dv_new)
    got = jitted(P.PallasWYDqkg(target=target, interpret=interpret, block_v=16))(*args)
    _close(got, jitted(S.ReferenceWYDqkg())(*args), 1e-12, "wy_dqkg")
    for bad in (8, 48):
        with pytest.raises(ValueError, match="block_v"):
            P.PallasWYDqkg(target=target, block_v=bad)


def test_wy_dqkg_dl_by_row_blocks():
    """B3's dL in row blocks (``dl_by_rows``), equal to the reference: chosen by itself at
    chunk 128 in float64 (the whole form's two [C, C] operands, 256 KiB, over sm_90's
    shared memory; 64 rows: 192 KiB), and asked for (``dl_rows=16``) on shared chunks,
    where dL is zero between sequences."""
    from kdax.pallas._wy import dl_rows

    assert dl_rows(128, 8, False) == 64 and dl_rows(64, 8, False) is None and dl_rows(128, 2, False) is None
    assert dl_rows(128, 4, True) == 64 and dl_rows(64, 4, True) is None
    x = _x(jnp.float64, 128, 12, 20, seed=7)
    dh, do, dv_new = rand_like(x["h"], 5), rand_like(x["v"], 3), rand_like(x["v"], 6)
    args = (x["scale"], x["q"], x["k"], x["v"], x["beta"], x["G"], x["Akk"], x["qg"], x["kg"], x["h"], dh,
            x["v_new"], do, dv_new)
    want = jitted(S.ReferenceWYDqkg())(*args)
    _close(jitted(P.PallasWYDqkg(target="triton", interpret=True))(*args), want, 1e-12, "wy_dqkg C=128")
    with pytest.raises(ValueError, match="dl_rows"):
        P.PallasWYDqkg(target="triton", dl_rows=24)
    C, K, V, HV = 32, 12, 6, 2
    L = make_shared_layout(45, C, jnp.asarray(SHARED_CU, jnp.int32))
    R, NC = L.valid.shape[:2]
    x = chunked(3, R=R, HV=HV, NC=NC, C=C, K=K, V=V, strong=True)
    Akk = jitted(S.ReferenceIntra())(x["scale"], x["q"], x["k"], x["beta"], x["G"], reset=L.reset).Akk
    wy = jitted(S.ReferenceWY())(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk, reset=L.reset)
    h = rand_like(jnp.zeros((R, HV, NC, K, V)), 8)
    bwd = (x["scale"], x["q"], x["k"], x["v"], x["beta"], x["G"], Akk, wy.qg, wy.kg, h, rand_like(h, 9),
           rand_like(wy.u, 10), rand_like(wy.u, 11), rand_like(wy.u, 12))
    got = jitted(P.PallasWYDqkg(target="triton", interpret=True, dl_rows=16))(*bwd, reset=L.reset)
    want = jitted(S.ReferenceWYDqkg())(*bwd, reset=L.reset)
    _close(got, want, 1e-12, "wy_dqkg dl_rows=16")
    seg = np.asarray(segments(L.reset))[:, None, :, :, None]
    across = np.broadcast_to(seg != np.swapaxes(seg, -1, -2), got.dL.shape)
    assert across.any() and np.all(np.asarray(got.dL)[across] == 0)


def test_dhu_chunk128_takes_16_value_columns():
    """B2 at chunk 128, where a Triton program takes 16 value columns (shared memory): four
    blocks for V = 40 padded to 64, equal to the reference."""
    x = _x(jnp.float64, 128, 12, 40, seed=4)
    do, dv, dht = rand_like(x["v"], 2), rand_like(x["v"], 3), rand_like(x["h0"], 4)
    bargs = (x["scale"], x["qg"], x["kg"], x["w"], x["G"], do, dv, dht, x["layout"])
    _close(jitted(P.PallasDhu(target="triton"))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu")


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.skipif(
    not (ON_DEVICE and P.default_target() == "triton"), reason="no GPU"))])
def test_state_kernels_dense(interpret):
    """A dense layout (row r is sequence r): the Triton state kernels start from h0 / dht
    and write the final state / dh0 once, outside the chunk loop."""
    layout = make_layout(2, 48, 16)
    assert layout.dense
    x = chunked(5, R=2, HV=2, NC=layout.num_chunks, C=16, K=12, V=20)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk)
    h0 = rand_like(jnp.zeros((2, 2, 12, 20)), 1)
    args = (w, u, kg, x["G"], h0, layout)
    kw = dict(target="triton", interpret=interpret, block_v=16)
    _close(jitted(P.PallasState(**kw))(*args), jitted(S.ReferenceState())(*args), 1e-12, "state")
    do, dv, dht = rand_like(x["v"], 2), rand_like(x["v"], 3), rand_like(h0, 4)
    bargs = (x["scale"], qg, kg, w, x["G"], do, dv, dht, layout)
    _close(jitted(P.PallasDhu(**kw))(*bargs), jitted(S.ReferenceDhu())(*bargs), 1e-12, "dhu")


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_kernels_k_tiles(packed, dtype, tol):
    """The Triton state kernels holding the state as row tiles (``block_k``; FLA's kernels
    use 64-row tiles): K = 40 padded to 64 in four tiles of 16, equal to the reference,
    dense and packed (lengths 10, 0, 1, 20: resets inside the chunk loop)."""
    cu = jnp.array([0, 10, 10, 11, 31], jnp.int32) if packed else None
    layout = make_layout(1, 31, 16, cu)
    N = 4 if packed else 1
    x = chunked(8, R=1, HV=2, NC=layout.num_chunks, C=16, K=40, V=24)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    cast = lambda t: tuple(a.astype(dtype) for a in t)
    w, u, qg, kg = cast(wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk))
    G = x["G"].astype(dtype)
    h0 = rand_like(jnp.zeros((N, 2, 40, 24), dtype), 1)
    args = (w, u, kg, G, h0, layout)
    kw = dict(target="triton", interpret=True, block_v=16, block_k=16)
    _close(jitted(P.PallasState(**kw))(*args), jitted(S.ReferenceState())(*args), tol, "state")
    do, dv, dht = rand_like(u, 2), rand_like(u, 3), rand_like(h0, 4)
    bargs = (x["scale"], qg, kg, w, G, do, dv, dht, layout)
    _close(jitted(P.PallasDhu(**kw))(*bargs), jitted(S.ReferenceDhu())(*bargs), tol, "dhu")
    with pytest.raises(ValueError, match="block_k"):
        P.PallasState(target="triton", block_k=24)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_kernels_round_operands_in_kernel(packed):
    """``round_in_kernel``: under "fast" the Triton F4 and B2 read their product-only
    operands in float32 and round them in the kernel, where by default XLA makes bf16
    copies first: the same numbers (1e-6: XLA:CPU's summation order of bf16 products in
    the interpreted kernel), dense and packed; without a half-precision policy the field
    changes nothing."""

    cu = jnp.array([0, 10, 10, 11, 31], jnp.int32) if packed else None
    layout = make_layout(1, 31, 16, cu)
    N = 4 if packed else 1
    x = chunked(9, R=1, HV=2, NC=layout.num_chunks, C=16, K=32, V=16)
    _, Akk = intra_chunk(x["q"], x["k"], x["beta"], x["G"], x["scale"])
    w, u, qg, kg = (a.astype(jnp.float32) for a in wy_chunk(x["q"], x["k"], x["v"], x["beta"], x["G"], Akk))
    G = x["G"].astype(jnp.float32)
    h0 = rand_like(jnp.zeros((N, 2, 32, 16), jnp.float32), 1)
    do, dv, dht = rand_like(u, 2), rand_like(u, 3), rand_like(h0, 4)
    kw = dict(target="triton", interpret=True, block_v=16, block_k=16)
    for policy, tol in (("fast", 1e-6), ("highest", 0.0)):
        for name, cls, args in (("state", P.PallasState, (w, u, kg, G, h0, layout)),
                                ("dhu", P.PallasDhu, (x["scale"], qg, kg, w, G, do, dv, dht, layout))):
            got = jitted(cls(**kw, round_in_kernel=True))(*args, precision=policy)
            want = jitted(cls(**kw))(*args, precision=policy)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                if tol:
                    assert_close(a, b, tol, name)
                else:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_triton_intra_tile_products(dtype, tol):
    """The Triton F2 (``intra_levels_kernel``: every score and every step of (I + L)^-1 a
    tile product, no per-token loop) equals the reference stage in rel-RMS and max-abs, at
    C = 64 with gates down to -1000: dense; with G_lo (float32); shared chunks with resets
    (exact zeros across sequences, as the reference, on both targets). A NaN in k at token
    t of one chunk: Aqk and Akk NaN in no row before t (those rows as without it), NaN in
    row t, no other chunk or head touched."""
    x = _x(dtype, 64, 16, 4, seed=7)
    sc, args = x["scale"], (x["q"], x["k"], x["beta"], x["G"])
    pal, ref = jitted(P.PallasIntra(target="triton", interpret=True)), jitted(S.ReferenceIntra())

    def close(got, want, name):
        for n in ("Aqk", "Akk"):
            a, b = np.asarray(getattr(got, n)), np.asarray(getattr(want, n))
            assert_close(a, b, tol, f"{name}.{n}")
            assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (name, n, np.max(np.abs(a - b)))

    close(pal(sc, *args), ref(sc, *args), "dense")
    if dtype == jnp.float32:
        lo = _G_lo(x["G"])
        close(pal(sc, *args, G_lo=lo), ref(sc, *args, G_lo=lo), "G_lo")
    reset = np.zeros((2, 2, 64), bool)
    reset[0, 0, [0, 5, 16, 17, 40]] = reset[0, 1, [63]] = reset[1, 1, [0, 31, 32]] = True
    reset = jnp.asarray(reset)
    want = ref(sc, *args, reset=reset)
    close(pal(sc, *args, reset=reset), want, "reset")
    tpu = jitted(P.PallasIntra(target="tpu", interpret=True))(sc, *args, reset=reset)
    close(tpu, want, "reset (tpu)")
    seg = np.cumsum(np.asarray(reset) & (np.arange(64) > 0), axis=-1)[:, None, :, :, None]
    across = np.broadcast_to(seg != np.swapaxes(seg, -1, -2), want.Aqk.shape)
    got = pal(sc, *args, reset=reset)
    assert across.any() and not np.asarray(got.Aqk)[across].any() and not np.asarray(got.Akk)[across].any()

    t = 21
    clean = pal(sc, *args)
    bad = pal(sc, x["q"], x["k"].at[1, 0, 1, t, 3].set(jnp.nan), x["beta"], x["G"])
    for n in ("Aqk", "Akk"):
        a, c = np.asarray(getattr(bad, n)), np.asarray(getattr(clean, n))
        np.testing.assert_array_equal(a[1, 0, 1, :t], c[1, 0, 1, :t], err_msg=n)
        assert np.isnan(a[1, 0, 1, t]).any(), n
        others = np.isnan(a).copy()
        others[1, 0, 1, t:] = False
        assert not others.any(), n


def _b4_args(dtype, C, K, seed):
    """B4's arguments: gates down to -1000 (``chunked(strong=True)``), dAqk lower
    triangular, dL strictly lower, B3's gradients random."""
    x = chunked(seed, R=2, HV=2, NC=2, C=C, K=K, V=4, strong=True)
    cast = lambda a: a.astype(dtype)  # noqa: E731
    q, k, beta, G = (cast(x[n]) for n in ("q", "k", "beta", "G"))
    mat = jnp.zeros(q.shape[:-1] + (C,), dtype)
    dL = jnp.tril(rand_like(mat, seed + 7), -1)
    grads = ChunkGrads(rand_like(q, seed + 8), rand_like(k, seed + 9), None, rand_like(beta, seed + 11),
                       rand_like(G, seed + 12), dL)
    return (x["scale"], q, k, beta, G, jnp.tril(rand_like(mat, seed + 13)), grads)


def _b4_close(got, want, tol, name):
    for f in ("dq", "dk", "dbeta", "dG"):
        a, b = np.asarray(getattr(got, f)), np.asarray(getattr(want, f))
        assert_close(a, b, tol, f"{name}.{f}")
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (name, f, np.max(np.abs(a - b)))


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)], ids=["f64", "f32"])
def test_triton_intra_backward_tile_products(dtype, tol):
    """The Triton B4 (``intra_bwd_levels_kernel``: per halving level the transposes of F2's
    level products, no per-token loop) equals the reference stage in rel-RMS and max-abs,
    gates down to -1000: dense at C = 16, 32, 64 with K not a power of 2 (K = 40 padded to
    64: two 32-column programs a chunk); with G_lo (float32); shared chunks with resets on
    both targets (pairs across sequences contribute nothing: a gradient of dAqk or dL
    across them changes nothing). A NaN in k at token t: NaN exactly where the
    reference's are (dq, dbeta from row t on; dk, dG in k's column), every other entry as
    the reference's, and no other chunk or head touched."""
    pal, ref = jitted(P.PallasIntraBackward(target="triton", interpret=True)), jitted(S.ReferenceIntraBackward())
    for C, K in ((16, 12), (32, 12), (64, 40)):
        args = _b4_args(dtype, C, K, seed=C)
        _b4_close(pal(*args), ref(*args), tol, f"dense C={C}")
    if dtype == jnp.float32:
        lo = _G_lo(args[4])
        _b4_close(pal(*args, G_lo=lo), ref(*args, G_lo=lo), tol, "G_lo")

    args = _b4_args(dtype, 64, 12, seed=3)
    reset = np.zeros((2, 2, 64), bool)
    reset[0, 0, [0, 5, 16, 17, 40]] = reset[0, 1, [63]] = reset[1, 1, [0, 31, 32]] = True
    reset = jnp.asarray(reset)
    want = ref(*args, reset=reset)
    got = pal(*args, reset=reset)
    _b4_close(got, want, tol, "reset")
    _b4_close(jitted(P.PallasIntraBackward(target="tpu", interpret=True))(*args, reset=reset), want, tol, "reset (tpu)")
    seg = np.cumsum(np.asarray(reset) & (np.arange(64) > 0), axis=-1)[:, None, :, :, None]
    across = jnp.asarray(np.broadcast_to(seg != np.swapaxes(seg, -1, -2), args[5].shape))
    assert across.any()
    noise = rand_like(args[5], 99)
    grads = args[6]
    moved = (*args[:5], jnp.where(across, noise, args[5]),
             ChunkGrads(grads.dq, grads.dk, None, grads.dbeta, grads.dG, jnp.where(across, noise, grads.dL)))
    for a, b in zip(jax.tree.leaves(pal(*moved, reset=reset)), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    t = 21
    bad = (*args[:2], args[2].at[1, 0, 1, t, 3].set(jnp.nan), *args[3:])
    clean, got, want = pal(*args), pal(*bad), ref(*bad)
    for f in ("dq", "dk", "dbeta", "dG"):
        a, b, c = (np.asarray(getattr(x, f)) for x in (got, want, clean))
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f)
        ok = ~np.isnan(b)
        assert np.max(np.abs(a[ok] - b[ok])) <= tol * np.max(np.abs(b[ok])), f
        hit = np.isnan(a[1, 0, 1])
        assert hit.any() and not hit[:t].any() if f in ("dq", "dbeta") else hit.any(), f
        if f in ("dq", "dk", "dG"):
            assert not np.delete(hit, 3, axis=-1).any(), f  # k's column only
        others = np.isnan(a).copy()
        others[1, 0, 1] = False
        assert not others.any(), f
        same = np.ones(a.shape[:3], bool)
        same[1, 0, 1] = False
        np.testing.assert_array_equal(a[same], c[same], err_msg=f)


@pytest.mark.parametrize("target,rows", [("tpu", 64), ("triton", 64), ("triton", 16), ("triton", 32)],
                         ids=["tpu-interpret", "triton-interpret", "triton-interpret-rows16", "triton-interpret-rows32"])
def test_intra_backward_diagonal_leaves_dG_exactly(target, rows):
    """Each Pallas B4 kernel (the whole chunk on TPU; on Triton the halving levels and the
    16- and 32-row sub-blocks) leaves the diagonal pairs out of dG, as the reference stage
    does (``tests/stages/test_intra.py``): a cotangent on the diagonals of dAqk and dL
    alone gives dG = 0 to the bit in float32, and dq, dk, dbeta carry them (the reference's
    to 1e-6). Kept in both the row and the column sums, they rounded into every row of dG."""
    x = chunked(3, C=64, NC=2, HV=2, K=12, strong=True)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    q, k, beta, G = (f32(x[n]) for n in ("q", "k", "beta", "G"))
    eye = jnp.eye(64, dtype=bool)
    mat = jnp.zeros(q.shape[:-1] + (64,), jnp.float32)
    dAqk, dL = (jnp.where(eye, rand_like(mat, s), 0.0) for s in (1, 2))
    zero = ChunkGrads(jnp.zeros_like(q), jnp.zeros_like(k), None, jnp.zeros_like(beta), jnp.zeros_like(G), dL)
    args = (0.37, q, k, beta, G, dAqk, zero)
    got = jitted(P.PallasIntraBackward(target=target, interpret=True, rows=rows))(*args)
    want = jitted(S.ReferenceIntraBackward())(*args)
    np.testing.assert_array_equal(np.asarray(got.dG), 0.0)
    np.testing.assert_array_equal(np.asarray(want.dG), 0.0)
    for f in ("dq", "dk", "dbeta"):
        assert float(jnp.max(jnp.abs(getattr(want, f)))) > 0.1, f  # (the diagonal reaches them)
        assert_close(getattr(got, f), getattr(want, f), 1e-6, f)


@pytest.mark.parametrize("target,interpret", MODES)
def test_nan_in_later_tokens_reaches_no_earlier_row(target, interpret):
    """F2 and B4 with q, k, beta and G NaN from token 35 of a 64-token chunk on (inside a
    16-token block, the next block's anchor row NaN): every entry of the rows before it
    that the reference stage keeps is kept, to the bit. The TPU kernels' anchored products
    (``scores_body``, ``pair_rows_body``, ``pair_cols_body``) met a later block's NaN anchor
    with the other rows' zeros, 0 * NaN: Aqk 256 and Akk 1024 entries of earlier rows NaN.
    (The finite change: ``check_stage``'s ``causal`` row. The kernels may make later rows
    NaN in more entries than the reference: ``nan-reach``.)"""
    x = _x(jnp.float64, 64, 16, 4, seed=3)
    t = 35
    bad = {n: x[n].at[:, :, 1, t:].set(jnp.nan) for n in ("q", "k", "beta", "G")}
    dA = jnp.tril(rand_like(x["Aqk"], 13))
    grads = ChunkGrads(rand_like(x["q"], 8), rand_like(x["k"], 9), rand_like(x["v"], 10), rand_like(x["beta"], 11),
                       rand_like(x["G"], 12), jnp.tril(rand_like(x["Aqk"], 7), -1))
    f2 = lambda v: (x["scale"], v["q"], v["k"], v["beta"], v["G"])  # noqa: E731
    b4 = lambda v: (x["scale"], v["q"], v["k"], v["beta"], v["G"], dA, grads)  # noqa: E731
    pairs = []
    for rows in (64, 16) if target == "triton" else (64,):  # (rows 16: the candidate-rows16-f2 kernels)
        kw = dict(target=target, interpret=interpret, rows=rows)
        pairs += [(f"intra rows={rows}", P.PallasIntra(**kw), S.ReferenceIntra(), f2),
                  (f"intra_bwd rows={rows}", P.PallasIntraBackward(**kw), S.ReferenceIntraBackward(), b4)]
    for name, pal, ref, args in pairs:
        pal, ref = jitted(pal), jitted(ref)
        outs = [jax.tree_util.tree_leaves(f(*args(v))) for f in (pal, ref) for v in (x, dict(x, **bad))]
        kept_by_ref = 0
        for a0, a, b0, b in zip(*outs):
            if a.ndim < 4 or a.shape[3] != 64:
                continue
            early = (slice(None), slice(None), 1, slice(0, t))
            same = lambda u, w: np.asarray(u[early]) == np.asarray(w[early])  # noqa: E731
            keep = same(b, b0)
            kept_by_ref += int(keep.sum())
            assert (same(a, a0) | ~keep).all(), f"{name}: {int((keep & ~same(a, a0)).sum())} entries of rows < {t}"
        assert kept_by_ref > 0, name
