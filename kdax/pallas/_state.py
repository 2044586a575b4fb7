"""Pallas inter-chunk state family: F4 (state recurrence) and B2 (dhu, in reverse), the
stages; their kernels, one file per target: ``_state_tpu`` (grid (row * head, chunk), the
chunk axis sequential, the state in a VMEM scratch; packed varlen through scalar-prefetched
sequence boundaries) and ``_state_triton`` (one program per row, head and block of value
columns looping over the chunks); both run every layout (dense, packed varlen one
sequence per chunk, shared chunks); the per-chunk arithmetic both share: ``_state_steps``.
"""

from typing import ClassVar, Mapping, Optional, Union

import equinox as eqx
from types import MappingProxyType

from . import _state_tpu as tpu, _state_triton as triton
from .._errors import UnsupportedCase
from .._layouts.resets import mask_exponent, state_passes
from .._layouts.tokens import Tokens
from .._numerics import precision as _precision
from .._stage_protocol.final import final
from .._annotations import ChunkState, ChunkV
from ..stages import KDA, AbstractDhu, AbstractState, DhuOut, StateOut
from ._shared_chunks import sequences
from ._common import PallasValueBlocks, check_block, feature_pad, flat, pow2, tuned, unflat


def _check_chunks(stage: str, NC: int):
    if NC == 0:
        raise UnsupportedCase(f"{stage}: T == 0 leaves no chunk to run a kernel on.")


def _gamma_col(G, target, reset=None):
    """``G[last]`` per chunk as a column ``[P, NC, Kp, 1]`` (scales the rows of h); -inf
    (no decay: the state is replaced) through a chunk in which a sequence starts after its
    first token (``reset``: shared chunks, ``kdax._layouts.resets``)."""
    gam = G[..., -1, :]
    if reset is not None:
        gam = mask_exponent(state_passes(reset), gam)  # [R, 1, NC, 1] against [R, HV, NC, K]
    return feature_pad(target, flat(gam), axes=(-2,))


def _gamma(G, target, reset):
    """``(array, rows)``: what the state kernels read ``G[last]`` from. On Triton, for
    chunks without resets and K a power of 2 (no feature padding), G itself (``rows``:
    the kernel reads each chunk's last row through a block of those rows,
    ``_state_triton.gamma_operand``), so XLA hands the kernel no sliced copy (at the GPU
    benchmark's shape 2 MiB and a fusion per kernel, three kernels a step); else the
    column ``_gamma_col``."""
    K = G.shape[-1]
    if target == "triton" and reset is None and pow2(K) == K:
        return flat(G), True
    return _gamma_col(G, target, reset), False


def _product_operands(target: str, in_kernel: bool, half, *xs):
    """``xs`` (operands that the Triton kernels read only as product operands) in the
    operand dtype ``half`` of the recurrence's precision policy (bf16 under ``"fast"``),
    else (None) unchanged. The kernel's ``dot`` rounds them to that dtype anyway, so this is exact;
    read as bf16 they take half the bytes and shared memory, and go to the tensor cores
    without passing through registers to be rounded (which took F4 at K = V = 128 over
    the 255 registers a thread may hold, spilling; ``tests/pallas/test_triton_registers.py``).
    ``in_kernel`` (the stages' ``round_in_kernel``): unchanged, the kernel rounds them."""
    if target != "triton" or half is None or in_kernel:
        return xs
    # (a Tokens view is read in its own dtype and cast in the kernel, to half here)
    return tuple(x.in_dtype(half) if isinstance(x, Tokens) else x.astype(half) for x in xs)


@final
class PallasState(AbstractState, PallasValueBlocks):
    """F4 as a Pallas kernel, on every layout (TPU: one program per row and head, the
    chunks in sequence; Triton: one program per row and block of ``block_v`` value
    columns). ``block_k`` (Triton): hold
    the state as tiles of that many rows (FLA's kernels use 64), None: one tile.
    ``round_in_kernel`` (Triton, under a half-precision policy such as ``"fast"``): read
    the operands used only in products (w, kg) in float32 and round them in the kernel,
    instead of reading half-precision copies that XLA makes before it. The same numbers;
    no converted copy (at the GPU benchmark's shape 128 MiB less HBM traffic per operand),
    but 48-64 B of spills a thread on sm_90 at 8 warps (``benchmarks/NOTES.md``, session
    15): which is faster is for a GPU to tell. In a pipeline under ``"fast"`` w, u and kg
    arrive stored in bf16 (``kdax._numerics.precision.storage``; ``half_stored``), leaving F4
    nothing to round; h and v_new are written in bf16 by the kernel. ``zero_h0`` (a
    capability: the call gave no initial states): the Triton kernel starts from zero states
    and reads no ``h0``, so XLA makes no zero array for it (TPU reads the zeros)."""

    math: ClassVar[Optional[str]] = KDA

    tile_safe: ClassVar[bool] = True
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe", "half_stored", "zero_h0"})
    block_k: Optional[int] = eqx.field(static=True, default=None)
    round_in_kernel: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        check_block("block_k", self.block_k, optional=True)

    @tuned
    def __call__(self, w, u, kg, G, h0, layout, reset=None, zero_h0: bool = False, *, precision: str = "highest"):
        R, HV, NC, C, K = w.shape
        V = u.shape[-1]
        self.check_widths(K=K, V=V)
        t = self.target
        if t == "tpu":
            _check_chunks("PallasState", NC)
        N = h0.shape[0]
        wf, kgf = _product_operands(t, self.round_in_kernel, self.operand(precision), self.padded(w), self.padded(kg))
        uf = self.padded(u)
        gam, rows = _gamma(G, t, reset)
        seg = None if reset is None else sequences(reset, HV)  # (the steps' masks: _state_steps)
        h0f = feature_pad(t, h0.reshape(N * HV, K, V), axes=(-2, -1))
        P, Kp, Vp = R * HV, wf.shape[-1], uf.shape[-1]
        # h and v_new as stored (bf16 under "fast"), the final states in h0's dtype
        st = _precision.storage(h0.dtype, precision)
        shapes = dict(NC=NC, C=C, Kp=Kp, Vp=Vp, dtype=[st, st, h0.dtype], interpret=self.run_interpreted,
                      mm=self.products(precision))
        if t == "tpu":
            h, v_new, final = tpu.state_forward(wf, uf, kgf, gam, h0f, layout, P=P, HV=HV, N=N, seg=seg, **shapes)
        else:
            h0f = None if zero_h0 else h0f  # (zeros: the kernel starts from them unread)
            h, v_new, final = triton.state_forward(wf, uf, kgf, gam, h0f, layout, R=R, HV=HV, N=N, gam_rows=rows,
                                                   block_v=self.block_v, block_k=self.block_k, seg=seg,
                                                   params=self.triton_params(), **shapes)
        return StateOut(unflat(h[..., :K, :V], R, HV), unflat(v_new[..., :V], R, HV),
                        final[:, :K, :V].reshape(N, HV, K, V))


@final
class PallasDhu(AbstractDhu, PallasValueBlocks):
    """B2 as a Pallas kernel, chunks in reverse, on every layout (TPU: one program per row
    and head; Triton: one program per row and block of ``block_v`` value columns; ``block_k`` as in
    ``PallasState``). Reads ``do`` from the caller's layout when handed a ``Tokens`` view
    (``tokens``; Triton, ``reads_tokens``). ``round_in_kernel`` as ``PallasState``'s (qg,
    kg, w, do). ``dh_start`` is added in the kernel after each chunk's step (sm_90, "fast",
    packed: 244 registers at 64 value columns a program, 136 at 32, against 203 and 128)."""

    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({"state": KDA, "output": KDA})

    accepts: ClassVar[frozenset] = frozenset({"reset", "tokens", "half_stored", "dh_start"})

    block_k: Optional[int] = eqx.field(static=True, default=None)
    round_in_kernel: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        check_block("block_k", self.block_k, optional=True)

    @tuned
    def __call__(
        self, scale, qg, kg, w, G, do: Union[ChunkV, Tokens], dv_intra, dht, layout, reset=None, *,
        dh_start: Optional[ChunkState] = None, precision: str = "highest"
    ):
        R, HV, NC, C, K = qg.shape
        V = do.shape[-1]
        self.check_widths(K=K, V=V)
        t = self.target
        if t == "tpu":
            _check_chunks("PallasDhu", NC)
        N = dht.shape[0]
        do = self.view_or_copy(do, V)
        do = do if isinstance(do, Tokens) else self.padded(do)
        qf, kf, wf, dof = _product_operands(t, self.round_in_kernel, self.operand(precision), *(self.padded(x) for x in (qg, kg, w)), do)
        dvf = self.padded(dv_intra)
        gam, rows = _gamma(G, t, reset)
        seg = None if reset is None else sequences(reset, HV)  # (the steps' masks: _state_steps)
        dhtf = feature_pad(t, dht.reshape(N * HV, K, V), axes=(-2, -1))
        # (``dh_start``: added to each chunk's start-state cotangent in the kernel, after its step)
        start = None if dh_start is None else feature_pad(t, dh_start.reshape(R * HV, NC, K, V), axes=(-2, -1))
        P, Kp, Vp = R * HV, qf.shape[-1], dvf.shape[-1]
        dt = dv_intra.dtype  # (dh as stored: bf16 under "fast")
        shapes = dict(NC=NC, C=C, Kp=Kp, Vp=Vp, dtype=[_precision.storage(dt, precision), dt, dt], interpret=self.run_interpreted,
                      mm=self.products(precision))
        if t == "tpu":
            dh, dv_new, dh0 = tpu.dhu_backward(scale, qf, kf, wf, gam, dof, dvf, dhtf, layout, P=P, HV=HV, N=N,
                                               seg=seg, start=start, **shapes)
        else:
            dh, dv_new, dh0 = triton.dhu_backward(scale, qf, kf, wf, gam, dof, dvf, dhtf, layout, R=R, HV=HV, N=N,
                                                  gam_rows=rows,
                                                  block_v=self.block_v, block_k=self.block_k, seg=seg, start=start,
                                                  params=self.triton_params(), **shapes)
        return DhuOut(unflat(dh[..., :K, :V], R, HV), dh0[:, :K, :V].reshape(N, HV, K, V),
                      unflat(dv_new[..., :V], R, HV))
