"""Shared Pallas plumbing: targets, interpret mode, block specs, padding, in-kernel helpers.

Every Pallas stage flattens the chunked layout ``[R, HV, NC, C, D]`` to ``[P, NC, C, D]``
(P = R * HV) and runs one kernel body per (p, chunk) block. The kernel bodies are shared
by both targets; a target only changes the wrapper:

* ``"tpu"`` (Mosaic): grid ``(P, NC)``; blocks use full trailing dims, so any K, V meet
  TPU tiling; the state recurrences run the chunk axis sequentially ("arbitrary") with a
  VMEM scratch state.
* ``"triton"`` (GPU): power-of-2 blocks (K and V are zero-padded to a power of 2, at least
  16; C is already one), no scratch: the state recurrences loop over chunks inside one
  program per (row, head).

Bodies only use 2-D values, ref loads with static or ``pl.ds`` slices, dots, elementwise
ops, ``where`` and keep-dims reductions, which both lowerings accept.
"""

import dataclasses
import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._errors import UnsupportedCase
from .._layouts.tokens import Tokens, as_chunked
from .._numerics import precision as _precision
from .._numerics.arrays import vary_like
from ._arith import Products, iota  # noqa: F401  (iota: the kernels' index helper, imported from here)

TARGETS = ("tpu", "triton")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}.")
    return target


F32_DOTS = ("ieee", "tf32x3", "tf32x3_split", "tf32")


class PallasTarget(eqx.Module):
    """The fields every Pallas stage has: the kernel target and interpret mode (None:
    interpret exactly when no accelerator of the target's kind is present, so a stage
    built directly on a GPU compiles its Triton kernels).

    Triton tuning (compiled kernels only; ignored by TPU and interpret mode):
    ``num_warps`` per program; ``num_stages``, Triton's software pipelining depth of the
    kernels' loops (1: none); ``f32_dot``, how a float32 product at full precision runs:
    ``"ieee"`` (CUDA-core FMAs, exact float32 products) or ``"tf32x3"`` (three TF32
    tensor-core products whose sum carries about float32's precision, relative error of
    order 1e-6 instead of 1e-7) or ``"tf32x3_split"`` (the same three products summed
    outside the accumulator, ``kdax.pallas._arith.Products.scaled_dot``: no product laid
    twice across eight warps) or ``"tf32"`` (one TF32 product, as FLA's float32
    ``tl.dot``: operands truncated to 10 mantissa bits; not for B4, whose dG cancels:
    dA_log 2.4 against FLA's 2e-2 at gates of -1e4, tests/test_precision.py). Half-precision
    products under a precision policy (``kdax._numerics.precision``) are unaffected.
    ``read_views``: read ``kdax.typing.Tokens`` views of the inputs in place where
    ``reads_tokens`` allows (False: their chunked copies). ``tuned_interpret``: trace
    interpreted kernels with the Triton tuning too, so their products ask for the GPU's
    dot algorithms (which tests/_gpu_products.py lowers with the GPU's rounding).
    ``f32_tuning``: ``((field, value), ...)`` that replace these fields (any of the stage's
    tuning fields: ``num_warps``, ``num_stages``, ``f32_dot``, a block size) when the
    stage's products take float32 operands (no half-precision policy for it,
    ``PallasTarget.operand``): a tile shape that fits the registers with
    bf16 operands may spill with TF32x3's split float32 ones. The tuning reaches the
    kernel builders as arguments (``products``, ``compiler_params``), nothing ambient."""

    target: str = eqx.field(static=True, default="tpu")
    interpret: Optional[bool] = eqx.field(static=True, default=None)
    num_warps: int = eqx.field(static=True, default=4)
    num_stages: int = eqx.field(static=True, default=1)
    f32_dot: str = eqx.field(static=True, default="ieee")
    read_views: bool = eqx.field(static=True, default=True)
    tuned_interpret: bool = eqx.field(static=True, default=False)
    f32_tuning: tuple = eqx.field(static=True, default=())

    def __check_init__(self):
        check_target(self.target)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected 1, 2, 4, 8 or 16, got {self.num_warps!r}.")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected 1 to 8, got {self.num_stages!r}.")
        if self.f32_dot not in F32_DOTS:
            raise ValueError(f"f32_dot: expected one of {F32_DOTS}, got {self.f32_dot!r}.")
        pairs = isinstance(self.f32_tuning, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in self.f32_tuning)
        if not pairs:
            raise ValueError(f"f32_tuning: expected a tuple of (field, value) pairs, got {self.f32_tuning!r}.")
        names = {f.name for f in dataclasses.fields(self)} - {"target", "interpret", "read_views", "tuned_interpret",
                                                              "f32_tuning"}
        bad = [n for n, _ in self.f32_tuning if n not in names]
        if bad:
            raise ValueError(f"f32_tuning: {bad} are not tuning fields of {type(self).__name__} "
                             f"(expected some of {sorted(names)}).")
        if self.f32_tuning:  # its values checked now, as the stage's own are
            dataclasses.replace(self, f32_tuning=(), **dict(self.f32_tuning))

    @property
    def live_tuning(self) -> bool:
        """Whether the Triton tuning applies: compiled Triton kernels, or interpreted ones
        traced with it (``tuned_interpret``)."""
        return self.target == "triton" and (not self.run_interpreted or self.tuned_interpret)

    def for_operands(self, precision: str) -> "PallasTarget":
        """This stage as its kernels are built under policy ``precision``: ``f32_tuning``
        applied where its products take float32 operands and the tuning applies."""
        if not self.f32_tuning or not self.live_tuning or self.operand(precision) is not None:
            return self
        return dataclasses.replace(self, f32_tuning=(), **dict(self.f32_tuning))

    def operand(self, precision: str):
        """The dtype this stage's products round float32 operands to under policy
        ``precision`` (``kdax._numerics.precision.operand``), or None."""
        return _precision.operand(precision, type(self))

    def products(self, precision: str):
        """The ``kdax.pallas._arith.Products`` of this stage's kernels under policy
        ``precision``: ``f32_dot`` where the tuning applies, else exact ("ieee") float32
        products; operands rounded as the policy says for this stage's family."""
        return Products(self.f32_dot if self.live_tuning else "ieee", self.operand(precision))

    def triton_params(self) -> dict:
        """``num_warps`` and ``num_stages`` for ``compiler_params``."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)

    @property
    def run_interpreted(self) -> bool:
        return resolve_interpret(self.target, self.interpret)

    # The preamble every stage's __call__ shares, written once.
    def check_widths(self, **widths: int) -> None:
        """``check_width`` for this stage, named by its class."""
        check_width(type(self).__name__, self.target, **widths)

    def view_or_copy(self, x, width: int):
        """A stage input as this stage's kernel takes it: a ``Tokens`` view read in place
        (``read_views`` and ``reads_tokens``), else its chunked copy; arrays as they are."""
        return x if self.read_views and reads_tokens(self.target, width) else as_chunked(x)

    def padded(self, x, axes=(-1,)):
        """Chunked ``x`` flattened to one program axis (``flat``), its feature ``axes``
        padded as the target needs (``feature_pad``)."""
        return feature_pad(self.target, flat(x), axes)

    def call(self, kernel, inputs, specs, out_blocks, P: int, NC: int, dtype, written: Optional[dict] = None):
        """``chunk_call`` on this stage's target, interpreted or not as it says."""
        return chunk_call(kernel, inputs, specs, out_blocks, P, NC, dtype, self.target, self.run_interpreted,
                          **self.triton_params(), written=written)


class PallasValueBlocks(PallasTarget):
    """The fields of a stage whose Triton kernel takes the value axis ``block_v`` columns
    at a time (a power of 2, at least 16): shared memory per program, and parallel work."""

    block_v: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        check_block("block_v", self.block_v)


def check_block(name: str, value, optional: bool = False) -> None:
    """A block size field: a power of 2 of at least 16 (or None where ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        expected = "None or a power of 2" if optional else "a power of 2"
        raise ValueError(f"{name}: expected {expected} of at least 16, got {value!r}.")


class PallasFeatureBlocks(PallasTarget):
    """The fields of a chunk-parallel stage whose Triton kernel takes the feature axis
    ``block_k`` columns at a time (a power of 2, at least 16): whole ``[C, K]`` tiles of
    every operand held at once took its kernel past the 255 registers a thread has at
    K = 128, spilling to local memory. TPU and interpret mode take all columns at once."""

    block_k: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        check_block("block_k", self.block_k)

    def feature_blocks(self, n: int):
        """``column_blocks`` of ``n`` feature columns for this stage's target."""
        return column_blocks(self.target, n, self.block_k)


def column_blocks(target: str, n: int, block: int):
    """The column blocks ``[(start, size), ...]`` a kernel takes one at a time: ``block``
    columns on Triton (register pressure), all ``n`` elsewhere."""
    bk = min(block, n) if target == "triton" else n
    return [(k0, bk) for k0 in range(0, n, bk)]


def tuned(call):
    """Decorator for a Pallas stage's ``__call__``: it runs on the stage as its kernels
    are built for its ``precision`` argument (``PallasTarget.for_operands``: ``f32_tuning``
    applied where its products take float32 operands)."""

    @functools.wraps(call)
    def wrapped(self, *args, precision: str = "highest", **kwargs):
        return call(self.for_operands(precision), *args, precision=precision, **kwargs)

    return wrapped


def default_target() -> str:
    return "triton" if jax.default_backend() == "gpu" else "tpu"


def resolve_interpret(target: str, interpret: Optional[bool]) -> bool:
    """``None``: interpret exactly when no accelerator of the target's kind is present."""
    if interpret is not None:
        return bool(interpret)
    backend = jax.default_backend()
    return not ((target == "tpu" and backend == "tpu") or (target == "triton" and backend == "gpu"))


def compiler_params(target: str, sequential_last: bool, ndim: int, num_warps: int = 4, num_stages: int = 1):
    if target == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        sem = ["parallel"] * ndim
        if sequential_last:
            sem[-1] = "arbitrary"
        return pltpu.CompilerParams(dimension_semantics=tuple(sem))
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def kernel_name(kernel) -> str:
    """``kdax_<stage class>_<kernel function>`` from the kernel's qualified name (through
    ``functools.partial``), e.g. ``kdax_PallasIntra_kernel`` or ``kdax_dhu_body``."""
    fn = kernel
    while hasattr(fn, "func"):
        fn = fn.func
    qual = getattr(fn, "__qualname__", "kernel").replace(".<locals>", "").replace(".__call__", "")
    return "kdax_" + qual.replace(".", "_").strip("_")


def pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


# Widest K and V (after padding) whose Triton kernels are known to fit one program's
# shared memory on Hopper (227 KiB): every kernel of a forward and backward at K = V = 128,
# compiled for sm_90 (tests/pallas/test_triton_shared_memory.py); at 256 they do not.
TRITON_MAX_WIDTH = 128


def check_width(stage: str, target: str, **widths: int) -> None:
    """Triton: refuse feature widths beyond ``TRITON_MAX_WIDTH`` before any kernel is built,
    with ``kdax.UnsupportedCase`` so that ``KDAPipeline.pallas()`` falls back to the
    reference stage (a kernel that asks for too much shared memory fails only at run time)."""
    if target != "triton":
        return
    wide = {n: w for n, w in widths.items() if pow2(w) > TRITON_MAX_WIDTH}
    if wide:
        got = ", ".join(f"{n}={w}" for n, w in wide.items())
        raise UnsupportedCase(
            f"{stage}: the Triton kernels take K and V up to {TRITON_MAX_WIDTH} (one program's shared "
            f"memory on Hopper), got {got}; use the reference stage."
        )


def pad_axis(x, axis: int, n: int):
    if x.shape[axis] == n:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pads)


def feature_pad(target: str, x, axes=(-1,)):
    """Zero-pad feature axes to a power of 2 (at least 16) for Triton; TPU uses full dims."""
    if target != "triton":
        return x
    for ax in axes:
        x = pad_axis(x, ax, pow2(x.shape[ax]))
    return x


def flat(x):
    """``[R, HV, NC, C, D] -> [P, NC, C, D]``; ``[R, HV, NC, C] -> [P, NC, C, 1]``."""
    if x.ndim == 4:
        x = x[..., None]
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def unflat(x, R: int, HV: int, squeeze: bool = False):
    x = x.reshape(R, HV, *x.shape[1:])
    return x[..., 0] if squeeze else x


def chunk_spec(block):
    """One (p, chunk) block of a ``[P, NC, *block]`` array."""
    return pl.BlockSpec((None, None) + tuple(block), lambda p, c: (p, c) + (0,) * len(block))


def token_operand(target: str, x, padded, block):
    """``(array, BlockSpec, load)`` for a kernel input: a ``kdax.typing.Tokens`` view
    read from the caller's array ``[B, NC, C, Hx, D]`` (a reshape; beta ``[..., 1]``),
    program p taking row ``p // HV``, head ``(p % HV) // group``, ``load`` its cast and
    cleaning (for ``loaded``); else the chunked array ``padded(x)``
    (``PallasTarget.padded``) with ``chunk_spec(block)`` and no load. Views reach here
    only where ``reads_tokens`` said so."""
    if not isinstance(x, Tokens):
        return padded(x), chunk_spec(block), None
    a = x.chunks()
    a = a[..., None] if a.ndim == 4 else a
    HV, G = x.heads, x.group
    spec = pl.BlockSpec((None, None, x.chunk_size, None, a.shape[-1]), lambda p, c: (p // HV, c, 0, (p % HV) // G, 0))
    return a, spec, x.load


class Loaded:
    """A kernel ref whose every read passes through ``load`` (a ``Tokens`` view's cast and
    cleaning), so a kernel body reads a view's blocks as it reads a chunked ref's."""

    def __init__(self, ref, load):
        self.ref, self.load = ref, load

    def __getitem__(self, idx):
        return self.load(self.ref[idx])


def loaded(ref, load):
    """``ref`` read through ``load`` (``Loaded``), or ``ref`` itself when ``load`` is None."""
    return ref if load is None else Loaded(ref, load)


def reads_tokens(target: str, width: int) -> bool:
    """Whether a kernel reads ``Tokens`` views of feature ``width`` from the caller's
    array: on Triton when the width needs no padding (a power of 2, at least 16); TPU
    blocks (a squeezed head axis second to last) and padding take the chunked copy."""
    return target == "triton" and width == pow2(width)


def head_spec(block, HV: int):
    """Per-head parameters ``[HV, *block]``, shared by every row and chunk."""
    return pl.BlockSpec((None,) + tuple(block), lambda p, c: (p % HV,) + (0,) * len(block))


def manual_inputs(inputs):
    """``(inputs, manual_axis_type)``: inside ``jax.shard_map``, every input cast to vary
    over each manual mesh axis that any of them varies over, and that type for the
    outputs (a ``pallas_call``'s outputs vary as its ``out_shape`` says; by default over
    nothing, which shard_map's type check refuses for per-device results). Outside
    shard_map: the inputs unchanged and None."""
    inputs = vary_like(tuple(inputs), inputs)
    mat = getattr(jax.typeof(inputs[0]), "manual_axis_type", None) if inputs else None
    return inputs, (mat if mat is not None and mat.varying else None)


def out_dtypes(dtype, n: int) -> list:
    """One dtype per output: ``dtype`` itself when it is a list or tuple of them, else
    ``n`` times ``dtype``."""
    return list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * n


def chunk_call(kernel, inputs, specs, out_blocks, P: int, NC: int, dtype, target: str, interpret: bool,
               num_warps: int = 4, num_stages: int = 1, written: Optional[dict] = None):
    """Run ``kernel`` over the grid (P, NC); every output is ``[P, NC, *block]``, of
    ``dtype`` (or one dtype per output: a list), but those of ``written`` (output index ->
    ``(shape, dtype, BlockSpec)``, ``kdax.pallas._written``). The call is named after the kernel
    (profiles, the shared-memory test)."""
    inputs, mat = manual_inputs(inputs)
    dtypes = out_dtypes(dtype, len(out_blocks))
    written = written or {}
    shapes = [written[i][:2] if i in written else ((P, NC) + tuple(b), d)
              for i, (b, d) in enumerate(zip(out_blocks, dtypes))]
    return pl.pallas_call(
        kernel,
        name=kernel_name(kernel),
        out_shape=[jax.ShapeDtypeStruct(shp, d, manual_axis_type=mat) for shp, d in shapes],
        grid=(P, NC),
        in_specs=specs,
        out_specs=[written[i][2] if i in written else chunk_spec(b) for i, b in enumerate(out_blocks)],
        interpret=interpret,
        compiler_params=None if interpret else compiler_params(target, False, 2, num_warps, num_stages),
    )(*inputs)


# -- in-kernel helpers (2-D values only; the arithmetic: kdax.pallas._arith) ----------------
def put(ref, idx, x):
    """``ref[idx] = x`` in the ref's dtype: a stored intermediate's (bf16 under the
    ``"fast"`` policy, ``kdax._numerics.precision.storage``) rounded once, as it is written."""
    ref[idx] = x.astype(ref.dtype)


def blockwise(blocks, body, carry):
    """``carry = body(start, size, carry)`` over equal ``blocks`` (``column_blocks``): one
    block inline (a static start), several in a ``fori_loop`` (a traced start, for
    ``pl.ds``): unrolled, Triton issued every block's loads at once and spilled."""
    size = blocks[0][1]
    if len(blocks) == 1:
        return body(blocks[0][0], size, carry)
    return loop(0, len(blocks), lambda i, c: body(i * size, size, c), carry)


def idiv(x, n: int):
    """Integer division of non-negative ints without ``sign`` (which Mosaic cannot lower
    without a TPU present)."""
    if isinstance(x, int):
        return x // n
    return jax.lax.div(x, jnp.asarray(n, x.dtype))


def loop(lo: int, hi: int, body, init):
    """``fori_loop`` with an int32 index even under x64 (Mosaic indexes in 32 bits)."""
    return jax.lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, init)


def row_of(x, i):
    """Row ``i`` (traced or static) of a 2-D value, as ``[1, n]``."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def col_of(x, j):
    """Column ``j`` of a 2-D value, as ``[m, 1]``."""
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


def ref_or_none(ref, idx):
    """``ref[idx]``, or None for a missing ref (G's low part)."""
    return None if ref is None else ref[idx]


def row_or_none(x, i):
    """``row_of(x, i)``, or None for a missing low part."""
    return None if x is None else row_of(x, i)


