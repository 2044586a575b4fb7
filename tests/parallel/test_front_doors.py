"""One validation behind every front door: ``kdax.parallel.chunk_kda`` (sequence parallel
on global arrays) runs ``kdax.chunk_kda``'s checks on the global inputs before any
``shard_map``, so a bad argument gives the same named error from both, eagerly and, for
``cu_seqlens``, inside a compiled program (not a device callback's internal error)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import kdax
from tests._util import assert_close, make_inputs, split_args

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices: see tests/conftest.py")

T = 32
PIPE = kdax.KDAPipeline.reference().untiled()


def _mesh():
    return jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])


def _doors():
    mesh = _mesh()
    return {
        "kdax.chunk_kda": lambda *a, **kw: kdax.chunk_kda(*a, pipeline=PIPE, chunk_size=16, **kw),
        "kdax.parallel.chunk_kda": lambda *a, **kw: kdax.parallel.chunk_kda(mesh, "sp", *a, pipeline=PIPE,
                                                                            chunk_size=16, **kw),
    }


def _x(**kw):
    x = make_inputs(3, B=1, T=T, H=2, HV=4, K=8, V=8, h0=False, **kw)
    return split_args(x)[0]


BAD = [  # (what to change, keyword arguments, the message both doors give)
    ("initial_state shape", dict(initial_state=np.zeros((1, 4, 8, 7))), r"initial_state: expected shape \[N, HV, K, V\]"),
    ("A_log shape", dict(use_gate_in_kernel=True, A_log=np.zeros(3)), r"A_log"),  # (jaxtyping names it)
    ("A_log without the gate", dict(A_log=np.zeros(4)), r"A_log: only used with use_gate_in_kernel=True"),
    ("cu_seqlens start", dict(cu_seqlens=[1, 8, T]), "cu_seqlens: must start at 0"),
    ("cu_seqlens order", dict(cu_seqlens=np.array([0, 20, 8, T])), "cu_seqlens: must be non-decreasing"),
    ("cu_seqlens end", dict(cu_seqlens=[0, 8, T - 1]), r"cu_seqlens: must end at T=32"),
    ("chunk size", dict(chunk_size=48), r"chunk_size: expected one of"),
]


@pytest.mark.parametrize("what, kw, msg", BAD, ids=[b[0] for b in BAD])
def test_same_error_from_every_door(what, kw, msg):
    pos = _x()
    for name, door in _doors().items():
        kw2 = dict(kw)
        if "chunk_size" in kw2:  # (the doors above fix chunk_size=16)
            door = {"kdax.chunk_kda": lambda *a, **k: kdax.chunk_kda(*a, pipeline=PIPE, **k),
                    "kdax.parallel.chunk_kda": lambda *a, **k: kdax.parallel.chunk_kda(_mesh(), "sp", *a,
                                                                                       pipeline=PIPE, **k)}[name]
        with pytest.raises((ValueError, TypeError), match=msg):
            door(*pos, **kw2)


@pytest.mark.parametrize("cu, msg", [([1, 8, T], "must start at 0"), ([0, 20, 8, T], "must be non-decreasing"),
                                     ([0, 8, T - 4], "must end at T=32")], ids=["start", "order", "end"])
def test_traced_cu_seqlens_same_error(cu, msg):
    """cu_seqlens traced (the caller's jit): checked inside the compiled program with
    the message of the eager check, by both doors; valid offsets give the same numbers."""
    pos = _x()
    outs = {}
    for name, door in _doors().items():
        f = eqx.filter_jit(lambda c: door(*pos, cu_seqlens=c)[0])
        with pytest.raises(Exception, match="cu_seqlens: " + msg):
            jax.block_until_ready(f(jnp.array(cu)))
        ok = [0, 5, 13, T][: len(cu)] if len(cu) == 4 else [0, 13, T]
        outs[name] = np.asarray(f(jnp.array(ok)))
    np.testing.assert_allclose(outs["kdax.parallel.chunk_kda"], outs["kdax.chunk_kda"], rtol=1e-12, atol=1e-12)


def test_forward_mode_is_refused_by_every_door_naming_what_works():
    """Both doors' derivative is a custom VJP, which JAX runs in reverse only: forward mode
    (``jax.jvp``, ``jax.jvp`` of ``jax.grad``, ``jax.jacfwd``, ``jax.hessian``) raises
    ``kdax.ForwardModeError`` (a TypeError) that names the two ways that work, and both
    do: a Hessian-vector product in reverse twice equals ``fused_recurrent_kda``'s
    forward over reverse (float64)."""
    q, *rest = _x()
    t = jnp.asarray(np.random.default_rng(5).normal(size=q.shape))
    loss = lambda f: (lambda q: jnp.sum(jnp.sin(f(q))))
    msg = r"forward-mode differentiation .*jax\.grad of a jax\.grad.*kdax\.fused_recurrent_kda"
    for door in _doors().values():
        o = lambda q: door(q, *rest)[0]
        for call in (lambda: jax.jvp(o, (q,), (t,)), lambda: jax.jvp(jax.grad(loss(o)), (q,), (t,)),
                     lambda: jax.jacfwd(o)(q), lambda: jax.jit(jax.hessian(loss(o)))(q)):
            with pytest.raises(kdax.ForwardModeError, match=msg):
                call()
    assert issubclass(kdax.ForwardModeError, TypeError)
    chunk = lambda q: _doors()["kdax.chunk_kda"](q, *rest)[0]
    recurrent = lambda q: kdax.fused_recurrent_kda(q, *rest)[0]
    twice = jax.jit(jax.grad(lambda q: jnp.vdot(jax.grad(loss(chunk))(q), t)))(q)
    forward_over_reverse = jax.jit(lambda q: jax.jvp(jax.grad(loss(recurrent)), (q,), (t,))[1])(q)
    assert_close(twice, forward_over_reverse, 1e-10, "HVP, reverse twice against forward over reverse")


def test_mesh_arguments_named():
    """``kdax.parallel.chunk_kda``'s and ``apply_layer``'s mesh arguments, checked before any
    ``shard_map``: an axis not on the mesh, one axis for both rows and tokens (that, and a
    batch that does not split evenly, were shard_map's own error about axis sizes)."""
    mesh2 = jax.make_mesh((2, 2), ("dp", "sp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
    q, k, v, g, beta = _x()
    call = lambda mesh, *a, **kw: kdax.parallel.chunk_kda(mesh, *a, q, k, v, g, beta, pipeline=PIPE, chunk_size=16,
                                                          **kw)
    for args, kw, msg in [
        (("tp",), {}, r"^seq_axis: 'tp' is not an axis of the mesh \(axes \('dp', 'sp'\)\)\."),
        (("sp",), dict(batch_axis="x"), r"^batch_axis: 'x' is not an axis of the mesh"),
        (("sp",), dict(batch_axis="sp"), r"^batch_axis: must differ from seq_axis \('sp'\)"),
        (("sp",), dict(batch_axis="dp"), r"^q: the batch axis B=1 must split evenly over the 2 devices of mesh axis "
                                         r"'dp'; pad B to a multiple of 2\."),
        (("sp",), dict(cu_seqlens=[0, 5, 32], batch_axis="dp"), r"^batch_axis: packed input"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call(mesh2, *args, **kw)
    with pytest.raises(ValueError, match=r"^q: the token axis T=31 must split evenly over the 2 devices"):
        kdax.parallel.chunk_kda(mesh2, "sp", *(a[:, :31] for a in (q, k, v, g, beta)), pipeline=PIPE)


def test_seq_axis_name_and_token_sharding_errors_named():
    """The doors inside ``jax.shard_map`` and on sharded arrays: ``seq_axis_name`` with
    concrete global offsets that are not offsets of the ``devices x local T`` tokens, and
    plain ``chunk_kda`` / ``fused_recurrent_kda`` on inputs whose token axis is sharded
    over an Explicit mesh axis (which sequence parallelism would have to handle)."""
    mesh = _mesh()
    spec = jax.sharding.PartitionSpec(None, "sp")
    xs = [jax.sharding.reshard(jnp.asarray(a), jax.NamedSharding(mesh, spec)) for a in _x()]

    def inside(cu):
        body = lambda *a: kdax.chunk_kda(*a, cu_seqlens=cu, seq_axis_name="sp", pipeline=PIPE, chunk_size=16)[0]
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)(*xs)

    offsets = r"^cu_seqlens: with seq_axis_name, the global offsets: non-decreasing from 0 to 4 devices x local T 8 = 32"
    for cu in ([0, 10, T - 1], [5, 10, T], [0, 20, 10, T]):
        with pytest.raises(ValueError, match=offsets + rf", got {cu}\.".replace("[", r"\[").replace("]", r"\]")):
            inside(np.array(cu))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected shape \[N \+ 1\] with N >= 1, got \(1,\)\."):
        inside(np.array([0]))
    assert np.isfinite(np.asarray(inside(np.array([0, 10, T])))).all()
    for fn in (kdax.chunk_kda, kdax.fused_recurrent_kda):
        with pytest.raises(ValueError, match=r"^q, k, v, g, beta: the token axis is sharded over 'sp'; sequence "
                                             r"parallelism needs seq_axis_name inside jax.shard_map"):
            fn(*xs)


def test_fla_only_arguments_named_by_the_global_door():
    """``kdax.parallel.chunk_kda`` said "X: not a kdax option" for FLA's arguments that
    ``kdax.chunk_kda`` takes (and a raw "got multiple values" for ``seq_axis_name``): as
    ``seq_axis_name`` inside ``shard_map``, they are taken at their defaults and refused
    otherwise, by name (an array too)."""
    mesh = _mesh()
    x = _x()
    cu = np.array([0, 10, T], np.int32)
    call = lambda **kw: kdax.parallel.chunk_kda(mesh, "sp", *x, pipeline=PIPE, chunk_size=16, **kw)
    base = np.asarray(call(cu_seqlens=cu)[0])
    for kw, default in [(dict(cu_seqlens_cpu=cu), "None"), (dict(max_num_seqs=2), "None"), (dict(cp_context=1), "None"),
                        (dict(use_graph=True), "False"), (dict(return_intermediate_states=True), "False")]:
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"^{name}: not supported by kdax.parallel.chunk_kda \(FLA-only argument; "
                                             rf"leave it at {default}\)\.$"):
            call(cu_seqlens=cu, **kw)
    same = call(cu_seqlens=cu, cp_context=None, use_graph=False, return_intermediate_states=False)[0]
    assert np.array_equal(np.asarray(same), base)
    with pytest.raises(TypeError, match=r"^seq_axis_name: kdax.parallel.chunk_kda takes the mesh axis as seq_axis"):
        call(seq_axis_name="sp")
