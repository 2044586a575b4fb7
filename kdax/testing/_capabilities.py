"""The checks of what a stage declares it accepts: ``reset`` (shared chunks give the
per-sequence layout's numbers), ``tile_safe`` (tiles give the whole forward's),
``half_stored`` (bf16 stored intermediates give their float32 copies' numbers), ``G_lo``
(float32 with ``G_lo`` no farther from float64 than without), ``tokens`` (views give the
chunked copies' numbers) and ``dh_start`` (B2: the cotangents it is given enter as through
its ``scale qg^T do`` term)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._errors import UnsupportedCase
from .._layouts.tokens import Tokens, as_chunked
from .._numerics import precision as _precision
from .._numerics.arrays import identity_row_terms
from .._runner.contracts import STAGES
from .._runner.routes import RESET_DECLARABLE, reference_is_exact, unsafe_for_tiles
from ._cases import _CU, Case, _dtname, _Twin, tolerance, x64_on
from ._compare import _compare, _leaves, _rel
from ._report import _error, _unsupported
from ._runs import (
    _for_stage,
    _jit_run,
    _outputs_ahead,
    _pipe_for,
    _pipeline_outputs,
    _record,
    _record_ahead,
    _UnflooredGate,
    _with_stage,
    trusting,
)


def _capability_checks(col, base, field, stage, caps, dtype, full):
    """Every declared capability against the per-sequence layout / the untiled forward, in
    pipelines that take the routes the declaration selects whatever the stage's math
    (``trusting``: ``KDAPipeline.trust_declarations``; a pipeline takes them only for
    KDA's math)."""
    base = trusting(base)
    P = _with_stage(base, field, stage)
    if caps.reset and field in RESET_DECLARABLE:
        _reset_checks(col, P, field, stage, dtype)
    if caps.tile_safe and STAGES[field].forward:
        _tile_safe_checks(col, P, field, stage, caps, dtype, full)
    if caps.half_stored:
        _half_stored_check(col, base, field, stage)
    if caps.dh_start and field == "dhu":
        _dh_start_check(col, base, field, stage, dtype, caps.reset)


def _capabilities_ahead(base, field, stage, caps, dtype, full):
    """Start compiling the programs ``_capability_checks`` and ``_tokens_check`` will run
    (``kdax.testing._runs._ahead``): the reset and tile_safe checks' forwards and gradients,
    the half_stored and tokens checks' recordings."""
    tokens_base, base = base, trusting(base)
    P = _with_stage(base, field, stage)
    if caps.reset and field in RESET_DECLARABLE:
        case = _reset_case(dtype)
        _outputs_ahead(dataclasses.replace(P, share_chunks=False), case, True)
        for _, Ps in _floors(P, field, case):
            _outputs_ahead(dataclasses.replace(Ps, share_chunks=True), case, True)
    if caps.tile_safe and STAGES[field].forward and not unsafe_for_tiles(P):
        for case in _tile_cases(field, caps, dtype, full):
            for Pt in _whole_and_tiled(P, case):
                _outputs_ahead(Pt, case, False)
    if caps.half_stored:
        case = _half_stored_case()
        _record_ahead(_half_stored_pipeline(base, field, stage, case), case, False, field=field)
    if caps.tokens:  # (not trusting, as _tokens_check runs)
        case = _tokens_case(dtype)
        _record_ahead(_with_stage(_pipe_for(tokens_base, case), field, stage), case, False, field=field)


def _reset_case(dtype) -> Case:
    return Case(f"packed {_dtname(dtype)}", dtype, B=1, T=_CU[-1], cu=_CU, h0=False)


def _floors(P, field, case) -> list:
    """``[(row name, pipeline)]``: ``P`` with F1's floor at sequence starts, and (but for
    F1 itself) without it."""
    got = [(case.name, P)]
    if field != "gate":
        got.append((f"{case.name} no-floor", eqx.tree_at(lambda p: p.gate, P, _UnflooredGate())))
    return got


def _reset_checks(col, P, field, stage, dtype):
    """``reset``: shared chunks give the per-sequence layout's outputs and gradients, with
    F1's log decay floor at sequence starts and without (then the stage's own reset must be
    exact: ``Case.floor``)."""
    forward = STAGES[field].forward
    case = _reset_case(dtype)
    per_seq = {}  # (the per-sequence layout's numbers, the same with and without the floor)

    def run(Ps, share, grads):
        if share or grads not in per_seq:
            out = _pipeline_outputs(dataclasses.replace(Ps, share_chunks=share), case, grads)
            if share:
                return out
            per_seq[grads] = out
        return per_seq[grads]

    for name, Ps in _floors(P, field, case):
        try:
            what = "outputs and gradients"
            try:
                o1, h1, g1, m1 = run(Ps, True, True)
                o0, h0, g0, m0 = run(P, False, True)
            except UnsupportedCase as e:
                if not forward:
                    raise
                # another stage of the backward cannot take this route (a derived stage without
                # `reset`): a forward stage's declaration is still checked on the outputs
                what = f"outputs (the gradient raised UnsupportedCase: {e})"
                o1, h1, _, m1 = run(Ps, True, False)
                o0, h0, _, m0 = run(P, False, False)
                g1 = g0 = None
            if m1["layout"] != "shared":
                col.add("reset", name, None, f"the pipeline ran the {m1['layout']} layout, not shared chunks")
            elif not forward and (m1["derived"] or m1["ran"].get(field) is not type(stage)):
                col.add("reset", name, None, "the pipeline did not run this backward stage (derived backward: "
                        "pass base= a pipeline whose forward it transposes)")
            else:
                ok, det = _compare((o1, h1, g1), (o0, h0, g0), tolerance(dtype))
                col.add("reset", name, ok, (f"shared chunks vs per-sequence, {what}: " + det)
                        if ok else f"declares `reset` but shared chunks give other numbers than the per-sequence "
                                   f"layout ({what}): {det}")
                if Ps is P:
                    _overflow_check(col, Ps, case, (o1, h1, g1), field, stage)
        except UnsupportedCase as e:
            _route_unsupported(col, "reset", name, field, stage, e)
        except Exception as e:
            col.add("reset", name, False, _error(e))


def _overflow_check(col, P, case, before, field, stage):
    """``reset``, one row more: in shared chunks, one sequence's keys so large that their
    products overflow (inf inside its own sequence: some of ``k_i . k_j`` and then F2's
    inverse, or every such product) leave every other sequence's outputs, final states and
    gradients bit for bit as they are beside ordinary keys (the exact zeros between
    sequences must never meet the inf as ``0 * inf``: docs/DESIGN.md §7); and, for a stage
    of KDA's math, are non-finite in each of that sequence's token rows of the outputs and
    gradients where the reference pipeline's are (an overflow inside the stage read as a
    number, a select on ``isfinite``, fails: by row, as ``nan-reach``)."""
    n = 1  # (tokens 7-22 of _CU: a chunk shared with the sequence before it, one with the one after)
    top = float(jnp.finfo(case.dtype).max)
    o0, h0, g0 = before
    cu, differs, finite = case.cu, [], []
    ref = _with_stage(P, field, STAGES[field].reference()) if reference_is_exact(field, stage) else None
    for size in (top ** 0.5 / 2, top / 10):
        bad = dataclasses.replace(case, overflow=("k", n, size))
        o, h, g, _ = _pipeline_outputs(dataclasses.replace(P, share_chunks=True), bad, g0 is not None)
        for m in range(len(cu) - 1):
            toks = slice(cu[m], cu[m + 1])
            pairs = [("outputs", o[:, toks], o0[:, toks]), ("final state", h[m], h0[m])]
            if g0 is not None:
                pairs += [(f"d{x}", a[:, toks], b[:, toks]) for x, a, b in zip("q k v g beta".split(), g[0], g0[0])]
            differs += [f"sequence {m}'s {what} (keys at ±{size:.0e})" for what, a, b in pairs
                        if m != n and not np.array_equal(np.asarray(a), np.asarray(b))]
        if ref is not None:
            ro, _, rg, _ = _pipeline_outputs(dataclasses.replace(ref, share_chunks=True), bad, g0 is not None)
            toks = slice(cu[n], cu[n + 1])
            mine = [("outputs", o, ro)] + ([(f"d{x}", a, b) for x, a, b in zip("q k v g beta".split(), g[0], rg[0])]
                                            if g0 is not None else [])
            rows = lambda y: ~np.isfinite(np.asarray(y)[:, toks].reshape(y.shape[0], cu[n + 1] - cu[n], -1)).all(-1)
            finite += [f"{what} at {int((rows(b) & ~rows(a)).sum())} tokens (keys at ±{size:.0e})"
                       for what, a, b in mine if (rows(b) & ~rows(a)).any()]
    ok = not (differs or finite)
    said = [f"a float overflow in sequence {n} changes {', '.join(differs[:3])}{' ...' if len(differs) > 3 else ''}"
            ": a product meets it with the zeros between sequences (select, don't multiply: docs/DESIGN.md "
            "§7)"] * bool(differs) + [f"sequence {n}'s own {', '.join(finite[:3])} finite where the reference "
                                      "pipeline's are not (an overflow read as a number)"] * bool(finite)
    col.add("reset", f"{case.name} overflow", ok,
            f"sequence {n}'s keys at ±{top ** 0.5 / 2:.0e} and ±{top / 10:.0e}: the other sequences' numbers bitwise "
            "as before" + (", its own non-finite where the reference pipeline's are" if ref is not None else "")
            if ok else "declares `reset` but " + "; ".join(said))


def _route_unsupported(col, check, case, field, stage, e):
    """A pipeline-level check whose route raised ``UnsupportedCase``: as ``_unsupported``
    when the stage under test raised it; otherwise (another stage of the pipeline) a skip
    that says the route could not run."""
    if _raised_by(stage, e):
        return _unsupported(col, check, case, field, stage, e)
    return col.add(check, case, None, f"not checked: another stage of the pipeline raised UnsupportedCase on this "
                                      f"route ({e})")


def _raised_by(stage, e) -> bool:
    """Whether ``stage``'s own ``__call__`` raised ``e`` (its frame is in the traceback)."""
    tb = e.__traceback__
    call = type(stage).__call__
    code = getattr(getattr(call, "__wrapped__", call), "__code__", None)
    while tb is not None:
        if tb.tb_frame.f_code is code or tb.tb_frame.f_locals.get("self") is stage:
            return True
        tb = tb.tb_next
    return False


def _tile_safe_checks(col, P, field, stage, caps, dtype, full):
    """``tile_safe``: tiles of one chunk give the whole forward's outputs (dense, packed;
    ``full``: shared chunks too, for a stage that declares ``reset``)."""
    if unsafe_for_tiles(P):
        col.add("tile_safe", "-", None, f"the base pipeline has stages that are not tile-safe: "
                                        f"{unsafe_for_tiles(P)}")
        return
    for case in _tile_cases(field, caps, dtype, full):
        try:
            whole, tiled = _whole_and_tiled(P, case)
            ow, hw, _, _ = _pipeline_outputs(whole, case, False)
            ot, ht, _, _ = _pipeline_outputs(tiled, case, False)
            ok, det = _compare((ot, ht), (ow, hw), tolerance(dtype))
            col.add("tile_safe", case.name, ok, ("tiles of one chunk vs whole: " + det) if ok else
                    f"declares `tile_safe` but tiles of one chunk give other numbers than the whole "
                    f"forward: {det}")
        except UnsupportedCase as e:
            _route_unsupported(col, "tile_safe", case.name, field, stage, e)
        except Exception as e:
            col.add("tile_safe", case.name, False, _error(e))


def _tile_cases(field, caps, dtype, full) -> list:
    """The tile_safe check's cases: dense, packed (``full``: shared chunks too, for a stage
    that declares ``reset``)."""
    d = _dtname(dtype)
    cases = [Case(f"dense {d}", dtype, T=40), Case(f"packed {d}", dtype, B=1, T=_CU[-1], cu=_CU)]
    if full and caps.reset and field in RESET_DECLARABLE:
        cases.append(Case(f"shared {d}", dtype, B=1, T=_CU[-1], cu=_CU, share=True, h0=False))
    return cases


def _whole_and_tiled(P, case) -> tuple:
    """``P`` in ``case``'s layout, whole and in tiles of one chunk."""
    whole = dataclasses.replace(P, share_chunks=case.share)
    R = case.B if not case.packed else 1
    return whole, dataclasses.replace(whole, tile=R * case.HV)


def _half_stored_case() -> Case:
    return Case("dense bfloat16", jnp.bfloat16)


def _half_stored_pipeline(base, field, stage, case):
    return _with_stage(_pipe_for(base, case), field, stage).with_precision("fast")


def _half_stored_check(col, base, field, stage):
    """``half_stored``: in a pipeline under ``"fast"`` (bf16 inputs), the stage given the
    stored intermediates in bf16 gives what it gives on their float32 copies (exact
    widenings: only the stage's own rounding differs)."""
    case = _half_stored_case()
    try:
        P = _half_stored_pipeline(base, field, stage, case)
        kw = _record(P, case, False, field=field)[0].get(field) or {}
        half = sorted(n for n, x in kw.items() if n in _precision.STORED and getattr(x, "dtype", None) == jnp.bfloat16)
        if not half:
            col.add("half_stored", case.name, None, "the pipeline passes no bf16 intermediates to this field here")
            return
        ok, det = _compare(_jit_run(P, field, kw), _jit_run(P, field, _precision.widened(kw)), tolerance(case.dtype))
        col.add("half_stored", case.name, ok, (f"bf16 {', '.join(half)} vs float32 copies: " + det) if ok else
                f"declares `half_stored` but bf16 {', '.join(half)} give other numbers than float32 copies: {det}")
    except UnsupportedCase as e:
        _route_unsupported(col, "half_stored", case.name, field, stage, e)
    except Exception as e:
        col.add("half_stored", case.name, False, _error(e))


def _dh_start_check(col, base, field, stage, dtype, reset: bool):
    """``dh_start`` (B2): on the arguments the pipeline passes (dense; shared chunks too for a
    stage that declares ``reset``), the stage given random chunk-start cotangents ``S`` gives
    what it gives without them plus what it makes of ``S`` alone entering through its
    ``scale qg^T do`` term (``qg`` rows of the identity, ``do`` rows of ``S / scale``, no
    other cotangent). B2 is linear in its cotangents, and that sum is what the pipeline runs
    for a B2 without the capability (``kdax._runner.output_vjp``)."""
    d = _dtname(dtype)
    shared = Case(f"shared {d}", dtype, B=1, T=_CU[-1], cu=_CU, share=True, h0=False)
    cases = [Case(f"dense {d}", dtype, T=40)] + [shared] * reset
    for case in cases:
        try:
            P = _with_stage(_pipe_for(base, case), field, stage)
            kw = {n: x for n, x in _for_stage(stage, _record(P, case, False, field=field)[0][field]).items()
                  if n != "dh_start"}
            qg, do, scale = kw["qg"], as_chunked(kw["do"]), kw["scale"]
            (R, HV, NC, _, K), V = qg.shape, do.shape[-1]
            S = jnp.asarray(np.random.default_rng(3).normal(size=(R, HV, NC, K, V)), kw["dht"].dtype)
            alone = dict(kw, dv_intra=jnp.zeros_like(kw["dv_intra"]), dht=jnp.zeros_like(kw["dht"]))
            parts = [_jit_run(P, field, kw)] + [_jit_run(P, field, dict(alone, qg=eye, do=rows.astype(do.dtype)))
                                                for eye, rows in identity_row_terms(S, qg, scale)]
            want = jax.tree.map(lambda *x: sum(x[1:], x[0]), *parts)
            ok, det = _compare(_jit_run(P, field, dict(kw, dh_start=S)), want, tolerance(case.dtype))
            col.add("dh_start", case.name, ok, ("random dh_start vs the same through scale qg^T do: " + det) if ok
                    else f"declares `dh_start` but gives other numbers than with those cotangents entering through "
                         f"its `scale qg^T do` term: {det}")
        except UnsupportedCase as e:
            _route_unsupported(col, "dh_start", case.name, field, stage, e)
        except Exception as e:
            col.add("dh_start", case.name, False, _error(e))


def _G_lo_check(col, base, field, stage, cases, results: dict, cache: bool = False):
    """``G_lo``: on the float32 dense case (strong gates), the stage's outputs with ``G_lo``
    are no farther from its own float64 outputs than without. ``results``: ``(pipeline,
    arguments, outputs, recorded arguments)`` by case name."""
    f32 = next((c for c in cases if c.name.startswith("dense") and jnp.dtype(c.dtype) == jnp.float32), None)
    if f32 is None or f32.name not in results:
        return
    P, kw, out, full_kw = results[f32.name]
    if "G_lo" not in full_kw or full_kw["G_lo"] is None:
        col.add("G_lo", f32.name, None, "the pipeline passes no G_lo to this field")
        return
    if not x64_on():  # (the float64 twin would compute in float32)
        col.add("G_lo", f32.name, None, "needs JAX's 64-bit mode (its float64 outputs are the yardstick)")
        return
    try:
        twin = dataclasses.replace(f32, name=f32.name + "->f64", dtype=jnp.float64)
        (x32, kw32) = f32.inputs()
        rec64 = _record(_pipe_for(base, twin), _Twin(twin, x32, kw32), cache, key=("float64 twin", f32),
                        backward=not STAGES[field].forward, field=field)[0]
        truth = _jit_run(_with_stage(_pipe_for(base, twin), field, stage), field,
                         _for_stage(stage, rec64[field]))
        without = _jit_run(P, field, {n: x for n, x in kw.items() if n != "G_lo"})
        e_with = max(_rel(x, y) for (_, x), (_, y) in zip(_leaves(out), _leaves(truth)))
        e_without = max(_rel(x, y) for (_, x), (_, y) in zip(_leaves(without), _leaves(truth)))
        ok = e_with <= 1.5 * e_without + 1e-7
        unused = all(np.array_equal(x, y) for (_, x), (_, y) in zip(_leaves(out), _leaves(without)))
        col.add("G_lo", f32.name, ok, f"float32 error vs its float64 output: {e_with:.1e} with G_lo, "
                                      f"{e_without:.1e} without" + ("" if ok else " (G_lo makes it worse)")
                + (" (the same outputs: the stage declares G_lo but does not use it)" if unused else ""))
    except Exception as e:
        col.add("G_lo", f32.name, False, _error(e))


def _tokens_case(dtype) -> Case:
    return Case(f"dense {_dtname(dtype)}", dtype)


def _tokens_check(col, base, field, stage, dtype):
    """``tokens``: in a pipeline with the stage, the views of the caller's arrays it is
    given give what their chunked copies give."""
    case = _tokens_case(dtype)
    try:
        P = _with_stage(_pipe_for(base, case), field, stage)
        rec = _record(P, case, False, field=field)[0]
        kw = rec.get(field)
        if kw is None or not any(isinstance(x, Tokens) for x in kw.values()):
            col.add("tokens", case.name, None, "the pipeline passes no Tokens views to this field here")
            return
        views = _jit_run(P, field, kw)
        copies = _jit_run(P, field, {n: as_chunked(x) for n, x in kw.items()})
        ok, det = _compare(views, copies, tolerance(case.dtype))
        col.add("tokens", case.name, ok, ("views vs chunked copies: " + det) if ok else
                f"declares `tokens` but the views give other numbers than the chunked copies: {det}")
    except Exception as e:
        col.add("tokens", case.name, False, _error(e))
