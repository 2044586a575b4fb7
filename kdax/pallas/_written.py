"""Kernel outputs written as the call's gradients (``kdax._layouts.tokens.FinalGrads``,
the capability ``final_grads`` of B3 and B5): in the caller's layout and the inputs'
dtypes, NaN where ``chunk_kda``'s isolation puts it, so that no XLA pass unpacks, masks
and casts them after the kernels."""

from typing import Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import reads_tokens


def writes_final(stage, final, *widths: int) -> bool:
    """Whether ``stage``'s kernel writes the gradients ``final`` asks for itself: on
    Triton, widths needing no padding (``reads_tokens``: the blocks a ``Tokens`` view's
    reads take); else it returns them chunked and the pipeline finishes them (the same
    numbers)."""
    return final is not None and all(reads_tokens(stage.target, w) for w in widths)


def written_output(final, name: str, HV: int, C: int, width: Optional[int]) -> tuple:
    """``(shape, dtype, BlockSpec)`` of a kernel output written as the call's gradient of
    input ``name`` (``final``: ``kdax._layouts.tokens.FinalGrads``): ``[B, NC, C, HV, width]``
    (a reshape of ``[B, T, HV, width]``; ``width`` None: beta's, ``[B, T, HV]``) in the
    input's dtype, program p writing row ``p // HV``, head ``p % HV``, as ``token_operand``
    reads."""
    B, NC = final.poison.shape[:2]
    w = 1 if width is None else width
    spec = pl.BlockSpec((None, None, C, None, w), lambda p, c: (p // HV, c, 0, p % HV, 0))
    return (B, NC, C, HV, w), final.dtype(name), spec


def poison_operand(final, name: str, HV: int) -> tuple:
    """``(array, BlockSpec)``: the ``[C, 1]`` column of ``final.poison`` that masks the
    gradient of input ``name`` in program p's chunk (for ``Poisoned``)."""
    C, j = final.poison.shape[2], final.column(name)
    return final.poison, pl.BlockSpec((None, None, C, None, 1), lambda p, c: (p // HV, c, 0, p % HV, j))


def as_written(final, name: str, x, like):
    """Kernel output ``x`` (``written_output``) as ``final.written``: ``[B, T, HV, *D]``."""
    B, NC, C, HV, w = x.shape
    y = x.reshape(B, NC * C, HV, w)
    return final.written(name, y[..., 0] if like.ndim == 4 else y, like)


class Poisoned:
    """An output ref written as a call's gradient: each write NaN at the rows ``mask`` (a
    loaded ``[C, 1]`` column, above zero there, of the rows every write takes, in their
    order) marks, then cast to the ref's dtype (the input's), as
    ``kdax._layouts.tokens.FinalGrads.finish`` does outside a kernel. (The mask is loaded
    once per program, not at each write inside the column loops.)"""

    def __init__(self, ref, mask):
        self.ref, self.mask = ref, mask

    def __setitem__(self, idx, x):
        self.ref[idx] = jnp.where(self.mask > 0, jnp.asarray(jnp.nan, x.dtype), x).astype(self.ref.dtype)


def poisoned(ref, mask):
    """``ref`` written through ``Poisoned``, or ``ref`` itself when ``mask`` is None."""
    return ref if mask is None else Poisoned(ref, mask)
