"""The Pallas state family's TPU (Mosaic) kernels: grid (row * head, chunk) with the chunk
axis sequential ("arbitrary") and the state carried in a VMEM scratch; dense layout only
(one sequence per row: ``PallasState``/``PallasDhu`` refuse packed input before this)."""

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import chunk_spec, compiler_params, manual_inputs, out_dtypes, put
from ._state_steps import dhu_step, state_step


def _run(kernel, ins, in_blocks, out_blocks, P, NC, dtype, state_shape, interpret, reverse, stage):
    """Sequential chunk axis, state in VMEM scratch. Blocks tagged 'c' are per chunk,
    'p' per row (the same block for every chunk)."""
    def spec(kind, block):
        if kind == "p":
            return pl.BlockSpec((None,) + block, lambda p, c: (p,) + (0,) * len(block))
        if reverse:
            return pl.BlockSpec((None, None) + block, lambda p, c: (p, NC - 1 - c) + (0,) * len(block))
        return chunk_spec(block)

    ins, mat = manual_inputs(ins)
    dtypes = out_dtypes(dtype, len(out_blocks))
    out_shape = [jax.ShapeDtypeStruct((P,) + ((NC,) if k == "c" else ()) + b, d, manual_axis_type=mat)
                 for (k, b), d in zip(out_blocks, dtypes)]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(P, NC), name=f"kdax_{stage}_kernel",
        in_specs=[spec(k, b) for k, b in in_blocks], out_specs=[spec(k, b) for k, b in out_blocks],
        scratch_shapes=[pltpu.VMEM(state_shape, dtypes[-1])], interpret=interpret,  # (the state's dtype)
        compiler_params=None if interpret else compiler_params("tpu", True, 2),
    )(*ins)


def state_forward(wf, uf, kgf, gam, h0f, *, P, NC, C, Kp, Vp, dtype, interpret):
    """F4 on padded, flattened operands (``[P, NC, C, Kp]`` ...): ``(h, v_new, final)``."""

    def kernel(w_ref, u_ref, kg_ref, g_ref, h0_ref, h_ref, vn_ref, fin_ref, scr):
        c = pl.program_id(1)

        @pl.when(c == 0)
        def _():
            scr[...] = h0_ref[...]

        h = scr[...]
        put(h_ref, ..., h)  # (in the stored dtype: bf16 under "fast")
        v_new, h_next = state_step(w_ref[...], u_ref[...], kg_ref[...], g_ref[...], h)
        put(vn_ref, ..., v_new)
        scr[...] = h_next

        @pl.when(c == NC - 1)
        def _():
            fin_ref[...] = h_next

    h, v_new, final = _run(
        kernel, (wf, uf, kgf, gam, h0f),
        [("c", (C, Kp)), ("c", (C, Vp)), ("c", (C, Kp)), ("c", (Kp, 1)), ("p", (Kp, Vp))],
        [("c", (Kp, Vp)), ("c", (C, Vp)), ("p", (Kp, Vp))], P, NC, dtype, (Kp, Vp), interpret, False, "PallasState",
    )
    return h, v_new, final


def dhu_backward(scale, qf, kf, wf, gam, dof, dvf, dhtf, *, P, NC, C, Kp, Vp, dtype, interpret):
    """B2 on padded, flattened operands, chunks in reverse: ``(dh, dv_new, dh0)``."""

    def kernel(q_ref, k_ref, w_ref, g_ref, do_ref, dvi_ref, dht_ref, dh_ref, dv_ref, dh0_ref, scr):
        c = pl.program_id(1)

        @pl.when(c == 0)
        def _():
            scr[...] = dht_ref[...]

        dh_end = scr[...]
        dh_ref[...] = dh_end.astype(dh_ref.dtype)
        dv, dh_start = dhu_step(scale, q_ref[...], k_ref[...], w_ref[...], g_ref[...], do_ref[...],
                                 dvi_ref[...], dh_end)
        dv_ref[...] = dv
        scr[...] = dh_start

        @pl.when(c == NC - 1)
        def _():
            dh0_ref[...] = dh_start

    dh, dv_new, dh0 = _run(
        kernel, (qf, kf, wf, gam, dof, dvf, dhtf),
        [("c", (C, Kp)), ("c", (C, Kp)), ("c", (C, Kp)), ("c", (Kp, 1)), ("c", (C, Vp)),
         ("c", (C, Vp)), ("p", (Kp, Vp))],
        [("c", (Kp, Vp)), ("c", (C, Vp)), ("p", (Kp, Vp))], P, NC, dtype, (Kp, Vp), interpret, True, "PallasDhu",
    )
    return dh, dv_new, dh0
