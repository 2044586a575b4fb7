"""Which math each stage computes or transposes, and the routes that follow.

Forward stages declare ``math`` (``kdax.stages.KDA`` or None), backward stages which
forward math they transpose, per field (``transposes``); ``TRANSPOSED_BY`` is fixed by
the algorithm. Where a backward stage does not transpose its forward stage, the
gradient is derived by ``jax.vjp`` through the forward stages instead (exact; KDA-math
stages run as their reference). A route a declaration selects (shared chunks, tiles) is
taken only for stages of KDA's math (``unchecked``). docs/stages.md, §4."""

import contextlib
import dataclasses
import functools
from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import DerivedBackwardError, FallbackWarning, warn_caller
from .._layouts.layout import pack_inputs
from .._numerics import isolation as _isolation
from ..stages import KDA, GateVjpBackward
from .._stage_protocol.capabilities import Capabilities, capabilities
from .contracts import STAGES
from .residuals import KDAGrads
from .stage_grads import as_pipeline_gradient

# Forward field -> the backward fields that transpose (part of) its math.
TRANSPOSED_BY = {
    "gate": ("gate_bwd",),
    "intra": ("intra_bwd",),
    "wy": ("wy_dqkg",),
    "state": ("dhu", "wy_dqkg"),
    "output": ("dav", "dhu", "wy_dqkg"),
}


def _name(pipeline, field: str) -> str:
    return f"{STAGES[field].step} `{field}` ({type(getattr(pipeline, field)).__qualname__})"


def mismatches(pipeline, skip: tuple = ()) -> tuple:
    """One sentence per forward field that a backward stage of ``TRANSPOSED_BY`` does not
    transpose (empty: the six-stage backward is exact); ``skip``: forward fields left out."""
    out = []
    for f, readers in TRANSPOSED_BY.items():
        if f in skip:
            continue
        math = getattr(pipeline, f).math
        off = [b for b in readers if not _is_vjp_of(getattr(pipeline, b), getattr(pipeline, f))
               and (math is None or getattr(pipeline, b).transposes.get(f) != math)]
        if off:
            says = ", ".join(f"{_name(pipeline, b)} transposes {getattr(pipeline, b).transposes.get(f)!r}" for b in off)
            out.append(f"{_name(pipeline, f)} computes math {math!r}, but {says}")
    return tuple(out)


def _is_vjp_of(backward, forward) -> bool:
    """Whether ``backward`` is JAX's VJP of ``forward``'s class, or of its reference when
    ``forward`` is of KDA's math (``GateVjpBackward``): a transpose whatever the math."""
    held = getattr(backward, "vjp_of", None)
    return held is not None and (type(held) is type(forward) or (is_kda(forward) and is_kda(held)))


class BackwardRoute(NamedTuple):
    """How ``chunk_kda``'s gradient is formed: by ``jax.vjp`` through F1-F5 (``derived``), or
    the six-stage backward, F5's transpose derived (``output_vjp``: kdax._runner.output_vjp,
    one device) and B5 as F1's VJP where it does not transpose F1 (``gate_vjp``)."""

    derived: bool
    output_vjp: bool
    gate_vjp: bool


def backward_route(pipeline, one_device: bool = True) -> BackwardRoute:
    """The ``BackwardRoute`` of ``pipeline`` (``one_device``: F5's transpose may be derived)."""
    gate = bool(mismatches(pipeline, skip=tuple(f for f in TRANSPOSED_BY if f != "gate")))
    output = one_device and output_alone_differs(pipeline)
    derived = bool(mismatches(pipeline, skip=("gate",))) and not output
    return BackwardRoute(derived, output, gate and not derived)


def output_alone_differs(pipeline) -> bool:
    """Whether F5's transpose alone is missing (F1's perhaps too) as ``output_vjp`` derives it:
    F5 not KDA's, F3 KDA's, B2 and B3 transposing KDA's F5, every other forward stage transposed."""
    return (pipeline.output.math != KDA and is_kda(pipeline.wy) and bool(mismatches(pipeline))
            and not mismatches(pipeline, skip=("gate", "output"))
            and all(getattr(pipeline, b).transposes.get("output") == KDA for b in ("dhu", "wy_dqkg")))


def gate_vjp_pipeline(pipeline, res, inputs):
    """``pipeline`` with B5 the VJP of its F1 (as the reference F1 where it is KDA's) at the
    forward's chunked raw ``inputs`` (q, k, v, g, beta, cleaned)."""
    qc, kc, _, gc, bc = pack_inputs(res.layout, tuple(inputs[:5]), res.v.shape[1], res.h0.dtype)
    gate = STAGES["gate"].reference() if is_kda(pipeline.gate) else pipeline.gate
    return dataclasses.replace(pipeline, gate_bwd=GateVjpBackward(gate, qc, kc, gc, bc))


def is_kda(stage) -> bool:
    """Whether ``stage`` declares its family's own formula (``math == KDA``)."""
    return getattr(stage, "math", None) == KDA


def reference_is_exact(field: str, stage) -> bool:
    """Whether falling back to ``field``'s reference stage changes no number: a forward stage
    of KDA's math, a backward stage transposing KDA's math everywhere, or B0."""
    if STAGES[field].forward:
        return is_kda(stage)
    if field == "recompute":
        return True
    says = getattr(stage, "transposes", {})
    return all(says.get(f) == KDA for f, readers in TRANSPOSED_BY.items() if field in readers)


def unchecked(pipeline, fields=None, trusted: bool = True) -> tuple:
    """The fields (default: all) whose stage's math is not checked against the reference
    (not ``reference_is_exact``). The one rule of routes: a route a declaration selects is
    taken only when no stage it reaches is here, so a false declaration changes no number.
    None with ``trust_declarations`` (when ``trusted``)."""
    if trusted and pipeline.trust_declarations:
        return ()
    return tuple(f for f in (STAGES if fields is None else fields) if not reference_is_exact(f, getattr(pipeline, f)))


def routed(pipeline, field: str) -> Capabilities:
    """The stage's capabilities, less ``reset`` and ``tile_safe`` unless its math is checked."""
    stage = getattr(pipeline, field)
    caps = capabilities(type(stage))
    if pipeline.trust_declarations or reference_is_exact(field, stage):
        return caps
    return caps._replace(reset=False, tile_safe=False)


@functools.cache
def warn_once(message: str) -> None:
    """A ``FallbackWarning`` once per message (the stage runner's fallbacks, ``warn_derived``),
    at the user's line that called into kdax (eager or traced, the frames between differ)."""
    warn_caller(message, FallbackWarning)


def warn_derived(pipeline) -> None:
    """The ``FallbackWarning`` that the gradient is derived (once per set of reasons)."""
    warn_once(_derived_warning(pipeline))


def _derived_warning(pipeline) -> str:
    reasons = mismatches(pipeline)
    return ("KDAPipeline: the backward stages are not the transposes of the forward stages ("
            + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
            + "), so chunk_kda's gradient is derived from the forward stages by jax.vjp (exact, slower than the "
            "six-stage backward). To keep the hand-written backward, give backward stages that transpose your forward "
            "stages and declare it (`math` on the forward stage, `transposes` on the backward ones: docs/stages.md).")


def differentiable_forward(pipeline):
    """``(pipeline untiled with each KDA-math forward stage as its reference, swapped
    fields)``: differentiable by JAX; the reference stages' chunk loops carry their own VJPs."""
    swaps = {n: i.reference() for n, i in STAGES.items()
             if i.forward and is_kda(getattr(pipeline, n)) and type(getattr(pipeline, n)) is not i.reference}
    return dataclasses.replace(pipeline, tile=None, **swaps), tuple(swaps)


def derived_vjp(pipeline, run, inputs):
    """``(outputs, vjp, swapped)`` of ``run(inputs, pipeline'')`` (``differentiable_forward``);
    ``DerivedBackwardError`` when JAX cannot differentiate a forward stage."""
    warn_once(_derived_warning(pipeline))
    diff_pipe, swapped = differentiable_forward(pipeline)
    with derivable(pipeline):
        out, vjp = eqx.filter_vjp(run, inputs, diff_pipe)
    return out, vjp, swapped


@contextlib.contextmanager
def derivable(pipeline, fields=None):
    """JAX failing to differentiate a forward stage (of ``fields``) becomes a ``DerivedBackwardError``."""
    try:
        yield
    except (ValueError, NotImplementedError, TypeError) as e:
        if not is_autodiff_failure(e):
            raise
        custom = fields or [f for f, info in STAGES.items() if info.forward and not is_kda(getattr(pipeline, f))]
        names = ", ".join(_name(pipeline, f) for f in custom) or "a forward stage"
        raise DerivedBackwardError(
            f"KDAPipeline: the backward stages do not transpose the forward stages ({mismatches(pipeline)[0]}), so "
            f"the gradient must be derived by jax.vjp through the forward stages, and JAX cannot differentiate "
            f"{names} ({e}). Pass backward stages that transpose it and declare so (`math` on the forward stage, "
            f"`transposes` on the backward stages of TRANSPOSED_BY: docs/stages.md), or write the stage in "
            f"differentiable jnp."
        ) from e


class DerivedResiduals(eqx.Module):
    """The derived backward's residuals: the forward's VJP, the swapped fields, the outputs' shapes."""

    vjp: object
    swapped: tuple = eqx.field(static=True)
    o: jax.ShapeDtypeStruct = eqx.field(static=True)
    final: jax.ShapeDtypeStruct = eqx.field(static=True)
    num_qk_heads: int = eqx.field(static=True)

    @classmethod
    def of(cls, vjp, swapped, o, final, num_qk_heads: int) -> "DerivedResiduals":
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        return cls(vjp, swapped, shape(o), shape(final), num_qk_heads)


def derived_gradients(res: DerivedResiduals, where, do, dht, cu_seqlens, axis=None) -> tuple:
    """``(input gradients (q, k, v, g, beta, h0, A_log, dt_bias), d_pipeline)`` at the cleaned cotangents
    (None: zeros), NaN where isolation puts it, as the six-stage backward (``axis``: clean_cotangents')."""
    zeros_if_none = lambda x, like: jnp.zeros(like.shape, like.dtype) if x is None else x  # (symbolic zeros)
    do, poison = _isolation.clean_cotangents(zeros_if_none(do, res.o), dht, cu_seqlens, res.num_qk_heads, axis)
    dht = _isolation.finite_or_zero(zeros_if_none(dht, res.final))
    d_inputs, d_pipe = res.vjp((do, dht))
    grads = _isolation.poison_inputs(where, poison(KDAGrads(*d_inputs)))  # (KDAGrads' fields: in this order)
    return tuple(getattr(grads, f.name) for f in dataclasses.fields(grads)), d_pipe


def is_autodiff_failure(e: Exception) -> bool:
    """Whether ``e`` is JAX saying it cannot differentiate something (by its message)."""
    return any(s in str(e) for s in ("reverse-mode", "Differentiation rule", "not implemented for",
                                     "Linearization failed", "transpose rule", "JVP"))


def pipeline_cotangent(perturbed, d_pipe, swapped: tuple):
    """The caller's pipeline gradient from the differentiated one (None for swapped fields)."""
    return as_pipeline_gradient(perturbed, {n: getattr(d_pipe, n) for n in STAGES if n not in swapped})


# The stages that receive the shared layout's reset table (F5 and B1 act per chunk on
# what the others made exact).
RESET_FIELDS = ("gate", "intra", "wy", "state", "recompute", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")
# The stages passed ``reset`` when they declare it: those and F5 (optional there, for overflow).
RESET_DECLARABLE = RESET_FIELDS + ("output",)


def other_math(pipeline, field: str, trusted: bool = True) -> Optional[str]:
    """``field``'s stage as other math than KDA's (in ``unchecked``), said; None if it is not."""
    if not unchecked(pipeline, (field,), trusted):
        return None
    stage = getattr(pipeline, field)
    what = f"math {stage.math!r}" if STAGES[field].forward else f"transposes {dict(stage.transposes)!r}"
    return f"{STAGES[field].step} {field} ({type(stage).__qualname__}): {what}, not KDA's"


def shared_chunks_refused(pipeline) -> Optional[str]:
    """Why packed input keeps one sequence per chunk (None: sequences share chunks):
    ``share_chunks=False``, a stage of other math, or a ``RESET_FIELDS`` stage that takes
    no ``reset`` and cannot fall back. F5 and B1, never told ``reset``, are KDA's even when
    trusting declarations (``output_vjp`` assumes no reset table)."""
    if not pipeline.share_chunks:
        return "share_chunks=False"
    other = unchecked(pipeline) or unchecked(pipeline, ("output", "dav"), trusted=False)
    if other or not is_kda(pipeline.state):
        said = other_math(pipeline, other[0] if other else "state", trusted=False)
        return f"{said}: shared chunks are taken only for KDA's math"
    for n in RESET_FIELDS:
        if not (routed(pipeline, n).reset or (pipeline.fallback and reference_is_exact(n, getattr(pipeline, n)))):
            return f"{STAGES[n].step} {n} ({type(getattr(pipeline, n)).__qualname__}) does not accept reset" + (
                "" if pipeline.fallback else " (and fallback=False)")
    return None


def shares_chunks(pipeline, cu_seqlens) -> bool:
    """Whether packed ``cu_seqlens`` input runs in shared chunks (``shared_chunks_refused``)."""
    return cu_seqlens is not None and shared_chunks_refused(pipeline) is None


def unsafe_for_tiles(pipeline) -> tuple:
    """The forward fields not tile-safe by ``routed``: with any, the forward runs whole."""
    return tuple(n for n, i in STAGES.items() if i.forward and not routed(pipeline, n).tile_safe)


def tiles_refused(pipeline) -> Optional[str]:
    """Why the forward without gradients runs whole though ``tile`` is set (None: in tiles)."""
    unsafe = unsafe_for_tiles(pipeline)
    if pipeline.tile is None or not unsafe:
        return None
    f = unsafe[0]  # (other math is the reason, even where the stage also declares tile_safe)
    other = other_math(pipeline, f)
    return (f"{other}: a stage of other math runs whole, whatever it declares" if other
            else f"not tile-safe: {f} ({type(getattr(pipeline, f)).__qualname__} does not declare tile_safe)")


def tile_chunks(pipeline, rows_heads: int, num_chunks: int) -> Optional[int]:
    """Chunks per forward tile (``tile`` blocks of (row, head, chunk)), or None: whole."""
    if pipeline.tile is None or unsafe_for_tiles(pipeline):
        return None
    n = max(1, pipeline.tile // max(rows_heads, 1))
    return None if n >= num_chunks else n


def check_transposes(pipeline) -> None:
    """``DerivedBackwardError`` unless the backward stages transpose the forward stages."""
    why = mismatches(pipeline)
    if why:
        raise DerivedBackwardError(
            f"KDAPipeline.backward: the backward stages are not the transposes of the forward stages ({why[0]}"
            f"{'; ...' if len(why) > 1 else ''}), so the six-stage backward would give another algorithm's "
            f"gradients. Differentiate chunk_kda (jax.grad / jax.vjp), which derives the backward from the forward "
            f"stages, or pass backward stages that transpose them and declare so (`math`, `transposes`: "
            f"docs/stages.md)."
        )
