"""``KDAPipeline.plan``: which implementation runs each stage, why it differs, the layout,
the tiles and the resolved configuration, found by tracing abstractly."""

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ._config import KDAOptions
from ._numerics import precision as _precision
from ._numerics.chunk_loops import loop_unroll, resolve_group, split_rows_and_heads
from ._stage_protocol.capabilities import capabilities
from ._runner.contracts import STAGES
from ._runner.routes import other_math, shared_chunks_refused, tiles_refused, unchecked, unsafe_for_tiles
from ._runner.runner import recording
from ._validate import check_arrays


class PlanRow(NamedTuple):
    """One stage: its field, step, the implementation in the pipeline, the one that runs (None: not run), why."""

    field: str
    step: str
    requested: str
    runs: Optional[str]
    reason: Optional[str]


class KDAPlan(NamedTuple):
    """What ``plan`` found: ``rows`` (``PlanRow``: the gradient's path), ``tile`` (the forward's
    tile size without gradients; None: whole), ``not_tile_safe``, ``layout`` ("dense",
    "per-sequence" or "shared"), ``notes`` (a stage that runs otherwise in the forward
    without gradients among them), ``config`` (``resolved_config``), ``why`` (route -> reason)."""

    rows: tuple
    tile: Optional[int]
    not_tile_safe: tuple
    layout: Optional[str] = None
    notes: tuple = ()
    config: Optional[dict] = None
    why: tuple = ()

    @property
    def fallbacks(self) -> dict:
        """Stage field -> reason, for every stage that falls back."""
        return {r.field: r.reason for r in self.rows if r.runs is not None and r.reason}

    def __str__(self) -> str:
        head = f"{'step':<5}{'field':<11}{'implementation':<24}{'runs':<24}note"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            runs = "-" if r.runs is None else ("same" if r.runs == r.requested and not r.reason else r.runs)
            lines.append(f"{r.step:<5}{r.field:<11}{r.requested:<24}{runs:<24}{r.reason or ''}")
        why = dict(self.why)
        tiles = f"tiles of ~{self.tile} blocks without gradients, whole under one"
        whole = "whole" + (f" ({why['forward']})" if "forward" in why else "")
        lines.append("forward: " + (whole if self.tile is None else tiles))
        if self.layout is not None:
            what = {"dense": "one sequence per row", "per-sequence": "each packed sequence from a chunk boundary",
                    "shared": "packed sequences share chunks, NC = ceil(T / C)"}[self.layout]
            lines.append(f"layout: {self.layout}: {what}" + (f" ({why['layout']})" if "layout" in why else ""))
        lines += list(self.notes)
        if self.config:
            lines.append("config: " + ", ".join(f"{n}={v}" for n, v in self.config.items() if not isinstance(v, dict)))
            lines += [f"  {n}: " + ", ".join(f"{a}={b}" for a, b in v.items())
                      for n, v in self.config.items() if isinstance(v, dict)]
        return "\n".join(lines)


def plan(pipeline, q, k, v, g, beta, **options) -> KDAPlan:
    """A ``KDAPlan`` for ``pipeline`` on these inputs (arrays or ``jax.ShapeDtypeStruct``) and
    options, the forward and backward traced abstractly; its ``str`` is a table."""
    opts = KDAOptions.from_kwargs(**options)

    def call(d):  # (q, k, v, g, beta, initial_state: traced, so that chunk_kda's shape checks run)
        check_arrays(*d, opts.A_log, opts.dt_bias, opts.cu_seqlens)
        return pipeline.apply(*d[:5], dataclasses.replace(opts, initial_state=d[5]))

    with recording(quiet=True) as rec:
        def loss(diff):
            o, ht = call(diff)
            return jnp.sum(o) if ht is None else jnp.sum(o) + jnp.sum(ht)

        jax.eval_shape(jax.grad(loss), (q, k, v, g, beta, opts.initial_state))
    with recording(quiet=True) as fwd:  # the forward without gradients: in tiles where it has them
        jax.eval_shape(call, (q, k, v, g, beta, opts.initial_state))
    unsafe = unsafe_for_tiles(pipeline)
    rows = []
    reasons, swapped = rec.derived or ((), ())
    empty = 0 in (*q.shape[:2], q.shape[-1], v.shape[-1])  # (chunk_kda returns before any stage)
    for name, info in STAGES.items():
        stage, ran, reason = rec.ran.get(name, (getattr(pipeline, name), None, None))
        if ran is None:
            reason = "not run: no work (B, T, K or V is 0): o is zeros, states pass through" if empty else {
                "recompute": "not run: the forward's cache is kept (disable_recompute=True)"}.get(name, "not run")
            if reasons and not info.forward:
                reason = "not run: the backward is derived by jax.vjp through the forward stages"
        elif name in swapped:
            stage = getattr(pipeline, name)
            reason = "differentiated as its reference stage (same math; derived backward)"
        elif type(stage) is not type(getattr(pipeline, name)):  # (B5 as F1's VJP: the route's stand-in)
            stage, reason = getattr(pipeline, name), "jax.vjp of F1 (this stage does not transpose the pipeline's F1)"
        runs = None if ran is None else type(ran).__qualname__
        rows.append(PlanRow(name, info.step, type(stage).__qualname__, runs, reason))
    # What a stage says of how it runs (``plan_note``, e.g. a segment-split recurrence).
    notes = tuple(f"{name}: {ran.plan_note}" for name, (_, ran, _) in rec.ran.items()
                  if getattr(ran, "plan_note", None))
    on_grad = {name: (type(ran), why) for name, (_, ran, why) in rec.ran.items()}
    notes += tuple(f"forward without gradients: {name} runs {type(ran).__qualname__} ({why})"
                   for name, (_, ran, why) in fwd.ran.items() if (type(ran), why) != on_grad.get(name))
    # Why a declaration selected no route (kdax._runner.routes.unchecked: stages of other math).
    for name in unchecked(pipeline):
        said = [c for c in ("reset", "tile_safe") if getattr(capabilities(type(getattr(pipeline, name))), c)]
        notes += (f"routes: {other_math(pipeline, name)}: packed sequences keep one chunk each and the forward "
                  f"runs whole, whatever a stage declares" + (f" (it declares {', '.join(said)})" if said else ""),)
    if reasons:
        notes += ("backward: derived by jax.vjp through F1-F5 (exact; the six-stage backward does not transpose "
                  "this forward: " + "; ".join(reasons) + ")",)
    refused = (("forward", tiles_refused(pipeline)),
               ("layout", shared_chunks_refused(pipeline) if rec.layout == "per-sequence" else None))
    why = tuple((route, r) for route, r in refused if r)
    return KDAPlan(tuple(rows), None if unsafe else pipeline.tile, unsafe, rec.layout, notes=notes,
                   config=resolved_config(pipeline, q, k, v, g, beta, opts.initial_state), why=why)


def resolved_config(pipeline, *dtypes) -> dict:
    """Every platform-dependent choice of ``pipeline`` for inputs of ``dtypes`` (float32 if none): ``backend``,
    ``precision`` (resolved), ``tile``, and per stage its static fields with "auto" resolved
    (``group``, ``chunk_loops``, ``loop_unroll``, the Pallas ``target``, ``interpret``,
    tuning). Each is a field of the pipeline or of a stage, read from nowhere else."""
    out = dict(backend=jax.default_backend(), precision=_precision.resolve(pipeline.precision, *(dtypes or (jnp.float32,))),
               tile=pipeline.tile)
    loops = lambda mode: "slices" if split_rows_and_heads(mode) else "flat"
    resolvers = {"group": resolve_group, "loop_unroll": loop_unroll, "chunk_loops": loops}
    for name in STAGES:
        stage = getattr(pipeline, name)
        fields = {f.name: resolvers.get(f.name, lambda x: x)(getattr(stage, f.name))
                  for f in dataclasses.fields(stage) if f.metadata.get("static", False)}
        if fields:
            out[name] = fields
    return out
