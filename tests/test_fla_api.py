"""FLA parity of the public API (issue 18.4-18.6): argument types and order, deprecated
alias, FLA's option checks, zero sizes, cu_seqlens checked inside jit."""

import inspect
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

from ._util import assert_close, make_inputs, oracle_kda, split_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
FNS = [kdax.chunk_kda, kdax.fused_recurrent_kda]
IDS = ["chunk", "recurrent"]
# FLA's chunk_kda signature (fla/ops/kda/chunk.py), in order; then the keywords it reads
# from **kwargs.
FLA_POSITIONAL = (
    "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
    "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
    "cp_context", "use_graph", "max_num_seqs",
)
FLA_KWARGS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout")


@pytest.fixture(scope="module")
def x():
    return make_inputs(B=1, T=20, H=1, HV=2, K=4, V=4)


def _run(fn, pos, *args, **opts):
    """``fn(*pos, *args, **opts)`` under jit, the options (and args) closed over as constants."""
    return jax.jit(lambda *p: fn(*p, *args, **opts))(*pos)


def _same(a, b):
    for u, w in zip(a, b):
        assert (u is None) == (w is None)
        if u is not None:
            np.testing.assert_array_equal(np.asarray(u), np.asarray(w))


def test_signature_is_flas_order():
    params = list(inspect.signature(kdax.chunk_kda).parameters.values())
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == FLA_POSITIONAL
    assert set(FLA_KWARGS) <= {p.name for p in params}


def test_positional_in_flas_order(x):
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    a = _run(kdax.chunk_kda, pos, 0.5, h0, True, True, False, False, False, False, None, True, chunk_size=16)
    b = _run(kdax.chunk_kda, pos, scale=0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
             disable_recompute=True, chunk_size=16)
    _same(a, b)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("scale", [1, np.float32(1.0), np.int64(1), jnp.float32(1.0), jnp.asarray(1)])
def test_scale_any_real_number(fn, x, scale):
    pos, kw = split_args(x)
    _same(_run(fn, pos, **kw, scale=scale), _run(fn, pos, **kw, scale=1.0))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_scale_refused(fn, x):
    pos, kw = split_args(x)
    with pytest.raises(TypeError, match="scale: expected a real number"):
        fn(*pos, **kw, scale=True)
    with pytest.raises(TypeError, match="scale: must be a concrete number"):
        jax.jit(lambda s: fn(*pos, **kw, scale=s))(1.0)
    for bad in (float("nan"), float("inf"), np.float32("-inf")):  # (every output NaN)
        with pytest.raises(ValueError, match=r"^scale: expected a finite number, got (nan|inf|-inf)\.$"):
            fn(*pos, **kw, scale=bad)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_cu_seqlens_list_or_tuple(fn, x):
    pos, _ = split_args(x)
    want = _run(fn, pos, cu_seqlens=jnp.array([0, 7, 20]), output_final_state=True)
    as_list = fn is kdax.chunk_kda  # one compile each: a list for one, a tuple for the other
    _same(_run(fn, pos, cu_seqlens=[0, 7, 20] if as_list else (0, 7, 20), output_final_state=True), want)
    with pytest.raises(TypeError, match="cu_seqlens: expected integers"):
        fn(*pos, cu_seqlens=[0.0, 7.5, 20.0])


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_transpose_state_layout_deprecated(fn, x):
    pos, kw = split_args(x)
    h0 = jnp.swapaxes(kw["initial_state"], -1, -2)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout is deprecated") as seen:
        a = _run(fn, pos, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    # attributed to the caller's line, so that Python's default filters show it (in __main__)
    assert {w.filename for w in seen if w.category is DeprecationWarning} == {__file__}
    _same(a, _run(fn, pos, initial_state=h0, output_final_state=True, state_v_first=True))
    with pytest.raises(ValueError, match="transpose_state_layout: cannot be given together"):
        fn(*pos, initial_state=h0, transpose_state_layout=True, state_v_first=True)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_allow_neg_eigval_needs_beta_sigmoid(fn, x):
    pos, kw = split_args(x)
    with pytest.raises(ValueError, match="allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True"):
        fn(*pos, **kw, allow_neg_eigval=True)


def test_safe_gate_range(x):
    pos, kw = split_args(x)
    gate = dict(use_gate_in_kernel=True, A_log=jnp.zeros(2), safe_gate=True)
    for lb in (-6.0, -5.5, 0.0):
        with pytest.raises(ValueError, match="lower_bound"):
            kdax.chunk_kda(*pos, **kw, **gate, lower_bound=lb)
    jax.eval_shape(lambda: kdax.chunk_kda(*pos, **kw, **gate, lower_bound=-5))  # an int, at FLA's bound


def test_safe_gate_with_gate_outside_kernel(x):
    """FLA's test_chunk calls safe_gate=True, lower_bound=... with g already activated:
    a promise about g that kdax accepts (and needs not)."""
    pos, kw = split_args(x)
    _same(_run(kdax.chunk_kda, pos, **kw, safe_gate=True, lower_bound=-5.0, chunk_size=16),
          _run(kdax.chunk_kda, pos, **kw, chunk_size=16))
    with pytest.raises(ValueError, match="lower_bound: safe_gate=True needs -5 <= lower_bound < 0"):
        kdax.chunk_kda(*pos, **kw, safe_gate=True, lower_bound=-7.0)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_a_log_kimi_shape(fn, x):
    pos, kw = split_args(x)
    A = jnp.array([-0.3, 0.2])
    a = _run(fn, pos, **kw, use_gate_in_kernel=True, A_log=A.reshape(1, 1, 2, 1))
    _same(a, _run(fn, pos, **kw, use_gate_in_kernel=True, A_log=A))
    with pytest.raises(Exception, match="A_log"):
        fn(*pos, **kw, use_gate_in_kernel=True, A_log=A.reshape(1, 2, 1, 1))


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_in_kernel_gate_arguments_named(fn, x):
    """The in-kernel gate's arguments, named before anything runs: a bool lower bound (a
    real number expected), A_log of Kimi Linear's four axes but another head count, and the
    gate with neither A_log nor lower_bound."""
    pos, kw = split_args(x)
    with pytest.raises(TypeError, match=r"^lower_bound: expected a real number \(Python, numpy or 0-d JAX scalar\), got bool\.$"):
        fn(*pos, **kw, use_gate_in_kernel=True, A_log=jnp.zeros(2), lower_bound=True)
    with pytest.raises(TypeError, match=r"^A_log: expected layout \[HV\] or \[1, 1, HV, 1\], got shape \(1, 1, 3, 1\): "
                                        r"axis 2 \(HV\) is 3, expected 2"):
        fn(*pos, **kw, use_gate_in_kernel=True, A_log=jnp.zeros((1, 1, 3, 1)))
    with pytest.raises(ValueError, match=r"^A_log: use_gate_in_kernel=True needs A_log \(softplus gate\) or "
                                         r"lower_bound \(lower-bound gate\); neither was given\.$"):
        fn(*pos, **kw, use_gate_in_kernel=True)


def test_fla_only_arguments(x):
    pos, kw = split_args(x)
    o, _, h = kdax.chunk_kda(*pos, **kw, return_intermediate_states=True)  # (tests/test_chunk_states.py)
    assert_close(o, kdax.chunk_kda(*pos, **kw)[0], 1e-13, "o")
    assert h.shape == (1, 1, 2, 4, 4), h.shape  # [B, ceil(T / 64), HV, K, V]
    with pytest.raises(ValueError, match="max_num_seqs: must equal"):
        kdax.chunk_kda(*pos, cu_seqlens=[0, 7, 20], max_num_seqs=3)
    _same(_run(kdax.chunk_kda, pos, cu_seqlens=[0, 7, 20], cu_seqlens_cpu=[0, 7, 20], use_graph=True, max_num_seqs=2),
          _run(kdax.chunk_kda, pos, cu_seqlens=[0, 7, 20]))
    # FLA's host copy of cu_seqlens: alone it ran as one dense row; it must equal cu_seqlens
    for given in (dict(cu_seqlens_cpu=np.array([0, 7, 20])), dict(cu_seqlens=[0, 7, 20], cu_seqlens_cpu=[0, 8, 20])):
        with pytest.raises(ValueError, match=r"^cu_seqlens_cpu: FLA's host copy of cu_seqlens, .* must equal"):
            kdax.chunk_kda(*pos, **given)


def test_docs_table_lists_every_fla_argument():
    text = (ROOT / "docs" / "fla_arguments.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    missing = set(FLA_POSITIONAL + FLA_KWARGS) - rows
    assert not missing, missing


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("dims", [dict(B=0), dict(K=0), dict(V=0), dict(T=0)], ids=["B0", "K0", "V0", "T0"])
def test_zero_sizes(fn, dims):
    x = make_inputs(**{**dict(B=2, T=5, H=1, K=3, V=3), **dims})
    pos, kw = split_args(x)
    o, ht = fn(*pos, **kw, output_final_state=True)
    # (the oracle needs a scale when K == 0: any scale multiplies empty sums)
    o_ref, ht_ref = oracle_kda(*pos, **kw, output_final_state=True, scale=1.0 if dims.get("K", 1) == 0 else None)
    assert o.shape == pos[2].shape and ht.shape == kw["initial_state"].shape
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref) if o.size else np.zeros(o.shape))
    np.testing.assert_allclose(np.asarray(ht), np.asarray(ht_ref), rtol=1e-12, atol=1e-12)

    def loss(h0, v):
        o, ht = fn(pos[0], pos[1], v, pos[3], pos[4], initial_state=h0, output_final_state=True)
        return jnp.sum(o) + jnp.sum(ht * 2.0)

    dh0, dv = jax.grad(loss, argnums=(0, 1))(kw["initial_state"], pos[2])
    if not dims.get("T", 1) == 0:  # with tokens, the state still decays: only check shapes
        assert dh0.shape == kw["initial_state"].shape and dv.shape == pos[2].shape
    else:
        np.testing.assert_array_equal(np.asarray(dh0), 2.0)


_JITTED = {}


def _jitted(fn, pos, n):
    """One compiled ``fn(*pos, cu_seqlens=c)[0]`` per function and length of ``c``: the
    values of ``c`` are data."""
    key = (fn, n)
    if key not in _JITTED:
        _JITTED[key] = eqx.filter_jit(lambda c: fn(*pos, cu_seqlens=c)[0])
    return _JITTED[key]


CU_BAD = [
    ([1, 7, 20], "cu_seqlens: must start at 0"),
    ([0, 12, 7, 20], "cu_seqlens: must be non-decreasing"),
    ([0, 7, 19], r"cu_seqlens: must end at T=20 \(q.shape\[1\]\)"),
]


@pytest.mark.parametrize("fn", FNS, ids=IDS)
@pytest.mark.parametrize("cu,msg", CU_BAD, ids=["start", "order", "end"])
def test_cu_seqlens_checked_under_jit(fn, x, cu, msg):
    pos, _ = split_args(x)
    with pytest.raises(ValueError, match=msg):  # eagerly
        fn(*pos, cu_seqlens=np.array(cu))
    f = _jitted(fn, pos, len(cu))
    with pytest.raises(Exception, match=msg):  # traced: inside the compiled program
        jax.block_until_ready(f(jnp.array(cu)))
    ok = [0, 7, 13, 20][: len(cu)] if len(cu) == 4 else [0, 7, 20]
    assert_close(f(jnp.array(ok)), oracle_kda(*pos, cu_seqlens=ok)[0], 1e-10, "valid cu_seqlens")


# FLA's fused_recurrent_kda signature (fla/ops/kda/fused_recurrent.py), in order.
FLA_RECURRENT_POSITIONAL = (
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
    "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
    "lower_bound", "state_v_first", "cu_seqlens",
)


def test_recurrent_signature_is_flas_order(x):
    params = inspect.signature(kdax.fused_recurrent_kda).parameters.values()
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == FLA_RECURRENT_POSITIONAL
    pos, kw = split_args(x)
    A = jnp.array([-0.3, 0.2])
    a = _run(kdax.fused_recurrent_kda, pos, A, None, 0.5, kw["initial_state"], True, False, True)
    b = _run(kdax.fused_recurrent_kda, pos, A_log=A, scale=0.5, initial_state=kw["initial_state"],
             output_final_state=True, use_gate_in_kernel=True)
    _same(a, b)


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_front_doors_pass_every_option_by_name(fn):
    """chunk_kda and fused_recurrent_kda build their KDAOptions explicitly, by name (a
    reader follows ``initial_state`` from the signature to the options): every option in
    the signature appears as ``name=name`` in that call."""
    import ast
    import textwrap

    src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "KDAOptions"]
    assert len(calls) == 1
    passed = {kw.arg for kw in calls[0].keywords}
    params = set(inspect.signature(fn).parameters)
    assert passed == {n for n in kdax.KDAOptions.names() if n in params}


@pytest.mark.parametrize("fn", FNS, ids=IDS)
def test_output_dtype_is_flas(fn, x):
    """FLA's ``chunk_kda`` returns ``o.type_as(q)``, its ``fused_recurrent_kda`` o in v's dtype
    (``torch.zeros_like(v)``): the same where q and v differ (before, chunk_kda gave v's)."""
    q, k, v, g, beta = split_args(x)[0]
    for qd, vd in ((jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)):
        o = fn(q.astype(qd), k.astype(qd), v.astype(vd), g.astype(jnp.float32), beta.astype(jnp.float32))[0]
        assert o.dtype == (qd if fn is kdax.chunk_kda else vd), (qd, vd, o.dtype)
