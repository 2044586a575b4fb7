"""Open stages (issue 14): pipelines holding arrays under every transformation, B0 with the
pipeline's own F3/F4, explicit fallback and ``plan``, stage contracts, tiles, intermediates."""

import dataclasses
import warnings
from types import MappingProxyType
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax import pallas as P
from kdax.stages import (
    KDA,
    AbstractDAv, AbstractGate, AbstractGateBackward, AbstractOutput, AbstractRecompute, AbstractState, ReferenceDAv,
    ReferenceGate, ReferenceGateBackward, ReferenceOutput, ReferenceRecompute, ReferenceState, StateOut,
)

from ._util import assert_close, load_example, make_inputs, oracle_kda, split_args



EX = load_example("custom_stage")
GAIN = jnp.array([0.5, 2.0, 1.5])


def _x(**kw):
    return make_inputs(**{**dict(B=2, T=24, H=3, K=4, V=4), **kw})


def _gain_oracle(q, k, v, g, beta, gain=GAIN, **opts):
    """The modified algorithm: q scaled per head by ``gain`` (H == HV here)."""
    return oracle_kda(q * gain[None, None, :, None], k, v, g, beta, **opts)


class Model(eqx.Module):
    """A user's module holding a pipeline whose stages hold arrays."""

    w: jax.Array
    pipe: kdax.KDAPipeline

    def __call__(self, q, k, v, g, beta, h0):
        o, ht = kdax.chunk_kda(q, k * self.w, v, g, beta, initial_state=h0, output_final_state=True,
                               chunk_size=16, pipeline=self.pipe)
        return o, ht


def _loss(o, ht):
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2)


def test_array_stages_in_a_model_filter_jit_grad_vmap():
    x = _x(B=1, T=20)
    pos, kw = split_args(x)
    h0 = kw["initial_state"]
    model = Model(jnp.full((4,), 0.9), EX.gain_pipeline(GAIN))
    loss = lambda m, *a: _loss(*m(*a))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, *pos, h0)

    def oracle_loss(w, gain):
        q, k, v, g, beta = pos
        return _loss(*_gain_oracle(q, k * w, v, g, beta, gain, initial_state=h0, output_final_state=True))

    dw, dgain = jax.jit(jax.grad(oracle_loss, argnums=(0, 1)))(model.w, GAIN)
    assert_close(grads.w, dw, 1e-10, "dw")
    # The F1 stage's array: its exact gradient (the gate's VJP at B4's cotangent); B5's
    # copy of the gain is read by the backward alone: its exact gradient is zero.
    assert_close(grads.pipe.gate.gain, dgain, 1e-10, "d gain (F1)")
    assert np.all(np.asarray(grads.pipe.gate_bwd.gain) == 0)
    o, ht = eqx.filter_jit(model)(*pos, h0)
    q, k, v, g, beta = pos
    o_ref, ht_ref = _gain_oracle(q, k * model.w, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o, o_ref, 1e-10, "o")
    assert_close(ht, ht_ref, 1e-10, "ht")
    # vmap over a leading axis of the inputs (and over stacked models with eqx.filter_vmap)
    ov, _ = eqx.filter_jit(jax.vmap(model))(*(jnp.stack([a, a * 0.5]) for a in pos), jnp.stack([h0, h0]))
    assert_close(ov[0], o, 1e-12, "vmap o[0]")


def test_array_stages_under_checkpoint_and_scan_over_layers():
    """Stacked pipelines (built with eqx.filter_vmap) scanned over as layers."""
    x = _x(B=1, T=20)
    pos, kw = split_args(x)
    q, k, v, g, beta = pos
    layers = eqx.filter_vmap(lambda s: EX.gain_pipeline(GAIN * s))(jnp.array([1.0, 0.7]))

    def net(v, layers):
        def layer(h, pipe):
            o, _ = kdax.chunk_kda(q, k, h, g, beta, chunk_size=16, pipeline=pipe)
            return jnp.tanh(o), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), v, layers)
        return jnp.sum(h**2)

    def oracle_net(v):
        h = v
        for s in (1.0, 0.7):
            o, _ = oracle_kda(q * (GAIN * s)[None, None, :, None], k, h, g, beta)
            h = jnp.tanh(o)
        return jnp.sum(h**2)

    got = eqx.filter_jit(jax.grad(net))(v, layers)
    assert_close(got, jax.jit(jax.grad(oracle_net))(v), 1e-10, "dv through scan + checkpoint")


class PerturbedState(AbstractState):
    """F4 whose output differs from the reference's (a deterministic perturbation)."""

    def __call__(self, w, u, kg, G, h0, layout):
        out = ReferenceState()(w, u, kg, G, h0, layout)
        return StateOut(out.h * 1.01, out.v_new + 0.01 * jnp.tanh(out.v_new), out.final)


def _grads(pipe, x, **opts):
    pos, kw = split_args(x)

    def loss(*a):
        o, ht = kdax.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, pipeline=pipe, **opts)
        return _loss(o, ht)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*pos, kw["initial_state"])


def _max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))


def test_recompute_uses_the_pipelines_own_stages():
    x = _x(B=1, T=37, H=1)
    pipe = eqx.tree_at(lambda p: p.state, kdax.KDAPipeline.reference(), PerturbedState())
    a = _grads(pipe, x, chunk_size=16, disable_recompute=True)
    b = _grads(pipe, x, chunk_size=16, disable_recompute=False)
    assert _max_diff(a, b) <= 1e-12
    # and the perturbation is really there: the reference pipeline's gradients differ
    c = _grads(kdax.KDAPipeline.reference(), x, chunk_size=16)
    assert _max_diff(a, c) > 1e-4


class SpyRecompute(AbstractRecompute):
    seen: list = eqx.field(static=True)

    def __call__(self, q, k, v, beta, G, Akk, h0, layout, *, wy=None, state=None):
        self.seen.append(state)
        return ReferenceRecompute()(q, k, v, beta, G, Akk, h0, layout, wy=wy, state=state)


def test_pallas_recompute_keeps_block_v():
    """A Pallas pipeline (Triton layout, interpreted) with F4/B2 at block_v=16 < V: B0 runs
    that very F4, and gradients with and without recompute agree."""
    x = _x(B=1, T=20, H=1, K=8, V=32)
    kw = dict(target="triton", interpret=True)
    seen = []
    pipe = KDApallas = kdax.KDAPipeline.pallas(**kw)
    pipe = dataclasses.replace(KDApallas, state=P.PallasState(block_v=16, **kw), dhu=P.PallasDhu(block_v=16, **kw),
                               recompute=SpyRecompute(seen))
    a = _grads(pipe, x, chunk_size=16, disable_recompute=True)
    b = _grads(pipe, x, chunk_size=16, disable_recompute=False)
    assert _max_diff(a, b) <= 1e-12
    assert seen and seen[0].pipeline.state.block_v == 16


class Unsupported(AbstractOutput):
    math: ClassVar[str] = KDA  # (an implementation of F5's own formula that runs no case)

    def __call__(self, scale, qg, h, Aqk, v_new):
        raise kdax.UnsupportedCase("this output stage takes no case at all (test)")


class UnsupportedCustom(AbstractOutput):
    """Other math than F5's (no ``math`` declared) that runs no case."""

    def __call__(self, scale, qg, h, Aqk, v_new):
        raise kdax.UnsupportedCase("this output stage takes no case at all (test)")


class Broken(AbstractOutput):
    def __call__(self, scale, qg, h, Aqk, v_new):
        raise NotImplementedError("a user's own bug")


def test_fallback_only_on_unsupported_case_with_warning_and_plan():
    x = _x(B=1, T=16, H=1)
    pos, kw = split_args(x)
    pallas = kdax.KDAPipeline.pallas("tpu", interpret=True)
    broken = eqx.tree_at(lambda p: p.output, pallas, Broken())
    with pytest.raises(NotImplementedError, match="a user's own bug"):
        kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=broken)
    pipe = eqx.tree_at(lambda p: p.output, pallas, Unsupported())
    with pytest.warns(kdax.FallbackWarning, match=r"KDAPipeline\.output \(F5\): Unsupported cannot run") as said:
        o, _ = kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=pipe)
    assert {w.filename for w in said} == {__file__}  # (the caller's line, not kdax's or jax's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (stage, implementation, reason)
        kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=pipe)
    assert_close(o, oracle_kda(*pos, **kw)[0], 1e-10, "o after fallback")
    plan = pipe.plan(*pos, **kw, chunk_size=16)
    assert plan.fallbacks == {"output": "this output stage takes no case at all (test)"}
    row = {r.field: r for r in plan.rows}["output"]
    assert (row.requested, row.runs) == ("Unsupported", "ReferenceOutput")
    assert "ReferenceOutput" in str(plan) and "takes no case" in str(plan)
    # without fallback the exception propagates, naming the stage (its own text may not)
    strict = dataclasses.replace(pipe, fallback=False)
    with pytest.raises(kdax.UnsupportedCase, match=r"^KDAPipeline\.output \(Unsupported\) cannot run this case "
                       r"\(this output stage takes no case at all \(test\)\), and the pipeline does not fall back"):
        kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=strict)
    # A stage of other math is never replaced by the reference (that would change the
    # numbers): its UnsupportedCase propagates, saying why, fallback or not.
    custom = eqx.tree_at(lambda p: p.output, pallas, UnsupportedCustom())
    with pytest.raises(kdax.UnsupportedCase, match=r"cannot fall back to ReferenceOutput: the stage declares other"):
        kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=custom)


@pytest.mark.parametrize("target", ["tpu", "triton"])
def test_pallas_varlen_runs_every_kernel_in_plan(target):
    """Packed varlen in a Pallas pipeline shares chunks and every stage takes the reset
    table: ``plan`` says each Pallas stage runs itself, none falls back (a stage without
    ``reset`` is named with its reason: tests/test_capabilities.py)."""
    x = _x(B=1, T=20, H=1)
    pos, _ = split_args(x)
    plan = kdax.KDAPipeline.pallas(target, interpret=True).plan(*pos, cu_seqlens=[0, 7, 20], chunk_size=16)
    assert plan.layout == "shared" and not plan.fallbacks, plan
    assert all(row.runs == row.requested and row.runs.startswith("Pallas") for row in plan.rows), plan


class ShortOutput(AbstractOutput):
    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)[..., :-1]


class RenamedOutput(AbstractOutput):
    def __call__(self, scale, qg, h, A, v_new):
        return ReferenceOutput()(scale, qg, h, A, v_new)


class TupleGate(AbstractGate):
    """Returns F1's fields as a plain tuple instead of ``Activated``."""

    math: ClassVar = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return tuple(jax.tree.leaves(ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)))


class RstdGate(AbstractGate):
    """Returns ``q_rstd`` where the call asked for no in-kernel l2norm (None expected)."""

    math: ClassVar = KDA

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        out = ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)
        return dataclasses.replace(out, q_rstd=jnp.ones(q.shape[:-1] + (1,), q.dtype))


class ThreeDAv(AbstractDAv):
    """Returns B1's pair and one more array."""

    transposes: ClassVar = {"output": KDA}

    def __call__(self, v_new, Aqk, do):
        return (*ReferenceDAv()(v_new, Aqk, do), do)


def test_contract_errors_name_field_and_class():
    x = _x(B=1, T=20, H=1)
    pos, kw = split_args(x)
    ref = kdax.KDAPipeline.reference()
    trace = lambda pipe: jax.eval_shape(lambda: kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=pipe))
    with pytest.raises(kdax.StageContractError, match=r"KDAPipeline\.output \(ShortOutput\) returned \(1, 1, 2, 16, 3\)"):
        trace(eqx.tree_at(lambda p: p.output, ref, ShortOutput()))
    with pytest.raises(kdax.StageContractError, match=r"(?s)KDAPipeline\.output \(RenamedOutput\).*"
                       r"Expected signature: AbstractOutput\.__call__\(self, scale, qg, h, Aqk, v_new, reset=None\)"):
        trace(eqx.tree_at(lambda p: p.output, ref, RenamedOutput()))
    # the output's structure: another type, an array where None belongs, a tuple's length
    forward = {n: i.forward for n, i in kdax.pipeline.STAGES.items()}
    for field, stage, msg in [
        ("gate", TupleGate(), r"KDAPipeline\.gate \(TupleGate\) returned tuple, expected an Activated \(AbstractGate's"),
        ("gate", RstdGate(), r"KDAPipeline\.gate \(RstdGate\) returned q_rstd \(1, 1, 2, 16, 1\) float64, expected None"),
        ("dav", ThreeDAv(), r"KDAPipeline\.dav \(ThreeDAv\) returned tuple, expected a tuple of 2 \(AbstractDAv's"),
    ]:
        pipe = eqx.tree_at(lambda p: getattr(p, field), ref, stage)
        loss = lambda q: jnp.sum(kdax.chunk_kda(q, *pos[1:], **kw, chunk_size=16, pipeline=pipe)[0])
        with pytest.raises(kdax.StageContractError, match=msg):
            trace(pipe) if forward[field] else jax.eval_shape(jax.grad(loss), pos[0])  # (B1: the backward)


def test_wrong_family_refused():
    ref = kdax.KDAPipeline.reference()
    fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref)}
    msg = r"KDAPipeline\.output: expected an implementation of AbstractOutput \(F5\), got kdax\.stages\._state\.ReferenceState"
    with pytest.raises(TypeError, match=msg):
        kdax.KDAPipeline(**{**fields, "output": ReferenceState()})
    # eqx.tree_at builds without __init__: refused at the call, before any stage runs
    bad = eqx.tree_at(lambda p: p.output, ref, ReferenceState())
    pos, kw = split_args(_x(B=1, T=20, H=1))
    with pytest.raises(TypeError, match=msg):
        jax.eval_shape(lambda: kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=bad))


class SizeSpy(AbstractOutput):
    """Records the number of chunks it is called on."""

    seen: list = eqx.field(static=True)
    tile_safe: ClassVar[bool] = False
    math: ClassVar[str] = KDA  # (the reference's: tiles are a route for KDA's math only)

    def __call__(self, scale, qg, h, Aqk, v_new):
        self.seen.append(qg.shape[2])
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


class TileSafeSpy(SizeSpy):
    tile_safe: ClassVar[bool] = True


class OwnMathTileSafeSpy(SizeSpy):
    """Declares tile_safe and math of its own: the forward runs whole (docs/stages.md, Capabilities)."""

    tile_safe: ClassVar[bool] = True
    math: ClassVar[str] = "kda, spied"


def test_tiles_only_for_tile_safe_stages():
    x = _x(B=1, T=32, H=1)
    pos, kw = split_args(x)
    ref = dataclasses.replace(kdax.KDAPipeline.reference(), tile=1)
    o_ref = oracle_kda(*pos, **kw)[0]
    for cls, whole in ((SizeSpy, True), (TileSafeSpy, False), (OwnMathTileSafeSpy, True)):
        seen = []
        pipe = eqx.tree_at(lambda p: p.output, ref, cls(seen))
        o, _ = jax.jit(lambda *a: kdax.chunk_kda(*a, **kw, chunk_size=16, pipeline=pipe))(*pos)
        assert_close(o, o_ref, 1e-10, cls.__name__)
        assert (set(seen) == {2}) == whole, (cls.__name__, seen)
    plan = eqx.tree_at(lambda p: p.output, ref, SizeSpy([])).plan(*pos, chunk_size=16)
    assert plan.not_tile_safe == ("output",) and "not tile-safe: output" in str(plan)


def test_read_intermediates_dense_and_per_sequence():
    x = make_inputs(B=1, T=37, H=1, HV=2, K=4, V=4, N=3)
    pos, kw = split_args(x)
    cu = [0, 9, 9, 37]
    pipe = kdax.KDAPipeline.reference()

    @eqx.filter_jit
    def read(*a, **k):
        _, _, res = pipe.forward(*a, chunk_size=16, **k)
        return {n: res.read(n, per_sequence=True) for n in ("v_new", "G", "beta", "Aqk", "h")}

    got = read(*pos, initial_state=kw["initial_state"], cu_seqlens=jnp.array(cu))
    assert got["v_new"].shape == (3, 37, 2, 4) and got["h"].shape == (3, 3, 2, 4, 4)
    assert got["beta"].shape == (3, 37, 2) and got["Aqk"].shape == (3, 37, 2, 16)
    for n in (1, 2):  # an empty sequence, and one that starts mid-row and crosses chunks
        s, e = cu[n], cu[n + 1]
        one = read(*(a[:, s:e] for a in pos), initial_state=kw["initial_state"][n : n + 1]) if e > s else None
        for name, val in got.items():
            L = e - s if name != "h" else -(-(e - s) // 16)
            if one is not None:
                np.testing.assert_allclose(val[n, :L], one[name][0, :L], rtol=1e-12, atol=1e-12, err_msg=name)
            assert np.all(np.asarray(val[n, L:]) == 0), name
    _, _, res = pipe.forward(*pos, chunk_size=16)
    np.testing.assert_array_equal(res.read("v_new", per_sequence=True), res.read("v_new"))  # dense: as is
    with pytest.raises(KeyError, match="name: expected one of"):
        res.read("nope")


@pytest.mark.slow  # tests/stages/test_ops.py runs stage_inputs in the default run
def test_stage_inputs_public():
    x = _x(B=1, T=16, H=1)
    pos, _ = split_args(x)
    pipe = kdax.KDAPipeline.reference()
    taps = kdax.stage_inputs(pipe, *pos, chunk_size=16)
    assert set(taps) == set(kdax.pipeline.STAGES)
    o = pipe.output(*taps["output"])
    assert o.shape == (1, 1, 1, 16, 4)


def test_options_spelled_once():
    import inspect

    params = inspect.signature(kdax.chunk_kda).parameters
    assert set(kdax.KDAOptions.names()) <= set(params)
    with pytest.raises(TypeError, match="not_an_option: not a kdax option"):
        kdax.KDAOptions.from_kwargs(not_an_option=1)
    x = _x(B=1, T=20, H=1)
    pos, kw = split_args(x)
    pipe = kdax.KDAPipeline.reference()
    opts = kdax.KDAOptions(chunk_size=16, output_final_state=True, **kw)
    a = pipe.forward(*pos, options=opts)[:2]
    b = pipe.forward(*pos, chunk_size=16, output_final_state=True, **kw)[:2]
    assert all(np.array_equal(u, w) for u, w in zip(a, b))


def test_example_runs():
    layer, d, (o, q_act, v_new, h) = EX.main(dtype=jnp.float64, verbose=False)
    q, k, v, g, beta = EX.inputs(jax.random.key(0), dtype=jnp.float64)
    gain = layer.pipeline.gate.gain
    o_ref, _ = oracle_kda(q * gain[None, None, :, None], k, v, g, beta)
    assert_close(o, o_ref, 1e-10, "example o")
    assert_close(q_act, q * gain[None, None, :, None], 1e-12, "example q after F1")
    loss = lambda ks: jnp.sum(oracle_kda(q * gain[None, None, :, None], k * ks, v, g, beta)[0] ** 2)
    assert_close(d.k_scale, jax.grad(loss)(layer.k_scale), 1e-10, "example d k_scale")


def _pallas_names(jaxpr, names):
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            names.add(e.params["name"])
        for v in e.params.values():
            sub = getattr(v, "jaxpr", None)
            if sub is not None:
                _pallas_names(getattr(sub, "jaxpr", sub), names)
    return names


def test_pallas_calls_named_and_interpret_resolved():
    """Each kernel is named after its stage (profiles); a stage built directly interprets
    only where no accelerator of its target is present."""
    pos, kw = split_args(_x(B=1, T=16, H=1))
    pipe = kdax.KDAPipeline.pallas("tpu", interpret=True)
    loss = lambda q: kdax.chunk_kda(q, *pos[1:], **kw, chunk_size=16, pipeline=pipe)[0].sum()
    names = _pallas_names(jax.make_jaxpr(jax.grad(loss))(pos[0]).jaxpr, set())
    want = {f"kdax_{type(getattr(pipe, n)).__name__}_kernel" for n in kdax.pipeline.STAGES if n != "recompute"}
    assert names == want
    for target, backend in (("triton", "gpu"), ("tpu", "tpu")):
        stage = P.PallasState(target=target)
        assert stage.interpret is None
        assert stage.run_interpreted == (jax.default_backend() != backend)


class _TileShyOutput(AbstractOutput):
    """F5 of KDA's math that takes no tile of fewer than 4 chunks."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        if qg.shape[2] < 4:
            raise kdax.UnsupportedCase("needs >= 4 chunks")
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


class _OtherGate(AbstractGate):
    math: ClassVar = "other"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class _KdaB5(AbstractGateBackward):
    transposes: ClassVar = MappingProxyType({"gate": KDA})

    def __call__(self, config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG):
        return ReferenceGateBackward()(config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG)


def test_plan_says_what_the_forward_without_gradients_runs_and_who_stands_in_for_b5():
    """``plan``'s rows are the gradient's path (the forward whole); a stage that runs otherwise
    in the forward's tiles without gradients gets a note (it said F5 ran the user's stage
    where the tiles fell back), and a B5 that does not transpose the pipeline's F1 is named
    beside the VJP standing in for it (the row named the stand-in as the pipeline's B5)."""
    pos, kw = split_args(make_inputs(B=1, T=128, K=8, V=8, h0=False))
    pipe = dataclasses.replace(eqx.tree_at(lambda p: p.output, kdax.KDAPipeline.reference(), _TileShyOutput()),
                               fallback=True, tile=4)
    plan = pipe.plan(*pos, **kw, chunk_size=16)
    assert {r.field: r.runs for r in plan.rows}["output"] == "_TileShyOutput"  # (whole: 8 chunks)
    assert "forward without gradients: output runs ReferenceOutput (needs >= 4 chunks)" in plan.notes
    with pytest.warns(kdax.FallbackWarning, match="needs >= 4 chunks"):
        kdax.chunk_kda(*pos, **kw, chunk_size=16, pipeline=pipe)
    pipe = eqx.tree_at(lambda p: (p.gate, p.gate_bwd), kdax.KDAPipeline.reference(), (_OtherGate(), _KdaB5()))
    row = {r.field: r for r in pipe.plan(*pos, **kw, chunk_size=16).rows}["gate_bwd"]
    assert (row.requested, row.runs) == ("_KdaB5", "GateVjpBackward") and row.reason.startswith("jax.vjp of F1")
