"""The backward follows the forward (kdax/_runner/routes.py): a pipeline whose forward stages
compute other math than its backward stages transpose gets the exact gradients of the
algorithm its forward stages compute (float64, against autodiff of a pure-JAX oracle of
the modified algorithm), or a named error; with backward stages that transpose it and say
so, the hand-written backward runs (plan says which)."""

import dataclasses
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import kdax
from kdax import pallas as P
from kdax.ref import _chunk as R
from kdax.stages import (
    AbstractGate,
    AbstractIntra,
    AbstractOutput,
    AbstractState,
    AbstractWY,
    IntraOut,
    ReferenceGate,
    ReferenceIntra,
    ReferenceOutput,
    ReferenceState,
    ReferenceWY,
)

from ._util import assert_close, jitted, load_example, make_inputs, oracle_kda, split_args

C = 2.5  # the modification's constant
CHUNK = 16


class ScaledQGate(AbstractGate):
    """F1, then ``q <- c q``: KDA at ``c q``."""

    tile_safe: ClassVar[bool] = True

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        act = ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid, reset=reset)
        return eqx.tree_at(lambda a: a.q, act, act.q * C)


class ScaledAqkIntra(AbstractIntra):
    """F2 with ``Aqk <- c Aqk`` (the intra-chunk part of o scaled)."""

    def __call__(self, scale, q, k, beta, G, G_lo=None, reset=None):
        out = ReferenceIntra()(scale, q, k, beta, G, G_lo=G_lo, reset=reset)
        return IntraOut(out.Aqk * C, out.Akk)


class ScaledVWY(AbstractWY):
    """F3 on ``c v``: KDA at ``c v``."""

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        return ReferenceWY()(q, k, v * C, beta, G, Akk, G_lo=G_lo, reset=reset)


class ScaledStartState(AbstractState):
    """F4 from ``c h0``: KDA from the initial states ``c h0``."""

    def __call__(self, w, u, kg, G, h0, layout, reset=None):
        return ReferenceState()(w, u, kg, G, h0 * C, layout, reset=reset)


class ScaledOutput(AbstractOutput):
    """F5 times c: ``c KDA``."""

    def __call__(self, scale, qg, h, Aqk, v_new):
        return C * ReferenceOutput()(scale, qg, h, Aqk, v_new)


class HeadGainOutput(AbstractOutput):
    """F5 times a per-head gain, declaring the capabilities of ReferenceOutput."""

    gain: Float[Array, " HV"]
    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return o * self.gain[None, :, None, None, None].astype(o.dtype)


class PallasScaledOutput(AbstractOutput):
    """``c`` times a Pallas F5: other math, and JAX cannot differentiate the kernel."""

    def __call__(self, scale, qg, h, Aqk, v_new):
        return C * P.PallasOutput(target="tpu", interpret=True)(scale, qg, h, Aqk, v_new)


def _loss(o, ht):
    return jnp.sum(o * jnp.sin(o)) + jnp.sum(ht * jnp.cos(ht))


def _chunk_oracle(q, k, v, g, beta, h0, scale, aqk_gain=1.0):
    """KDA in chunks from kdax.ref's readable pieces (float64), ``Aqk`` times ``aqk_gain``:
    the oracle of ``ScaledAqkIntra``'s algorithm (dense input, T a multiple of the chunk)."""
    qc, kc, vc, gc, bc = (R.to_chunks(x, CHUNK) for x in (q, k, v, g, beta))
    G = jnp.cumsum(gc, axis=-2)
    Aqk, Akk = R.intra_chunk(qc, kc, bc, G, scale)
    w, u, qg, kg = R.wy_chunk(qc, kc, vc, bc, G, Akk)
    h, v_new, hT = R.state_scan(w, u, kg, G, h0)
    return R.from_chunks(R.output_chunk(qg, h, aqk_gain * Aqk, v_new, scale), q.shape[1]), hT


def _oracle(case, pos, h0):
    q, k, v, g, beta = pos
    if case == "gate":
        return oracle_kda(q * C, k, v, g, beta, initial_state=h0, output_final_state=True)
    if case == "intra":
        return _chunk_oracle(q, k, v, g, beta, h0, q.shape[-1] ** -0.5, aqk_gain=C)
    if case == "wy":
        return oracle_kda(q, k, v * C, g, beta, initial_state=h0, output_final_state=True)
    if case == "state":
        return oracle_kda(q, k, v, g, beta, initial_state=h0 * C, output_final_state=True)
    o, ht = oracle_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    return C * o, ht


USER = {"gate": ScaledQGate, "intra": ScaledAqkIntra, "wy": ScaledVWY, "state": ScaledStartState,
        "output": ScaledOutput}
STEP = {"gate": "F1", "intra": "F2", "wy": "F3", "state": "F4", "output": "F5"}


def _grads(pipe, pos, h0, **opts):
    f = lambda *a: _loss(*kdax.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK,
                                         pipeline=pipe, **opts))
    return jax.jit(jax.grad(f, argnums=tuple(range(6))))(*pos, h0)


@pytest.mark.parametrize("field", list(USER))
def test_modified_stage_gives_the_modified_algorithms_gradients(field):
    x = make_inputs(B=1, T=32, H=2, K=4, V=4)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    pipe = eqx.tree_at(lambda p: getattr(p, field), kdax.KDAPipeline.reference(), USER[field]())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(pipe, pos, h0)
    said = any(issubclass(w.category, kdax.FallbackWarning) and "derived from the forward stages" in str(w.message)
               and f"{STEP[field]} `{field}`" in str(w.message) for w in caught)
    # F1 alone of other math: B5 is F1's VJP, B0-B4 hand-written; F5 alone: F5's VJP in
    # B1's place and feeding B2 and B3, B0 and B2-B5 hand-written (nothing derived whole, no warning)
    assert said == (field not in ("gate", "output"))
    want = jax.jit(jax.grad(lambda *a: _loss(*_oracle(field, a[:5], a[5])), argnums=tuple(range(6))))(*pos, h0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, 1e-10, f"{name} ({field})")
    o, ht = kdax.chunk_kda(*pos, initial_state=h0, output_final_state=True, chunk_size=CHUNK, pipeline=pipe)
    o_ref, ht_ref = jax.jit(_oracle, static_argnums=0)(field, pos, h0)
    assert_close(o, o_ref, 1e-10, f"o ({field})")
    assert_close(ht, ht_ref, 1e-10, f"ht ({field})")
    plan = pipe.plan(*pos, initial_state=h0, output_final_state=True, chunk_size=CHUNK)
    if field == "gate":  # B0-B4 hand-written, B5 F1's VJP
        assert "backward: derived by jax.vjp" not in str(plan)
        row = {r.field: r for r in plan.rows}["gate_bwd"]  # (the pipeline's B5, beside what stands in for it)
        assert (row.requested, row.runs) == ("ReferenceGateBackward", "GateVjpBackward") and "jax.vjp of F1" in row.reason
        return
    if field == "output":  # B1 replaced by F5's VJP, B0 and B2-B5 hand-written (kdax._runner.output_vjp;
        # kdax's own B2 as its recurrence taking d_h directly, not called as a stage)
        assert "backward: derived by jax.vjp" not in str(plan)
        rows = {r.field: r for r in plan.rows}
        assert rows["dav"].runs is None
        assert all(rows[f].runs is not None for f in ("recompute", "wy_dqkg", "intra_bwd", "gate_bwd"))
        return
    assert "backward: derived by jax.vjp" in str(plan)
    assert all(r.runs is None for r in plan.rows if r.step.startswith("B"))


def test_packed_initial_states_with_a_head_gain_declaring_reference_capabilities():
    # Once, declaring ReferenceOutput's capabilities (`standard`) let the pipeline compute
    # F5's terms for states entering shared chunks (outputs 28% off) and the backward
    # ignored the gain (60%). No capability says what a stage computes now (`math` does),
    # and `standard` is a named error.
    class Standard(HeadGainOutput):
        accepts: ClassVar[frozenset] = frozenset({"tile_safe", "standard"})

    with pytest.raises(TypeError, match=r"Standard\.accepts: 'standard' is gone .*math = kdax\.stages\.KDA"):
        kdax._stage_protocol.capabilities.capabilities(Standard)
    x = make_inputs(B=1, T=40, H=3, K=4, V=4, N=3)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    cu = jnp.array([0, 7, 30, 40], jnp.int32)
    gain = jnp.array([0.6, -1.3, 2.0])
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), HeadGainOutput(gain))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        got = _grads(pipe, pos, h0, cu_seqlens=cu)
        o, ht = kdax.chunk_kda(*pos, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK,
                               pipeline=pipe)

    def oracle(*a):
        o_, ht_ = oracle_kda(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu)
        return o_ * gain[None, None, :, None], ht_

    o_ref, ht_ref = jax.jit(oracle)(*pos, h0)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")
    want = jax.jit(jax.grad(lambda *a: _loss(*oracle(*a)), argnums=tuple(range(6))))(*pos, h0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, 1e-10, name)
    assert pipe.plan(*pos, initial_state=h0, cu_seqlens=cu, chunk_size=CHUNK).layout == "per-sequence"


def test_matching_backward_stages_keep_the_hand_written_backward():
    ex = load_example("custom_stage")
    x = make_inputs(B=1, T=32, H=2, K=4, V=4)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    gain = jnp.array([0.5, 2.0])
    pipe = ex.gain_pipeline(gain)
    assert kdax._runner.routes.mismatches(pipe) == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdax.FallbackWarning)
        got = _grads(pipe, pos, h0)
    plan = pipe.plan(*pos, initial_state=h0, chunk_size=CHUNK)
    assert "derived" not in str(plan)
    assert {r.field: r.runs for r in plan.rows}["gate_bwd"] == "QGainGateBackward"

    def oracle(*a):
        q = a[0] * jnp.repeat(gain, 1)[None, None, :, None]
        return oracle_kda(q, *a[1:5], initial_state=a[5], output_final_state=True)

    want = jax.jit(jax.grad(lambda *a: _loss(*oracle(*a)), argnums=tuple(range(6))))(*pos, h0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, 1e-10, name)
    # The same gate without its backward: derived, and still exact.
    alone = eqx.tree_at(lambda p: p.gate_bwd, pipe, kdax.stages.ReferenceGateBackward())
    assert "B5 `gate_bwd` (ReferenceGateBackward) transposes 'kda'" in kdax._runner.routes.mismatches(alone)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        got = _grads(alone, pos, h0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, 1e-10, name + " (derived)")


@pytest.mark.parametrize("field", ["state", "output"])
def test_pallas_pipeline_with_a_user_stage_differentiates_same_math_kernels_as_references(field):
    # A user's F4: the backward derived whole, the Pallas stages of KDA's math
    # differentiated as their reference stages. A user's F5: the Pallas B0, B2-B5 kept,
    # F5's VJP in B1's place (kdax._runner.output_vjp).
    x = make_inputs(B=1, T=32, H=2, K=4, V=4)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    pipe = eqx.tree_at(lambda p: getattr(p, field), kdax.KDAPipeline.pallas("triton", interpret=True), USER[field]())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        got = _grads(pipe, pos, h0)
        plan = pipe.plan(*pos, initial_state=h0, chunk_size=CHUNK)
    want = jax.jit(jax.grad(lambda *a: _loss(*_oracle(field, a[:5], a[5])), argnums=tuple(range(6))))(*pos, h0)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, 1e-10, name)
    rows = {r.field: r for r in plan.rows}
    if field == "output":
        assert rows["intra"].runs == "PallasIntra" and rows["dhu"].runs == "PallasDhu" and rows["dav"].runs is None
        return
    assert rows["intra"].requested == "PallasIntra" and rows["intra"].runs == "ReferenceIntra"
    assert "differentiated as its reference stage" in rows["intra"].reason


def test_underivable_stage_and_direct_backward_are_named_errors():
    x = make_inputs(B=1, T=32, H=2, K=4, V=4)
    pos, _ = split_args(x)
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), PallasScaledOutput())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        with pytest.raises(kdax.DerivedBackwardError, match=r"cannot differentiate F5 `output` \(PallasScaledOutput\)"):
            jax.grad(lambda q: jnp.sum(kdax.chunk_kda(q, *pos[1:], chunk_size=CHUNK, pipeline=pipe)[0]))(pos[0])
    # The forward alone runs; its hand-written backward would be another algorithm's.
    o, _ = kdax.chunk_kda(*pos, chunk_size=CHUNK, pipeline=pipe)
    assert_close(o, C * oracle_kda(*pos)[0], 1e-10, "o")
    scaled = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), ScaledOutput())
    o, _, res = scaled.forward(*pos, chunk_size=CHUNK)
    with pytest.raises(kdax.DerivedBackwardError, match=r"KDAPipeline\.backward: .*F5 `output` \(ScaledOutput\)"):
        scaled.backward(res, jnp.ones_like(o))


def test_declarations():
    ref, pal = kdax.KDAPipeline.reference(), kdax.KDAPipeline.pallas("triton", interpret=True)
    assert kdax._runner.routes.mismatches(ref) == () and kdax._runner.routes.mismatches(pal) == ()
    assert kdax._runner.routes.mismatches(kdax.KDAPipeline.mixed("tpu", interpret=True)) == ()
    assert kdax._runner.routes.mismatches(kdax.stages.segmented(ref)) == ()
    # A segmented F4 computes what its inner stage does (segmented() itself refuses an
    # F4 of other math: tests/parallel/test_custom_stages.py).
    seg = eqx.tree_at(lambda p: p.state, ref, kdax.stages.SegmentedState(ScaledStartState(), 4))
    assert "F4 `state` (SegmentedState) computes math None" in kdax._runner.routes.mismatches(seg)[0]
    assert np.all([getattr(ref, f).math == kdax.stages.KDA for f in USER])


def test_eager_derived_gradient_is_compiled_once():
    """An eager jax.grad of a pipeline whose gradient is derived runs compiled programs
    cached like the default's: a second call traces no stage (it took 14 s a call op by op
    at T=512), with the jitted gradient's numbers."""
    traced = []

    class CountingOutput(AbstractOutput):
        def __call__(self, scale, qg, h, Aqk, v_new):
            traced.append(1)
            return ReferenceOutput()(scale, qg, h, Aqk, v_new)

    x = make_inputs(B=1, T=32, H=2, K=8, V=8)
    pos, kw = split_args(x)
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), CountingOutput())
    loss = lambda q: _loss(*kdax.chunk_kda(q, *pos[1:], **kw, output_final_state=True, chunk_size=CHUNK, pipeline=pipe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        first = jax.grad(loss)(pos[0])
        n = len(traced)
        second = jax.grad(loss)(pos[0])
        assert len(traced) == n, "the second eager call traced the stages again"
        jitted = jax.jit(jax.grad(loss))(pos[0])
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert_close(first, jitted, 1e-12, "eager vs jitted dq")


def test_eager_derived_gradient_warns_once_with_the_jitted_numbers():
    """An eager jax.grad (no jit) of a pipeline whose whole backward is derived (an F3 of
    other math): the FallbackWarning said once, where the eager rule compiles its program
    (a cached trace would say nothing), and the jitted gradient's numbers."""
    from kdax._runner.routes import warn_once

    x = make_inputs(B=1, T=32, H=2, K=4, V=4)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    pipe = eqx.tree_at(lambda p: p.wy, kdax.KDAPipeline.reference(), ScaledVWY())
    f = lambda *a: _loss(*kdax.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK,
                                         pipeline=pipe))
    warn_once.cache_clear()  # (once per process and message: another test may have said it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = [jax.grad(f, argnums=tuple(range(6)))(*pos, h0) for _ in range(2)]
    said = [w for w in caught if issubclass(w.category, kdax.FallbackWarning)]
    assert len(said) == 1 and "derived from the forward stages" in str(said[0].message), [str(w.message) for w in said]
    assert "F3 `wy` (ScaledVWY)" in str(said[0].message) and said[0].filename == __file__, said[0]
    warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jitted = _grads(pipe, pos, h0)  # (traced: the same warning, at the line that calls chunk_kda)
    assert [w.filename for w in caught if issubclass(w.category, kdax.FallbackWarning)] == [__file__]
    for name, a, b, c in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), eager[0], eager[1], jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_close(a, c, 1e-12, f"eager vs jitted {name}")


# -- the reference stages' chunk-local VJPs (their loops' own: over_chunks, F4's recurrence) --


_TAPS = {}  # case -> kdax.stage_inputs' result (jitted: op by op, the first case took 40 s, then ~2 s each)


def _stage_kwargs(field, case, pipe, x, **options):
    """The keyword arguments ``pipe``'s stage ``field`` gets in one forward (float64) of
    ``case`` (its inputs ``x``), every field's taken in one run per case."""
    import inspect

    from kdax._runner.contracts import STAGES

    if case not in _TAPS:
        pos, kw = split_args(x)
        _TAPS[case] = jitted(kdax.stage_inputs)(pipe, *pos, **kw, **options)
    args = _TAPS[case][field]
    params = [p.name for p in list(inspect.signature(STAGES[field].family.__call__).parameters.values())[1:]]
    return dict(zip(params, args))


@pytest.mark.parametrize("case", ["dense", "packed", "in-kernel gate"])
@pytest.mark.parametrize("field", ["gate", "intra", "wy", "state", "output"])
def test_reference_stage_vjp_through_its_loop(field, case):
    # A reference forward stage differentiated by JAX (the derived backward): its chunk
    # loop's own VJP (groups of 3 of the 20 (row, head, chunk) blocks, each rematerialised;
    # F4's chunks walked backwards) equals JAX's VJP of the stage without a loop, float64.
    from kdax._runner.contracts import STAGES

    opts = dict(chunk_size=CHUNK, output_final_state=True)
    if case == "packed":  # shared chunks: reset tables, a state table
        x = make_inputs(B=1, T=80, H=4, K=8, V=4, N=3)
        opts["cu_seqlens"] = jnp.array([0, 9, 50, 80], jnp.int32)
        x.pop("initial_state")
    elif case == "in-kernel gate":  # softplus gate with A_log, dt_bias (read whole by every group), l2norm
        x = make_inputs(B=2, T=80, H=2, K=8, V=4, gate="raw", A_log=True, dt_bias=True, beta_raw=True)
        opts.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        x = make_inputs(B=2, T=80, H=2, K=8, V=4)
    kwargs = _stage_kwargs(field, case, kdax.KDAPipeline.reference().untiled(), x, **opts)
    ref = STAGES[field].reference
    looped, whole = (ref(unroll=0), ref(unroll=100)) if field == "state" else (ref(group=3), ref(group=None))
    diff = {n: a for n, a in kwargs.items() if eqx.is_inexact_array(a)}
    rest = {n: a for n, a in kwargs.items() if n not in diff}
    want, vjp_want = jax.jit(lambda d: jax.vjp(lambda d_: whole(**d_, **rest), d))(diff)
    got, vjp_got = jax.jit(lambda d: jax.vjp(lambda d_: looped(**d_, **rest), d))(diff)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, 1e-13, f"{field} forward ({case})")
    leaves, tree = jax.tree.flatten(want)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    ct = jax.tree.unflatten(tree, [jax.random.normal(kk, a.shape, a.dtype) for kk, a in zip(keys, leaves)])
    call = jax.jit(lambda vjp, ct: vjp(ct))  # (the backward compiled, not run op by op)
    (d_want,), (d_got,) = call(vjp_want, ct), call(vjp_got, ct)
    assert set(d_got) == set(d_want)
    for n in d_want:
        if d_want[n] is not None:
            assert_close(d_got[n], d_want[n], 1e-13, f"d{n} ({field}, {case})")


def test_derived_pipeline_runs_reference_stages():
    # The derived forward runs each KDA stage as its family's reference stage (Pallas
    # stages have no JAX derivative) and a user's stage as it is.
    from kdax._runner import routes
    from kdax._runner.contracts import STAGES

    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.pallas(), ScaledOutput())
    diff, swapped = routes.differentiable_forward(pipe)
    assert set(swapped) == {"gate", "intra", "wy", "state"}
    for f in swapped:
        assert type(getattr(diff, f)) is STAGES[f].reference
    assert diff.output is pipe.output and diff.tile is None
    diff, swapped = routes.differentiable_forward(eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(),
                                                                  ScaledOutput()))
    assert swapped == ()


class GainTanhOutput(AbstractOutput):
    """F5 of other math holding an array: ``gain o + 0.1 tanh(o)`` per value head."""

    gain: Float[Array, " HV"]

    def __call__(self, scale, qg, h, Aqk, v_new):
        o = ReferenceOutput()(scale, qg, h, Aqk, v_new)
        return o * self.gain[None, :, None, None, None].astype(o.dtype) + 0.1 * jnp.tanh(o)


def test_trusting_pipeline_keeps_other_f5_out_of_shared_chunks():
    # kdax.testing's trusting pipelines take every route a declaration selects; F5 is never
    # told `reset`, so none of its declarations selects shared chunks, and F5's derived
    # transpose (kdax._runner.output_vjp) assumes none. Packed without initial states, a
    # trusting pipeline with an F5 of other math took shared chunks and gave k's gradient
    # off by 4.2 (float64); now it runs per sequence, its gradients the untrusting ones.
    from kdax._runner.runner import recording

    x = make_inputs(B=1, T=48, H=2, K=40, V=8, N=3)
    pos, _ = split_args(x)
    cu = jnp.array([0, 5, 30, 48], jnp.int32)
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), GainTanhOutput(jnp.array([0.7, -1.2])))

    def grads(p):
        f = lambda a: _loss(*kdax.chunk_kda(*a, output_final_state=True, chunk_size=CHUNK, pipeline=p, cu_seqlens=cu))
        with recording(quiet=True) as rec, warnings.catch_warnings():
            warnings.simplefilter("ignore", kdax.FallbackWarning)
            return jax.jit(jax.grad(f))(tuple(pos)), rec.layout

    want, layout = grads(pipe)
    trusting = dataclasses.replace(pipe, trust_declarations=True)
    got, trusted_layout = grads(trusting)
    assert layout == trusted_layout == "per-sequence"
    plan = trusting.plan(*pos, chunk_size=CHUNK, cu_seqlens=cu, output_final_state=True)
    assert "F5 output (GainTanhOutput)" in dict(plan.why)["layout"], str(plan)  # (plan says why: the route's own reason)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert_close(a, b, 1e-12, name)


@pytest.mark.parametrize("case", ["dense", "dense, F1 too", "packed", "packed, B2 by identity rows"])
def test_output_alone_differs_keeps_the_hand_written_backward(case, monkeypatch):
    # F5 of other math (F1's too): B0, B2-B5 hand-written, F5's VJP in B1's place and fed
    # to B2 and B3 (kdax._runner.output_vjp); against the backward derived whole, float64,
    # the F5 array's gradient included. Packed: one sequence per chunk (per-sequence
    # layout). A B2 other than kdax's takes d_h through its `scale qg^T do` term: K = 40 >
    # C = 16, three passes of identity rows.
    from kdax._runner import routes
    from kdax.stages import AbstractDhu, ReferenceDhu

    class MyDhu(AbstractDhu):
        transposes: ClassVar = ReferenceDhu.transposes

        def __call__(self, scale, qg, kg, w, G, do, dv_intra, dht, layout):
            return ReferenceDhu()(scale, qg, kg, w, G, do, dv_intra, dht, layout)

    gate = case == "dense, F1 too"
    opts = {}
    if case.startswith("packed"):
        x = make_inputs(B=1, T=48, H=2, K=40, V=8, N=3)
        opts["cu_seqlens"] = jnp.array([0, 5, 30, 48], jnp.int32)
    else:
        x = make_inputs(B=2, T=48, H=2, K=40, V=8)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    pipe = eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), GainTanhOutput(jnp.array([0.7, -1.2])))
    if gate:
        pipe = eqx.tree_at(lambda p: p.gate, pipe, ScaledQGate())
    if case.endswith("identity rows"):
        pipe = eqx.tree_at(lambda p: p.dhu, pipe, MyDhu())
    assert routes.backward_route(pipe) == routes.BackwardRoute(derived=False, output_vjp=True, gate_vjp=gate)

    def grads():
        def f(diff):
            a, p = diff
            return _loss(*kdax.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=CHUNK,
                                         pipeline=p, **opts))
        return eqx.filter_jit(eqx.filter_grad(f))(((*pos, h0), pipe))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads()
    assert not any(issubclass(w.category, kdax.FallbackWarning) for w in caught)
    monkeypatch.setattr(routes, "output_alone_differs", lambda p: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdax.FallbackWarning)
        want = grads()
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got[0], want[0]):
        assert_close(a, b, 1e-12, name)
    assert_close(got[1].output.gain, want[1].output.gain, 1e-12, "dgain")
