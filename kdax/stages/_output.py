"""Output family: F5 (o from the inter- and intra-chunk parts) and B1 (dAv)."""

import abc
import functools
from typing import Optional

import equinox as eqx
import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkState, ChunkV, typecheck
from ._ops import full_precision, lower_matmul, mT, over_chunks, tri_mask


class AbstractOutput(eqx.Module):
    """F5: ``o = scale qg h + Aqk v_new``."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        h: ChunkState,
        Aqk: ChunkMat,
        v_new: ChunkV,
    ) -> ChunkV:
        raise NotImplementedError


def _output_chunk(scale, qg, h, Aqk, v_new):
    return scale * qg @ h + lower_matmul(Aqk, v_new)


class ReferenceOutput(AbstractOutput):
    """F5 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    group: Optional[int] = eqx.field(static=True, default=16)

    @full_precision
    @typecheck
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        h: ChunkState,
        Aqk: ChunkMat,
        v_new: ChunkV,
    ) -> ChunkV:
        return over_chunks(functools.partial(_output_chunk, scale), self.group, qg, h, Aqk, v_new)


class AbstractDAv(eqx.Module):
    """B1: ``dAqk = tril(do v_new^T)`` and the intra-chunk part of dv_new, ``Aqk^T do``."""

    @abc.abstractmethod
    def __call__(
        self,
        v_new: ChunkV,
        Aqk: ChunkMat,
        do: ChunkV,
    ) -> tuple[ChunkMat, ChunkV]:
        raise NotImplementedError


def _dav_chunk(v_new, Aqk, do):
    dAqk = jnp.where(tri_mask(Aqk.shape[-1], strict=False), do @ mT(v_new), 0.0)
    return dAqk, mT(Aqk) @ do


class ReferenceDAv(AbstractDAv):
    """B1 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    group: Optional[int] = eqx.field(static=True, default=16)

    @full_precision
    @typecheck
    def __call__(
        self,
        v_new: ChunkV,
        Aqk: ChunkMat,
        do: ChunkV,
    ) -> tuple[ChunkMat, ChunkV]:
        return over_chunks(_dav_chunk, self.group, v_new, Aqk, do)
