"""The per-chunk arithmetic of the Pallas state kernels, shared by both targets: one
chunk of F4 (``state_step``) and of B2 (``dhu_step``), whole or on the state held as row
tiles (``*_tiled``, ``k_tiles``). ``mm``: the kernel's ``kdax.pallas._arith.Products``;
``masks`` (shared chunks, ``kdax.pallas._arith.segment_masks``, else None): the terms between
sequences sharing the chunk (the decays' exact zeros) selected away, so that one's overflow
(inf) never meets them as ``0 * inf`` (as ``kdax.stages.ReferenceState`` and
``ReferenceDhu``).
The tiled steps take their operands as loads (callables, or values): each tile read
where its product needs it, not all of them first (F4 and B2 at float32 operands spilled
0.4-1.3 KiB a thread on sm_90 with every tile loaded up front)."""

import jax.numpy as jnp


def state_step(mm, w, u, kg, gam, h, masks=None):
    v_new = u - _select(masks, 0, mm.dot(w, h))
    return v_new, _select(masks, 2, jnp.exp(gam) * h) + mm.dot(kg, _select(masks, 1, v_new), ta=True)


def k_tiles(Kp: int, block_k):
    """The state's row tiles ``[(start, size), ...]`` (Triton): ``block_k`` rows each
    (FLA holds the state as 64-row register tiles), or one tile of all Kp rows."""
    bk = Kp if block_k is None else min(block_k, Kp)
    return [(i, bk) for i in range(0, Kp, bk)]


def state_step_tiled(mm, w, u, kg, gam, hs, masks=None):
    """``state_step`` on the state as row tiles ``hs`` (``w``, ``kg`` and ``gam`` as
    matching lists of column / row tiles): the same sums, split along K."""
    v_new = u
    for wi, hi in zip(w, hs):
        v_new = v_new - _select(masks, 0, mm.dot(_get(wi), hi))
    ends = _select(masks, 1, v_new)
    return v_new, tuple(_select(masks, 2, jnp.exp(_get(gi)) * hi) + mm.dot(_get(ki), ends, ta=True)
                        for ki, gi, hi in zip(kg, gam, hs))


def _select(masks, i: int, x):
    """``x`` where ``masks[i]`` (zero elsewhere), or ``x`` itself without masks: ``masks``
    are ``(from_start, to_end, passes)``."""
    return x if masks is None else jnp.where(masks[i], x, 0.0)


def dhu_step_tiled(mm, scale, qg, kg, w, gam, do, dv_intra, dhs, masks=None):
    dv = _get(dv_intra)
    for ki, hi in zip(kg, dhs):
        dv = dv + _select(masks, 1, mm.dot(_get(ki), hi))
    do = _get(do)
    starts = _select(masks, 0, dv)
    return dv, tuple(_select(masks, 2, jnp.exp(_get(gi)) * hi) + scale * mm.dot(_get(qi), do, ta=True)
                     - mm.dot(_select(masks, 0, _get(wi)), starts, ta=True) for qi, wi, gi, hi in zip(qg, w, gam, dhs))


def _get(x):
    """A load: called where it is used (a callable), or the value itself."""
    return x() if callable(x) else x


def dhu_step(mm, scale, qg, kg, w, gam, do, dv_intra, dh_end, masks=None):
    dv = dv_intra + _select(masks, 1, mm.dot(kg, dh_end))
    return dv, (_select(masks, 2, jnp.exp(gam) * dh_end) + scale * mm.dot(qg, do, ta=True)
                - mm.dot(_select(masks, 0, w), _select(masks, 0, dv), ta=True))
