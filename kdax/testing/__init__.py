"""Conformance checks for stage authors (docs/stages.md, "Checking a stage").

``check_stage(stage, field)`` runs one stage on the arguments a pipeline gives its field
(recorded from a forward and backward of ``base``, the reference pipeline by default, over
a matrix of cases that reaches every argument and option a stage receives: dense, packed
per-sequence and shared-chunk layouts, float64 / float32 / bf16 / f16 inputs, initial
states, a scale other than the default with K != V, grouped value heads (three of them
where the stage holds no array, two elsewhere), the softplus
gate with ``allow_neg_eigval``, the lower-bound gate with and without ``A_log``, chunk 64,
T <= C, tiles: ``default_cases``) and checks what the stage says
of itself: its output contract, every capability it declares, isolation between
sequences (NaN and other values), ``jax.jit`` / ``eqx.filter_jit`` / ``vmap`` / ``grad``, and, when it declares
KDA's math (``math = KDA``, or ``transposes`` KDA for a backward stage), its values against
its family's reference stage on the same arguments.

``check_pipeline(pipeline)`` compares a pipeline's gradients with the exact gradients of
its own forward (``jax.vjp`` through its forward stages, the same-math Pallas stages
differentiated as their reference twins: ``kdax._runner.routes.differentiable_forward``) and
its outputs across layouts (dense rows, packed per-sequence, shared chunks, tiles).

Both return a ``Report``: ``.ok`` (no check failed; skipped ones say why), ``.failed``,
and a table when printed, one row per (check, case), with a legend of the cases. ``ok``
is a statement about values only where they were compared: a stage whose math is not
KDA's gets ``reference`` rows that say "not compared" (``Report.not_compared``), except a
B5 checked in its F1's pipeline (``base=``), compared with that F1's VJP.
"""

from ._cases import DTYPES as DTYPES, Case as Case, default_cases as default_cases, tolerance as tolerance
from ._check_pipeline import check_pipeline as check_pipeline
from ._check_stage import check_stage as check_stage
from ._report import Check as Check, Report as Report

__all__ = ["Check", "Report", "Case", "DTYPES", "check_stage", "check_pipeline", "default_cases", "tolerance"]
