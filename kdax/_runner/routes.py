"""The backward follows the forward: whether a pipeline's hand-written backward stages
are the transposes of its forward stages, and, where they are not, the backward derived
from the forward stages themselves.

Every forward stage declares the formula it computes (``math``: ``kdax.stages.KDA`` for
its family's own, None for anything else) and every backward stage which forward math it
is the transpose of, per forward field (``transposes``). Which backward stages transpose
which forward stage is fixed by the algorithm (``TRANSPOSED_BY``; docs/stages.md, "Which
backward stage reads what"): ``do`` enters B1, B2 and B3, so all three transpose F5. When a
forward stage's math is not what each of its backward stages says it transposes (a user's
F5 computing ``c o``, say, beside the reference B1-B3), the six-stage backward would
return the original algorithm's gradients; ``chunk_kda``'s VJP then differentiates the
forward stages with ``jax.vjp`` instead (exact by construction), says so once
(``FallbackWarning``) and in ``plan``. Forward stages that declare KDA's math are
differentiated as their family's reference stage (a Pallas kernel has no JAX derivative);
a forward stage of other math that JAX cannot differentiate is a ``DerivedBackwardError``
at trace time, naming the stage and what to pass.
"""

import contextlib
import dataclasses
import functools
import warnings
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from .._errors import DerivedBackwardError, FallbackWarning
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


def mismatches(pipeline, skip_gate: bool = False, skip: tuple = ()) -> tuple:
    """Why ``pipeline``'s backward stages are not the transposes of its forward stages:
    one sentence per forward stage that some backward stage of ``TRANSPOSED_BY`` does not
    transpose; empty when the hand-written backward is exact. ``skip_gate``: leave F1 and
    its transpose B5 out; ``skip``: these forward fields too."""
    out = []
    for f, readers in TRANSPOSED_BY.items():
        if (skip_gate and f == "gate") or f in skip:
            continue
        math = getattr(pipeline, f).math
        off = [b for b in readers if not _is_vjp_of(getattr(pipeline, b), getattr(pipeline, f))
               and (math is None or getattr(pipeline, b).transposes.get(f) != math)]
        if off:
            says = ", ".join(f"{_name(pipeline, b)} transposes {getattr(pipeline, b).transposes.get(f)!r}" for b in off)
            out.append(f"{_name(pipeline, f)} computes math {math!r}, but {says}")
    return tuple(out)


def _is_vjp_of(backward, forward) -> bool:
    """Whether backward stage ``backward`` is JAX's VJP of (a stage of the class of)
    ``forward``, or of its reference stage when ``forward`` declares KDA's math
    (``kdax.stages.GateVjpBackward``): its transpose whatever the math."""
    held = getattr(backward, "vjp_of", None)
    return held is not None and (type(held) is type(forward) or (is_kda(forward) and is_kda(held)))


def whole_derived(pipeline) -> bool:
    """Whether the backward is derived whole by ``jax.vjp`` through F1-F5: the backward
    stages miss a transpose other than F1's (F1's alone: B5 is F1's VJP, B0-B4 hand-written)."""
    return bool(mismatches(pipeline)) and not gate_alone_differs(pipeline)


def output_alone_differs(pipeline) -> bool:
    """Whether ``pipeline``'s backward misses F5's transpose (F1's perhaps too) in the way
    ``kdax._runner.output_vjp`` derives exactly: F5's math is not KDA's, F3's is, B2 and B3
    transpose KDA's F5, and every other forward stage is transposed (B5 excepted: then
    F1's VJP, ``gate_vjp_pipeline``). B0 and B2-B5 stay hand-written, F5's transpose is
    ``jax.vjp`` of F5. (One device; sequence parallel derives the backward whole.)"""
    if pipeline.output.math == KDA or not is_kda(pipeline.wy) or not mismatches(pipeline):
        return False
    if mismatches(pipeline, skip=("gate", "output")):
        return False
    return all(getattr(pipeline, b).transposes.get("output") == KDA for b in ("dhu", "wy_dqkg"))


def gate_differs(pipeline) -> bool:
    """Whether B5 does not transpose ``pipeline``'s F1 (B5 is then F1's VJP when the rest
    of the backward is hand-written: ``gate_vjp_pipeline``)."""
    return bool(mismatches(pipeline, skip=tuple(f for f in TRANSPOSED_BY if f != "gate")))


def gate_alone_differs(pipeline) -> bool:
    """Whether ``pipeline``'s backward misses only F1's transpose (B5 does not transpose its
    F1, every other backward stage transposes its forward stages): then B5 alone is
    derived, by ``jax.vjp`` of F1 (``gate_vjp_pipeline``), and B0-B4 stay hand-written."""
    return bool(mismatches(pipeline)) and not mismatches(pipeline, skip_gate=True)


def gate_vjp_pipeline(pipeline, res, inputs):
    """``pipeline`` with B5 the VJP of its F1 (``kdax.stages.GateVjpBackward``) at the
    forward's chunked raw inputs (``inputs``: the raw, cleaned ``q, k, v, g, beta``; ``res``
    the forward's residuals). An F1 declaring KDA's math is differentiated as the
    reference F1 (a Pallas kernel has no JAX derivative)."""
    qc, kc, _, gc, bc = pack_inputs(res.layout, tuple(inputs[:5]), res.v.shape[1], res.h0.dtype)
    gate = STAGES["gate"].reference() if is_kda(pipeline.gate) else pipeline.gate
    return dataclasses.replace(pipeline, gate_bwd=GateVjpBackward(gate, qc, kc, gc, bc))


def is_kda(stage) -> bool:
    """Whether ``stage`` declares its family's own formula (what the reference stage computes)."""
    return getattr(stage, "math", None) == KDA


def reference_is_exact(field: str, stage) -> bool:
    """Whether the reference stage of ``field``'s family computes what ``stage`` does (so
    that falling back to it on ``UnsupportedCase`` changes no number): a forward stage of
    KDA's math, a backward stage transposing KDA's math of every field it transposes, B0
    (it re-runs the pipeline's own F3 and F4)."""
    if STAGES[field].forward:
        return is_kda(stage)
    if field == "recompute":
        return True
    says = getattr(stage, "transposes", {})
    return all(says.get(f) == KDA for f, readers in TRANSPOSED_BY.items() if field in readers)


def unchecked(pipeline, fields=None) -> tuple:
    """The fields (of ``fields``, default every stage) whose stage's math is not checked
    against the reference stage (not ``reference_is_exact``: ``check_stage``'s reference
    check does not cover it). The one rule of routes: a route that a declaration selects
    (shared chunks, ``reset``, tiles) is taken only when no stage it reaches is here, so
    that a false declaration changes no number (docs/stages.md, "Capabilities"). A tile
    is a KDA problem with an initial state and a shared chunk KDA with exact resets: a
    KDA stage wrong there is wrong KDA, which the reference check reports. A pipeline
    with ``trust_declarations`` (``kdax.testing`` checking a declaration) has none."""
    if pipeline.trust_declarations:
        return ()
    fields = tuple(STAGES) if fields is None else fields
    return tuple(f for f in fields if not reference_is_exact(f, getattr(pipeline, f)))


def routed(pipeline, field: str) -> Capabilities:
    """The capabilities of ``pipeline``'s stage in ``field`` that select a route: its
    declaration, less ``reset`` and ``tile_safe`` unless its math is checked (``unchecked``)."""
    stage = getattr(pipeline, field)
    caps = capabilities(type(stage))
    if pipeline.trust_declarations or reference_is_exact(field, stage):
        return caps
    return caps._replace(reset=False, tile_safe=False)


@functools.cache
def _warn_once(reasons: tuple) -> None:
    warnings.warn(
        "KDAPipeline: the backward stages are not the transposes of the forward stages ("
        + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
        + "), so chunk_kda's gradient is derived from the forward stages by jax.vjp (exact, slower than the "
        "six-stage backward). To keep the hand-written backward, give backward stages that transpose your forward "
        "stages and declare it (`math` on the forward stage, `transposes` on the backward ones: docs/stages.md).",
        FallbackWarning, stacklevel=5,
    )


def warn_derived(pipeline) -> None:
    """The ``FallbackWarning`` that the gradient is derived (once per set of reasons)."""
    _warn_once(mismatches(pipeline))


def differentiable_forward(pipeline):
    """``(pipeline'', swapped fields)``: ``pipeline`` untiled, each forward stage that
    declares KDA's math run as its family's reference stage (same math, differentiable by
    JAX; swapped: the fields whose stage was not that reference stage); the other stages
    kept, and differentiated as they are. The reference stages' VJPs are chunk-local:
    their chunk loops carry their own (``kdax._numerics.chunk_loops.over_chunks``,
    ``kdax.stages._state``'s recurrence), each group or chunk rematerialised."""
    swaps, swapped = {}, []
    for name, info in STAGES.items():
        stage = getattr(pipeline, name)
        if info.forward and is_kda(stage) and type(stage) is not info.reference:
            swapped.append(name)
            swaps[name] = info.reference()
    return dataclasses.replace(pipeline, tile=None, **swaps), tuple(swapped)


def derived_vjp(pipeline, run, inputs):
    """``(outputs, vjp, swapped)``: ``run(inputs, pipeline'')`` through the forward
    stages (``differentiable_forward``), ``vjp(cotangents) -> (d_inputs, d_pipeline'')``
    (``pipeline_cotangent`` maps the latter onto the caller's pipeline) and the swapped
    fields. Raises ``DerivedBackwardError`` when JAX cannot differentiate a forward
    stage."""
    reasons = mismatches(pipeline)
    _warn_once(reasons)
    diff_pipe, swapped = differentiable_forward(pipeline)
    with derivable(pipeline):
        out, vjp = eqx.filter_vjp(run, inputs, diff_pipe)
    return out, vjp, swapped


@contextlib.contextmanager
def derivable(pipeline, fields=None):
    """Inside the block, JAX failing to differentiate a forward stage of ``pipeline`` (of
    ``fields``, default those not of KDA's math) is a ``DerivedBackwardError`` naming them
    and what to pass."""
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
    """The residuals of the derived backward (one device or a device's part of sequence
    parallel): the forward's VJP, the swapped fields, and what the cotangents need (the
    primal outputs' shapes, the q/k heads)."""

    vjp: object
    swapped: tuple = eqx.field(static=True)
    o: jax.ShapeDtypeStruct = eqx.field(static=True)
    final: jax.ShapeDtypeStruct = eqx.field(static=True)
    num_qk_heads: int = eqx.field(static=True)

    @classmethod
    def of(cls, vjp, swapped, o, final, num_qk_heads: int) -> "DerivedResiduals":
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        return cls(vjp, swapped, shape(o), shape(final), num_qk_heads)


def derived_gradients(res: DerivedResiduals, where, do, dht, cu_seqlens) -> tuple:
    """``(input gradients (q, k, v, g, beta, h0, A_log, dt_bias), d_pipeline)``: the
    forward's VJP at the cleaned cotangents (``do``, ``dht`` or None: symbolic zeros), NaN
    put where the recurrence's gradients have it, as the six-stage backward does
    (``kdax._numerics.isolation``)."""
    zeros_if_none = lambda x, like: jnp.zeros(like.shape, like.dtype) if x is None else x  # (symbolic zeros)
    do, poison = _isolation.clean_cotangents(zeros_if_none(do, res.o), dht, cu_seqlens, res.num_qk_heads)
    dht = _isolation.finite_or_zero(zeros_if_none(dht, res.final))
    d_inputs, d_pipe = res.vjp((do, dht))
    q, k, v, g, beta, h0, A_log, dt_bias = d_inputs
    grads = KDAGrads(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias)
    grads = _isolation.poison_inputs(where, poison(grads))
    out = (grads.q, grads.k, grads.v, grads.g, grads.beta, grads.initial_state, grads.A_log, grads.dt_bias)
    return out, d_pipe


def is_autodiff_failure(e: Exception) -> bool:
    """Whether ``e`` is JAX saying it cannot differentiate something (a Pallas kernel, a
    loop of dynamic length): by its message, JAX raising plain exception types."""
    text = str(e)
    return any(s in text for s in ("reverse-mode", "Differentiation rule", "not implemented for",
                                   "Linearization failed", "transpose rule", "JVP"))


def pipeline_cotangent(perturbed, d_pipe, swapped: tuple):
    """The gradients of the caller's pipeline arrays (``perturbed``: its flags) from
    ``d_pipe`` (the differentiated pipeline's): None for swapped fields and every leaf not
    perturbed."""
    return as_pipeline_gradient(perturbed, {n: getattr(d_pipe, n) for n in STAGES if n not in swapped})


# The stages that receive the shared layout's reset table (F5 and B1 act per chunk on
# what the others made exact).
RESET_FIELDS = ("gate", "intra", "wy", "state", "recompute", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


def shares_chunks(pipeline, cu_seqlens) -> bool:
    """Whether ``pipeline`` can pack the sequences of ``cu_seqlens`` into shared chunks
    (``share_chunks``), by the one rule (``unchecked``): packed varlen input, every stage
    of KDA's math (the shared chunks' final states are F4's math computed around the
    stages, ``kdax._layouts.shared_states``), and the stages of ``RESET_FIELDS`` accepting
    ``reset`` (or ``fallback`` to the reference ones). Whether initial states may enter
    them is the forward's route to decide (``kdax._runner.forward``)."""
    if not pipeline.share_chunks or cu_seqlens is None:
        return False
    if not is_kda(pipeline.state) or unchecked(pipeline):
        return False
    return all(routed(pipeline, n).reset
               or (pipeline.fallback and reference_is_exact(n, getattr(pipeline, n))) for n in RESET_FIELDS)


def unsafe_for_tiles(pipeline) -> tuple:
    """The forward stages of ``pipeline`` that are not tile-safe by the one rule of routes
    (``routed``): their class does not declare ``tile_safe``, or their math is not KDA's.
    With any, the forward runs whole (untiled)."""
    return tuple(n for n, i in STAGES.items() if i.forward and not routed(pipeline, n).tile_safe)


def tile_chunks(pipeline, rows_heads: int, num_chunks: int) -> Optional[int]:
    """Chunks per forward tile of ``pipeline`` (its ``tile``: about that many (row, head,
    chunk) blocks), or None to run each stage once over everything."""
    if pipeline.tile is None or unsafe_for_tiles(pipeline):
        return None
    n = max(1, pipeline.tile // max(rows_heads, 1))
    return None if n >= num_chunks else n


def check_transposes(pipeline) -> None:
    """``DerivedBackwardError`` unless ``pipeline``'s backward stages transpose its forward
    stages (``mismatches``): what ``KDAPipeline.backward`` runs only when exact."""
    why = mismatches(pipeline)
    if why:
        raise DerivedBackwardError(
            f"KDAPipeline.backward: the backward stages are not the transposes of the forward stages ({why[0]}"
            f"{'; ...' if len(why) > 1 else ''}), so the six-stage backward would give another algorithm's "
            f"gradients. Differentiate chunk_kda (jax.grad / jax.vjp), which derives the backward from the forward "
            f"stages, or pass backward stages that transpose them and declare so (`math`, `transposes`: "
            f"docs/stages.md)."
        )
