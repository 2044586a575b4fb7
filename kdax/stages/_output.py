"""Output family: F5 (o from the inter- and intra-chunk parts) and B1 (dAv)."""

import abc
from types import MappingProxyType
import functools
from typing import ClassVar, Mapping, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._layouts.resets import from_start, per_head, same_segment, segments, select_zero
from .._numerics.arrays import lower_matmul, mT, tri_mask

from .._numerics.chunk_loops import ChunkGroup, over_chunks
from .._stage_protocol.final import final
from .._stage_protocol.output_specs import Specs
from .._annotations import ChunkK, ChunkMat, ChunkState, ChunkV, ChunkValid
from ._types import KDA, AbstractBackwardStage, AbstractForwardStage


class AbstractOutput(AbstractForwardStage):
    """F5: ``o = scale qg h + Aqk v_new``.

    Arguments: ``scale``; ``qg`` ``[R, HV, NC, C, K]`` (F3); ``h`` ``[R, HV, NC, K, V]``
    the state at each chunk's start (F4); ``Aqk`` ``[.., C, C]`` (F2, already scaled);
    ``v_new`` ``[.., V]`` (F4).

    Returns ``o`` ``[R, HV, NC, C, V]``.

    ``reset`` ``[R, NC, C]`` or None (shared chunks, ``kdax._layouts.resets``), passed only
    to a stage that declares it: F5 never needs it (the other stages make the terms between
    sequences exact zeros); one that takes it keeps a sequence's overflow (inf in its
    ``v_new`` or ``h``) from meeting those zeros."""

    @abc.abstractmethod
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        h: ChunkState,
        Aqk: ChunkMat,
        v_new: ChunkV,
        reset: Optional[ChunkValid] = None,
    ) -> ChunkV:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> jax.ShapeDtypeStruct:
        """What F5 returns for the arguments ``kw`` (the pipeline checks it at every call)."""
        return s.computed(kw["qg"], kw["v_new"].shape)


def _output_chunk(scale, qg, h, Aqk, v_new, seg=None):
    if seg is None:
        return scale * qg @ h + lower_matmul(Aqk, v_new)
    # (the start state reaches the chunk's first sequence only; a NaN row of v_new, its own sequence)
    return select_zero(from_start(seg), scale * qg @ h) + lower_matmul(Aqk, v_new, same=same_segment(seg))


@final
class ReferenceOutput(AbstractOutput):
    """F5 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(self, scale, qg, h, Aqk, v_new, reset=None, *, precision: str = "highest"):
        seg = () if reset is None else (per_head(segments(reset), qg.shape[1]),)
        return over_chunks(functools.partial(_output_chunk, scale), self.group, qg, h, Aqk, v_new, *seg,
                           loops=self.chunk_loops)


class AbstractDAv(AbstractBackwardStage):
    """B1: the VJP of ``o ⊃ Aqk v_new``.

    Arguments: ``v_new`` ``[R, HV, NC, C, V]``; ``Aqk`` ``[.., C, C]``; ``do`` ``[.., V]``.

    Returns ``(dAqk, dv_intra)``: ``tril(do v_new^T)`` ``[.., C, C]`` (incl. the
    diagonal; the gradient of the scaled Aqk) and ``Aqk^T do`` ``[.., V]``."""

    @abc.abstractmethod
    def __call__(
        self,
        v_new: ChunkV,
        Aqk: ChunkMat,
        do: ChunkV,
    ) -> tuple[ChunkMat, ChunkV]:
        raise NotImplementedError

    @staticmethod
    def output_spec(kw: dict, config, s: Specs) -> tuple:
        """What B1 returns for the arguments ``kw`` (the pipeline checks it at every call):
        ``dAqk`` in ``do``'s dtype (``Aqk`` may arrive stored in bf16)."""
        return s.like(kw["do"], kw["Aqk"].shape), s.like(kw["do"])


def _dav_chunk(v_new, Aqk, do):
    dAqk = jnp.where(tri_mask(Aqk.shape[-1], strict=False), do @ mT(v_new), 0.0)
    AqkT = mT(Aqk)
    if jax.default_backend() == "cpu":
        # Made once: XLA:CPU's dot reads a transposed small lhs slowly (as in B3; bitwise equal).
        AqkT = jax.lax.optimization_barrier(AqkT)
    return dAqk, AqkT @ do


@final
class ReferenceDAv(AbstractDAv):
    """B1 in jnp, ``group`` chunks at a time (None: all at once; see ``over_chunks``)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"output": KDA})
    accepts: ClassVar[frozenset] = frozenset()

    group: ChunkGroup = eqx.field(static=True, default="auto")
    # The loop's form (kdax._numerics.chunk_loops.split_rows_and_heads): "auto", "flat", "slices".
    chunk_loops: str = eqx.field(static=True, default="auto")

    def __call__(self, v_new, Aqk, do, *, precision: str = "highest"):
        return over_chunks(_dav_chunk, self.group, v_new, Aqk, do, loops=self.chunk_loops)
