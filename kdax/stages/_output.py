"""Output family: F5 (o from the inter- and intra-chunk parts) and B1 (dAv)."""

import abc

import equinox as eqx
import jax.numpy as jnp

from .._typing import ChunkK, ChunkMat, ChunkState, ChunkV, typecheck


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def causal_mask(C: int):
    return jnp.arange(C)[None, :] <= jnp.arange(C)[:, None]


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


class ReferenceOutput(AbstractOutput):
    """F5 in jnp."""

    @typecheck
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        h: ChunkState,
        Aqk: ChunkMat,
        v_new: ChunkV,
    ) -> ChunkV:
        return scale * qg @ h + Aqk @ v_new


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


class ReferenceDAv(AbstractDAv):
    """B1 in jnp."""

    @typecheck
    def __call__(
        self,
        v_new: ChunkV,
        Aqk: ChunkMat,
        do: ChunkV,
    ) -> tuple[ChunkMat, ChunkV]:
        dAqk = jnp.where(causal_mask(Aqk.shape[-1]), do @ _t(v_new), 0.0)
        return dAqk, _t(Aqk) @ do
