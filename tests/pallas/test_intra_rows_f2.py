"""F2 over smaller programs (``PallasIntra(rows=16)``, ``kdax.pallas._intra_rows_f2``): the
scores one Triton program per (row * head, chunk, 16-token sub-block), ``(I + L)^-1`` a
second kernel over the stored L. It equals the reference stage as the whole-chunk kernel
does (interpret mode: float64 to 1e-12, float32 at F2's 1e-5; dense at every chunk size, K
padded, several feature blocks, G_lo, resets, NaN reach as the reference and the
whole-chunk kernel, causal to the bit) and compiles for sm_90 at 4 warps without spills
(benchmarks/results/f2_rows16_resources.txt). The ``"candidate-rows16-f2"`` preset's
whole pipeline is checked with the B4 preset's in ``tests/pallas/test_intra_rows.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax import pallas as P
from kdax import stages as S

from .._util import assert_close, jitted
from .test_intra_rows import RESET, check_g_lo_and_resets
from .test_stages import _b4_args



def _rows(rows: int, **kw):
    return P.PallasIntra(target="triton", interpret=True, rows=rows, **kw)


def _args(dtype, C, K, seed):
    """F2's arguments ``(scale, q, k, beta, G)``: gates down to -1000."""
    return _b4_args(dtype, C, K, seed)[:5]


def _close(got, want, tol, name):
    for n in ("Aqk", "Akk"):
        a, b = np.asarray(getattr(got, n)), np.asarray(getattr(want, n))
        assert a.dtype == b.dtype, (name, n)
        assert_close(a, b, tol, f"{name}.{n}")
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (name, n, np.max(np.abs(a - b)))


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)], ids=["f64", "f32"])
def test_rows16_equals_the_reference(dtype, tol):
    """Dense at C = 16 (one sub-block), 32, 64 and 128 (eight), K = 12 padded to 16 and
    K = 40 padded to 64 (one block of 64 columns, or four of 16), gates down to -1000; with
    G_lo; shared chunks with resets (pairs across sequences exact zeros in Aqk and Akk)."""
    ref = jitted(S.ReferenceIntra())
    for C, K, bk in ((16, 12, 64), (32, 12, 64), (64, 40, 64), (64, 40, 16), (128, 12, 64)):
        args = _args(dtype, C, K, seed=C + bk)
        _close(jitted(_rows(16, block_k=bk))(*args), ref(*args), tol, f"dense C={C} block_k={bk}")
    pal = jitted(_rows(16, block_k=32))
    _, got, across = check_g_lo_and_resets(pal, ref, lambda C, K, seed: _args(dtype, C, K, seed),
                                           _close, tol, lambda out: out.Aqk)
    across = np.broadcast_to(across, got.Aqk.shape)
    for n in ("Aqk", "Akk"):
        assert not np.asarray(getattr(got, n))[across].any(), n


def test_rows32_and_chunks_smaller_than_rows():
    """``rows=32``: the same kernels on 32-token sub-blocks (C = 64: two; C = 16: the chunk
    is one sub-block), float64, dense and with resets."""
    pal, ref = jitted(_rows(32)), jitted(S.ReferenceIntra())
    for C, K in ((16, 12), (64, 40)):
        args = _args(jnp.float64, C, K, seed=C + 1)
        _close(pal(*args), ref(*args), 1e-12, f"dense C={C}")
    args = _args(jnp.float64, 64, 12, seed=4)
    reset = jnp.asarray(RESET)
    _close(pal(*args, reset=reset), ref(*args, reset=reset), 1e-12, "reset")


@pytest.mark.parametrize("t,name", [(21, "k"), (48, "G"), (32, "G"), (47, "G"), (16, "q"), (3, "beta")])
def test_rows16_nonfinite_reach(t, name):
    """A NaN in one input at token t, column 3 (beta: the token's row) of one chunk and
    head: NaN exactly where the whole-chunk kernel's are (some, none in a row before t), in
    Aqk also exactly where the reference's are (Akk: both kernels set every column of the
    rows from the first one reached, a superset of the reference's), every other entry as
    the reference's, no other chunk or head touched. t = 32 and 48 are the
    anchors of the off-diagonal levels (48: of the pairs (48.., 32..47), not of those with
    0..31, whose anchor is 32), t = 16 the first row of a sub-block."""
    args = list(_args(jnp.float32, 64, 12, seed=3))
    i = {"q": 1, "k": 2, "beta": 3, "G": 4}[name]
    args[i] = args[i].at[1, 0, 1, t].set(jnp.nan) if name == "beta" else args[i].at[1, 0, 1, t, 3].set(jnp.nan)
    pal, ref = jitted(_rows(16, block_k=32)), jitted(S.ReferenceIntra())
    old = jitted(P.PallasIntra(target="triton", interpret=True))
    got, want, whole = pal(*args), ref(*args), old(*args)
    clean = pal(*_args(jnp.float32, 64, 12, seed=3))
    hit = 0
    for f in ("Aqk", "Akk"):
        a, b, c, w = (np.asarray(getattr(x, f)) for x in (got, want, clean, whole))
        if f == "Aqk":
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(w), err_msg=f)
        hit += np.isnan(a[1, 0, 1]).sum()
        assert not np.isnan(a[1, 0, 1, :t]).any(), f  # (no row before t)
        ok = ~np.isnan(a)
        assert not np.isnan(b[ok]).any(), f
        assert np.max(np.abs(a[ok] - b[ok])) <= 1e-5 * np.max(np.abs(b[ok])), f
        same = np.ones(a.shape[:3], bool)
        same[1, 0, 1] = False
        np.testing.assert_array_equal(a[same], c[same], err_msg=f)
    assert hit, name


@pytest.mark.parametrize("t", [16, 21, 47])
def test_rows16_causal_to_the_bit(t):
    """Changing q, k, beta and G from token t on (G kept non-increasing, as a cumsum of log
    decays) changes no row of Aqk or Akk before t, to the bit, and leaves everything finite:
    the anchors of the products (a level's first row of the upper half) may lie after t in
    a sub-block, and its entries before t are the same sums."""
    sc, q, k, beta, G = _args(jnp.float32, 64, 12, seed=t)
    r = np.random.default_rng(t)
    after = (jnp.arange(64) >= t)[:, None]
    q2 = jnp.where(after, jnp.asarray(r.normal(size=q.shape) * 20, q.dtype), q)
    k2 = jnp.where(after, jnp.asarray(r.normal(size=k.shape) * 20, k.dtype), k)
    beta2 = jnp.where(after[:, 0], jnp.asarray(r.uniform(size=beta.shape), beta.dtype), beta)
    G2 = G - jnp.cumsum(jnp.where(after, jnp.asarray(r.uniform(0, 30, size=G.shape), G.dtype), 0.0), axis=-2)
    pal = jitted(_rows(16, block_k=32))
    o1, o2 = pal(sc, q, k, beta, G), pal(sc, q2, k2, beta2, G2)
    for f in ("Aqk", "Akk"):
        a, b = np.asarray(getattr(o1, f)), np.asarray(getattr(o2, f))
        np.testing.assert_array_equal(a[..., :t, :], b[..., :t, :], err_msg=f)
        assert np.isfinite(b).all() and not np.array_equal(a, b), f


def test_rows_field_checked():
    with pytest.raises(ValueError, match=r"rows: expected 16, 32 or 64, got 8"):
        P.PallasIntra(target="triton", rows=8)
    with pytest.raises(ValueError, match=r"rows: 16 is a Triton kernel's grid; target is 'tpu'"):
        P.PallasIntra(target="tpu", rows=16)
    assert P.PallasIntra(target="triton").rows == 64


@pytest.mark.parametrize("fields", [dict(rows=16), pytest.param(dict(num_warps=16), marks=pytest.mark.slow)],
                         ids=["rows16", "16-warps"])
def test_check_stage_passes_the_presets_f2(fields):
    """``kdax.testing.check_stage`` passes the F2 of the ``candidate-rows16-f2`` and
    ``fastest-modelled`` tunings, its ``reset`` check's "overflow" row included (an inverse
    that overflows in one sequence leaves the others bit for bit: the stage runs the kernel
    again with its products selected by sequence, ``kdax.pallas._intra._isolated``). Before,
    that row failed for both (about 10 s each)."""
    from kdax.testing import check_stage

    report = check_stage(P.PallasIntra(target="triton", interpret=True, **fields), "intra")
    assert report.ok, report.names_failed


def _f2_kernels(policy: str, tuning: dict, packed: bool) -> dict:
    """``captured`` TTIR of F2's Triton kernels at K = 128, chunk 64 (as
    ``tests/pallas/_triton.py``'s ``chunk_kernels``, which expects one kernel a stage), with
    G's low part where the policy keeps it, shared chunks' resets when ``packed``."""
    from kdax._numerics import precision as _precision

    from ._triton import captured

    R, HV, NC, C, K = 1, 2, 4, 64, 128
    s = jax.ShapeDtypeStruct
    ck, cs = s((R, HV, NC, C, K), jnp.float32), s((R, HV, NC, C), jnp.float32)
    lo = ck if _precision.keeps_low_part(policy) else None
    rs = (s((R, NC, C), jnp.bool_),) if packed else ()
    st = P.PallasIntra(target="triton", interpret=False, **tuning)
    with captured() as mods:
        jax.jit(lambda q, k, b, G, lo, *r: st(0.1, q, k, b, G, lo, *r, precision=policy)).trace(
            ck, ck, cs, ck, lo, *rs).lower(lowering_platforms=("cuda",))
    return mods


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("policy", ["fast", "bfloat16"])
def test_rows16_fits_several_ctas_an_sm(policy, packed):
    """sm_90 at K = 128, chunk 64, the preset's F2 (4 warps, 1 stage, 16 feature columns a
    step), dense and with resets: two kernels (the scores per sub-block, bf16 tensor-core
    products; the inverse per chunk, TF32), neither with thread-local memory, within the
    registers measured (``SCORES_REGISTERS``, ``SOLVE_REGISTERS``: 3-5 CTAs an SM; the
    whole-chunk kernel: one of 207 at 8 warps)."""
    pytest.importorskip("triton")
    from ._triton import HOPPER_SHARED_BYTES, resources

    t = dict(P.TUNINGS["candidate-rows16-f2"].fields["intra"])
    assert t["rows"] == 16 and t["num_warps"] == 4
    texts = _f2_kernels(policy, t, packed)
    assert len(texts) == 2, list(texts)
    for text in texts.values():
        solve = "kernel_solve" in text
        r = resources(text, t["num_warps"], t["num_stages"])
        assert r.local == 0 and 0 < r.shared <= HOPPER_SHARED_BYTES, (solve, r)
        assert r.registers <= (SOLVE_REGISTERS if solve else SCORES_REGISTERS)[policy], (solve, r)
        assert any((".tf32" if solve else ".bf16") in m for m in r.mma), (solve, r)


# Registers a thread (sm_90, 4 warps, 1 stage; measured, dense and packed): the scores 96
# under the preset's "fast" (5 CTAs an SM), 128 with G's low part ("bfloat16"); the
# inverse's plain TF32 under "fast" 165 (3 CTAs), TF32x3 under "bfloat16" 239.
SCORES_REGISTERS = {"fast": 96, "bfloat16": 128}
SOLVE_REGISTERS = {"fast": 165, "bfloat16": 239}


def test_pipe_names_reach_f2_rows():
    """``benchmarks/gpu_vs_fla.py``'s pipe names: ``triton:candidate-rows16-f2`` is the
    preset; ``+rows.intra=16`` (now that ``PallasIntra`` has rows) sets F2's rows alone."""
    from tests.benchmarks._load import load_benchmark

    gvf = load_benchmark("gpu_vs_fla")
    assert gvf.kdax_pipeline("triton:candidate-rows16-f2") == kdax.KDAPipeline.pallas(
        "triton", tuning="candidate-rows16-f2")
    built = gvf.kdax_pipeline("triton:candidate-rows16+warps.intra=4+rows.intra=16")
    assert (built.intra.rows, built.intra.num_warps, built.intra_bwd.rows) == (16, 4, 16)
