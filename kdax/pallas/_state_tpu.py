"""The Pallas state family's TPU (Mosaic) kernels: grid (row * head, chunk) with the chunk
axis sequential ("arbitrary") and the state carried in a VMEM scratch.

Dense layout (row r is sequence r, from chunk 0 to the last): the state enters at chunk 0
and leaves at the last chunk. Any other layout (packed varlen, one sequence per chunk or
shared chunks with their one-entry state table, ``kdax._layouts.layout``) says per chunk
which sequence starts (``first``) and ends (``last``) there; the kernels read that from
two scalar-prefetched code arrays (``_marks``) that also pick, in the block index maps,
the state-table block a chunk's program holds: the sequence's ``h0``/``dht`` as it enters,
its ``final``/``dh0`` as it leaves. The per-chunk arithmetic is ``_state_steps``'."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._layouts.layout import ChunkLayout
from ._common import compiler_params, idiv, manual_inputs, out_dtypes, put
from ._arith import segment_masks
from ._state_steps import dhu_step, state_step


def _nearest(x, ahead: bool):
    """Along the chunk axis of ``x [R, NC]`` (-1: no entry), each chunk's nearest entry at
    or before it (``ahead``: at or after it), else -1."""
    if ahead:
        return _nearest(x[:, ::-1], False)[:, ::-1]
    at = jax.lax.cummax(jnp.where(x >= 0, jnp.arange(x.shape[1], dtype=jnp.int32), -1), axis=1)
    return jnp.where(at >= 0, jnp.take_along_axis(x, jnp.maximum(at, 0), axis=1), -1)


def _marks(layout: ChunkLayout) -> tuple:
    """``(enter, leave)``, int32 ``[R * NC]`` each, ``2 * entry + mark`` per chunk. enter:
    ``mark`` a sequence starts in the chunk (``first``), ``entry`` the state-table entry
    of the nearest start at or before it (else after it); leave: ``mark`` one ends there
    (``last``), ``entry`` the nearest end at or after it (else before it). So the chunks
    between two marks name one block, and an output block (``final`` in chunk order,
    ``dh0`` in reverse) is written at the last chunk of its run: TPU writes a block back
    when the index changes, and never one that no chunk wrote."""

    def code(x, ahead):
        near, far = _nearest(x, ahead), _nearest(x, not ahead)
        entry = jnp.where(near >= 0, near, jnp.maximum(far, 0))
        return (2 * entry + (x >= 0).astype(entry.dtype)).astype(jnp.int32).reshape(-1)

    return code(layout.first, False), code(layout.last, True)


def _marked(ref, at):
    return (ref[at] & 1) == 1


def _run(kernel, ins, in_blocks, out_blocks, P, NC, HV, dtype, state_shape, interpret, reverse, stage, marks):
    """Sequential chunk axis, state in VMEM scratch. Blocks tagged 'c' are per chunk,
    'p' per row (dense: the same block for every chunk), 'enter'/'leave' (packed, with
    ``marks``) the state-table block of the chunk's entering/leaving sequence."""
    chunk = (lambda c: NC - 1 - c) if reverse else (lambda c: c)

    def spec(kind, block):
        zeros = (0,) * len(block)
        if kind == "c":  # (``codes``: the scalar-prefetched marks, when there are)
            return pl.BlockSpec((None, None) + block, lambda p, c, *codes: (p, chunk(c)) + zeros)
        if kind == "p":
            return pl.BlockSpec((None,) + block, lambda p, c: (p,) + zeros)
        which = 0 if kind == "enter" else 1

        def index(p, c, *codes):
            entry = codes[which][idiv(p, HV) * NC + chunk(c)] >> 1
            return (entry * HV + jax.lax.rem(p, jnp.asarray(HV, p.dtype)),) + zeros

        return pl.BlockSpec((None,) + block, index)

    ins, mat = manual_inputs(ins if marks is None else (*marks, *ins))  # (inside shard_map: all vary alike)
    if marks is not None:
        marks, ins = ins[:2], ins[2:]
    dtypes = out_dtypes(dtype, len(out_blocks))
    out_shape = [jax.ShapeDtypeStruct((P, NC) + b if k == "c" else s, d, manual_axis_type=mat)
                 for (k, b, s), d in zip(out_blocks, dtypes)]
    in_specs = [spec(k, b) for k, b in in_blocks]
    out_specs = [spec(k, b) for k, b, _ in out_blocks]
    scratch = [pltpu.VMEM(state_shape, dtypes[-1])]  # (the state's dtype)
    params = dict(out_shape=out_shape, name=f"kdax_{stage}_kernel", interpret=interpret,
                  compiler_params=None if interpret else compiler_params("tpu", True, 2))
    if marks is None:
        return pl.pallas_call(kernel, grid=(P, NC), in_specs=in_specs, out_specs=out_specs,
                              scratch_shapes=scratch, **params)(*ins)
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(P, NC), in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch)
    return pl.pallas_call(kernel, grid_spec=grid_spec, **params)(*marks, *ins)


def _bounds(marks, NC: int, HV: int, reverse: bool):
    """``split(refs) -> (refs, starts, ends)`` for a kernel's arguments: the operand refs,
    and functions saying whether this chunk starts / ends a sequence (dense: chunk 0 /
    NC - 1; read where the kernel asks, so the dense kernels trace as before). Packed,
    ``split`` also zeroes the state at the program's first step: a chunk that holds no
    sequence (the layout's spare chunks after the last one) runs from zero, as in the
    Triton kernels and the reference stages."""

    def split(refs):
        c = pl.program_id(1)
        if marks is None:
            first, last = (NC - 1, 0) if reverse else (0, NC - 1)
            return refs, lambda: c == first, lambda: c == last
        enter, leave, *refs = refs

        @pl.when(c == 0)
        def _():
            refs[-1][...] = jnp.zeros(refs[-1].shape, refs[-1].dtype)  # (the state scratch)

        at = idiv(pl.program_id(0), HV) * NC + (NC - 1 - c if reverse else c)
        return refs, lambda: _marked(enter, at), lambda: _marked(leave, at)

    return split


def _segment_inputs(seg):
    """``(inputs, blocks)`` of the shared chunks' ``seg`` ``[P, NC, C, 1]`` (or none), and
    ``split(refs) -> (refs, masks)`` for the kernel (``segment_masks``, None without it)."""
    if seg is None:
        return (), [], lambda refs: (refs, None)
    C = seg.shape[2]
    return (seg,), [("c", (C, 1))], lambda refs: (refs[1:], segment_masks(refs[0][...]))


def state_forward(wf, uf, kgf, gam, h0f, layout: ChunkLayout, *, P, HV, N, NC, C, Kp, Vp, dtype, interpret, mm,
                  seg=None):
    """F4 on padded, flattened operands (``[P, NC, C, Kp]`` ...; ``h0f [N * HV, Kp, Vp]``):
    ``(h, v_new, final [N * HV, Kp, Vp])``; ``mm``: the kernel's ``Products``; ``seg``: shared
    chunks' sequences (``_segment_inputs``) or None."""
    marks = None if layout.dense else _marks(layout)
    split = _bounds(marks, NC, HV, reverse=False)
    seg_in, seg_blocks, seg_split = _segment_inputs(seg)

    def kernel(*refs):
        refs, starts, ends = split(refs)
        (w_ref, u_ref, kg_ref, g_ref, h0_ref, h_ref, vn_ref, fin_ref, scr), masks = seg_split(refs)

        @pl.when(starts())
        def _():
            scr[...] = h0_ref[...]

        h = scr[...]
        put(h_ref, ..., h)  # (in the stored dtype: bf16 under "fast")
        v_new, h_next = state_step(mm, w_ref[...], u_ref[...], kg_ref[...], g_ref[...], h, masks)
        put(vn_ref, ..., v_new)
        scr[...] = h_next

        @pl.when(ends())
        def _():
            fin_ref[...] = h_next

    state = "p" if marks is None else "enter"
    h, v_new, final = _run(
        kernel, (*seg_in, wf, uf, kgf, gam, h0f),
        seg_blocks + [("c", (C, Kp)), ("c", (C, Vp)), ("c", (C, Kp)), ("c", (Kp, 1)), (state, (Kp, Vp))],
        [("c", (Kp, Vp), None), ("c", (C, Vp), None), ("p" if marks is None else "leave", (Kp, Vp), (N * HV, Kp, Vp))],
        P, NC, HV, dtype, (Kp, Vp), interpret, False, "PallasState", marks,
    )
    if marks is not None:  # a sequence of length 0 has no chunk to write its final state: it keeps h0
        final = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], h0f, final)
    return h, v_new, final


def dhu_backward(scale, qf, kf, wf, gam, dof, dvf, dhtf, layout: ChunkLayout, *, P, HV, N, NC, C, Kp, Vp, dtype,
                 interpret, mm, seg=None, start=None):
    """B2 on padded, flattened operands, chunks in reverse: ``(dh, dv_new, dh0 [N * HV, Kp, Vp])``.
    ``start`` ``[P, NC, Kp, Vp]`` (``dh_start``): added to each chunk's start-state cotangent."""
    marks = None if layout.dense else _marks(layout)
    split = _bounds(marks, NC, HV, reverse=True)
    seg_in, seg_blocks, seg_split = _segment_inputs(seg)
    has_start = start is not None

    def kernel(*refs):
        refs, starts, ends = split(refs)
        refs, masks = seg_split(refs)
        start_ref, refs = (refs[7], refs[:7] + refs[8:]) if has_start else (None, refs)
        q_ref, k_ref, w_ref, g_ref, do_ref, dvi_ref, dht_ref, dh_ref, dv_ref, dh0_ref, scr = refs

        @pl.when(ends())  # (in reverse: the sequence's last chunk comes first)
        def _():
            scr[...] = dht_ref[...]

        dh_end = scr[...]
        dh_ref[...] = dh_end.astype(dh_ref.dtype)
        dv, dh_start = dhu_step(mm, scale, q_ref[...], k_ref[...], w_ref[...], g_ref[...], do_ref[...],
                                 dvi_ref[...], dh_end, masks)
        dv_ref[...] = dv
        if has_start:
            dh_start = dh_start + start_ref[...]
        scr[...] = dh_start

        @pl.when(starts())
        def _():
            dh0_ref[...] = dh_start

    dh, dv_new, dh0 = _run(
        kernel, (*seg_in, qf, kf, wf, gam, dof, dvf, dhtf) + ((start,) if has_start else ()),
        seg_blocks + [("c", (C, Kp)), ("c", (C, Kp)), ("c", (C, Kp)), ("c", (Kp, 1)), ("c", (C, Vp)),
         ("c", (C, Vp)), ("p" if marks is None else "leave", (Kp, Vp))] + [("c", (Kp, Vp))] * has_start,
        [("c", (Kp, Vp), None), ("c", (C, Vp), None), ("p" if marks is None else "enter", (Kp, Vp), (N * HV, Kp, Vp))],
        P, NC, HV, dtype, (Kp, Vp), interpret, True, "PallasDhu", marks,
    )
    if marks is not None:  # a sequence of length 0 passes its dht straight to dh0
        dh0 = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], dhtf, dh0)
    return dh, dv_new, dh0
