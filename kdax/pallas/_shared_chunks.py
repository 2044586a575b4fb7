"""What the Pallas stages compute around their kernels for shared chunks (packed sequences
sharing a chunk: ``reset``, ``kdax._layouts.resets``): each token's sequence as kernel
operands, and the rows that a non-finite value reaches within its own sequence, made in
XLA (inside the Triton kernels their ``[C, C]`` masks spilled registers on sm_90)."""

import jax.numpy as jnp
import numpy as np

from .._layouts.resets import per_head, same_segment, segments
from .._numerics.arrays import ranked
from ._common import chunk_spec, flat


def sequences(reset, HV: int):
    """Each token's sequence within its chunk, per value head: ``[P, NC, C, 1]`` int32."""
    return flat(per_head(segments(reset), HV))


def segment_operands(reset, HV: int) -> tuple:
    """``(inputs, specs)`` of a kernel given ``reset`` ``[R, NC, C]``: ``sequences`` as a
    ``[C, 1]`` column and a ``[1, C]`` row a chunk (for the pairs within one sequence)."""
    seg = sequences(reset, HV)
    P, NC, C, _ = seg.shape
    return (seg, seg.reshape(P, NC, 1, C)), [chunk_spec((C, 1)), chunk_spec((1, C))]


def sequence_pairs(reset, HV: int):
    """``[R, HV, NC, C, C]`` bool: the pairs of a chunk's tokens in one sequence."""
    return same_segment(per_head(segments(reset), HV))


def reached_rows(bad, reset, later: bool):
    """``[R, HV, NC, C]`` bool: the rows with a row of ``bad [R, HV, NC, C]`` in their own
    sequence at or after them (``later``), else at or before them."""
    same = sequence_pairs(reset, bad.shape[1])
    C = bad.shape[-1]
    order = (np.triu if later else np.tril)(np.ones((C, C), bool))
    return jnp.any(ranked(order, same) & same & bad[..., None, :], axis=-1)
