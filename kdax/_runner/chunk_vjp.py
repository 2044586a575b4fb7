"""Chunk-local VJPs for the derived backward (``kdax._runner.routes.derived_vjp``).

Differentiated by ``jax.vjp`` as they are, the reference stages' chunk-group loops
(``kdax._numerics.chunk_loops.over_chunks``: ``fori_loop``s) become scans whose every
intermediate, in every group, is kept for the backward: F2's recursive halving alone
keeps dozens of arrays the size of its inputs, and the derived backward took 4.6-4.9x the
six-stage backward's temp memory (benchmarks/results/custom_stage_costs.txt).

A forward stage of KDA's math computes each chunk from that chunk alone (F1, F2, F3, F5:
the family's formula), so its VJP is the VJP of each slice of chunks. ``chunk_local``
wraps such a stage (its family's reference stage) so that, differentiated, it keeps only
its inputs, and its backward walks the chunk axis a few chunks at a time, rematerialising
each slice's forward and taking ``jax.vjp`` of the stage on that slice alone: the
transpose's temporaries stay the size of a slice. F4 (a recurrence over chunks) keeps
its inputs too, and its backward is ``jax.vjp`` of the whole stage, rematerialised. The
forward runs the stage exactly as before (the same numbers, bit for bit).

Which axis is the chunk axis, by an argument's rank: ``[R, HV, NC, ...]`` (rank 4 and
more) the third, ``[R, NC, C]`` (``valid``, ``reset``) the second; arrays of lower rank
(the gate parameters ``A_log``, ``dt_bias``) are read whole by every slice, their
gradients summed over the slices.
"""

import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._numerics import chunk_loops as _chunk_loops
from .._numerics import precision as _precision
from .._numerics.arrays import varying_axes
from .._numerics.arrays import mT
from ..stages import KDA, ChunkGrads, IntraOut, ReferenceIntraBackward
from .contracts import STAGES

# Forward fields whose KDA stage computes each chunk alone (differentiated slice by slice).
CHUNK_LOCAL = ("gate", "intra", "wy", "output")
# Chunks per backward slice: about this many (row, head, chunk) blocks, as over_chunks' groups.
_BLOCKS = "auto"


def _axis(x) -> Optional[int]:
    """The chunk axis of an argument or output (None: read whole by every slice)."""
    return 2 if x.ndim >= 4 else (1 if x.ndim == 3 else None)


def _slices(NC: int, blocks: int) -> int:
    """Chunks per slice: a divisor of ``NC`` near ``blocks`` (rows x heads already counted)."""
    want = max(1, min(NC, blocks))
    return next(d for d in range(want, 0, -1) if NC % d == 0)


@functools.cache
def _wrapper(field: str) -> type:
    """The wrapper class of ``field``'s family (one per field)."""
    info = STAGES[field]
    ref = info.reference

    def __call__(self, **kwargs):
        # The scope the stage runs under (the precision policy), to trace its backward
        # under the same one (the loop form is the stage's own field).
        scopes = (_precision._CURRENT.get(),)
        diff = {n: x for n, x in kwargs.items() if eqx.is_inexact_array(x)}
        rest = {n: x for n, x in kwargs.items() if n not in diff}
        return _differentiated(diff, self.inner, rest, field, scopes)

    ns = {
        "__annotations__": {"inner": info.family},
        "__call__": __call__,
        "__module__": __name__,
        "__doc__": f"{ref.__qualname__} ({info.step}) differentiated chunk by chunk (kdax._runner.chunk_vjp).",
        "math": KDA,
        "tile_safe": getattr(ref, "tile_safe", False),
        "accepts": frozenset(ref.accepts) - {"tokens", "half_stored"},
    }
    # Named as the stage it runs (``plan`` and ``kdax.testing`` report what ran).
    ns["__qualname__"] = ref.__qualname__
    return type(ref.__name__, (info.family,), ns)


def chunk_local(field: str, stage):
    """``stage`` (a forward stage of KDA's math: its family's reference stage) wrapped so
    that its VJP keeps only its inputs and is taken a slice of chunks at a time (F1, F2,
    F3, F5), or rematerialised whole (F4)."""
    return _wrapper(field)(stage)


def unwrapped(stage):
    """The stage inside a ``chunk_local`` wrapper (a cotangent's too); others as they are."""
    return stage.inner if type(stage) is _wrapper_of(stage) else stage


def _wrapper_of(stage):
    for field in STAGES:
        if STAGES[field].forward and isinstance(stage, STAGES[field].family):
            return _wrapper(field)
    return None


@eqx.filter_custom_vjp
def _differentiated(diff, inner, rest, field, scopes):
    return inner(**diff, **rest)


@_differentiated.def_fwd
def _fwd(perturbed, diff, inner, rest, field, scopes):
    out = inner(**diff, **rest)
    # (the backward reads the primal inputs; F2's, its Akk too, which F3 keeps anyway)
    return out, (out.Akk if field == "intra" else None)


@_differentiated.def_bwd
def _bwd(residuals, g, perturbed, diff, inner, rest, field, scopes):
    token = _precision._CURRENT.set(scopes[0])
    try:
        if field == "intra":
            grads = _intra_vjp(diff, rest, g, residuals)
        elif field in CHUNK_LOCAL:
            grads = _sliced_vjp(inner, diff, rest, g)
        else:
            grads = _whole_vjp(inner, diff, rest, g)
    finally:
        _precision._CURRENT.reset(token)
    return {n: (d if perturbed.get(n) is True else None) for n, d in grads.items()}



def _materialised(g, out):
    """The cotangent ``g`` of the output ``out``: zeros where it is None (a symbolic zero),
    each leaf varying over the manual mesh axes its output leaf varies over (inside
    ``shard_map``: sequence parallel)."""
    def like(c, o):
        if o is None:
            return c
        c = jnp.zeros(o.shape, o.dtype) if c is None else c
        missing = tuple(sorted(varying_axes(o) - varying_axes(c)))
        return jax.lax.pcast(c, missing, to="varying") if missing else c

    return jax.tree.map(like, g, out, is_leaf=lambda x: x is None)


def _whole_vjp(inner, diff, rest, g):
    out, vjp = jax.vjp(lambda d: inner(**d, **rest), diff)
    (grads,) = vjp(_materialised(g, out))
    return grads


def _sliced_vjp(inner, diff, rest, g):
    """The VJP of ``inner`` at ``diff`` (``rest`` not differentiated) and output cotangent
    ``g``, a slice of chunks at a time (the module docstring)."""
    lead = next(x for x in diff.values() if x.ndim >= 4)
    R, HV, NC = lead.shape[:3]
    blocks = _chunk_loops.resolve_group(_BLOCKS)
    gc = _slices(NC, max(1, blocks // max(R * HV, 1)))

    def part(x, i):
        ax = _axis(x) if hasattr(x, "ndim") else None
        return x if ax is None else jax.lax.dynamic_slice_in_dim(x, i * gc, gc, ax)

    def slice_vjp(i):
        d_i = jax.tree.map(lambda x: part(x, i), diff)
        r_i = jax.tree.map(lambda x: part(x, i) if eqx.is_array(x) else x, rest)
        out_i, vjp = jax.vjp(lambda d: inner(**d, **r_i), d_i)
        g_i = jax.tree.map(lambda x: None if x is None else part(x, i), g, is_leaf=lambda x: x is None)
        return vjp(_materialised(g_i, out_i))[0]

    if gc == NC:
        return slice_vjp(0)

    def step(i, acc):
        d_i = slice_vjp(i)
        return jax.tree.map(
            lambda a, d: a + d if _axis(a) is None else jax.lax.dynamic_update_slice_in_dim(a, d, i * gc, _axis(a)),
            acc, d_i)

    init = jax.tree.map(jnp.zeros_like, diff)
    return jax.lax.fori_loop(0, NC // gc, step, init)


def _intra_vjp(diff, rest, g, Akk):
    """F2's VJP by its hand-written transpose: ``Akk = (I + L)^-1`` gives
    ``dL = -Akk^T dAkk Akk^T`` (strictly lower: F2 reads nothing else of ``L``), and B4
    (``ReferenceIntraBackward``, the transpose of F2's ``Aqk`` and ``L``) the rest; ``G_lo``
    (the low part of ``G``, F2 reading ``G + G_lo``) gets ``G``'s cotangent, as the six-stage
    backward gives it."""
    g = _materialised(g, IntraOut(Akk, Akk))
    hi = jax.lax.Precision.HIGHEST
    C = Akk.shape[-1]
    lower = jnp.tril(jnp.ones((C, C), bool), -1)
    dL = jnp.where(lower, -jnp.matmul(jnp.matmul(mT(Akk), g.Akk, precision=hi), mT(Akk), precision=hi), 0.0)
    q, k, beta, G = diff["q"], diff["k"], diff["beta"], diff["G"]
    zero = jnp.zeros_like
    grads = ChunkGrads(zero(q), zero(k), zero(k), zero(beta), zero(G), dL.astype(Akk.dtype))
    kw = {n: x for n, x in (("G_lo", diff.get("G_lo")), ("reset", rest.get("reset"))) if x is not None}
    out = ReferenceIntraBackward()(rest["scale"], q, k, beta, G, g.Aqk, grads, **kw)
    d = dict(q=out.dq, k=out.dk, beta=out.dbeta, G=out.dG)
    if "G_lo" in diff:
        d["G_lo"] = out.dG
    return d
