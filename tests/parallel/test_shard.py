"""Batch and head sharding on 8 simulated CPU devices: jit on Explicit meshes and
shard_map on Auto and Explicit meshes, forward and jax.grad, for chunk_kda and
fused_recurrent_kda: results equal the unsharded ones, keep the inputs' sharding, and the
compiled program has no collective."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kdax
from tests._util import assert_close, make_inputs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py")

# shard_map and Auto-mesh tests use the untiled reference pipeline (half the compile
# time; the same stages); the Explicit-mesh jit test the default one.
FNS = {"chunk": functools.partial(kdax.chunk_kda, chunk_size=16, pipeline=kdax.KDAPipeline.reference().untiled()),
       "recurrent": kdax.fused_recurrent_kda}
SPECS = dict(q=P("b", None, "h"), k=P("b", None, "h"), v=P("b", None, "h"), g=P("b", None, "h"),
             beta=P("b", None, "h"), initial_state=P("b", "h"))
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _inputs():
    x = make_inputs(0, B=2, T=40, H=4, HV=8, K=8, V=8)
    return {n: x[n] for n in SPECS}


def _loss(fn, x):
    o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2)


def _reference(fn, x):
    out = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True))(x)
    return out, jax.jit(jax.grad(lambda x: _loss(fn, x)))(x)


def _check(out, grads, ref_out, ref_grads, specs=None):
    for a, r, name in zip(out, ref_out, ("o", "ht")):
        assert_close(a, r, 1e-12, name)
    for n in ref_grads:
        assert_close(grads[n], ref_grads[n], 1e-12, "d" + n)
    if specs is not None:
        assert _spec(out[0]) == _spec(out[0], SPECS["v"]), out[0].sharding.spec
        assert _spec(out[1]) == _spec(out[1], SPECS["initial_state"]), out[1].sharding.spec
        for n in grads:
            assert _spec(grads[n]) == _spec(grads[n], specs[n]), (n, grads[n].sharding.spec)


def _spec(x, spec=None):
    """``spec`` (default: x's own) padded with None to x's rank."""
    spec = tuple(x.sharding.spec if spec is None else spec)
    return spec + (None,) * (x.ndim - len(spec))


@pytest.mark.parametrize("name", list(FNS))
def test_jit_explicit_mesh_keeps_sharding_no_collectives(name):
    fn = functools.partial(kdax.chunk_kda, chunk_size=16) if name == "chunk" else FNS[name]
    x = _inputs()
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items()}
    fwd = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True))
    grad = jax.jit(jax.grad(lambda x: _loss(fn, x)))
    with jax.set_mesh(mesh):
        out, grads = fwd(xs), grad(xs)
        hlos = [f.lower(xs).compile().as_text() for f in (fwd, grad)]
    _check(out, grads, ref_out, ref_grads, SPECS)
    for hlo in hlos:
        found = [c for c in COLLECTIVES if c in hlo]
        assert not found, found


def test_eager_calls_on_explicit_meshes():
    # Eager chunk_kda on batch- and head-sharded inputs (no jit, no kdax.parallel): once
    # "custom_vjp symbolic_zeros support with shard_map is not implemented". An eager
    # jax.grad of a function of Explicit-sharded arrays needs the mesh set, as JAX's own
    # error says (README, "Across devices").
    fn = functools.partial(kdax.chunk_kda, chunk_size=16, pipeline=kdax.KDAPipeline.reference().untiled())
    x = _inputs()
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items()}
    out = fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["initial_state"], output_final_state=True)
    with jax.set_mesh(mesh):
        grads = jax.grad(lambda x: _loss(fn, x))(xs)
    _check(out, grads, ref_out, ref_grads, SPECS)


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_shard_map(name, axis_type):
    fn, x = FNS[name], _inputs()
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(axis_type,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items()}

    def body(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True)

    sm = jax.shard_map(body, mesh=mesh, in_specs=(SPECS,), out_specs=(SPECS["v"], SPECS["initial_state"]))
    out = jax.jit(sm)(xs)
    grads = jax.jit(jax.grad(lambda x: _loss(lambda *a, **kw: sm(x), x)))(xs)
    _check(out, grads, ref_out, ref_grads, SPECS)


@pytest.mark.parametrize("name", list(FNS))
def test_shard_map_with_replicated_gate_parameters(name):
    """Inside the caller's shard_map over the batch, the in-kernel gate's ``A_log`` and
    ``dt_bias`` replicated (as a model's parameters are): their gradients summed over the
    shards, equal to the unsharded ones. Before, chunk_kda's VJP returned them varying over
    the batch axis and JAX refused it ("Custom VJP bwd rule must produce an output with the
    same type as the args tuple")."""
    fn, x = FNS[name], _inputs()
    HV, K = x["v"].shape[2], x["q"].shape[3]
    r = np.random.default_rng(1)
    x = dict(x, A_log=jnp.asarray(r.normal(size=HV)), dt_bias=jnp.asarray(r.normal(size=HV * K)))
    specs = dict(SPECS, q=P("b"), k=P("b"), v=P("b"), g=P("b"), beta=P("b"), initial_state=P("b"), A_log=P(),
                 dt_bias=P())
    mesh = jax.make_mesh((4,), ("b",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])

    def body(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
                  dt_bias=x["dt_bias"], use_gate_in_kernel=True, output_final_state=True)

    def loss(call, x):
        o, ht = call(x)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2)

    x = dict(x, q=jnp.concatenate([x["q"]] * 2), k=jnp.concatenate([x["k"]] * 2))
    x.update({n: jnp.concatenate([x[n]] * 2) for n in ("v", "g", "beta", "initial_state")})
    want = jax.jit(jax.grad(lambda x: loss(body, x)))(x)
    xs = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in x.items()}
    sm = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(P("b"), P("b")))
    got = jax.jit(jax.grad(lambda x: loss(sm, x)))(xs)
    for n in want:
        assert_close(got[n], want[n], 1e-12, "d" + n)


@pytest.mark.parametrize("name", list(FNS))
def test_sharded_parameters_and_state_beside_unsharded_tokens_are_gathered(name):
    """Tokens on no mesh axis beside the in-kernel gate's A_log / dt_bias sharded over heads
    and the initial state over rows (a model's parameters and states in their types, the
    batch not sharded, as in a one-row eval): the call runs with them gathered, outputs and
    gradients equal to the unsharded ones, eager and in jit. Before: JAX's ShardingTypeError
    ("All operands should have the same sharding")."""
    fn, x = FNS[name], _inputs()
    HV, K = x["v"].shape[2], x["q"].shape[3]
    r = np.random.default_rng(2)
    x = dict(x, A_log=jnp.asarray(r.normal(size=HV)), dt_bias=jnp.asarray(r.normal(size=HV * K)))

    def call(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], A_log=x["A_log"],
                  dt_bias=x["dt_bias"], use_gate_in_kernel=True, output_final_state=True)

    def loss(x):
        o, ht = call(x)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(ht**2)

    want, want_grads = jax.jit(call)(x), jax.jit(jax.grad(loss))(x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    specs = dict(A_log=P("h"), dt_bias=P("h"), initial_state=P("b"))
    xs = {n: jax.device_put(a, NamedSharding(mesh, specs.get(n, P()))) for n, a in x.items()}
    for got in (call(xs), jax.jit(call)(xs)):
        for a, b, n in zip(got, want, ("o", "ht")):
            assert_close(a, b, 1e-12, n)
    grads = jax.jit(jax.grad(loss))(xs)
    for n in want_grads:
        assert_close(grads[n], want_grads[n], 1e-12, "d" + n)


@pytest.mark.parametrize("name", list(FNS))
def test_sharded_inputs_errors_name_the_global_shapes(name):
    """Bad arguments beside inputs sharded over batch and heads get chunk_kda's messages
    with the caller's shapes (before: the shard's shapes, "expected (2, 2, 8, 8)" for a
    state of 4 rows and 4 heads, or JAX's raw error that an axis does not divide)."""
    fn, x = FNS[name], _inputs()
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items() if n != "initial_state"}
    B, _, HV, K = x["g"].shape
    V = x["v"].shape[-1]
    bad = [(dict(initial_state=jnp.zeros((B, HV, K + 1, V))), rf"initial_state: expected shape \[N, HV, K, V\] = "
            rf"\({B}, {HV}, {K}, {V}\), got \({B}, {HV}, {K + 1}, {V}\)"),
           (dict(initial_state=jnp.zeros((3, HV, K, V))), rf"got \(3, {HV}, {K}, {V}\)"),
           (dict(use_gate_in_kernel=True, A_log=jnp.zeros(HV), dt_bias=jnp.zeros(6)),
            rf"dt_bias: expected shape \[HV \* K\] = \({HV * K},\), got \(6,\)"),
           (dict(cu_seqlens=jnp.asarray([0, 40], jnp.int32)), f"needs B == 1 \\(q.shape\\[0\\]\\), got B={B}")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], **kw)


def test_jit_auto_mesh_recurrent_keeps_sharding():
    fn, x = kdax.fused_recurrent_kda, _inputs()
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Auto,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items()}
    out = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True))(xs)
    grads = jax.jit(jax.grad(lambda x: _loss(fn, x)))(xs)
    _check(out, grads, ref_out, ref_grads, SPECS)


@pytest.mark.parametrize("pipeline", ["untiled", pytest.param("default", marks=pytest.mark.slow)])
def test_jit_auto_mesh_chunk_keeps_sharding(pipeline):
    """jit on an Auto mesh: XLA's sharding propagation keeps rows and heads sharded
    through the chunked stages (their chunk-group loops slice the chunk axis only), with no
    all-gather; the untiled pipeline compiles with no collective at all. (The default CPU
    pipeline's tiled forward keeps one all-reduce of B x T scalars: the data dependence of
    its output buffer, ``zeros_after``.)"""
    # "slices": as the stages' field (untiled), and as "auto" resolves under jax.set_mesh
    # of a mesh with Auto axes (the default pipeline chunk_kda builds).
    untiled = kdax.KDAPipeline.reference(chunk_loops="slices").untiled()
    fn = functools.partial(kdax.chunk_kda, chunk_size=16, pipeline=untiled if pipeline == "untiled" else None)
    x = _inputs()
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Auto,) * 2)
    xs = {n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in x.items()}
    fwd = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True))
    grad = jax.jit(jax.grad(lambda x: _loss(fn, x)))
    with jax.set_mesh(mesh):
        out, grads = fwd(xs), grad(xs)
        hlos = [f.lower(xs).compile().as_text() for f in (fwd, grad)]
    _check(out, grads, ref_out, ref_grads, SPECS)
    for hlo in hlos:
        found = [c for c in (COLLECTIVES if pipeline == "untiled" else ("all-gather",)) if c in hlo]
        assert not found, found


@pytest.mark.parametrize("H, mesh_shape", [(1, (1, 8)), (2, (2, 4))])
@pytest.mark.parametrize("name", list(FNS))
def test_head_sharded_grouped_values(name, H, mesh_shape):
    """Value heads sharded more ways than there are q/k heads (H=1 with HV=8 on 8
    devices; H=2 on a 4-way axis): q and k are replicated over the head axis and each
    shard slices the one head its value heads read; outputs and every gradient (dq
    summed over the shards reading that head) equal the unsharded call's."""
    fn = FNS[name]
    x = make_inputs(1, B=2, T=24, H=H, HV=8, K=8, V=8)
    x = {n: x[n] for n in SPECS}
    ref_out, ref_grads = _reference(fn, x)
    mesh = jax.make_mesh(mesh_shape, ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    specs = dict(SPECS, q=P("b"), k=P("b"))
    xs = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in x.items()}
    fwd = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True))
    with jax.set_mesh(mesh):
        out, grads = fwd(xs), jax.jit(jax.grad(lambda x: _loss(fn, x)))(xs)
    _check(out, grads, ref_out, ref_grads)


def test_head_sharded_grouped_values_misaligned_is_refused():
    """H=3 q/k heads, HV=12 value heads on a 4-way head axis: a shard's 3 value heads
    read two different q/k heads, so neither sharding nor slicing fits: a clear error."""
    x = make_inputs(2, B=1, T=8, H=3, HV=12, K=4, V=4, h0=False)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = [put(x[n], P(None, None, "h" if n not in "qk" else None)) for n in ("q", "k", "v", "g", "beta")]
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"HV=12.*4 ways.*\('h',\).*H=3"):
        kdax.chunk_kda(*args)


@pytest.mark.parametrize("packed", [False, True])
def test_intermediate_states_keep_the_sharding(packed):
    """``return_intermediate_states`` on an Explicit mesh: each chunk's start state
    ``[B, NC, HV, K, V]`` sharded over the batch (dense) and heads like the final state, the
    numbers the unsharded call's."""
    fn = functools.partial(kdax.chunk_kda, chunk_size=16, pipeline=kdax.KDAPipeline.reference().untiled(),
                           output_final_state=True, return_intermediate_states=True)
    x = make_inputs(3, B=1 if packed else 2, T=40, H=4, HV=8, K=8, V=8, N=3 if packed else None)
    kw = dict(cu_seqlens=jnp.asarray([0, 7, 30, 40], jnp.int32)) if packed else {}
    call = jax.jit(lambda x: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], **kw))
    want = call(x)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    specs = {n: (P(None, *s[1:]) if packed else s) for n, s in SPECS.items()}
    xs = {n: jax.device_put(x[n], NamedSharding(mesh, specs[n])) for n in SPECS}
    with jax.set_mesh(mesh):
        got = call(xs)
    for a, r, name in zip(got, want, ("o", "ht", "h")):
        assert_close(a, r, 1e-12, name)
    b = None if packed else "b"
    assert _spec(got[2]) == (b, None, "h", None, None), got[2].sharding.spec
