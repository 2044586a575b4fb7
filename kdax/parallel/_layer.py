"""``kdax.parallel.apply_layer``: a ``kdax.nn.KimiDeltaAttention`` layer sequence-parallel
on global arrays."""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from .._annotations import CuSeqlensIn, typecheck
from .._errors import reverse_mode_only
from .._validate import check_cu_seqlens
from ._global import check_mesh_axes
from ._interpret import interprets


@typecheck
def apply_layer(
    mesh: Mesh,
    seq_axis: str,
    layer,
    x: Float[Array, "B T D"],
    *,
    cu_seqlens: Optional[CuSeqlensIn] = None,
    cache=None,
    batch_axis: Optional[str] = None,
    **options,
):
    """``layer(x, cu_seqlens=..., cache=..., **options)`` with the token axis of ``x``
    split over ``mesh`` axis ``seq_axis`` (and the batch over ``batch_axis``, dense input
    only), by ``jax.shard_map`` and the layer's ``seq_axis_name``. T must divide evenly
    over the devices of ``seq_axis``; ``cu_seqlens`` are the global offsets. Returns
    ``(y, new_cache)`` as the layer does, y's tokens sharded over ``seq_axis`` (on an
    Explicit mesh an eager ``jax.grad`` through it needs ``with jax.set_mesh(mesh):``)."""
    check_mesh_axes(mesh, seq_axis, batch_axis, cu_seqlens, "x", x.shape[1], x.shape[0])
    if cu_seqlens is not None:  # (a list or numpy array, as kdax.chunk_kda takes)
        # kdax.chunk_kda's checks on the global offsets; a traced one is checked inside
        # each device's program (kdax.parallel.chunk_kda says why), so the result is unused.
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], "x")
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    return _sharded_layer(mesh, seq_axis, batch_axis, options, layer, x, cu_seqlens, cache)


# Under jit, as kdax.parallel.chunk_kda's call: an eager shard_map does not take
# chunk_kda's custom VJP (JAX 0.10: "custom_vjp symbolic_zeros support with shard_map is
# not implemented"), so an eager apply_layer raised; a second call with the same mesh,
# options and shapes reuses the compiled program.
@reverse_mode_only
@eqx.filter_jit
def _sharded_layer(mesh, seq_axis, batch_axis, options, layer, x, cu_seqlens, cache):
    tok, rows = P(batch_axis, seq_axis), P(batch_axis if cu_seqlens is None else None)

    def local(layer, x, cu, cache):
        return layer(x, cu_seqlens=cu, cache=cache, seq_axis_name=seq_axis, **options)

    in_specs = (P(), tok, P(), rows)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(tok, rows),
                       check_vma=not interprets(options.get("pipeline")))
    args = (layer, x, cu_seqlens, cache)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        # shard_map on an Explicit mesh takes arrays already sharded as in_specs says.
        args = tuple(jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, s)), a)
                     for a, s in zip(args, in_specs))
    return fn(*args)
