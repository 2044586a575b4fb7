"""KimiDeltaAttention against an independent float64 numpy transcription of Kimi Linear's
layer (``_oracle.py``); cache, padding, packing, pools, prefix states and gradients.

Calls go through one jitted runner with few distinct shapes so compilations are shared
between tests (the default run stays short)."""

import dataclasses
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import kdax
from kdax.nn import KDACache, KimiDeltaAttention

from .._util import assert_close, one_device_env
from ._oracle import jnp_layer, numpy_layer, random_state_dict

EPS = 1e-5
D, H, K, HV = 24, 2, 8, 4
FIELDS = ("conv_q", "conv_k", "conv_v", "state")


@eqx.filter_jit
def run(layer, x, **kw):
    return layer(x, **kw)


def make_layer(seed=0, H=H, HV=HV, naming="fla", conv_bias=False, **options):
    """The standard test layer: FLA names, GVA (HV = 2H), allow_neg_eigval (``conv_bias``:
    with biases on the short convolutions)."""
    options = {"allow_neg_eigval": True, **options} if naming == "fla" and "lower_bound" not in options else options
    sd = random_state_dict(naming, num_heads=H, head_dim=K, hidden_size=D, num_v_heads=HV, seed=seed,
                           conv_bias=conv_bias)
    options = {"allow_neg_eigval": False, "lower_bound": None, **options}
    layer = KimiDeltaAttention.from_state_dict(sd, naming=naming, num_heads=H, head_dim=K, norm_eps=EPS,
                                               param_dtype=jnp.float64, **options)
    return layer, sd, options


def rand(seed, *shape):
    return jnp.asarray(np.random.default_rng(100 + seed).normal(size=shape))


def rand_cache(layer, N, seed):
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape) * 0.5), layer.init_cache(N))


def oracle(sd, options, x, cache=None, naming="fla", H=H):
    """numpy reference; ``cache`` a KDACache (or None)."""
    c = None if cache is None else {f: np.asarray(getattr(cache, f)) for f in FIELDS}
    return numpy_layer(sd, np.asarray(x), naming=naming, num_heads=H, head_dim=K, norm_eps=EPS, cache=c, **options)


def check_cache(cache, ref, tol, name):
    for f in FIELDS:
        assert_close(getattr(cache, f), ref[f], tol, f"{name} {f}")


# -- Must show: equals an independent numpy transcription of Kimi Linear's layer ---------

@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("naming,h,hv", [("moonshot", 2, 2), ("fla", 2, 4)])  # fla: GVA, allow_neg_eigval
def test_matches_numpy_kimi_linear(naming, h, hv, mode):
    layer, sd, options = make_layer(1, H=h, HV=hv, naming=naming)
    x = rand(1, 2, 37, D)  # 37 tokens: not a multiple of the chunk (16)
    y, cache = run(layer, x, mode=mode, chunk_size=16)
    ref, ref_cache = oracle(sd, options, x, naming=naming, H=h)
    assert_close(y, ref, 1e-10, f"{naming} {mode}")
    check_cache(cache, ref_cache, 1e-10, mode)


@pytest.mark.parametrize("mode", ["recurrent", pytest.param("chunk", marks=pytest.mark.slow)])
def test_lower_bound_gate_matches_numpy(mode):
    layer, sd, options = make_layer(2, H=1, HV=2, lower_bound=-5.0)
    x = rand(2, 2, 37, D)
    y, _ = run(layer, x, mode=mode, chunk_size=16)
    assert_close(y, oracle(sd, options, x, H=1)[0], 1e-10, mode)


# -- cache: prefill then steps == one call -------------------------------------------------

def test_prefill_then_steps_equals_one_call():
    layer, _, _ = make_layer(3)
    x = rand(3, 2, 37, D)
    y_full, c_full = run(layer, x, mode="chunk", chunk_size=16)
    y, cache = run(layer, x[:, :21], chunk_size=16)  # prefill (chunked)
    ys = [y]
    for t in range(21, 29):  # single tokens: the recurrent path by default
        yt, cache = run(layer, x[:, t:t + 1], cache=cache)
        ys.append(yt)
    yt, cache = run(layer, x[:, 29:], cache=cache, mode="chunk", chunk_size=16)  # 8 tokens chunked from the cache
    ys.append(yt)
    assert_close(jnp.concatenate(ys, 1), y_full, 1e-10, "y")
    for f in FIELDS:
        assert_close(getattr(cache, f), getattr(c_full, f), 1e-10, f)


def test_left_padded_prefill_then_steps_equals_each_alone():
    layer, sd, options = make_layer(4)
    lens, T, M = (9, 14), 14, 3
    seqs = [rand(10 + i, 1, n + M, D) for i, n in enumerate(lens)]
    x = np.full((2, T, D), 7.0)  # junk in the padding
    mask = np.zeros((2, T), np.int32)
    for i, n in enumerate(lens):
        x[i, T - n:], mask[i, T - n:] = seqs[i][0, :n], 1
    y, cache = run(layer, jnp.asarray(x), attention_mask=jnp.asarray(mask), chunk_size=16)
    steps = []
    for t in range(M):
        yt, cache = run(layer, jnp.concatenate([s[:, n + t:n + t + 1] for s, n in zip(seqs, lens)]), cache=cache)
        steps.append(yt)
    steps = jnp.concatenate(steps, 1)
    for i, n in enumerate(lens):
        alone, alone_cache = oracle(sd, options, seqs[i])
        assert_close(y[i, T - n:], alone[0, :n], 1e-10, f"prefill row {i}")
        assert_close(steps[i], alone[0, n:], 1e-10, f"steps row {i}")
        assert np.all(np.asarray(y[i, :T - n]) == 0.0), "padding rows of y must be exactly zero"
        check_cache(jax.tree.map(lambda a: a[i:i + 1], cache), alone_cache, 1e-10, f"row {i}")


def test_pooled_step_leaves_other_slots_bit_identical():
    layer, sd, options = make_layer(5)
    P, idx = 6, jnp.asarray([4, 1], jnp.int32)
    pool = rand_cache(layer, P, 5)
    before = jax.tree.map(np.array, pool)
    x = rand(5, 2, 1, D)
    ref, ref_cache = oracle(sd, options, x, cache=jax.tree.map(lambda a: a[np.asarray(idx)], before))
    # Donates the pool (and x, idx): the step updates the pool's buffers in place.
    step = eqx.filter_jit(lambda l, x, c, i: l(x, cache=c, state_indices=i), donate="all-except-first")
    y, pool = step(layer, x, pool, idx)
    assert_close(y, ref, 1e-10, "y")
    touched = np.array([4, 1])
    untouched = np.setdiff1d(np.arange(P), touched)
    for f in FIELDS:
        new, old = np.asarray(getattr(pool, f)), getattr(before, f)
        assert np.array_equal(new[untouched], old[untouched]), f"{f}: untouched slots changed"
        assert_close(new[touched], ref_cache[f], 1e-10, f)


# -- padding and packing -----------------------------------------------------------------

def test_padded_batch_equals_each_alone_without_recompiling():
    layer, sd, options = make_layer(6)
    B, T = 2, 14
    x = rand(6, B, T, D)
    f = lambda l, x, m: run(l, x, attention_mask=m, chunk_size=16)
    f(layer, x, jnp.ones((B, T), bool))
    compiled = run._cached._cache_size()
    for side in ("left", "right"):
        for lens in ((14, 5), (1, 0)):
            mask = np.zeros((B, T), bool)
            for i, n in enumerate(lens):
                mask[i] = (np.arange(T) >= T - n) if side == "left" else (np.arange(T) < n)
            y, cache = f(layer, x, jnp.asarray(mask))
            for i, n in enumerate(lens):
                sel = mask[i]
                assert np.all(np.asarray(y[i][~sel]) == 0.0), "padding rows of y must be exactly zero"
                if n:
                    ref, ref_cache = oracle(sd, options, x[i:i + 1][:, sel])
                    assert_close(y[i][sel], ref[0], 1e-10, f"{side} {lens} row {i}")
                    check_cache(jax.tree.map(lambda a: a[i:i + 1], cache), ref_cache, 1e-10, f"{side} row {i}")
                else:  # an empty row keeps its (zero) initial cache
                    assert all(np.all(np.asarray(getattr(cache, f_)[i]) == 0.0) for f_ in FIELDS)
    assert run._cached._cache_size() == compiled, "a new mask must not recompile"


def test_packed_input_never_mixes_sequences():
    layer, sd, options = make_layer(7)
    cu = jnp.asarray([0, 7, 7, 20, 29], jnp.int32)  # an empty sequence included
    spans = [(0, 7), (7, 7), (7, 20), (20, 29)]
    x = rand(7, 1, 29, D)
    x2 = x.at[:, 7:20].set(rand(8, 1, 13, D))
    c0 = rand_cache(layer, 4, 1)
    # One sequence per chunk: the other sequences do not see the change, bitwise. Shared
    # chunks (the default, initial states entering them): to float rounding, as
    # docs/stages.md §1 says; a sequence's chunk-local G starts from the chunk's start, so
    # differences within it round after the sum of its neighbour's decays (~1e-16).
    per_seq = dataclasses.replace(kdax.KDAPipeline.reference(), share_chunks=False)
    for pipeline, exact in ((per_seq, True), (None, False)):
        kw = dict(cu_seqlens=cu, cache=c0, mode="chunk", chunk_size=16, pipeline=pipeline)
        y, cache = run(layer, x, **kw)
        y2, cache2 = run(layer, x2, **kw)
        same = (lambda a, b, what: np.testing.assert_array_equal(np.asarray(a), np.asarray(b), what)) if exact else (
            lambda a, b, what: assert_close(a, b, 1e-13, what))
        for a, b in ((0, 7), (20, 29)):
            same(y[:, a:b], y2[:, a:b], f"tokens {a}:{b}")
        for i in (0, 1, 3):
            for f in FIELDS:
                same(getattr(cache, f)[i], getattr(cache2, f)[i], f)
    # each sequence continues from its own cache row (conv history and state)
    for mode in ("chunk", "recurrent"):
        yp, cp = run(layer, x, cu_seqlens=cu, cache=c0, mode=mode, chunk_size=16)
        for i, (a, b) in enumerate(spans):
            row = jax.tree.map(lambda t: t[i:i + 1], c0)
            with np.errstate(invalid="ignore"):  # the empty sequence: the oracle's norm of nothing
                ref, ref_cache = oracle(sd, options, x[:, a:b], cache=row)
            if b > a:
                assert_close(yp[:, a:b], ref, 1e-10, f"{mode} sequence {a}:{b}")
            check_cache(jax.tree.map(lambda t: t[i:i + 1], cp), ref_cache, 1e-10, f"{mode} seq {i}")


# -- prefix caching ----------------------------------------------------------------------

def test_intermediate_states_resume_any_chunk_prefix():
    layer, sd, options = make_layer(8)
    C, x = 16, rand(9, 2, 37, D)
    c0 = rand_cache(layer, 2, 2)
    y, final, inter = run(layer, x, cache=c0, return_intermediate_states=True, chunk_size=C)
    ref, ref_final = oracle(sd, options, x, cache=c0)
    assert_close(y, ref, 1e-10, "y")
    check_cache(final, ref_final, 1e-10, "final")
    assert inter.state.shape[:2] == (2, 3)
    for c in range(3):
        at = jax.tree.map(lambda a: a[:, c], inter)
        want = {f: np.asarray(getattr(c0, f)) for f in FIELDS} if c == 0 else oracle(sd, options, x[:, :c * C], c0)[1]
        check_cache(at, want, 1e-10, f"after {c} chunks")
    at = jax.tree.map(lambda a: a[:, 2], inter)
    y_rest, c_rest = run(layer, x[:, 2 * C:], cache=at, mode="recurrent")
    assert_close(y_rest, ref[:, 2 * C:], 1e-10, "resumed")
    check_cache(c_rest, ref_final, 1e-10, "resumed final")


# -- gradients -----------------------------------------------------------------------------

def test_grad_every_parameter_matches_jnp_oracle():
    layer, _, _ = make_layer(9)
    x = rand(11, 2, 21, D)
    w = rand(12, 2, 21, D)
    params, static = eqx.partition(layer, eqx.is_array)

    @jax.jit
    def grads(params, x):
        loss = lambda p, x: jnp.sum(eqx.combine(p, static)(x, mode="chunk", chunk_size=16)[0] * w)
        return jax.grad(loss, argnums=(0, 1))(params, x)

    @jax.jit
    def grads_ref(params, x):
        def loss(p, x):
            fields = {k: v for k, v in vars(p).items() if v is not None}
            return jnp.sum(jnp_layer(fields, x, H=H, K=K, eps=EPS, allow_neg_eigval=True) * w)
        return jax.grad(loss, argnums=(0, 1))(params, x)

    (g, gx), (g_ref, gx_ref) = grads(params, x), grads_ref(params, x)
    names = [k for k, v in vars(params).items() if eqx.is_array(v)]
    assert len(names) == 16  # every parameter
    for name in names:
        assert_close(getattr(g, name), getattr(g_ref, name), 1e-8, name)
    assert_close(gx, gx_ref, 1e-8, "x")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the program XLA:CPU compiles")
def test_training_step_keeps_no_transposed_or_shifted_copies():
    """The layer's training step as XLA:CPU compiles it (float32, B=1 T=128 hidden 64): no
    weight gradient reads a transposed ``[hidden, T]`` copy of its projection's output
    gradient (the projections' rows in their ``[B, T]`` axes made one per projection, with
    the kernel's gradient unpacking and the activations' VJPs fused into it: 1.17x the
    step's time at T=4096 hidden 1024), and each short convolution keeps one padded copy
    of its input, not one per shift (96 MiB of temporaries there)."""
    T, hidden = 128, 64
    layer = KimiDeltaAttention(hidden, 2, 32, key=jax.random.key(0))
    x, w = (jax.random.normal(jax.random.key(s), (1, T, hidden), jnp.float32) for s in (1, 2))
    params, static = eqx.partition(layer, eqx.is_array)
    step = jax.grad(lambda p, x, w: jnp.sum(eqx.combine(p, static)(x, mode="chunk")[0] * w))
    text = jax.jit(step).lower(params, x, w).compile().as_text()
    top = text[text.index("\nENTRY"):].splitlines()  # (kernels: fused computations' insides left out)
    shaped = lambda *dims: [ln.split("=")[0].strip() for ln in top if f"= f32[{','.join(map(str, dims))}]" in ln]
    assert shaped(hidden, T) == []
    padded = [name for j in range(1, layer.conv_size) for name in shaped(1, T + j, hidden)]
    assert len(padded) == 3, padded


@pytest.mark.slow
def test_grad_through_mask_matches_rows_alone():
    layer, _, _ = make_layer(10)
    x = rand(13, 2, 12, D)
    mask = jnp.asarray([[0, 0, 0] + [1] * 9, [1] * 12])
    f = lambda l: jnp.sum(l(x, attention_mask=mask)[0] ** 2)
    f_ref = lambda l: jnp.sum(l(x[:1, 3:])[0] ** 2) + jnp.sum(l(x[1:])[0] ** 2)
    g, g_ref = eqx.filter_jit(eqx.filter_grad(f))(layer), eqx.filter_jit(eqx.filter_grad(f_ref))(layer)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert_close(a, b, 1e-10)


# -- options and errors ------------------------------------------------------------------

def test_no_short_conv_float32_and_bfloat16_compute():
    layer = KimiDeltaAttention(16, 2, 8, key=jax.random.key(0), use_short_conv=False)
    assert layer.q_conv is None and layer.q_proj.dtype == jnp.float32
    x = jax.random.normal(jax.random.key(1), (2, 10, 16), jnp.float32)
    y, cache = run(layer, x, mode="recurrent")
    assert y.dtype == jnp.float32 and cache.conv_q is None and cache.state.dtype == jnp.float32
    bf16 = KimiDeltaAttention(16, 2, 8, key=jax.random.key(0), use_short_conv=False, dtype=jnp.bfloat16)
    yb, cb = run(bf16, x, mode="recurrent")
    assert yb.dtype == jnp.bfloat16 and cb.state.dtype == jnp.float32
    assert_close(yb, y, 5e-2)


def test_bad_input_names_the_argument():
    layer, _, _ = make_layer(0)
    x = rand(0, 2, 5, D)
    with pytest.raises(ValueError, match="hidden_size=24"):
        layer(x[..., :20])
    with pytest.raises((ValueError, TypeCheckError), match="attention_mask"):
        layer(x, attention_mask=jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=jnp.asarray([0, 5]))
    with pytest.raises(ValueError, match="state: expected"):
        layer(x, cache=layer.init_cache(3))
    with pytest.raises(ValueError, match="state_indices"):
        layer(x, cache=layer.init_cache(3), state_indices=jnp.asarray([0, 1, 2]))
    with pytest.raises(Exception, match="state_indices: every slot"):
        layer(x[:, :1], cache=layer.init_cache(3), state_indices=jnp.asarray([0, 3]), mode="recurrent")
    with pytest.raises(ValueError, match="return_intermediate_states"):
        layer(x, attention_mask=jnp.ones((2, 5)), return_intermediate_states=True)
    with pytest.raises(ValueError, match="mode"):
        layer(x, mode="fast")
    with pytest.raises(ValueError, match="num_v_heads=3"):
        KimiDeltaAttention(8, 2, 4, key=jax.random.key(0), num_v_heads=3)
    assert isinstance(layer.init_cache(2), KDACache)
    with pytest.raises(ValueError, match=r"^x: expected at least one token per row, got shape \(2, 0, 24\)\.$"):
        layer(x[:, :0])
    with pytest.raises(ValueError, match=r"^attention_mask and cu_seqlens: pass at most one of them\.$"):
        layer(x[:1], attention_mask=jnp.ones((1, 5)), cu_seqlens=[0, 5])
    with pytest.raises(ValueError, match=r"^state_indices: needs a cache \(the pool\) to index\.$"):
        layer(x, state_indices=jnp.asarray([0, 1]))
    # FLA's cache handed over wrong
    fla = layer.init_cache(2).to_fla()
    for kw, msg in [(dict(layer_cache=fla, recurrent_state=fla["recurrent_state"]), "not both"),
                    (dict(layer_cache={"recurrent_state": None}), r"recurrent_state is missing \(FLA's cache"),
                    (dict(), r"recurrent_state is missing"),
                    (dict(recurrent_state=np.zeros((2, 3, 4))), r"^recurrent_state: expected \[N, HV, V, K\], got shape "
                                                                r"\(2, 3, 4\)\.$"),
                    (dict(recurrent_state=fla["recurrent_state"], conv_state=fla["conv_state"][:2]),
                     r"^conv_state: expected FLA's \(q, k, v\) tuple, got 2 entries\.$")]:
        with pytest.raises(ValueError, match=msg):
            KDACache.from_fla(**kw)



@pytest.mark.parametrize("mask", [np.where(np.arange(5) < 3, 0.0, -1e9), np.full(5, 0.5), np.array([1, 1, 2, 1, 0]),
                                  np.array([1.0, np.nan, 1, 1, 1])], ids=["additive", "half", "two", "nan"])
def test_attention_mask_values_other_than_0_or_1_are_refused(mask):
    """An additive mask (0 for tokens, -1e9 for padding) ran as its inverse, silently
    (its padding as tokens, its tokens dropped; FLA reads any nonzero value as a token):
    refused eagerly and inside a compiled program, naming the argument. 0/1 in any
    dtype and booleans run, and give the same numbers."""
    layer, _, _ = make_layer(0)
    x = rand(0, 2, 5, D)
    m = np.stack([np.ones(5), mask])
    want = r"^attention_mask: expected 1 \(a token\) or 0 \(padding\) in every entry, or booleans; an additive mask"
    with pytest.raises(ValueError, match=want + r".*\(mask == 0\), got "):
        layer(x, attention_mask=m)
    ok = np.stack([np.ones(5), np.arange(5) >= 2])
    y_bool = run(layer, x, attention_mask=jnp.asarray(ok))[0]
    for dtype in (np.int32, np.float32):
        assert np.array_equal(run(layer, x, attention_mask=jnp.asarray(ok.astype(dtype)))[0], y_bool)
        assert np.array_equal(layer(x, attention_mask=ok.astype(dtype))[0], y_bool)


def test_attention_mask_values_checked_inside_a_compiled_program():
    """Traced, on one device (a user's CPU program: a fresh process), inside the program
    (``eqx.error_if``; with several devices an error would end the process, so it is not
    made there)."""
    code = """
import jax, jax.numpy as jnp, numpy as np, equinox as eqx
from kdax.nn import KimiDeltaAttention
assert jax.device_count() == 1
layer = KimiDeltaAttention(16, 2, 8, key=jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (2, 5, 16))
run = eqx.filter_jit(lambda layer, x, m: layer(x, attention_mask=m)[0])
ok = jnp.asarray(np.stack([np.ones(5), np.arange(5) >= 2]), jnp.float32)
run(layer, x, ok).block_until_ready()
try:
    run(layer, x, ok.at[1, 0].set(-1e9)).block_until_ready()
except Exception as e:
    print("raised:", str(e).splitlines()[0] if str(e) else type(e).__name__)
    print("message" if "attention_mask: expected 1 (a token) or 0 (padding)" in str(e) else "no message")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=one_device_env(),
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "raised:" in out.stdout and "\nmessage" in out.stdout, out.stdout


# (what, cu_seqlens, the message kdax.chunk_kda gives for it)
BAD_CU = [
    ("start", [1, 3, 6], "cu_seqlens: must start at 0"),
    ("order", np.array([0, 4, 2, 6]), "cu_seqlens: must be non-decreasing"),
    ("end", (0, 3, 5), r"cu_seqlens: must end at T=6 \(x.shape\[1\]\)"),
    ("floats", [0.0, 3.0, 6.0], "cu_seqlens: expected integers"),
    ("shape", np.zeros((2, 2), np.int32), "cu_seqlens"),  # (the signature's jaxtyping check names it)
]


def test_layer_cu_seqlens_checked_as_chunk_kda_checks_it():
    """Issue 25 item 5: the layer takes ``cu_seqlens`` as ``kdax.chunk_kda`` does (list,
    tuple, numpy, array) and refuses a bad one with the same named error, before anything
    runs; under jit its values are checked inside the program (Equinox's error with the
    message), and valid offsets given as an array run the same program."""
    layer, _, _ = make_layer(0)
    x = rand(1, 1, 6, D)
    pos = (rand(2, 1, 6, H, K), rand(3, 1, 6, H, K), rand(4, 1, 6, HV, K), -jnp.abs(rand(5, 1, 6, HV, K)),
           jnp.full((1, 6, HV), 0.5))
    for what, cu, msg in BAD_CU:
        with pytest.raises((ValueError, TypeError, TypeCheckError), match=msg):
            layer(x, cu_seqlens=cu)
        if what != "shape":  # kdax.chunk_kda's error for the same offsets at T=6
            with pytest.raises((ValueError, TypeError), match=msg.replace("x.shape", "q.shape")):
                kdax.chunk_kda(*pos, cu_seqlens=cu)
    f = eqx.filter_jit(lambda x, cu: layer(x, cu_seqlens=cu)[0])
    with pytest.raises(Exception, match="cu_seqlens: must be non-decreasing"):
        jax.block_until_ready(f(x, jnp.asarray([0, 4, 2, 6], jnp.int32)))
    y = f(x, jnp.asarray(np.array([0, 2, 6]), jnp.int32))
    assert_close(y, f(x, jnp.asarray([0, 2, 6], jnp.int32)), 0.0)


def test_short_prompt_many_heads_no_head_first_warning():
    """The layer lays out [B, T, H, K] itself: T < H is a short prompt, not FLA's old
    head-first layout, so chunk_kda's HeadFirstLayoutWarning is not raised through it."""
    import warnings

    import kdax

    layer = kdax.nn.KimiDeltaAttention(hidden_size=64, num_heads=8, head_dim=8, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.HeadFirstLayoutWarning)
        y, _ = layer(x)
    assert y.shape == x.shape


def test_forward_mode_through_the_layer_names_what_works():
    """An eager ``jax.jvp``/``jax.jacfwd`` of the layer gave JAX's bare "can't apply
    forward-mode autodiff (jvp) to a custom_vjp function" (the eager call is one compiled
    program, where chunk_kda's own refusal does not run): ``kdax.ForwardModeError`` now, as
    from chunk_kda; the recurrent path (plain JAX) still differentiates forward."""
    layer, _, _ = make_layer(0)
    x = rand(0, 1, 20, D)
    with pytest.raises(kdax.ForwardModeError, match="reverse only"):
        jax.jvp(lambda x: layer(x)[0], (x,), (x,))
    with pytest.raises(kdax.ForwardModeError):
        jax.jacfwd(lambda x: layer(x)[0].sum())(x)
    y, dy = jax.jvp(lambda x: layer(x, mode="recurrent")[0], (x,), (x,))
    assert np.isfinite(np.asarray(dy)).all() and dy.shape == y.shape
