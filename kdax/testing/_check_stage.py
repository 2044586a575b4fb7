"""``check_stage``, the entry point: one stage, as the implementation of a pipeline field, on
the arguments a pipeline gives that field over a matrix of cases (the rows of each case:
``_case_checks``; of each declared capability: ``_capabilities``)."""

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import equinox as eqx

from .._annotations import typecheck
from .._runner import routes as _routes
from .._runner.contracts import STAGES
from .._runner.routes import RESET_DECLARABLE
from .._stage_protocol.capabilities import capabilities
from ..pipeline import KDAPipeline
from ._capabilities import _capabilities_ahead, _capability_checks, _G_lo_check, _tokens_check
from ._case_checks import _case_checks, _cases_ahead, _stage_runs_ahead, _strong_grad_checks, _transform_checks
from ._cases import DTYPES, Case, check_dtypes, default_cases, holds_no_array
from ._report import Report, _Collector, _error
from ._runs import _base, release_near_the_mapping_limit


@typecheck
def check_stage(
    stage: eqx.Module,
    field: str,
    *,
    dtypes: Sequence[Any] = DTYPES,
    base: Optional[KDAPipeline] = None,
    full: bool = False,
    cases: Optional[Sequence[Case]] = None,
) -> Report:
    """Check ``stage`` as the implementation of pipeline field ``field`` (``"gate"``, ...,
    ``"gate_bwd"``).

    The arguments come from a forward and backward of ``base`` (the reference pipeline by
    default; pass the pipeline the stage belongs with when it transposes another forward
    stage's math), as ``kdax.stage_inputs`` gives them, negotiated for ``stage`` as the
    pipeline's stage runner does (``G_lo``, ``reset``), over ``cases`` (default
    ``default_cases(dtypes, full)``: every dtype; packed per-sequence and shared chunks;
    initial states; ``scale`` other than the default with K != V; the softplus gate with
    ``A_log``/``dt_bias`` and ``allow_neg_eigval``; the lower-bound gate with and without
    ``A_log``; chunk 64; T <= C; tiles of each; shared chunks only when the stage declares
    ``reset``; three value heads, not two, when the stage holds no array). Checks, one
    report row per check and case:

    * ``family``, ``declarations``: the class, ``accepts``, ``math`` / ``transposes``;
    * ``contract``: the output's container, shapes and dtypes (the pipeline's own check);
      a stage that raises ``UnsupportedCase`` is skipped there when it declares KDA's math
      (a pipeline with ``fallback`` runs the reference stage), and fails otherwise (no
      pipeline falls back for other math: ``chunk_kda`` raises);
    * ``finite``: finite outputs;
    * ``reference`` (a stage declaring KDA's math: ``math = KDA``; backward stages
      ``transposes`` KDA; B0 always): its outputs equal the reference stage's on the same
      arguments (``tolerance``: 1e-10 float64, 1e-5 float32, 5e-3 bf16 inputs), also on
      shared chunks without F1's floor (``shared-exact``: each stage's reset exact on its
      own) and, for a forward stage declaring ``tile_safe``, on a tile of each case (a
      carried state): the routes the pipeline takes on these declarations are KDA problems.
      A B5 whose ``transposes["gate"]`` is the math of ``base``'s F1 (not KDA's) is
      compared with ``jax.vjp`` of that F1 at its recorded arguments (``GateVjpBackward``).
      Any other stage of other math gets a ``reference`` row per case that says "not
      compared" (``Report.not_compared``): nothing compares its values with a formula;
    * ``nan-isolation``, ``isolation``: each sequence in turn, its part of each per-token,
      per-chunk and per-sequence argument NaN, then negated and scaled by 1e4, reaches no other sequence's
      outputs (dense rows; packed per-sequence chunks);
    * ``nan-reach`` (a stage of KDA's math; shared chunks too): each sequence's part of all
      those arguments NaN at once is non-finite in every token row of its outputs where the
      reference stage's is (non-finite values read as numbers fail); ``overflow`` (B3 of
      KDA's math): a row of ``dw = -dv_new h^T`` that overflows from finite operands is
      non-finite in the rows it reaches where the reference stage's is; ``causal`` (a stage
      of KDA's math; dense, packed): each sequence's tokens from its middle one on, less one
      in every per-token argument, leave every entry the reference stage's leaves, to the
      bit;
    * ``jit``, ``filter_jit``, ``vmap`` (two cases' arguments stacked), ``grad`` (forward
      stages; skipped where JAX cannot differentiate it): finite, and for a stage of other
      math in float64 (a derived backward runs its JAX derivative) against central
      differences;
    * declared capabilities, in pipelines that take the routes they select whatever the
      stage's math (``KDAPipeline.trust_declarations``): ``reset`` (shared chunks give the
      per-sequence layout's outputs and gradients, with F1's floor and without),
      ``tile_safe`` (tiles of one chunk give the whole forward's outputs), ``G_lo`` (float32: with G_lo no farther from the stage's own
      float64 output than without), ``tokens`` (views give the chunked copies' outputs),
      ``half_stored`` (under ``"fast"``, bf16 stored intermediates give what their float32
      copies give).

    ``dtypes`` are of ``DTYPES`` (float64, float32, bfloat16, float16). Float64 in
    ``dtypes`` (the default) or in ``cases`` needs JAX's 64-bit mode
    (``jax.config.update("jax_enable_x64", True)``); without it a ``ValueError`` says so
    before anything runs. With float32 first, the ``G_lo`` row needs it too (a skip).

    ``Report.ok`` means no check failed. For a stage of KDA's math that includes its
    values against the reference stage on every case (a B5 of other math in its F1's
    pipeline: against that F1's VJP); for another stage of other math it does not (its
    ``reference`` rows say "not compared", and the report's header says so).

    Each check compiles programs for its stage, which JAX keeps; once the process holds
    60% of the kernel's limit on memory mappings (Linux), a check first drops every
    compiled program (``jax.clear_caches()``), so that checks in a loop do not end the
    process in a compile.
    """
    if field not in STAGES:
        raise ValueError(f"field: expected one of {tuple(STAGES)}, got {field!r}.")
    # (given cases, only dtypes[0] is used: the capabilities' checks run in it)
    check_dtypes(dtypes if cases is None else tuple(dtypes)[:1], "dtypes", "check_stage")
    if cases is not None:
        if not cases:  # (a report of no case would compare nothing and say ok)
            raise ValueError("cases: check_stage expected at least one Case (None: default_cases(dtypes, full)).")
        check_dtypes([c.dtype for c in cases], "cases", "check_stage")
    release_near_the_mapping_limit()  # (checks in a loop: each compiles programs JAX keeps)
    col = _Collector()
    subject = f"check_stage({type(stage).__qualname__}, {field!r}: {STAGES[field].step})"
    caps = _declarations(col, stage, field)
    if caps is None:
        return Report(subject, col.rows)
    cache_ok = base is None  # (the reference pipeline's recorded arguments are kept across reports)
    base = _base(base)
    if cases is None:
        cases = default_cases(dtypes, full, shared=caps.reset and field in RESET_DECLARABLE, heads=holds_no_array(stage))
    # (every program the cases and capabilities need, traced first and compiled meanwhile)
    _cases_ahead(base, field, cases, cache_ok)
    _capabilities_ahead(base, field, stage, caps, dtypes[0], full)
    _stage_runs_ahead(base, field, stage, caps, cases, cache_ok)
    results = {}
    for case in cases:
        got = _case_checks(col, base, field, stage, caps, case, cache_ok, dtypes[0])
        if got is not None:
            results[case.name] = got
    # transformations, on the first dense case
    first = next((c for c in cases if c.name.startswith("dense") and c.name in results), None)
    if first is not None:
        _transform_checks(col, base, field, stage, first, results[first.name], cache_ok)
    _strong_grad_checks(col, field, stage, cases, results, first)
    _capability_checks(col, base, field, stage, caps, dtypes[0], full)
    if caps.G_lo:  # float32 with strong gates, against the stage's own float64 output
        _G_lo_check(col, base, field, stage, cases, results, cache_ok)
    if caps.tokens:  # views of the caller's arrays, in a pipeline with the stage
        _tokens_check(col, base, field, stage, dtypes[0])
    return Report(subject, col.rows, {c.name: c.describe() for c in cases if hasattr(c, "describe")})


# The arguments a pipeline passes only to a stage that declares them (its signature is not read).
_DECLARED_BY = {"G_lo": "G_lo", "reset": "reset", "final": "final_grads", "zero_h0": "zero_h0",
                "dh_start": "dh_start", "precision": "precision"}


def _declarations(col, stage, field):
    """``family`` and ``declarations`` rows; the stage's capabilities, or None when it is
    no implementation of the field's family or its declarations cannot be read."""
    info = STAGES[field]
    if not col.add("family", "-", isinstance(stage, info.family),
                   f"{type(stage).__qualname__} implements {info.family.__name__}"
                   if isinstance(stage, info.family) else f"not an implementation of {info.family.__name__}"):
        return None
    try:
        caps = capabilities(type(stage))
        says = (f"math={stage.math!r}" if info.forward else f"transposes={dict(getattr(stage, 'transposes', {}))}")
        decl = f"accepts {sorted(n for n in caps._fields if getattr(caps, n))}; {says}"
        readers = [f for f, bs in _routes.TRANSPOSED_BY.items() if field in bs]
        extra = [] if info.forward else [f for f in getattr(stage, "transposes", {}) if f not in readers]
        # A parameter the pipeline passes only when declared, taken but not declared: never passed.
        params = inspect.signature(type(stage).__call__).parameters
        unsaid = [p for p, c in _DECLARED_BY.items() if p in params and not getattr(caps, c)]
        col.add("declarations", "-", not extra and not unsaid, decl + (
            f"; transposes fields it does not read: {extra} (it reads {readers})" if extra else "") + (
            f"; its __call__ takes {unsaid} but accepts does not declare {[_DECLARED_BY[p] for p in unsaid]}: the "
            f"pipeline never passes them (docs/stages.md, capabilities)" if unsaid else ""))
    except Exception as e:
        col.add("declarations", "-", False, _error(e))
        return None
    return caps
