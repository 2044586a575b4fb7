"""Exact sequence resets inside shared chunks (``_layouts.layout.make_shared_layout``).

A chunk of the shared layout may hold the end of one sequence and the starts of others.
F1 gives each sequence's first token (``reset``) the log decay floor, so G stays
non-increasing through the chunk and every difference ``G_i - G_j`` within one sequence is
its own; the decay between two sequences is then about exp(floor), tiny but not zero. The
stages that take ``reset`` make it exactly zero: with ``seg`` the index of each token's
sequence within its chunk (0: the one that continues from the chunk's start), they mask
in the exponent, or select,

- pair terms ``e^(G_i - G_j)`` (F2, B4) where ``seg_i != seg_j``;
- the state at the chunk's start reaching token i, ``e^(G_i)`` (``qg``, ``w``: F3, B3),
  where ``seg_i != 0``;
- token j writing the state at the chunk's end, ``e^(Γ - G_j)`` (``kg``: F3, B3), where
  ``seg_j`` is not the chunk's last sequence;
- the state's decay through the chunk, ``e^Γ`` (F4, B2, B3), where a sequence starts
  after the chunk's first token (the state is replaced, not decayed).

Each sequence then equals running it alone to rounding, whatever its neighbours hold (a
finite value: a product with an exact zero is zero; ``kdax._numerics.isolation`` keeps non-finite
inputs out of shared chunks).
"""

import dataclasses

import jax.numpy as jnp


def segments(reset):
    """``reset [R, NC, C]`` -> ``[R, NC, C]`` int32: each token's sequence within its
    chunk, 0 for the one that continues from the chunk's start (a sequence starting at
    the chunk's first token is also 0: the state it meets there is already zero)."""
    after_first = reset & (jnp.arange(reset.shape[-1]) > 0)
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
    """``reset [R, NC, C]`` -> ``[R, 1, NC, 1]`` bool: the state at the chunk's start
    reaches its end (no sequence starts after its first token)."""
    return ~jnp.any(reset[..., 1:], axis=-1)[:, None, :, None]


def mask_exponent(keep, x):
    """``x`` where ``keep``, else -inf (its exponential an exact zero)."""
    return x if keep is None else jnp.where(keep, x, -jnp.inf)


# -- the pipeline's own masks on a stage given ``reset`` ---------------------------------


def guards(stage) -> bool:
    """Whether the pipeline masks what ``stage`` makes of ``reset`` (``guard_inputs``,
    ``guard_outputs``): every stage but kdax's own, which mask it themselves (their
    ``check_stage`` rows run in kdax's tests) and keep their programs unchanged."""
    return type(stage).__module__.split(".")[0] != "kdax"


def _mask(keep, x):
    return jnp.where(keep, x, jnp.zeros((), x.dtype))  # a select, never keep * x (0 * inf)


def guard_inputs(name: str, kwargs: dict) -> dict:
    """B4's pair gradients ``dAqk`` and ``grads.dL`` with exact zeros between sequences:
    every term B4 forms from a pair is then ``0 * (a finite product)``, what its own mask
    gives, so a B4 that ignores ``reset`` gives its numbers. Other fields: unchanged."""
    if name != "intra_bwd":
        return kwargs
    same = same_segment(per_head(segments(kwargs["reset"]), kwargs["dAqk"].shape[1]))
    grads = kwargs["grads"]
    if grads.dL is not None:
        grads = dataclasses.replace(grads, dL=_mask(same, grads.dL))
    return dict(kwargs, dAqk=_mask(same, kwargs["dAqk"]), grads=grads)


def _guard_wy(wy, seg):
    # w = Akk (beta k e^G) and qg = q e^G vanish where the chunk's start state does not
    # reach (Akk already zero between sequences), kg = k e^(Γ - G) where the token's
    # sequence ends inside the chunk: the reference stage's own mask, row by row.
    start, end = from_start(seg), to_end(seg)
    return dataclasses.replace(wy, w=_mask(start, wy.w), qg=_mask(start, wy.qg), kg=_mask(end, wy.kg))


def guard_outputs(name: str, out, reset):
    """``out`` of a stage of KDA's math that was given ``reset``, with every term
    between two sequences an exact zero where that is exact whatever the stage made of
    ``reset`` (finite inputs, ``kdax._numerics.isolation``): F2's ``Aqk`` and ``Akk`` (``I + L``
    is block lower triangular over the chunk's sequences, so the blocks of its inverse
    on the diagonal are the inverses of its own: zeroing the others is the inverse of
    the masked ``L``), F3's ``w``, ``qg``, ``kg`` (above; B0 recomputes with the
    pipeline's F3, guarded there). F1, F4, B0's states, B2, B3 and B5 sum or carry
    across tokens: not here (docs/stages.md, "Capabilities")."""
    if name == "intra":
        same = same_segment(per_head(segments(reset), out.Aqk.shape[1]))
        return dataclasses.replace(out, Aqk=_mask(same, out.Aqk), Akk=_mask(same, out.Akk))
    if name == "wy":
        return _guard_wy(out, per_head(segments(reset), out.w.shape[1]))
    return out
