"""``kdax.parallel.apply_layer``: a ``kdax.nn.KimiDeltaAttention`` layer sequence-parallel
on global arrays."""

from typing import NamedTuple, Optional

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
from ._shard import explicit_spec, spec_axes


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
        args = resharded(mesh, args, in_specs)
    return fn(*args)


def resharded(mesh, args: tuple, specs: tuple) -> tuple:
    """Each of ``args`` (a tree of arrays, or None) resharded over ``mesh`` as its spec of ``specs`` says."""
    return tuple(jax.tree.map(lambda a, s=s: jax.sharding.reshard(a, NamedSharding(mesh, s)), a)
                 for a, s in zip(args, specs))


class BatchShards(NamedTuple):
    """The Explicit mesh axes ``axes`` of ``mesh`` that shard a layer's batch (``batch_shards``)."""

    mesh: Mesh
    axes: object

    def replicated(self, tree):
        """``tree``'s arrays resharded to be replicated over the mesh (a pool's rows are
        taken and written there: a gather from a sharded pool has no unambiguous sharding)."""
        return resharded(self.mesh, (tree,), (P(),))[0]

    def run(self, fn, layer, x, attention_mask, cu_seqlens, rows, pipeline):
        """``fn(layer, x, attention_mask, cu_seqlens, rows, pipeline)`` (the layer on its cache
        rows: ``(y, new_rows, intermediate)``) in ``jax.shard_map`` over the batch axes:
        rows are independent, so no collective; the parameters are replicated (their
        gradients summed by shard_map's transpose). The cache rows and the intermediate
        states follow the batch (dense) or are replicated (packed: B == 1)."""
        b = self.axes
        tok, cache = P(b, None, None), P(b) if cu_seqlens is None else P()
        in_specs = (P(), tok, P(b, None), P(), cache, P())
        args = resharded(self.mesh, (layer, x, attention_mask, cu_seqlens, rows, pipeline), in_specs)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=(tok, cache, P(b)),
                             check_vma=not interprets(pipeline))(*args)


def batch_shards(x, params=()) -> Optional[BatchShards]:
    """How ``x [B, T, D]`` is sharded over Explicit mesh axes (the layer then runs per batch
    shard: ``BatchShards.run``), or None. ``x`` replicated beside ``params`` (the layer's
    arrays) sharded so (FSDP): every device runs every row, the parameters gathered. A
    sharded token axis is refused (sequence parallel has its own entries)."""
    found = explicit_spec(jax.typeof(x))
    if found is None:
        mesh = next((s[0] for a in jax.tree.leaves(params) if (s := explicit_spec(jax.typeof(a))) is not None), None)
        return None if mesh is None else BatchShards(mesh, None)
    mesh, spec = found
    if spec_axes(spec[1]):
        raise ValueError(f"x: the token axis is sharded over {spec[1]!r}; run sequence parallel with "
                         "kdax.parallel.apply_layer (global arrays) or seq_axis_name inside jax.shard_map, or "
                         "shard x over the batch axis only.")
    return BatchShards(mesh, spec[0])
