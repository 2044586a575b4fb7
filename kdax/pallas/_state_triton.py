"""The Pallas state family's Triton kernels: one program per (row, head, block of
``block_v`` value columns) that loops over chunks (no scratch), reading chunk blocks with
``pl.ds`` and the sequence boundaries (``layout.first`` / ``layout.last``) as scalars, so
it runs dense and packed varlen alike; the state as row tiles of ``block_k`` rows."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._layouts.tokens import Tokens
from ._arith import segment_masks
from ._common import compiler_params, idiv, loop, manual_inputs, out_dtypes, put
from ._state_steps import dhu_step_tiled, k_tiles, state_step_tiled


def _run(kernel, ins, out_shapes, P, NV, dtype, interpret, stage, params, specs=None):
    """One program per (row, block of value columns); whole arrays, chunk blocks read with
    pl.ds inside the kernel (``specs``: a BlockSpec per input, None for a whole array).
    The columns of the state evolve independently, so splitting them halves each
    program's shared memory and doubles the programs (more parallel work for a GPU at
    small batch)."""
    ins, mat = manual_inputs(ins)
    blocks = {} if specs is None else dict(in_specs=[pl.BlockSpec() if s is None else s for s in specs])
    return pl.pallas_call(
        kernel, grid=(P, NV), **blocks,
        out_shape=[jax.ShapeDtypeStruct(s, d, manual_axis_type=mat) for s, d in zip(out_shapes, out_dtypes(dtype, 3))],
        name=f"kdax_{stage}_kernel",
        interpret=interpret, compiler_params=None if interpret else compiler_params("triton", False, 1, **params),
    )(*ins)


def _bound_inputs(layout) -> tuple:
    """The sequence boundaries a kernel reads: ``(layout.first, layout.last)``, none on a
    dense layout (row r is sequence r from its first chunk to its last: the kernels read
    no boundary there, and an operand they never read is glue XLA computes for nothing)."""
    return () if layout.dense else (layout.first, layout.last)


def _bounds(dense: bool, refs, seg=None) -> tuple:
    """``(first_ref, last_ref, seg_ref, *outputs)`` from a kernel's refs after its arrays
    (the boundaries None on a dense layout: ``_bound_inputs``; ``seg_ref`` None without
    shared chunks' ``seg``)."""
    refs = ((None, None) if dense else ()) + tuple(refs)
    return refs[:2] + ((None,) + refs[2:] if seg is None else refs[2:])


def _masks(seg_ref, p, rows):
    """The chunk's ``segment_masks`` from ``seg_ref`` (None: no shared chunks)."""
    return None if seg_ref is None else segment_masks(seg_ref[p, rows, :])


def gamma_operand(gam, rows: bool, C: int, Kp: int):
    """``(array, spec, load)`` of the decay ``G[last]`` per chunk: ``rows``: ``gam`` is G
    ``[P, NC, C, Kp]``, read as a block of each chunk's last row (``[NC, 1, Kp]`` per
    program: the kernel reads those rows of G, no sliced copy), ``load(ref, p, c, k0, bk)``
    a ``[bk, 1]`` column; else the column array ``[P, NC, Kp, 1]`` read whole."""
    if rows:
        NC = gam.shape[1]
        spec = pl.BlockSpec((None, NC, 1, Kp), lambda p, j: (p, 0, C - 1, 0))
        return gam, spec, lambda ref, p, c, k0, bk: ref[c, 0, pl.ds(k0, bk)][:, None]
    return _tokens(gam), None, lambda ref, p, c, k0, bk: ref[p, pl.ds(c * Kp + k0, bk), :]


def _specs(n_before: int, g_spec, n_after: int):
    """Per input, None (whole) but the decay's ``g_spec``; None if every input is whole."""
    return None if g_spec is None else [None] * n_before + [g_spec] + [None] * n_after


def _tokens(x):
    """``[P, NC, A, B] -> [P, NC * A, B]`` so a chunk is a ``pl.ds`` slice of rows."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])


def state_forward(wf, uf, kgf, gam, h0f, layout, *, R, HV, NC, C, Kp, Vp, N, block_v, block_k, dtype, interpret, mm,
                  params, gam_rows=False, seg=None):
    """F4 on padded, flattened operands: ``(h [P, NC, Kp, Vp], v_new, final [N * HV, Kp, Vp])``.
    ``mm``: the kernel's ``Products``; ``params``: its ``num_warps`` and ``num_stages``;
    ``gam``, ``gam_rows``: the decay as ``gamma_operand`` takes it. ``h0f`` None: zero
    initial states, not read (no operand). ``seg`` ``[P, NC, C, 1]``: shared chunks'
    sequences, or None."""
    P = R * HV
    # Sequence boundaries from the layout (dense or packed varlen): a chunk that
    # starts sequence f loads h0[f]; one that ends sequence l writes final[l].
    bv = min(block_v, Vp)
    dense = layout.dense
    tiles = k_tiles(Kp, block_k)
    g_in, g_spec, g_load = gamma_operand(gam, gam_rows, C, Kp)
    zero = h0f is None
    st_dt = jnp.dtype(dtype[2])  # (the final states': h0's dtype)

    def kernel(w_ref, u_ref, kg_ref, g_ref, *refs):
        h0_ref, refs = (None, refs) if zero else (refs[0], refs[1:])
        first_ref, last_ref, seg_ref, h_ref, vn_ref, fin_ref = _bounds(dense, refs, seg)

        p, cols = pl.program_id(0), pl.ds(pl.program_id(1) * bv, bv)
        r, hv = idiv(p, HV), p % HV

        def start(row, k0, bk):  # a sequence's initial state (row of h0), rows k0 to k0 + bk
            return jnp.zeros((bk, bv), st_dt) if zero else h0_ref[row, pl.ds(k0, bk), cols]

        # The state as row tiles of block_k rows (one tile: all of K), each a loop carry.
        def step(c, hs):
            rows = pl.ds(c * C, C)
            if not dense:  # a sequence may start or end at any chunk
                f = first_ref[r, c]
                hs = tuple(jnp.where(f >= 0, start(jnp.maximum(f, 0) * HV + hv, k0, bk), h)
                           for (k0, bk), h in zip(tiles, hs))
            for (k0, bk), h in zip(tiles, hs):
                # Stored as FLA stores them (bf16 under "fast": kdax._numerics.precision.storage).
                put(h_ref, (p, pl.ds(c * Kp + k0, bk), cols), h)
            v_new, hs_next = state_step_tiled(  # (loads, each read where its product needs it: _state_steps)
                mm, [lambda k0=k0, bk=bk: w_ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles], u_ref[p, rows, cols],
                [lambda k0=k0, bk=bk: kg_ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles],
                [lambda k0=k0, bk=bk: g_load(g_ref, p, c, k0, bk) for k0, bk in tiles], hs, _masks(seg_ref, p, rows))
            put(vn_ref, (p, rows, cols), v_new)
            if not dense:
                l = last_ref[r, c]

                @pl.when(l >= 0)
                def _():
                    for (k0, bk), h in zip(tiles, hs_next):
                        fin_ref[l * HV + hv, pl.ds(k0, bk), cols] = h

            return hs_next

        # Dense: row r is sequence r, from chunk 0 to the last (no per-chunk state load).
        init = tuple(start(p, k0, bk) if dense else jnp.zeros((bk, bv), st_dt) for k0, bk in tiles)
        hs = loop(0, NC, step, init)
        if dense:
            for (k0, bk), h in zip(tiles, hs):
                fin_ref[p, pl.ds(k0, bk), cols] = h

    h0_in = () if zero else (h0f,)
    after = (*h0_in, *_bound_inputs(layout), *(() if seg is None else (_tokens(seg),)))
    h, v_new, final = _run(
        kernel, (_tokens(wf), _tokens(uf), _tokens(kgf), g_in, *after),
        [(P, NC * Kp, Vp), (P, NC * C, Vp), (N * HV, Kp, Vp)], P, Vp // bv, dtype, interpret, "PallasState", params,
        _specs(3, g_spec, len(after)),
    )
    h, v_new = h.reshape(P, NC, Kp, Vp), v_new.reshape(P, NC, C, Vp)
    # A sequence of length 0 has no chunk to write its final state: it keeps h0.
    final = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], jnp.zeros((), final.dtype) if zero else h0f, final)
    return h, v_new, final


def dhu_backward(scale, qf, kf, wf, gam, dof, dvf, dhtf, layout, *, R, HV, NC, C, Kp, Vp, N, block_v, block_k, dtype,
                 interpret, mm, params, gam_rows=False, seg=None, start=None):
    """B2 on padded, flattened operands, chunks in reverse: ``(dh, dv_new, dh0)``. ``dof``
    may be a ``Tokens`` view (dense layout, V a power of 2): read from the caller's
    ``[B, T, H, V]`` array, row r's tokens of head ``hv // group``. ``seg`` as
    ``state_forward``'s. ``start`` ``[P, NC, Kp, Vp]`` (``dh_start``): added to each
    chunk's start-state cotangent, tile by tile."""
    P = R * HV
    if isinstance(dof, Tokens):
        view, do_in = dof, dof.x
        read_do = lambda ref, p, r, hv, rows, cols: view.load(ref[r, rows, idiv(hv, view.group), cols])
    else:
        do_in = _tokens(dof)
        read_do = lambda ref, p, r, hv, rows, cols: ref[p, rows, cols]
    # The [C, K] operands dominate at chunk 128: 64 value columns asked 256 KiB of
    # shared memory at K = V = 128, 16 columns 208 KiB (sm_90 allows 227).
    bv = min(block_v, Vp, 16 if C > 64 else Vp)
    dense = layout.dense
    tiles = k_tiles(Kp, block_k)
    g_in, g_spec, g_load = gamma_operand(gam, gam_rows, C, Kp)

    def kernel(q_ref, k_ref, w_ref, g_ref, do_ref, dvi_ref, dht_ref, *refs):
        start_ref, refs = (refs[0], refs[1:]) if start is not None else (None, refs)
        first_ref, last_ref, seg_ref, dh_ref, dv_ref, dh0_ref = _bounds(dense, refs, seg)
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
                dh_ref[p, pl.ds(c * Kp + k0, bk), cols] = h.astype(dh_ref.dtype)
            # (loads, each read where its product needs it: _state_steps)
            cut = lambda ref: [lambda k0=k0, bk=bk: ref[p, rows, pl.ds(k0, bk)] for k0, bk in tiles]  # noqa: E731
            gam = [lambda k0=k0, bk=bk: g_load(g_ref, p, c, k0, bk) for k0, bk in tiles]
            dv, dhs_start = dhu_step_tiled(mm, scale, cut(q_ref), cut(k_ref), cut(w_ref), gam,
                                            lambda: read_do(do_ref, p, r, hv, rows, cols), lambda: dvi_ref[p, rows, cols],
                                            dhs, _masks(seg_ref, p, rows))
            if start_ref is not None:
                dhs_start = tuple(h + start_ref[p, pl.ds(c * Kp + k0, bk), cols] for (k0, bk), h in zip(tiles, dhs_start))
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

    after = (do_in, _tokens(dvf), dhtf, *(() if start is None else (_tokens(start),)), *_bound_inputs(layout),
             *(() if seg is None else (_tokens(seg),)))
    dh, dv_new, dh0 = _run(
        kernel, (_tokens(qf), _tokens(kf), _tokens(wf), g_in, *after),
        [(P, NC * Kp, Vp), (P, NC * C, Vp), (N * HV, Kp, Vp)], P, Vp // bv, dtype, interpret, "PallasDhu", params,
        _specs(3, g_spec, len(after)),
    )
    dh, dv_new = dh.reshape(P, NC, Kp, Vp), dv_new.reshape(P, NC, C, Vp)
    # A sequence of length 0 passes its dht straight to dh0.
    dh0 = jnp.where(jnp.repeat(layout.empty, HV)[:, None, None], dhtf, dh0)
    return dh, dv_new, dh0
