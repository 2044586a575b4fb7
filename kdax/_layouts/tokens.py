"""The call's inputs in the caller's layout, for stages that read them there themselves.

Packing an input into the chunked layout (``kdax._layouts.layout.pack``) is a copy: a transpose
from ``[B, T, H, D]`` to ``[R, HV, NC, C, D]``, in the compute dtype (float32 for bf16
inputs). A stage that declares the capability ``"tokens"`` (docs/stages.md, capabilities)
is handed a ``Tokens`` view instead and reads its blocks from the caller's array (a
Pallas kernel's block spec: ``kdax.pallas._common.token_operand``), casting and cleaning each block as it loads
it; any other stage gets the chunked copy (``Tokens.chunked``), made by the stage runner.
Views are made only for dense input whose T is a multiple of the chunk size (the chunked
layout is then a reshape of the caller's, with no padding).
"""

import dataclasses
from typing import Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._numerics import isolation as _isolation
from .layout import ChunkLayout, expand_group, pack, pack_inputs, to_chunks


class Tokens(eqx.Module):
    """An input ``x`` ``[B, T, Hx, *D]`` (beta ``[B, T, Hx]``) in its own dtype, T a multiple
    of ``chunk_size``, read as the chunked array ``[B, heads, T // C, C, *D]`` of dtype
    ``dtype`` that ``pack`` would give: value head h reads x's head ``h // (heads // Hx)``,
    and the elements that the ``kdax._numerics.isolation`` kind ``clean`` names (None: none) read as
    zero. ``shape``, ``ndim`` and ``dtype`` are the chunked array's, so the pipeline's
    contracts read a view as the array it stands for."""

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
        B, T, _ = self.x.shape[:3]
        C = self.chunk_size
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
        """A block read from ``x`` (any shape) as the chunked array holds it: cleaned,
        then cast (``pack``'s order). Usable inside a kernel."""
        if self.clean is not None:
            block = jnp.where(_isolation.is_bad(self.clean, block), jnp.zeros((), block.dtype), block)
        return block.astype(self.dtype)

    def chunks(self):
        """``x`` as ``[B, T // C, C, Hx, *D]`` (a reshape, no copy): what a kernel's block
        spec indexes (``kdax.pallas._common.token_operand``)."""
        return to_chunks(self.x, self.chunk_size)

    def chunked(self) -> Array:
        """The chunked copy ``[B, heads, NC, C, *D]`` (``pack``'s result)."""
        x = jnp.moveaxis(self.load(self.chunks()), 3, 1)
        return expand_group(x, self.heads)


def as_chunked(x):
    """``x``, or the chunked copy of a ``Tokens`` view."""
    return x.chunked() if isinstance(x, Tokens) else x


def token_inputs(raw, HV: int, chunk_size: int, dtype, kinds: Optional[tuple]):
    """``(q, k, v, g, beta)`` as ``Tokens`` views (``kinds``: the ``kdax._numerics.isolation`` kind of
    each, or None for no cleaning); None stays None."""
    kinds = kinds or (None,) * 5
    return tuple(None if x is None else Tokens(x, HV, chunk_size, np.dtype(dtype), kind) for x, kind in zip(raw, kinds))


def views_fit(layout: ChunkLayout) -> bool:
    """Whether the caller's arrays are the chunked layout up to a reshape (``Tokens``
    views): dense rows, T a multiple of the chunk size (no padding)."""
    return layout.dense and layout.T % layout.chunk_size == 0


def chunked_inputs(config, layout: ChunkLayout, raw, HV: int, dt, clean, reads: tuple):
    """``(q, k, v, g, beta)`` for F1-F3 (whole, untiled): the chunked copies
    (``pack_inputs``; ``clean`` the cleaner or None). Where the caller's arrays fit
    (``views_fit``), ``Tokens`` views instead for a reader that declares ``tokens``
    (``reads``: F1's, F3's): q, k, g and beta with such an F1 (B5 reads g), v with such an
    F3 (B0 and B3 read it too); no copy is made of those. Readers without the capability
    get a copy from the stage runner. ``config`` the stages' ``KDAConfig``."""
    if not (views_fit(layout) and any(reads)):
        return pack_inputs(layout, raw, HV, dt, clean)
    kinds = _isolation.input_kinds(config.use_gate_in_kernel, config.use_beta_sigmoid_in_kernel) if clean else None
    q, k, v, g, beta = token_inputs(raw, HV, layout.chunk_size, dt, kinds)
    if not reads[0]:
        q, k, g, beta = (x.chunked() for x in (q, k, g, beta))
    return q, k, v if reads[1] else v.chunked(), g, beta


def chunked_cotangent(layout: ChunkLayout, do, dt, reads: bool):
    """``do`` for B1-B3: the chunked copy, or where the caller's arrays fit (``views_fit``)
    and a B1, B2 or B3 reads the caller's layout (``reads``: declares ``tokens``), a
    ``Tokens`` view (the stage runner gives the others the copy)."""
    if views_fit(layout) and reads:
        return Tokens(do, do.shape[2], layout.chunk_size, np.dtype(dt))
    return pack(layout, do, dt)


class Written(eqx.Module):
    """A gradient a stage wrote as the call's result (``FinalGrads``): ``x`` ``[B, T, H, *D]``
    (dbeta ``[B, T, H]``) in the input's dtype, NaN where ``chunk_kda``'s isolation puts
    NaN. ``shape`` and ``dtype`` are those of the chunked gradient it stands for, so the
    pipeline's contracts read it as that array; only ``KDAGrads.unpacked`` reads it."""

    x: Array
    shape: tuple = eqx.field(static=True)
    dtype: np.dtype = eqx.field(static=True)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class FinalGrads(eqx.Module):
    """What a B3 or B5 that declares ``final_grads`` (docs/stages.md, capabilities) may
    write its gradients of ``q, k, v, g, beta`` as: the call's results, in the caller's
    layout (``[B, T, H, D]``, dbeta ``[B, T, H]``; blocks as a ``Tokens`` view's) and the
    inputs' ``dtypes``, NaN at the tokens and heads where ``chunk_kda``'s isolation puts NaN
    (``kdax._numerics.isolation``): ``poison`` ``[B, T // C, C, HV, 2]`` float32, above zero
    there: column 0 for dq, column 1 for dk, dv, dg and dbeta. Such a gradient comes back
    as ``Written``; one a stage leaves chunked the pipeline finishes (``finish``): the same
    numbers. Made only where ``Tokens`` views fit and q, k have a head per value head."""

    poison: Array
    dtypes: tuple = eqx.field(static=True)  # of (q, k, v, g, beta)

    NAMES = ("q", "k", "v", "g", "beta")

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.dtypes[self.NAMES.index(name)])

    def column(self, name: str) -> int:
        """The column of ``poison`` that masks the gradient of input ``name``."""
        return 0 if name == "q" else 1

    def written(self, name: str, x, like) -> Written:
        """``x`` (caller's layout, written by a kernel) standing for the chunked ``like``."""
        return Written(x, tuple(like.shape), np.dtype(like.dtype))

    def finish(self, name: str, y):
        """The gradient ``y`` of input ``name`` in the caller's layout (unpacked) as the
        kernels write it: NaN where poisoned, cast to the input's dtype."""
        B, NC, C, HV, _ = self.poison.shape
        m = self.poison[..., self.column(name)].reshape(B, NC * C, HV) > 0
        m = m.reshape(m.shape + (1,) * (y.ndim - 3))
        return jnp.where(m, jnp.asarray(jnp.nan, y.dtype), y).astype(self.dtype(name))
