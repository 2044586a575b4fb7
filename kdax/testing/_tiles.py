"""A stage's arguments on a tile (``kdax._layouts.tiles``): what the pipeline gives a tiled
forward stage, and what it reads of the stage's output there."""

import dataclasses
from typing import Optional

import numpy as np

from .._layouts.layout import ChunkLayout
from .._layouts.tiles import Tiles
from .._layouts.tokens import Tokens, as_chunked
from ._cases import _device, _host_weights


def _tile_of(kw: dict) -> Optional[dict]:
    """The arguments a forward stage gets on a tile of the input ``kw`` was recorded on
    (``kdax._layouts.tiles``: the pipeline's tiles are KDA problems with an initial state): chunks
    ``[c0, NC)``, ``c0`` where a packed sequence goes on from the chunk before (a carry),
    the arrays sliced, the layout as ``Tiles`` makes it and the state table with one
    carry per row (a fixed random state: any finite state may start a tile). None for a
    single chunk."""
    kw = {n: as_chunked(x) if isinstance(x, Tokens) else x for n, x in kw.items()}
    arrays = [x for n, x in kw.items() if n not in ("h0", "layout") and hasattr(x, "ndim") and x.ndim >= 3]
    if not arrays:
        return None
    NC = arrays[0].shape[1] if arrays[0].ndim == 3 else arrays[0].shape[2]
    if NC < 2:
        return None
    c0 = max(1, NC - 2)
    out = {}
    for n, x in kw.items():
        if n in ("h0", "layout") or not (hasattr(x, "ndim") and x.ndim >= 3):
            out[n] = x
        elif x.ndim == 3:  # valid, reset [R, NC, C] (sliced on the host: no program per slice)
            out[n] = _device(np.asarray(x)[:, c0:], x.dtype)
        else:  # [R, HV, NC, ...]
            out[n] = _device(np.asarray(x)[:, :, c0:], x.dtype)
    L = kw.get("layout")
    if isinstance(L, ChunkLayout):
        h0 = kw["h0"]
        tiles = Tiles(L, h0.shape[0], NC - c0)
        R = L.valid.shape[0]
        carry = _device(0.3 * _host_weights((R,) + tuple(h0.shape[1:]), h0.dtype, 5), h0.dtype)
        out["layout"] = tiles.layout_of(c0, NC - c0, True)
        out["h0"] = tiles.table(h0, carry, c0, NC - c0)
    return out


def _tile_read(out, tile: dict):
    """What the pipeline reads of a stage's output on a tile: of F4's final states, only
    the entries that end in the tile (``kdax._layouts.tiles``: ``collect``, ``carry_of``; the
    others are no sequence's there, their values unspecified)."""
    L = tile.get("layout")
    if not isinstance(L, ChunkLayout) or getattr(out, "final", None) is None:
        return out
    ends = np.unique(np.asarray(L.last))
    return dataclasses.replace(out, final=out.final[ends[ends >= 0]])
