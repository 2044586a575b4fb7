"""Bad input gets a clear error naming the argument, before any computation."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import kdax

from ._util import make_inputs, split_args

FNS = [kdax.chunk_kda, kdax.fused_recurrent_kda]


def _call(fn, x, **opts):
    pos, kw = split_args(x)
    kw.update(opts)
    return fn(*pos, **kw)


@pytest.fixture
def x():
    return make_inputs(B=1, T=12, H=2, K=8, V=8, h0=False)


@pytest.mark.parametrize("fn", FNS)
def test_shape_mismatch_names_argument(fn, x):
    x["k"] = x["k"][:, :, :, :4]
    with pytest.raises(TypeError, match="'k'"):
        _call(fn, x)


@pytest.mark.parametrize("fn", FNS)
def test_time_mismatch_names_argument(fn, x):
    x["beta"] = x["beta"][:, :5]
    with pytest.raises(TypeError, match="'beta'"):
        _call(fn, x)


@pytest.mark.parametrize("fn", FNS)
def test_heads_not_multiple(fn):
    x = make_inputs(B=1, T=12, H=2, HV=3, K=8, V=8, h0=False)
    with pytest.raises(ValueError, match=r"^v: .*multiple"):
        _call(fn, x)


@pytest.mark.parametrize("fn", FNS)
def test_non_float_input(fn, x):
    x["q"] = jnp.ones(x["q"].shape, jnp.int32)
    with pytest.raises(TypeError, match="'q'"):
        _call(fn, x)


@pytest.mark.parametrize("fn", FNS)
def test_cu_seqlens_needs_batch_one(fn):
    x = make_inputs(B=2, T=12, H=2, K=8, V=8, h0=False)
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*B == 1"):
        _call(fn, x, cu_seqlens=jnp.array([0, 5, 12], jnp.int32))


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("cu,what", [([1, 5, 12], "start at 0"), ([0, 7, 5, 12], "be non-decreasing"), ([0, 5, 11], "end at T")])
def test_cu_seqlens_values(fn, x, cu, what):
    with pytest.raises(ValueError, match=f"^cu_seqlens: must {what}"):
        _call(fn, x, cu_seqlens=jnp.array(cu, jnp.int32))


@pytest.mark.parametrize("fn", FNS)
def test_gate_in_kernel_needs_parameters(fn, x):
    with pytest.raises(ValueError, match=r"^A_log: use_gate_in_kernel=True needs"):
        _call(fn, x, use_gate_in_kernel=True)


@pytest.mark.parametrize("fn", FNS)
def test_gate_parameters_without_gate_in_kernel(fn, x):
    with pytest.raises(ValueError, match=r"^A_log: only used with use_gate_in_kernel"):
        _call(fn, x, A_log=jnp.zeros(2))


@pytest.mark.parametrize("fn", FNS)
def test_dt_bias_shape(fn, x):
    with pytest.raises(ValueError, match=r"^dt_bias: expected shape \[HV \* K\]"):
        _call(fn, x, use_gate_in_kernel=True, A_log=jnp.zeros(2), dt_bias=jnp.zeros(7))


@pytest.mark.parametrize("fn", FNS)
def test_initial_state_shape(fn, x):
    with pytest.raises(ValueError, match=r"^initial_state: expected shape"):
        _call(fn, x, initial_state=jnp.zeros((2, 2, 8, 8)))
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[N, HV, V, K\]"):
        _call(fn, x, initial_state=jnp.zeros((1, 2, 8, 4)), state_v_first=True)


@pytest.mark.parametrize("fn", FNS)
def test_initial_state_count_varlen(fn, x):
    with pytest.raises(ValueError, match=r"^initial_state: expected shape"):
        _call(fn, x, initial_state=jnp.zeros((1, 2, 8, 8)), cu_seqlens=jnp.array([0, 4, 12], jnp.int32))


def test_chunk_size(x):
    with pytest.raises(ValueError, match=r"^chunk_size: expected one of"):
        _call(kdax.chunk_kda, x, chunk_size=48)


def test_safe_gate_needs_lower_bound(x):
    with pytest.raises(ValueError, match=r"^lower_bound: safe_gate=True"):
        _call(kdax.chunk_kda, x, use_gate_in_kernel=True, A_log=jnp.zeros(2), safe_gate=True)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("lb", [0.5, 0.0, float("nan")])
def test_lower_bound_negative(fn, x, lb):
    """(-inf is a lower bound: every token forgets exactly, tests/test_hardening.py.)"""
    with pytest.raises(ValueError, match=r"^lower_bound: must be negative \(the gate is"):
        _call(fn, x, use_gate_in_kernel=True, lower_bound=lb)


def test_pipeline_forward_and_backward_check_shapes(x):
    pipe = kdax.KDAPipeline.reference()
    pos, _ = split_args(x)
    o, ht, res = pipe.forward(*pos, output_final_state=True)
    bad = list(pos)
    bad[1] = bad[1][:, :5]
    with pytest.raises(TypeError, match="'k'"):
        pipe.forward(*bad)
    with pytest.raises(ValueError, match=r"^do: expected shape"):
        pipe.backward(res, o[:, :3], ht)
    with pytest.raises(ValueError, match=r"^dht: expected shape"):
        pipe.backward(res, o, ht[..., :4])


@pytest.mark.parametrize("bad", ["v", "beta", "k"])
def test_pipeline_call_and_plan_check_shapes_as_chunk_kda(x, bad):
    """``pipe(...)`` and ``pipe.plan(...)`` gave JAX's broadcast errors (a wrong v or beta)
    or named the chunked layout (``k: expected layout [R, HV, NC, C, K]``): chunk_kda's
    checks now, naming the argument in the caller's layout."""
    pipe = kdax.KDAPipeline.reference()
    pos, _ = split_args(x)
    args = dict(zip(("q", "k", "v", "g", "beta"), pos))
    args[bad] = {"v": args["v"][:, :7], "beta": args["beta"][:, :, :1], "k": args["k"][..., :4]}[bad]
    want = {"v": r"v: expected layout \[B, T, HV, V\].*axis 1 \(T\) is 7, expected 12",
            "beta": r"beta: expected layout \[B, T, HV\].*axis 2 \(HV\) is 1, expected 2",
            "k": r"k: expected layout \[B, T, H, K\].*axis 3 \(K\) is 4, expected 8"}[bad]
    for call in (pipe, pipe.plan):
        with pytest.raises(TypeError, match=want):
            call(**args)


def test_pipeline_backward_takes_and_gives_states_in_the_forwards_layout():
    """After ``forward(..., state_v_first=True)`` the final state is ``[N, HV, V, K]``, and
    ``backward`` read ``dht`` as ``[N, HV, K, V]`` and gave the initial state's gradient so:
    at K == V no error, dk 1.84 and dh0 0.35 off ``jax.grad(chunk_kda)``. Both now in the
    forward's layout: equal to ``jax.grad`` to float64 rounding."""
    x = make_inputs(B=1, T=40, H=2, K=8, V=8, h0=True, dtype=jnp.float64)
    pos, _ = split_args(x)
    h0 = jnp.swapaxes(x["initial_state"], -1, -2)  # [N, HV, V, K]
    pipe = kdax.KDAPipeline.reference()
    opts = dict(initial_state=h0, output_final_state=True, state_v_first=True)
    o, ht, res = pipe.forward(*pos, **opts)
    do, dht = jnp.cos(o), jnp.sin(ht) + 0.5 * jnp.swapaxes(ht, -1, -2)  # (not symmetric: a transpose shows)
    got = pipe.backward(res, do, dht)

    def loss(*a):
        o, ht = kdax.chunk_kda(*a[:5], **dict(opts, initial_state=a[5]))
        return jnp.sum(o * do) + jnp.sum(ht * dht)

    want = jax.grad(loss, argnums=range(6))(*pos, h0)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for name, a, b in zip(names, (getattr(got, n) for n in names), want):
        assert a.shape == b.shape and float(jnp.max(jnp.abs(a - b))) <= 1e-12, name
    with pytest.raises(ValueError, match=r"^dht: expected shape \[N, HV, V, K\] = \(1, 2, 8, 8\), got \(1, 2, 8, 4\)\."):
        pipe.backward(res, do, dht[..., :4])


@pytest.mark.parametrize("fn", FNS)
def test_out_of_domain_gate_and_beta_named_eagerly(fn, x):
    """What a newcomer tries first, random-normal g and beta, gave NaN in most outputs
    silently (issue 39 item 7): eagerly, and in an eager jax.grad, g > 0 and beta outside
    [0, 1] raise a ValueError naming the argument and its domain; the in-kernel
    activations take raw values; non-finite entries are kdax._numerics.isolation's (no error)."""
    import jax

    pos, kw = split_args(x)
    q, k, v, g, beta = pos
    with pytest.raises(ValueError, match=r"^g: must be a log decay <= 0"):
        fn(q, k, v, g.at[0, 3, 1, 2].set(0.5), beta)
    for bad in (-0.1, 1.2):
        with pytest.raises(ValueError, match=r"^beta: must lie in \[0, 1\]"):
            fn(q, k, v, g, beta.at[0, 5, 0].set(bad))
    with pytest.raises(ValueError, match=r"^g: must be a log decay"):  # eager jax.grad: the primal is checked
        jax.grad(lambda q: fn(q, k, v, -g, beta)[0].sum())(q)
    # boundaries, non-finite entries, and raw values with the in-kernel activations: no error
    fn(q, k, v, g.at[0, 0].set(0.0).at[0, 1, 0, 0].set(jnp.inf), beta.at[0, 0].set(1.0).at[0, 1, 0].set(jnp.nan))
    fn(q, k, v, -g, beta + 2, use_gate_in_kernel=True, A_log=jnp.zeros(2), use_beta_sigmoid_in_kernel=True)
    # under jit the values are checked inside the program (tests/test_input_checks.py);
    # check_inputs=False leaves them unchecked: no error is raised
    jax.block_until_ready(jax.jit(lambda g: fn(q, k, v, g, beta, check_inputs=False)[0])(-g))


def test_misspelt_keywords_and_mistyped_declarations_are_named():
    """A misspelt keyword names the function, the nearest argument and every argument
    (before: Python's "got an unexpected keyword argument", naming neither); ``accepts``
    given as a string and ``segmented`` given a stage say what they expect (before:
    "unknown capabilities ['_', 'a', ...]" and an AttributeError), and ``run_stage`` a
    name that is not a stage's, the nearest."""
    x, b = jnp.ones((1, 8, 2, 4)), jnp.full((1, 8, 2), 0.5)
    for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: unexpected keyword argument 'intial_state' \(did you "
                                            r"mean 'initial_state'\?\); its arguments are q, k, v, g, beta, "):
            fn(x, x, x, -x, b, intial_state=None)
    layer = kdax.nn.KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"^KimiDeltaAttention.__call__: unexpected keyword argument 'attn_mask' "
                                        r"\(did you mean 'attention_mask'\?\)"):
        layer(jnp.ones((1, 4, 16)), attn_mask=None)

    class StringAccepts(kdax.stages.AbstractOutput):
        accepts: ClassVar = "tile_safe"
        math: ClassVar = kdax.stages.KDA

        def __call__(self, scale, qg, h, Aqk, v_new):
            return kdax.stages.ReferenceOutput()(scale, qg, h, Aqk, v_new)

    with pytest.raises(TypeError, match=r"StringAccepts.accepts: expected a frozenset of names, e.g. "
                                        r"frozenset\(\{'tile_safe'\}\)"):
        pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), StringAccepts())
        kdax.chunk_kda(x, x, x, -x, b, pipeline=pipe)
    with pytest.raises(TypeError, match=r"^pipeline: expected a KDAPipeline \(segmented splits its F4 and B2 stages\), "
                                        r"got ReferenceOutput"):
        kdax.stages.segmented(kdax.stages.ReferenceOutput(), 2)
    # (before: "'KDAPipeline' object has no attribute 'outputs'")
    with pytest.raises(ValueError, match=r"^name: expected a stage's name, one of gate, intra, .*, gate_bwd; got "
                                         r"'outputs' \(did you mean 'output'\?\)"):
        kdax.KDAPipeline.reference().run_stage("outputs", scale=1.0)
