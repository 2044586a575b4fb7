"""Pallas inter-chunk state family: F4 (state recurrence) and B2 (dhu, in reverse).

TPU: grid (row * head, chunk) with the chunk axis sequential ("arbitrary") and the state
carried in a VMEM scratch; dense layout only (one sequence per row): packed varlen needs
per-chunk resets addressed by scalar prefetch, not implemented, so it raises
``kdax.UnsupportedCase`` and ``KDAPipeline.pallas`` falls back to the reference stage.
Triton: one program per (row, head, block of ``block_v`` value columns) that loops over
chunks (no scratch), reading chunk blocks with ``pl.ds`` and the sequence boundaries
(``layout.first`` / ``layout.last``) as scalars, so it runs dense and packed varlen alike.
"""

from typing import ClassVar, Optional

import equinox as eqx

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .. import _precision
from .._errors import UnsupportedCase
from .._layout import ChunkLayout
from .._resets import mask_exponent, state_passes
from .._typing import ChunkK, ChunkV, ChunkValid, SeqState, typecheck
from ..stages import AbstractDhu, AbstractState, DhuOut, StateOut
from .._final import final
from ._common import (
    PallasValueBlocks, check_width, chunk_spec, compiler_params, dot, feature_pad, flat, idiv, kernel_name, loop, tuned, unflat,
)
from ._common import manual_inputs


def _check_dense(stage: str, layout: ChunkLayout, NC: int):
    if not layout.dense:
        raise UnsupportedCase(
            f"{stage}: a layout other than one sequence per row (packed varlen input, "
            "cu_seqlens) needs per-chunk sequence resets, which this kernel does not "
            "implement; use the reference stage."
        )
    if NC == 0:
        raise UnsupportedCase(f"{stage}: T == 0 leaves no chunk to run a kernel on.")


def _gamma_col(G, target, reset=None):
    """``G[last]`` per chunk as a column ``[P, NC, Kp, 1]`` (scales the rows of h); -inf
    (no decay: the state is replaced) through a chunk in which a sequence starts after its
    first token (``reset``: shared chunks, ``kdax._resets``)."""
    gam = G[..., -1, :]
    if reset is not None:
        gam = mask_exponent(state_passes(reset), gam)  # [R, 1, NC, 1] against [R, HV, NC, K]
    return feature_pad(target, flat(gam), axes=(-2,))


def _state_step(w, u, kg, gam, h):
    v_new = u - dot(w, h)
    return v_new, jnp.exp(gam) * h + dot(kg, v_new, ta=True)


def _check_block_k(block_k):
    if block_k is not None and (not isinstance(block_k, int) or block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"block_k: expected None or a power of 2 of at least 16, got {block_k!r}.")


def _k_tiles(Kp: int, block_k):
    """The state's row tiles ``[(start, size), ...]`` (Triton): ``block_k`` rows each
    (FLA holds the state as 64-row register tiles), or one tile of all Kp rows."""
    bk = Kp if block_k is None else min(block_k, Kp)
    return [(i, bk) for i in range(0, Kp, bk)]


def _state_step_tiled(w, u, kg, gam, hs):
    """``_state_step`` on the state as row tiles ``hs`` (``w``, ``kg`` and ``gam`` as
    matching lists of column / row tiles): the same sums, split along K."""
    v_new = u
    for wi, hi in zip(w, hs):
        v_new = v_new - dot(wi, hi)
    return v_new, tuple(jnp.exp(gi) * hi + dot(ki, v_new, ta=True) for ki, gi, hi in zip(kg, gam, hs))


def _dhu_step_tiled(scale, qg, kg, w, gam, do, dv_intra, dhs):
    dv = dv_intra
    for ki, hi in zip(kg, dhs):
        dv = dv + dot(ki, hi)
    return dv, tuple(jnp.exp(gi) * hi + scale * dot(qi, do, ta=True) - dot(wi, dv, ta=True)
                     for qi, wi, gi, hi in zip(qg, w, gam, dhs))


def _dhu_step(scale, qg, kg, w, gam, do, dv_intra, dh_end):
    dv = dv_intra + dot(kg, dh_end)
    return dv, jnp.exp(gam) * dh_end + scale * dot(qg, do, ta=True) - dot(w, dv, ta=True)


def _run_tpu(kernel, ins, in_blocks, out_blocks, P, NC, dtype, state_shape, interpret, reverse):
    """Sequential chunk axis, state in VMEM scratch. Blocks tagged 'c' are per chunk,
    'p' per row (the same block for every chunk)."""
    from jax.experimental.pallas import tpu as pltpu

    def spec(kind, block):
        if kind == "p":
            return pl.BlockSpec((None,) + block, lambda p, c: (p,) + (0,) * len(block))
        if reverse:
            return pl.BlockSpec((None, None) + block, lambda p, c: (p, NC - 1 - c) + (0,) * len(block))
        return chunk_spec(block)

    ins, mat = manual_inputs(ins)
    out_shape = [jax.ShapeDtypeStruct((P,) + ((NC,) if k == "c" else ()) + b, dtype, manual_axis_type=mat)
                 for k, b in out_blocks]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(P, NC), name=kernel_name(kernel),
        in_specs=[spec(k, b) for k, b in in_blocks], out_specs=[spec(k, b) for k, b in out_blocks],
        scratch_shapes=[pltpu.VMEM(state_shape, dtype)], interpret=interpret,
        compiler_params=None if interpret else compiler_params("tpu", True, 2),
    )(*ins)


def _run_triton(kernel, ins, out_shapes, P, NV, dtype, interpret):
    """One program per (row, block of value columns); whole arrays, chunk blocks read with
    pl.ds inside the kernel. The columns of the state evolve independently, so splitting
    them halves each program's shared memory and doubles the programs (more parallel
    work for a GPU at small batch)."""
    ins, mat = manual_inputs(ins)
    return pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(s, dtype, manual_axis_type=mat) for s in out_shapes], grid=(P, NV),
        name=kernel_name(kernel),
        interpret=interpret, compiler_params=None if interpret else compiler_params("triton", False, 1),
    )(*ins)


def _tokens(x):
    """``[P, NC, A, B] -> [P, NC * A, B]`` so a chunk is a ``pl.ds`` slice of rows."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])


@final
class PallasState(AbstractState, PallasValueBlocks):
    """F4 as a Pallas kernel (TPU: dense layout; Triton: dense and packed varlen, one
    program per row and block of ``block_v`` value columns). ``block_k`` (Triton): hold
    the state as tiles of that many rows (FLA's kernels use 64), None: one tile."""

    tile_safe: ClassVar[bool] = True
    block_k: Optional[int] = eqx.field(static=True, default=None)

    def __check_init__(self):
        _check_block_k(self.block_k)

    @tuned
    @typecheck
    def __call__(
        self,
        w: ChunkK,
        u: ChunkV,
        kg: ChunkK,
        G: ChunkK,
        h0: SeqState,
        layout: ChunkLayout,
        reset: Optional[ChunkValid] = None,
    ) -> StateOut:
        R, HV, NC, C, K = w.shape
        V = u.shape[-1]
        check_width("PallasState", self.target, K=K, V=V)
        t = self.target
        if t == "tpu":
            _check_dense("PallasState", layout, NC)
        N = h0.shape[0]
        wf, kgf = feature_pad(t, flat(w)), feature_pad(t, flat(kg))
        uf = feature_pad(t, flat(u))
        gam = _gamma_col(G, t, reset)
        h0f = feature_pad(t, h0.reshape(N * HV, K, V), axes=(-2, -1))
        P, Kp, Vp = R * HV, wf.shape[-1], uf.shape[-1]
        interpret = self.run_interpreted
        if t == "tpu":

            def kernel(w_ref, u_ref, kg_ref, g_ref, h0_ref, h_ref, vn_ref, fin_ref, scr):
                c = pl.program_id(1)

                @pl.when(c == 0)
                def _():
                    scr[...] = h0_ref[...]

                h = scr[...]
                h_ref[...] = _precision.stored(h)
                v_new, h_next = _state_step(w_ref[...], u_ref[...], kg_ref[...], g_ref[...], h)
                vn_ref[...] = _precision.stored(v_new)
                scr[...] = h_next

                @pl.when(c == NC - 1)
                def _():
                    fin_ref[...] = h_next

            h, v_new, final = _run_tpu(
                kernel, (wf, uf, kgf, gam, h0f),
                [("c", (C, Kp)), ("c", (C, Vp)), ("c", (C, Kp)), ("c", (Kp, 1)), ("p", (Kp, Vp))],
                [("c", (Kp, Vp)), ("c", (C, Vp)), ("p", (Kp, Vp))], P, NC, w.dtype, (Kp, Vp), interpret, False,
            )
        else:

            # Sequence boundaries from the layout (dense or packed varlen): a chunk that
            # starts sequence f loads h0[f]; one that ends sequence l writes final[l].
            bv = min(self.block_v, Vp)

            dense = layout.dense

            tiles = _k_tiles(Kp, self.block_k)

            def kernel(w_ref, u_ref, kg_ref, g_ref, h0_ref, first_ref, last_ref, h_ref, vn_ref, fin_ref):
                p, cols = pl.program_id(0), pl.ds(pl.program_id(1) * bv, bv)
                r, hv = idiv(p, HV), p % HV

                # The state as row tiles of block_k rows (one tile: all of K), each a loop carry.
                def step(c, hs):
                    rows = pl.ds(c * C, C)
                    if not dense:  # a sequence may start or end at any chunk
                        f = first_ref[r, c]
                        hs = tuple(jnp.where(f >= 0, h0_ref[jnp.maximum(f, 0) * HV + hv, pl.ds(k0, bk), cols], h)
                                   for (k0, bk), h in zip(tiles, hs))
                    for (k0, bk), h in zip(tiles, hs):
                        # Stored as FLA stores them (bf16 values under "fast": kdax._precision).
                        h_ref[p, pl.ds(c * Kp + k0, bk), cols] = _precision.stored(h)
                    v_new, hs_next = _state_step_tiled(
                        [w_ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles], u_ref[p, rows, cols],
                        [kg_ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles],
                        [g_ref[p, pl.ds(c * Kp + k0, bk), :] for k0, bk in tiles], hs)
                    vn_ref[p, rows, cols] = _precision.stored(v_new)
                    if not dense:
                        l = last_ref[r, c]

                        @pl.when(l >= 0)
                        def _():
                            for (k0, bk), h in zip(tiles, hs_next):
                                fin_ref[l * HV + hv, pl.ds(k0, bk), cols] = h

                    return hs_next

                # Dense: row r is sequence r, from chunk 0 to the last (no per-chunk state load).
                init = tuple(h0_ref[p, pl.ds(k0, bk), cols] if dense else jnp.zeros((bk, bv), h0_ref.dtype)
                             for k0, bk in tiles)
                hs = loop(0, NC, step, init)
                if dense:
                    for (k0, bk), h in zip(tiles, hs):
                        fin_ref[p, pl.ds(k0, bk), cols] = h

            h, v_new, final = _run_triton(
                kernel, (_tokens(wf), _tokens(uf), _tokens(kgf), _tokens(gam), h0f, layout.first, layout.last),
                [(P, NC * Kp, Vp), (P, NC * C, Vp), (N * HV, Kp, Vp)], P, Vp // bv, w.dtype, interpret,
            )
            h, v_new = h.reshape(P, NC, Kp, Vp), v_new.reshape(P, NC, C, Vp)
            # A sequence of length 0 has no chunk to write its final state: it keeps h0.
            final = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], h0f, final)
        return StateOut(unflat(h[..., :K, :V], R, HV), unflat(v_new[..., :V], R, HV),
                        final[:, :K, :V].reshape(N, HV, K, V))


@final
class PallasDhu(AbstractDhu, PallasValueBlocks):
    """B2 as a Pallas kernel, chunks in reverse (TPU: dense layout; Triton: also varlen, one
    program per row and block of ``block_v`` value columns; ``block_k`` as in
    ``PallasState``)."""

    block_k: Optional[int] = eqx.field(static=True, default=None)

    def __check_init__(self):
        _check_block_k(self.block_k)

    @tuned
    @typecheck
    def __call__(
        self,
        scale: float,
        qg: ChunkK,
        kg: ChunkK,
        w: ChunkK,
        G: ChunkK,
        do: ChunkV,
        dv_intra: ChunkV,
        dht: SeqState,
        layout: ChunkLayout,
        reset: Optional[ChunkValid] = None,
    ) -> DhuOut:
        R, HV, NC, C, K = qg.shape
        V = do.shape[-1]
        check_width("PallasDhu", self.target, K=K, V=V)
        t = self.target
        if t == "tpu":
            _check_dense("PallasDhu", layout, NC)
        N = dht.shape[0]
        qf, kf, wf = (feature_pad(t, flat(x)) for x in (qg, kg, w))
        dof, dvf = feature_pad(t, flat(do)), feature_pad(t, flat(dv_intra))
        gam = _gamma_col(G, t, reset)
        dhtf = feature_pad(t, dht.reshape(N * HV, K, V), axes=(-2, -1))
        P, Kp, Vp = R * HV, qf.shape[-1], dof.shape[-1]
        interpret = self.run_interpreted
        if t == "tpu":

            def kernel(q_ref, k_ref, w_ref, g_ref, do_ref, dvi_ref, dht_ref, dh_ref, dv_ref, dh0_ref, scr):
                c = pl.program_id(1)

                @pl.when(c == 0)
                def _():
                    scr[...] = dht_ref[...]

                dh_end = scr[...]
                dh_ref[...] = dh_end
                dv, dh_start = _dhu_step(scale, q_ref[...], k_ref[...], w_ref[...], g_ref[...], do_ref[...],
                                         dvi_ref[...], dh_end)
                dv_ref[...] = dv
                scr[...] = dh_start

                @pl.when(c == NC - 1)
                def _():
                    dh0_ref[...] = dh_start

            dh, dv_new, dh0 = _run_tpu(
                kernel, (qf, kf, wf, gam, dof, dvf, dhtf),
                [("c", (C, Kp)), ("c", (C, Kp)), ("c", (C, Kp)), ("c", (Kp, 1)), ("c", (C, Vp)),
                 ("c", (C, Vp)), ("p", (Kp, Vp))],
                [("c", (Kp, Vp)), ("c", (C, Vp)), ("p", (Kp, Vp))], P, NC, qg.dtype, (Kp, Vp), interpret, True,
            )
        else:

            # The [C, K] operands dominate at chunk 128: 64 value columns asked 256 KiB of
            # shared memory at K = V = 128, 16 columns 208 KiB (sm_90 allows 227).
            bv = min(self.block_v, Vp, 16 if C > 64 else Vp)

            dense = layout.dense

            tiles = _k_tiles(Kp, self.block_k)

            def kernel(q_ref, k_ref, w_ref, g_ref, do_ref, dvi_ref, dht_ref, first_ref, last_ref,
                       dh_ref, dv_ref, dh0_ref):
                p, cols = pl.program_id(0), pl.ds(pl.program_id(1) * bv, bv)
                r, hv = idiv(p, HV), p % HV

                # dh as row tiles of block_k rows (one tile: all of K), each a loop carry.
                def step(i, dhs):
                    c = NC - 1 - i
                    if not dense:  # a sequence may end or start at any chunk
                        l = last_ref[r, c]
                        dhs = tuple(jnp.where(l >= 0, dht_ref[jnp.maximum(l, 0) * HV + hv, pl.ds(k0, bk), cols], h)
                                    for (k0, bk), h in zip(tiles, dhs))
                    rows = pl.ds(c * C, C)
                    for (k0, bk), h in zip(tiles, dhs):
                        dh_ref[p, pl.ds(c * Kp + k0, bk), cols] = h
                    cut = lambda ref: [ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles]
                    dv, dhs_start = _dhu_step_tiled(scale, cut(q_ref), cut(k_ref), cut(w_ref),
                                                    [g_ref[p, pl.ds(c * Kp + k0, bk), :] for k0, bk in tiles],
                                                    do_ref[p, rows, cols], dvi_ref[p, rows, cols], dhs)
                    dv_ref[p, rows, cols] = dv
                    if not dense:
                        f = first_ref[r, c]

                        @pl.when(f >= 0)
                        def _():
                            for (k0, bk), h in zip(tiles, dhs_start):
                                dh0_ref[f * HV + hv, pl.ds(k0, bk), cols] = h

                    return dhs_start

                # Dense: row r is sequence r, from the last chunk back to chunk 0.
                init = tuple(dht_ref[p, pl.ds(k0, bk), cols] if dense else jnp.zeros((bk, bv), dht_ref.dtype)
                             for k0, bk in tiles)
                dhs = loop(0, NC, step, init)
                if dense:
                    for (k0, bk), h in zip(tiles, dhs):
                        dh0_ref[p, pl.ds(k0, bk), cols] = h

            dh, dv_new, dh0 = _run_triton(
                kernel, (_tokens(qf), _tokens(kf), _tokens(wf), _tokens(gam), _tokens(dof), _tokens(dvf), dhtf,
                         layout.first, layout.last),
                [(P, NC * Kp, Vp), (P, NC * C, Vp), (N * HV, Kp, Vp)], P, Vp // bv, qg.dtype, interpret,
            )
            dh, dv_new = dh.reshape(P, NC, Kp, Vp), dv_new.reshape(P, NC, C, Vp)
            # A sequence of length 0 passes its dht straight to dh0.
            dh0 = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], dhtf, dh0)
        return DhuOut(unflat(dh[..., :K, :V], R, HV), dh0[:, :K, :V].reshape(N, HV, K, V),
                      unflat(dv_new[..., :V], R, HV))
