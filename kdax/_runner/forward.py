"""The forward's route, decided once before F1 (``forward_route``): the layout (dense,
per-sequence, shared chunks, with or without initial states entering them), the gate
parameters and initial states in the compute dtype, the layout's hooks, the cleaner of
non-finite inputs and the tiles; ``on_route`` runs F1-F5 on it, whole or tile by tile.
The plain layouts' hooks (forward and backward) are here; shared chunks' are in
``kdax._layouts.shared_states``."""

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp

from .._config import KDAConfig
from .._layouts import shared_states as _shared_states
from .._layouts.layout import ChunkLayout, make_layout, make_shared_layout, unpack
from .._layouts.tiles import forward_tiled
from .._layouts.tokens import chunked_inputs
from .._numerics import isolation as _isolation
from ..ref import compute_dtype
from .routes import is_kda, shares_chunks, tile_chunks
from .runner import record_layout


class PlainHooks:
    """What a layout adds to F1-F5 and to the six-stage backward at named points: nothing,
    for the dense and per-sequence layouts (shared chunks: ``SharedForwardHooks``,
    ``SharedChunkHooks``). The layout's own part (``extra``), returned by the forward's
    ``f4_inputs`` and the backward's ``after_dav``, is what the later points take; a hook
    object holds only what it was built with."""

    def f4_inputs(self, h0, layout, *, act, intra, v, g, A_log, dt_bias) -> tuple:
        """``(h0, layout, extra)`` F4 runs on, after F1-F3."""
        return h0, layout, None

    def v_out(self, v_new, extra=None):
        """What F5 reads as ``v_new`` (in the backward: what it read; no ``extra``)."""
        return v_new

    def after_output(self, oc, extra):
        return oc

    def final_states(self, fw, final):
        """The final states ``[N, HV, K, V]`` from F1-F5's outputs ``fw`` and F4's ``final``."""
        return final

    def tile_finals(self):
        """``(initial, update)`` when the tiled forward makes the final states tile by tile
        (``forward_tiled``'s ``finals``), else None: from F4's state table."""
        return None

    def residuals(self, layout, h0, extra) -> tuple:
        """``(layout, h0, the entries' parts or None)`` the residuals keep."""
        return layout, h0, None

    def b2_dht(self, dht, h0):
        """The ``dht`` B2 starts from (``[N, HV, K, V]``; non-finite heads read as zero)."""
        return jnp.zeros_like(h0) if dht is None else _isolation.finite_or_zero(dht.astype(h0.dtype))

    def after_dav(self, dv_intra, *, k, G, v_out, h) -> tuple:
        """``(dv_intra, extra)``."""
        return dv_intra, None

    def dh_start(self, extra):  # (the chunk-start states' cotangents B2 may add: ``dh_start``)
        return None

    def after_dhu(self, dhu, run_dhu, extra, took: bool = False) -> tuple:
        """``(dhu, extra)``; ``run_dhu(dht, layout)`` runs B2 again from states alone (``took``: it had ``dh_start``)."""
        return dhu, extra

    def after_wy_dqkg(self, grads, extra, *, dv_intra, doc, Akk) -> tuple:
        """``(grads, extra)``."""
        return grads, extra

    def after_gate_bwd(self, raw, extra):
        return raw

    def initial_state(self, dhu, extra):
        """The initial states' gradient ``[N, HV, K, V]`` (None: none were given)."""
        return dhu.dh0


def backward_hooks(res, dht):
    """``SharedChunkHooks`` on the shared-chunk layout, else ``PlainHooks``."""
    return PlainHooks() if res.layout.reset is None else _shared_states.SharedChunkHooks(res, dht)


class ForwardRoute(NamedTuple):
    """What ``forward_route`` decided: the layout, its hooks, F4's state table ``h0``
    ``[N, HV, K, V]``, ``A_log`` and ``dt_bias`` in the compute ``dtype``, the inputs'
    dtypes, the cleaner (or None), chunks per tile (None: whole). ``h0_zero``: ``h0`` is
    the zeros of a call without initial states (F4 may be told: ``zero_h0``)."""

    layout: ChunkLayout
    hooks: PlainHooks
    h0: object
    A_log: object
    dt_bias: object
    in_dtypes: tuple
    dtype: object
    clean: Optional[Callable]
    tile: Optional[int]
    h0_zero: bool = False


def forward_route(pipeline, config: KDAConfig, raw: tuple, h0, A_log, dt_bias, cu_seqlens, clean: bool,
                  entries: bool) -> ForwardRoute:
    """The route of the forward on the caller's ``raw = (q, k, v, g, beta)`` (module docstring)."""
    (B, T, _, K), (HV, V), C = raw[0].shape, raw[2].shape[2:], config.chunk_size
    dt = compute_dtype(*raw, h0)
    # (entering states compute terms of F1's and F5's math outside them: KDA's only)
    entries = entries and all(is_kda(getattr(pipeline, n)) for n in ("gate", "output"))
    shared = (h0 is None or entries) and shares_chunks(pipeline, cu_seqlens)
    entering = shared and h0 is not None
    zero = h0 is None and not shared
    if entering:  # (cast before the layout is made: the program lowered as it was)
        in_dtypes, A_log, dt_bias, h0 = in_compute_dtype(raw, h0, A_log, dt_bias, dt, None)
        ok = _isolation.finite_heads(h0) if clean else None  # (False: the head reads a zero state)
    layout = make_shared_layout(T, C, cu_seqlens) if shared else make_layout(B, T, C, cu_seqlens)
    N = cu_seqlens.shape[0] - 1 if shared else layout.empty.shape[0]
    if not entering:  # (shared: one stream of T tokens, a state table of one entry, zero)
        in_dtypes, A_log, dt_bias, h0 = in_compute_dtype(raw, h0, A_log, dt_bias, dt, (1 if shared else N, HV, K, V))
    record_layout("shared" if shared else ("dense" if cu_seqlens is None else "per-sequence"))
    nt = None if entering else tile_chunks(pipeline, layout.valid.shape[0] * HV, layout.num_chunks)
    if nt is not None and not layout.dense and h0.shape[0] > nt * C:
        nt = None  # sequences shorter than a tile on average: whole ran faster (512 in 4096 tokens: 0.8-0.9x)
    hooks = PlainHooks() if not shared else _shared_states.SharedForwardHooks(
        config, layout, cu_seqlens, (N, HV, K, V), dt, h0=h0 if entering else None, ok=ok if entering else None,
        tiled=nt is not None)
    cleaner = _isolation.cleaner_of(config) if clean else None
    return ForwardRoute(layout, hooks, h0, A_log, dt_bias, in_dtypes, dt, cleaner, nt, zero)


def on_route(route: ForwardRoute, stages: Callable, config: KDAConfig, raw: tuple, reads: tuple) -> tuple:
    """``(o [B, T, HV, V], final states, stage outputs)`` of ``stages`` (F1-F5) on ``route``:
    whole (``reads``: whether F1, F3 read ``Tokens`` views) or tile by tile."""
    HV = raw[2].shape[2]
    if route.tile is not None:
        return forward_tiled(stages, route.layout, raw, HV, route.dtype, route.h0, route.tile, route.clean,
                             route.hooks.tile_finals())
    chunked = chunked_inputs(config, route.layout, raw, HV, route.dtype, route.clean, reads)
    oc, fw, final = stages(chunked, route.h0, route.layout)
    return unpack(route.layout, oc), final, fw


def initial_states(h0, shape, dt):
    """The initial states ``[N, HV, K, V]`` in the compute dtype (zeros when not given)."""
    return jnp.zeros(shape, dt) if h0 is None else h0.astype(dt)


def in_compute_dtype(raw, h0, A_log, dt_bias, dt, shape) -> tuple:
    """``(in_dtypes, A_log, dt_bias, h0)``: the dtypes of (q, k, v, g, beta, h0, A_log,
    dt_bias) as given (None where absent), the rest in the compute dtype ``dt`` (``h0``:
    zeros of ``shape`` when not given)."""
    in_dtypes = tuple(None if x is None else jnp.dtype(x.dtype) for x in (*raw, h0, A_log, dt_bias))
    cast = lambda x: None if x is None else x.astype(dt)
    return in_dtypes, cast(A_log), cast(dt_bias), initial_states(h0, shape, dt)
