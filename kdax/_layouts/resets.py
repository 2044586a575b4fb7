"""Exact sequence resets inside shared chunks (docs/DESIGN.md §7). ``seg``: each token's
sequence within its chunk (0: the one continuing from the chunk's start); stages given
``reset`` mask, in the exponent or by a select, pair terms where ``seg_i != seg_j``, the
start state reaching token i where ``seg_i != 0``, token j writing the end state where
``seg_j`` is not the last, and the state's decay through a chunk where a sequence starts
after its first token."""

import dataclasses

import jax.numpy as jnp


def segments(reset):
    """``reset [R, NC, C]`` -> ``[R, NC, C]`` int32: each token's sequence within its chunk
    (0: the one continuing from the start, or starting at the first token)."""
    after_first = reset & (jnp.arange(reset.shape[-1]) > 0)[None, None]  # (explicit: rank promotion may raise)
    return jnp.cumsum(after_first.astype(jnp.int32), axis=-1)


def per_head(x, HV: int):
    """``[R, NC, ...]`` -> ``[R, HV, NC, ...]`` (a broadcast, for ``over_chunks``)."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], HV) + x.shape[1:])


def same_segment(seg):
    """``seg [..., C]`` -> ``[..., C, C]``: row i and column j in one sequence."""
    return seg[..., :, None] == seg[..., None, :]


def from_start(seg):
    """``seg [..., C]`` -> ``[..., C, 1]``: the chunk's start state reaches the token."""
    return (seg == 0)[..., None]


def to_end(seg):
    """``seg [..., C]`` -> ``[..., C, 1]``: the token writes the chunk's end state."""
    return (seg == seg[..., -1:])[..., None]


def state_passes(reset):
    """``reset [R, NC, C]`` -> ``[R, 1, NC, 1]``: no sequence starts after the chunk's first token."""
    return ~jnp.any(reset[..., 1:], axis=-1)[:, None, :, None]


def mask_exponent(keep, x):
    """``x`` where ``keep``, else -inf (its exponential an exact zero)."""
    return x if keep is None else jnp.where(keep, x, -jnp.inf)


def select_zero(keep, x):
    """``x`` where ``keep``, else zero: a select, never ``keep * x`` (``0 * inf`` is NaN)."""
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


# -- the pipeline's own masks on a stage given ``reset`` ---------------------------------


def guards(stage) -> bool:
    """Whether the pipeline masks what ``stage`` makes of ``reset``: any stage but kdax's own."""
    return type(stage).__module__.split(".")[0] != "kdax"


def guard_inputs(name: str, kwargs: dict) -> dict:
    """B4's ``dAqk`` and ``grads.dL`` with exact zeros between sequences; other fields unchanged."""
    if name != "intra_bwd":
        return kwargs
    same = same_segment(per_head(segments(kwargs["reset"]), kwargs["dAqk"].shape[1]))
    grads = kwargs["grads"]
    if grads.dL is not None:
        grads = dataclasses.replace(grads, dL=select_zero(same, grads.dL))
    return dict(kwargs, dAqk=select_zero(same, kwargs["dAqk"]), grads=grads)


def guard_outputs(name: str, out, reset):
    """``out`` with the terms between sequences exact zeros, whatever the stage made of
    ``reset``: F2's ``Aqk``, ``Akk`` (the inverse of a block lower triangular ``I + L`` has
    the inverses of its diagonal blocks), F3's ``w``, ``qg``, ``kg``. Other stages sum or
    carry across tokens: unchanged."""
    if name == "intra":
        same = same_segment(per_head(segments(reset), out.Aqk.shape[1]))
        return dataclasses.replace(out, Aqk=select_zero(same, out.Aqk), Akk=select_zero(same, out.Akk))
    if name == "wy":  # w = Akk (beta k e^G) and qg = q e^G vanish where the chunk's start state does
        # not reach (Akk already zero between sequences), kg = k e^(Γ - G) where the token's sequence
        # ends inside the chunk: the reference stage's own mask, row by row.
        seg = per_head(segments(reset), out.w.shape[1])
        start, end = from_start(seg), to_end(seg)
        return dataclasses.replace(out, w=select_zero(start, out.w), qg=select_zero(start, out.qg), kg=select_zero(end, out.kg))
    return out
