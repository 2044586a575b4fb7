"""B4 on FLA's grid (``PallasIntraBackward(rows=16)``, ``kdax.pallas._intra_rows``): one
Triton program per (row * head, chunk, block of feature columns, 16-token sub-block). It
equals the reference stage as the whole-chunk kernel does (interpret mode: float64 to
1e-12, float32 at B4's 1e-5; dense at every chunk size, K padded, G_lo, resets, NaN reach,
causal to the bit), keeps TF32x3's precision under the GPU's product emulation, runs the
whole pipelines of the ``"candidate-rows16"`` and ``"candidate-rows16-f2"`` presets
against the golden cases and the oracle, and compiles for sm_90 at 4 warps without spills
in at most 128 registers (4 CTAs an SM; the whole-chunk kernel: one of 178 at 8 warps)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax import pallas as P
from kdax import stages as S
from kdax.stages import ChunkGrads

from .._util import GOLDEN_CASES, check_golden, jitted, rel_rms
from ..stages._chunked import rand_like
from ..test_pipeline import assert_gradients_causal, build_case, check_against_oracle
from .test_stages import _b4_args, _b4_close, _G_lo

RESET = np.zeros((2, 2, 64), bool)  # sequences starting inside sub-blocks, on their edges, at the chunk's end
RESET[0, 0, [0, 5, 16, 17, 40]] = RESET[0, 1, [63]] = RESET[1, 1, [0, 31, 32]] = True


def _rows(rows: int, **kw):
    return P.PallasIntraBackward(target="triton", interpret=True, rows=rows, **kw)


def check_g_lo_and_resets(pal, ref, make_args, close, tol: float, used):
    """The G_lo and reset part of a rows stage's check against its reference (B4 here, F2 in
    test_intra_rows_f2.py): ``pal`` with G_lo (which must move ``used(output)`` by more than
    100 ``tol``), with ``RESET``, and with both, each ``close`` to ``ref``; ``make_args(C, K,
    seed)`` gives the stage's arguments. Returns ``(the reset case's arguments, pal's output
    on them, the pairs of tokens across sequences [2, 1, 2, C, C])``."""
    args = make_args(64, 40, 5)
    lo = _G_lo(args[4])
    got = pal(*args, G_lo=lo)
    close(got, ref(*args, G_lo=lo), tol, "G_lo")
    assert float(jnp.max(jnp.abs(used(got) - used(pal(*args))))) > 100 * tol  # (G_lo is used)
    args, reset = make_args(64, 12, 3), jnp.asarray(RESET)
    got = pal(*args, reset=reset)
    close(got, ref(*args, reset=reset), tol, "reset")
    close(pal(*args, G_lo=lo[..., :12], reset=reset), ref(*args, G_lo=lo[..., :12], reset=reset), tol,
          "reset with G_lo")
    seg = np.cumsum(RESET & (np.arange(64) > 0), axis=-1)[:, None, :, :, None]
    across = seg != np.swapaxes(seg, -1, -2)
    assert across.any()
    return args, got, across


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)], ids=["f64", "f32"])
def test_rows16_equals_the_reference(dtype, tol):
    """Dense at C = 16 (one sub-block), 32, 64 and 128 (eight), K = 12 padded to 16 and
    K = 40 padded to 64 (two 32-column programs a sub-block), gates down to -1000; with
    G_lo; shared chunks with resets (pairs across sequences contribute nothing: a
    gradient of dAqk or dL across them changes nothing, to the bit)."""
    pal, ref = jitted(_rows(16)), jitted(S.ReferenceIntraBackward())
    for C, K in ((16, 12), (32, 12), (64, 40), (128, 12)):
        args = _b4_args(dtype, C, K, seed=C)
        _b4_close(pal(*args), ref(*args), tol, f"dense C={C}")
    args, got, across = check_g_lo_and_resets(pal, ref, lambda C, K, seed: _b4_args(dtype, C, K, seed=seed),
                                              _b4_close, tol, lambda out: out.dG)
    reset, across = jnp.asarray(RESET), jnp.asarray(across)
    noise, grads = rand_like(args[5], 99), args[6]
    moved = (*args[:5], jnp.where(across, noise, args[5]),
             ChunkGrads(grads.dq, grads.dk, None, grads.dbeta, grads.dG, jnp.where(across, noise, grads.dL)))
    for a, b in zip(jax.tree.leaves(pal(*moved, reset=reset)), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rows32_and_chunks_smaller_than_rows():
    """``rows=32``: the same kernel on 32-token sub-blocks (C = 64: two; C = 16: the chunk
    is one sub-block), float64, dense and with resets."""
    pal, ref = jitted(_rows(32)), jitted(S.ReferenceIntraBackward())
    for C, K in ((16, 12), (64, 40)):
        args = _b4_args(jnp.float64, C, K, seed=C + 1)
        _b4_close(pal(*args), ref(*args), 1e-12, f"dense C={C}")
    args = _b4_args(jnp.float64, 64, 12, seed=4)
    reset = jnp.asarray(RESET)
    _b4_close(pal(*args, reset=reset), ref(*args, reset=reset), 1e-12, "reset")


@pytest.mark.parametrize("t,name", [(21, "k"), (47, "G"), (16, "q"), (3, "beta")])
def test_rows16_nonfinite_reach(t, name):
    """A NaN in one input at token t, column 3 (beta: the token's row) of one chunk and
    head: NaN exactly where the reference's (and the whole-chunk kernel's) are (some), every
    other entry as the reference's, no other chunk or head touched. t = 16 starts a
    sub-block (the rows side's anchor), t = 47 ends one (the columns side's)."""
    args = list(_b4_args(jnp.float32, 64, 12, seed=3))
    i = {"q": 1, "k": 2, "beta": 3, "G": 4}[name]
    args[i] = args[i].at[1, 0, 1, t].set(jnp.nan) if name == "beta" else args[i].at[1, 0, 1, t, 3].set(jnp.nan)
    pal, ref = jitted(_rows(16)), jitted(S.ReferenceIntraBackward())
    old = jitted(P.PallasIntraBackward(target="triton", interpret=True))
    got, want, whole = pal(*args), ref(*args), old(*args)
    clean = pal(*_b4_args(jnp.float32, 64, 12, seed=3))
    hit = 0
    for f in ("dq", "dk", "dbeta", "dG"):
        a, b, c, w = (np.asarray(getattr(x, f)) for x in (got, want, clean, whole))
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(w), err_msg=f)
        hit += np.isnan(a[1, 0, 1]).sum()
        ok = ~np.isnan(b)
        assert np.max(np.abs(a[ok] - b[ok])) <= 1e-5 * np.max(np.abs(b[ok])), f
        same = np.ones(a.shape[:3], bool)
        same[1, 0, 1] = False
        np.testing.assert_array_equal(a[same], c[same], err_msg=f)
    assert hit, name


@pytest.mark.parametrize("t", [16, 21, 47])
def test_rows16_causal_to_the_bit(t):
    """With the cotangents dAqk, dL and the incoming gradients zero from token t on (a loss
    on the outputs before t), changing q, k, beta and G there (G kept non-increasing, as a
    cumsum of log decays) changes no gradient before t, to the bit: the anchors of the
    products (a sub-block's first and last row) may lie after t, their sums there are
    exact zeros."""
    args = _b4_args(jnp.float32, 64, 12, seed=t)
    sc, q, k, beta, G, dA, grads = args
    before = (jnp.arange(64) < t)
    rows2 = before[:, None] & before[None, :]
    cut = lambda x: jnp.where(before[:, None], x, 0.0) if x.ndim == 5 else jnp.where(before, x, 0.0)  # noqa: E731
    grads = ChunkGrads(cut(grads.dq), cut(grads.dk), None, cut(grads.dbeta), cut(grads.dG), jnp.where(rows2, grads.dL, 0.0))
    dA = jnp.where(rows2, dA, 0.0)
    r = np.random.default_rng(t)
    after = (~before)[:, None]
    q2 = jnp.where(after, jnp.asarray(r.normal(size=q.shape) * 20, q.dtype), q)
    k2 = jnp.where(after, jnp.asarray(r.normal(size=k.shape) * 20, k.dtype), k)
    beta2 = jnp.where(~before, jnp.asarray(r.uniform(size=beta.shape), beta.dtype), beta)
    drop = jnp.cumsum(jnp.where(after, jnp.asarray(r.uniform(0, 30, size=G.shape), G.dtype), 0.0), axis=-2)
    G2 = G - drop
    pal = jitted(_rows(16))
    g1, g2 = pal(sc, q, k, beta, G, dA, grads), pal(sc, q2, k2, beta2, G2, dA, grads)
    for f in ("dq", "dk", "dbeta", "dG"):
        a, b = np.asarray(getattr(g1, f)), np.asarray(getattr(g2, f))
        np.testing.assert_array_equal(a[:, :, :, :t], b[:, :, :, :t], err_msg=f)
        assert np.isfinite(b).all(), f


def test_rows16_keeps_tf32x3_precision():
    """Under the GPU's product emulation (``gpu_products``) with its tuning traced in
    (``tuned_interpret``), f32_dot "tf32x3", float32, gates down to -1000, C = 64, K = 64:
    every gradient within 1e-6 rel-RMS of the float64 stage on the same values, as the
    whole-chunk kernel (tests/test_precision.py::test_tf32_emulation_rounds_b4); plain
    "tf32" is off by TF32's rounding (over 10x more), so the emulation is live."""
    from .._gpu_products import gpu_products

    args = _b4_args(jnp.float32, 64, 64, seed=64)
    args64 = jax.tree.map(lambda a: a.astype(jnp.float64) if isinstance(a, jax.Array) else a, args)
    want = _rows(16)(*args64)
    with gpu_products():
        x3 = _rows(16, f32_dot="tf32x3", num_warps=4, tuned_interpret=True)(*args)
        tf32 = _rows(16, f32_dot="tf32", num_warps=4, tuned_interpret=True)(*args)
    for f in ("dq", "dk", "dbeta", "dG"):
        e_x3, e_tf32 = rel_rms(getattr(x3, f), getattr(want, f)), rel_rms(getattr(tf32, f), getattr(want, f))
        assert e_x3 <= 1e-6 and e_tf32 > 10 * e_x3, (f, e_x3, e_tf32)


def test_rows_field_checked():
    with pytest.raises(ValueError, match=r"rows: expected 16, 32 or 64, got 8"):
        P.PallasIntraBackward(target="triton", rows=8)
    with pytest.raises(ValueError, match=r"rows: 16 is a Triton kernel's grid; target is 'tpu'"):
        P.PallasIntraBackward(target="tpu", rows=16)
    assert P.PallasIntraBackward(target="triton").rows == 64


# The presets on 16-row programs and the stages they run so: B4, and F2 too.
PRESETS = {"candidate-rows16": ("intra_bwd",), "candidate-rows16-f2": ("intra", "intra_bwd")}


def _preset(tuning: str = "candidate-rows16", **kw):
    """Preset ``tuning``'s stages in interpret mode, no fallback, at precision ``"auto"``
    (the preset's "fast" rounds operands to bf16, beyond float64's tolerance)."""
    pipe = kdax.KDAPipeline.pallas("triton", interpret=True, tuning=tuning)
    assert pipe.precision == "fast"
    assert all(getattr(pipe, f).rows == 16 and getattr(pipe, f).num_warps == 4 for f in PRESETS[tuning])
    return dataclasses.replace(pipe.with_precision("auto"), fallback=False, **kw)


@pytest.mark.parametrize("tuning", PRESETS)
@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_preset_pipeline_golden_float64(name, tuning):
    """``jax.grad(chunk_kda)`` through the preset's Pallas pipeline, B4 (and F2) on 16-row
    programs: the golden cases in float64 to 1e-10."""
    check_golden(_preset(tuning), name, jnp.float64, 1e-10, 1e-10)


@pytest.mark.parametrize("tuning", PRESETS)
def test_preset_pipeline_shared_chunks_against_oracle(tuning):
    """Packed sequences starting inside 64-token chunks (shared chunks: B4 and F2 with
    resets), Kimi Linear's gate options, float64, against the recurrent oracle."""
    x, opts = build_case(dict(cu_seqlens=[0, 21, 90, 150], K=24, V=8, chunk_size=64, use_gate_in_kernel=True,
                              A_log=True, dt_bias=True, use_qk_l2norm_in_kernel=True))
    check_against_oracle(_preset(tuning), x, opts)


@pytest.mark.parametrize("tuning", PRESETS)
@pytest.mark.parametrize("t", [21, 48])
def test_preset_pipeline_gradients_causal_to_the_bit(t, tuning):
    """As ``tests/test_pipeline.py::test_gradients_causal_to_the_bit`` through the preset's
    pipeline at chunk 64 (four sub-blocks a chunk), float32."""
    assert_gradients_causal(t, chunk_size=64, pipeline=_preset(tuning))


def test_pipe_name_reaches_the_preset():
    """``benchmarks/gpu_vs_fla.py``'s pipe names: ``+rows.intra_bwd=16`` after
    ``+warps.intra_bwd=4`` on the candidate is the ``"candidate-rows16"`` preset; a stage
    without ``rows`` is refused by name."""
    from tests.benchmarks._load import load_benchmark

    gvf = load_benchmark("gpu_vs_fla")
    built = gvf.kdax_pipeline("triton:candidate+warps.intra_bwd=4+rows.intra_bwd=16")
    assert built == gvf.kdax_pipeline("triton:candidate-rows16")
    assert built == kdax.KDAPipeline.pallas("triton", tuning="candidate-rows16")
    with pytest.raises(ValueError, match="'wy' is not a Pallas stage with rows"):
        gvf.kdax_pipeline("triton:candidate+rows.wy=16")


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("policy", ["fast", "bfloat16"])
def test_rows16_fits_four_ctas_an_sm(policy, packed):
    """sm_90 at K = 128, chunk 64, the preset's B4 (4 warps, 2 stages, TF32x3), dense and
    with resets: no thread-local memory, TF32 tensor-core products, and under the preset's
    policy ("fast") at most 128 registers a thread (4 CTAs of 4 warps an SM; measured 128
    dense and packed). With G's low part ("bfloat16", not the preset's) 128 dense, 138
    packed since the diagonal pairs are summed apart (168 before; 3 CTAs an SM): no spills
    asserted there (benchmarks/results/b4_rows16_resources.txt)."""
    pytest.importorskip("triton")
    from ._triton import HOPPER_SHARED_BYTES, chunk_kernels, resources

    t = dict(P.TUNINGS["candidate-rows16"].fields["intra_bwd"])
    assert t == dict(num_warps=4, num_stages=2, f32_dot="tf32x3", rows=16)
    (text,) = chunk_kernels(policy, t, only=("intra_bwd",), packed=packed).values()
    r = resources(text, 4, 2)
    assert r.local == 0 and 0 < r.shared <= HOPPER_SHARED_BYTES, r
    assert r.registers <= (128 if policy == "fast" else 168), r
    assert any(".tf32" in m for m in r.mma), r
