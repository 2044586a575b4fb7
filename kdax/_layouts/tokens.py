"""Views of the call's inputs in the caller's layout, for stages that read them there.

Packing (``pack``) copies ``[B, T, H, D]`` into ``[R, HV, NC, C, D]`` in the compute
dtype. A stage declaring ``"tokens"`` gets a ``Tokens`` view instead and reads its blocks
from the caller's array (casting and cleaning each as it loads it); any other stage gets
the chunked copy from the stage runner. Views are made only for dense input with T a
multiple of C (the chunked layout is then a reshape)."""

import dataclasses
from typing import Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._numerics import isolation as _isolation
from .layout import ChunkLayout, expand_group, pack, pack_inputs, to_chunks


class Tokens(eqx.Module):
    """``x`` ``[B, T, Hx, *D]`` (beta ``[B, T, Hx]``) read as the chunked ``[B, heads, T // C,
    C, *D]`` array of ``dtype`` that ``pack`` gives: head h reads x's ``h // (heads // Hx)``,
    elements of the isolation kind ``clean`` read as zero. ``shape``/``ndim``/``dtype`` are
    the chunked array's, so the contracts read a view as the array it stands for."""

    x: Array
    heads: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)
    clean: Optional[str] = eqx.field(static=True, default=None)

    def __check_init__(self):
        B, T, Hx = self.x.shape[:3]
        if T % self.chunk_size or self.heads % Hx:
            raise ValueError(f"Tokens: T = {T} must be a multiple of chunk_size = {self.chunk_size} and heads = "
                             f"{self.heads} a multiple of the array's {Hx} heads.")

    @property
    def shape(self) -> tuple:
        B, T, C = self.x.shape[0], self.x.shape[1], self.chunk_size
        return (B, self.heads, T // C, C) + tuple(self.x.shape[3:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def group(self) -> int:
        """Value heads per head of ``x``."""
        return self.heads // self.x.shape[2]

    def in_dtype(self, dtype) -> "Tokens":
        """The same view read as ``dtype`` (a kernel operand's dtype)."""
        return dataclasses.replace(self, dtype=np.dtype(dtype))

    def load(self, block):
        """A block read from ``x`` as the chunked array holds it: cleaned, then cast (usable in a kernel)."""
        if self.clean is not None:
            block = jnp.where(_isolation.is_bad(self.clean, block), jnp.zeros((), block.dtype), block)
        return block.astype(self.dtype)

    def chunks(self):
        """``x`` as ``[B, T // C, C, Hx, *D]`` (a reshape): what a kernel's block spec indexes."""
        return to_chunks(self.x, self.chunk_size)

    def chunked(self) -> Array:
        """The chunked copy ``[B, heads, NC, C, *D]`` (``pack``'s result)."""
        return expand_group(jnp.moveaxis(self.load(self.chunks()), 3, 1), self.heads)


def as_chunked(x):
    """``x``, or the chunked copy of a ``Tokens`` view."""
    return x.chunked() if isinstance(x, Tokens) else x


def token_inputs(raw, HV: int, chunk_size: int, dtype, kinds: Optional[tuple]):
    """``(q, k, v, g, beta)`` as ``Tokens`` (``kinds``: each one's isolation kind, or None); None stays None."""
    kinds = kinds or (None,) * 5
    return tuple(None if x is None else Tokens(x, HV, chunk_size, np.dtype(dtype), kind) for x, kind in zip(raw, kinds))


def views_fit(layout: ChunkLayout) -> bool:
    """Whether the caller's arrays are the chunked layout up to a reshape: dense, T a multiple of C."""
    return layout.dense and layout.T % layout.chunk_size == 0


def chunked_inputs(config, layout: ChunkLayout, raw, HV: int, dt, clean, reads: tuple):
    """``(q, k, v, g, beta)`` for F1-F3 (untiled): chunked copies, or where views fit,
    ``Tokens`` views for a reader declaring ``tokens`` (``reads``: F1's, F3's): q, k, g,
    beta for such an F1, v for such an F3."""
    if not (views_fit(layout) and any(reads)):
        return pack_inputs(layout, raw, HV, dt, clean)
    kinds = _isolation.input_kinds(config.use_gate_in_kernel, config.use_beta_sigmoid_in_kernel) if clean else None
    q, k, v, g, beta = token_inputs(raw, HV, layout.chunk_size, dt, kinds)
    if not reads[0]:
        q, k, g, beta = (x.chunked() for x in (q, k, g, beta))
    return q, k, v if reads[1] else v.chunked(), g, beta


def chunked_cotangent(layout: ChunkLayout, do, dt, reads: bool):
    """``do`` for B1-B3: a ``Tokens`` view where views fit and one of them ``reads`` them, else the chunked copy."""
    fit = views_fit(layout) and reads
    return Tokens(do, do.shape[2], layout.chunk_size, np.dtype(dt)) if fit else pack(layout, do, dt)


class Written(eqx.Module):
    """A gradient a stage wrote as the call's result: ``x`` ``[B, T, H, *D]`` in the input's
    dtype, NaN where isolation puts it; ``shape``/``dtype`` those of the chunked gradient."""

    x: Array
    shape: tuple = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class FinalGrads(eqx.Module):
    """What a B3 or B5 declaring ``final_grads`` may write its gradients of q, k, v, g, beta
    as: the call's results (caller's layout, the inputs' ``dtypes``), NaN where ``poison``
    ``[B, T // C, C, HV, 2]`` is above zero (column 0: dq; 1: the others). One a stage
    leaves chunked the pipeline finishes (``finish``): the same numbers."""

    poison: Array
    dtypes: tuple = eqx.field(static=True)  # of (q, k, v, g, beta)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.dtypes[("q", "k", "v", "g", "beta").index(name)])

    def column(self, name: str) -> int:
        """The column of ``poison`` that masks the gradient of input ``name``."""
        return 0 if name == "q" else 1

    def written(self, name: str, x, like) -> Written:
        """``x`` (caller's layout, written by a kernel) standing for the chunked ``like``."""
        return Written(x, tuple(like.shape), np.dtype(like.dtype))

    def finish(self, name: str, y):
        """The unpacked gradient ``y`` of input ``name`` as the kernels write it: poisoned, cast."""
        B, NC, C, HV, _ = self.poison.shape
        m = self.poison[..., self.column(name)].reshape(B, NC * C, HV) > 0
        m = m.reshape(m.shape + (1,) * (y.ndim - 3))
        return jnp.where(m, jnp.asarray(jnp.nan, y.dtype), y).astype(self.dtype(name))
