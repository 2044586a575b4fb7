"""Sequence parallelism: ``chunk_kda`` with the token axis split over a mesh axis, exact.

Inside ``jax.shard_map``: ``kdax.chunk_kda(..., seq_axis_name="sp")`` on each device's
tokens. On global arrays: ``kdax.parallel.chunk_kda(mesh, "sp", q, k, v, g, beta, ...)``.
The summaries and their prefix: ``exclusive_prefix`` (over devices), ``scan_prefix``
(over stacked spans, as ``kdax.stages.SegmentedState`` uses it inside one device); the short convolution's halo:
``conv_halo`` and ``sp_causal_conv1d``. The layer: ``KimiDeltaAttention(...)(x,
seq_axis_name="sp")`` inside ``jax.shard_map``, ``apply_layer(mesh, "sp", layer, x)`` on
global arrays.
"""

from ._chunk import check_axis as check_axis, sp_chunk_kda as sp_chunk_kda
from ._global import chunk_kda as chunk_kda
from ._halo import causal_conv1d as causal_conv1d, conv_halo as conv_halo, sp_causal_conv1d as sp_causal_conv1d
from ._halo import sp_conv_tail as sp_conv_tail, sp_token_segments as sp_token_segments
from ._layer import apply_layer as apply_layer, batch_shards as batch_shards
from ._summary import exclusive_prefix as exclusive_prefix, scan_prefix as scan_prefix
