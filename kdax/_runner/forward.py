"""How a pipeline's forward lays out its tokens, decided once before F1 runs
(``forward_route``): dense, one sequence per chunk, or packed sequences sharing chunks
(with or without initial states entering them); the gate parameters and initial states
in the compute dtype; the layout's hooks between the stages (``kdax._layouts``:
``ForwardHooks``, ``SharedFinalHooks``, ``EntryHooks``), which also give the final
states; the cleaner of non-finite inputs; and the forward's tiles. ``KDAPipeline.run_forward``
then runs F1-F5 on the route (``on_route``: whole or tile by tile) as one straight line."""

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp

from .._config import KDAConfig
from .._layouts import shared_states as _shared_states
from .._layouts.layout import ChunkLayout, ForwardHooks, make_layout, make_shared_layout, unpack
from .._layouts.tiles import forward_tiled
from .._layouts.tokens import chunked_inputs
from .._numerics import isolation as _isolation
from ..ref import compute_dtype
from .routes import is_kda, shares_chunks, tile_chunks
from .runner import record_layout


class ForwardRoute(NamedTuple):
    """What ``forward_route`` decided: the layout, its hooks, F4's state table ``h0``
    (``[N, HV, K, V]``, one zero entry in shared chunks), ``A_log`` and ``dt_bias`` in the
    compute dtype ``dtype``, the inputs' dtypes as given, the cleaner (or None) and the
    chunks per forward tile (None: each stage once over everything). ``h0_zero``: ``h0`` is
    the zeros made for a call without initial states (not a state table of shared chunks):
    F4 may be told so (``zero_h0``, a capability) and read none of it."""

    layout: ChunkLayout
    hooks: ForwardHooks
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
    """The route of ``pipeline``'s forward on the caller's ``raw = (q, k, v, g, beta)``,
    as the module docstring says (``KDAPipeline.run_forward``'s ``clean`` and ``entries``)."""
    (B, T, _, K), (HV, V), C = raw[0].shape, raw[2].shape[2:], config.chunk_size
    dt = compute_dtype(*raw, h0)
    # (initial states entering shared chunks compute terms of F1's and F5's math in
    # kdax._layouts.shared_states: only for stages that declare KDA's, as shares_chunks asks
    # of every stage; others keep one sequence per chunk, every term from the stage)
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
        shape = (1 if shared else N, HV, K, V)
        in_dtypes, A_log, dt_bias, h0 = in_compute_dtype(raw, h0, A_log, dt_bias, dt, shape)
    record_layout("shared" if shared else ("dense" if cu_seqlens is None else "per-sequence"))
    if entering:
        hooks = _shared_states.EntryHooks(config, layout, cu_seqlens, h0, ok)
    elif shared:
        hooks = _shared_states.SharedFinalHooks(config, layout, cu_seqlens, (N, HV, K, V), dt)
    else:
        hooks = ForwardHooks()
    cleaner = _isolation.cleaner_of(config) if clean else None
    nt = None if entering else tile_chunks(pipeline, layout.valid.shape[0] * HV, layout.num_chunks)
    if nt is not None and not layout.dense and h0.shape[0] > nt * C:
        nt = None  # each tile's state table, O(N), would cost more than its tokens
    return ForwardRoute(layout, hooks, h0, A_log, dt_bias, in_dtypes, dt, cleaner, nt, zero)


def on_route(route: ForwardRoute, stages: Callable, config: KDAConfig, raw: tuple, reads: tuple) -> tuple:
    """``(o [B, T, HV, V], final states, stage outputs)`` of ``stages(chunked inputs,
    state table, layout) -> (o chunked, stage outputs, final states)`` (F1-F5) run on
    ``route``: once over the whole input (F1's and F3's inputs as ``chunked_inputs`` gives
    them, ``reads`` whether each reads the caller's layout), or tile by tile
    (``forward_tiled``: only where the hooks add nothing between the stages)."""
    HV = raw[2].shape[2]
    if route.tile is not None:
        return forward_tiled(stages, route.layout, raw, HV, route.dtype, route.h0, route.tile, route.clean)
    chunked = chunked_inputs(config, route.layout, raw, HV, route.dtype, route.clean, reads)
    oc, fw, final = stages(chunked, route.h0, route.layout)
    return unpack(route.layout, oc), final, fw


def _in_dtypes(raw, h0, A_log, dt_bias) -> tuple:
    """The dtypes of the forward's inputs (q, k, v, g, beta, h0, A_log, dt_bias), None
    where absent: the backward returns each gradient in its input's dtype."""
    return tuple(None if x is None else jnp.dtype(x.dtype) for x in (*raw, h0, A_log, dt_bias))


def _cast(x, dt):
    return None if x is None else x.astype(dt)


def initial_states(h0, shape, dt):
    """The initial states ``[N, HV, K, V]`` in the compute dtype (zeros when not given)."""
    return jnp.zeros(shape, dt) if h0 is None else h0.astype(dt)


def in_compute_dtype(raw, h0, A_log, dt_bias, dt, shape) -> tuple:
    """``(in_dtypes, A_log, dt_bias, h0)``: the inputs' dtypes (``_in_dtypes``), and the gate
    parameters and initial states in the compute dtype ``dt`` (zeros of ``shape`` when no
    initial states are given)."""
    return _in_dtypes(raw, h0, A_log, dt_bias), _cast(A_log, dt), _cast(dt_bias, dt), initial_states(h0, shape, dt)
