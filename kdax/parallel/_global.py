"""``kdax.parallel.chunk_kda``: sequence-parallel ``chunk_kda`` on global arrays."""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._config import KDAOptions
from .._errors import reverse_mode_only
from .._annotations import ALogIn, ArrayIn, Beta, CuSeqlensIn, Float, Gate, QK, State, Values, typecheck
from .._validate import validate
from ._chunk import sp_chunk_kda
from ._interpret import interprets
from ._shard import without_fla_only
from ._summary import PrefixMethod


@typecheck
def chunk_kda(
    mesh: Mesh,
    seq_axis: str,
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    *,
    batch_axis: Optional[str] = None,
    initial_state: Optional[State] = None,
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, "_"]] = None,
    cu_seqlens: Optional[CuSeqlensIn] = None,
    prefix: PrefixMethod = "auto",
    **options,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "N HV _S1 _S2"]]]:
    """``kdax.chunk_kda`` with the token axis of q, k, v, g, beta ``[B, T, ...]`` split over
    ``mesh`` axis ``seq_axis`` (and the batch over ``batch_axis``, dense input only), by
    ``jax.shard_map``. T must divide evenly over the devices of ``seq_axis``; ``cu_seqlens``
    are the global offsets. Same arguments and results as ``kdax.chunk_kda``, less FLA's
    ``return_intermediate_states``, ``cu_seqlens_cpu``, ``cp_context``, ``use_graph`` and
    ``max_num_seqs`` (left at their defaults; others refused by name). On an Explicit mesh
    (``jax.make_mesh``'s default) o and the final state come back sharded over the mesh,
    so an eager ``jax.grad`` through the call needs the mesh set, as for any
    Explicit-sharded array: ``with jax.set_mesh(mesh): jax.grad(loss)(...)`` (under
    ``jax.jit`` or on an Auto mesh it does not)."""
    check_mesh_axes(mesh, seq_axis, batch_axis, cu_seqlens, "q", q.shape[1], q.shape[0])
    if "seq_axis_name" in options:
        raise TypeError("seq_axis_name: kdax.parallel.chunk_kda takes the mesh axis as seq_axis, its second argument "
                        "(seq_axis_name is chunk_kda's, inside your own jax.shard_map).")
    options = without_fla_only(dict(options), "by kdax.parallel.chunk_kda")
    # kdax.chunk_kda's validation on the global arrays, before any shard_map: the same
    # accepted types and named errors. A traced cu_seqlens is checked inside each device's
    # program (sp_chunk_kda), where every device raises: a check here, in the one program
    # that spans the devices, would stop one device while the others wait in a collective.
    given = {n: x for n, x in options.items() if n in KDAOptions.names()}
    _, opts = validate(q, k, v, g, beta, KDAOptions.from_kwargs(
        initial_state=initial_state, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, **given))
    A_log = opts.A_log  # Kimi's [1, 1, HV, 1] as [HV]
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)  # (a list or numpy array, as kdax.chunk_kda takes)
    arrays = dict(initial_state=initial_state, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens)
    arrays = {name: x for name, x in arrays.items() if x is not None}
    return _sharded_call(mesh, seq_axis, batch_axis, prefix, options, q, k, v, g, beta, arrays)


# Under jit: eqx.filter_custom_vjp's symbolic zeros are not supported by an eager shard_map
# (JAX 0.10), only by a traced one; Equinox's jit reports a check's failure inside the
# program (a traced cu_seqlens) with its message. One module-level function, so that a
# second call with the same mesh, options and shapes reuses the compiled program.
@reverse_mode_only  # (JAX refuses forward mode at the shard_map boundary, here)
@eqx.filter_jit
def _sharded_call(mesh, seq_axis, batch_axis, prefix, options, q, k, v, g, beta, arrays):
    tok, row = P(batch_axis, seq_axis), P(batch_axis)
    specs = {name: (row if name == "initial_state" else P()) for name in arrays}
    state_spec = row if "cu_seqlens" not in arrays else P()

    def local(q, k, v, g, beta, arrays):
        return sp_chunk_kda(q, k, v, g, beta, seq_axis_name=seq_axis, prefix=prefix, **arrays, **options)

    out_specs = (tok, state_spec if options.get("output_final_state", False) else None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(tok,) * 5 + (specs,), out_specs=out_specs,
                       check_vma=not interprets(options.get("pipeline")))
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # shard_map on an Explicit mesh takes arrays already sharded as in_specs says.
        put = lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))
        q, k, v, g, beta = (put(x, tok) for x in (q, k, v, g, beta))
        arrays = {name: put(x, specs[name]) for name, x in arrays.items()}
    return fn(q, k, v, g, beta, arrays)


def check_mesh_axes(mesh, seq_axis: str, batch_axis, cu_seqlens, name: str, T: int, B: int) -> None:
    """The global wrappers' mesh arguments: both axes on the mesh and distinct, no batch axis
    with packed input, ``T`` and ``B`` (of argument ``name``) divisible over their axes."""
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"seq_axis: {seq_axis!r} is not an axis of the mesh (axes {mesh.axis_names}).")
    if batch_axis is not None and batch_axis not in mesh.axis_names:
        raise ValueError(f"batch_axis: {batch_axis!r} is not an axis of the mesh (axes {mesh.axis_names}).")
    if batch_axis is not None and cu_seqlens is not None:
        raise ValueError("batch_axis: packed input (cu_seqlens) has B == 1 and cannot be split over a batch axis.")
    if batch_axis is not None and batch_axis == seq_axis:
        raise ValueError(f"batch_axis: must differ from seq_axis ({seq_axis!r}): one mesh axis cannot split both the "
                         f"rows and the tokens.")
    if batch_axis is not None and B % mesh.shape[batch_axis]:
        raise ValueError(f"{name}: the batch axis B={B} must split evenly over the {mesh.shape[batch_axis]} devices of "
                         f"mesh axis {batch_axis!r}; pad B to a multiple of {mesh.shape[batch_axis]}.")
    n = mesh.shape[seq_axis]
    if T % n:
        raise ValueError(
            f"{name}: the token axis T={T} must split evenly over the {n} devices of mesh axis {seq_axis!r} "
            f"(every device needs the same local T); pad T to a multiple of {n}."
        )
