"""The rows ``check_stage`` adds for each case, on the arguments the pipeline gives the
stage there: ``contract``, ``finite``, ``reference`` (a stage of KDA's math against its
family's reference stage, also on a tile), ``nan-isolation`` and ``isolation``; and on the first dense case
the transformations ``jit``, ``filter_jit``, ``vmap``, ``grad``."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._errors import StageContractError, UnsupportedCase
from .._layouts.tokens import Tokens
from .._runner import routes as _routes
from .._runner.contracts import STAGES
from ..stages import KDA, GateVjpBackward
from ._cases import Case, _device, _weights, tolerance
from ._compare import _compare, _leaves, _named, central_differences
from ._report import NOT_COMPARED, _error, _unsupported
from ._runs import (
    _compile_options,
    _for_reference,
    _for_stage,
    _jit,
    _jit_run,
    _pipe_for,
    _record,
    _record_ahead,
    _run,
    _run_ahead,
    _with_stage,
)
from ._reach import _causal, _dw_overflow, _kept, _owners, _rows_missed
from ._tiles import _tile_of, _tile_read


def _reference_checks(col, pipe, field, stage, caps, case: Case, out, full_kw: dict, vjp=None):
    """``reference``: a stage declaring KDA's math gives its family's reference stage's
    outputs on the arguments the pipeline ``pipe`` recorded for ``field`` (``full_kw``), and,
    a tile-safe forward stage, on a tile of them (a carried state); a B5 transposing
    ``pipe``'s F1 of other math, those of ``vjp`` (``_vjp_of_gate``)."""
    reference = STAGES[field].reference() if vjp is None else vjp
    name = reference.__class__.__name__ if vjp is None else f"jax.vjp of {type(vjp.gate).__qualname__}"
    claim = "declares KDA's math" if vjp is None else f"transposes {vjp.gate.math!r}"
    tol = tolerance(case.dtype)
    try:
        want = _jit_run(_with_stage(pipe, field, reference), field, _for_reference(reference, stage, full_kw))
        ok, det = _compare(out, want, tol)
        col.add("reference", case.name, ok, f"vs {name}: {det}" if ok else f"{claim} but differs from {name}: {det}")
    except Exception as e:  # (an F1 JAX cannot differentiate leaves its B5 to check_pipeline)
        col.add("reference", case.name, None if vjp is not None else False,
                f"{NOT_COMPARED}: {name} raised {_error(e)}" if vjp is not None else _error(e))
    # and on a tile of it, where the pipeline runs a tile-safe forward stage
    tile = _tile_of(full_kw) if STAGES[field].forward and caps.tile_safe else None
    if tile is None:
        return
    try:
        got = _jit_run(_with_stage(pipe, field, stage), field, _for_stage(stage, tile))
        want = _jit_run(_with_stage(pipe, field, reference), field, _for_reference(reference, stage, tile))
        ok, det = _compare(_tile_read(got, tile), _tile_read(want, tile), tol)
        col.add("reference", case.name + " tile", ok, f"a tile (carried state) vs {name}: {det}" if ok else
                f"declares KDA's math but differs from {name} on a tile (carried state): {det}")
    except Exception as e:
        col.add("reference", case.name + " tile", False, _error(e))


# What a change to one sequence's part of an argument is made of, per row of the report:
# NaN (a leak through any arithmetic), then the values negated and scaled up (a leak
# through a comparison or a select, which NaN can pass unseen: a decision on the batch's
# largest log decay, or on its largest magnitude, which NaN-skipping reductions ignore).
_CHANGES = (("nan-isolation", "NaN", lambda x: np.full_like(x, np.nan)),
            ("isolation", "negated and scaled by 1e4", lambda x: -1e4 * x))


def _isolation(col, pipe, field, kw, clean, case: Case, name: str, reference=None):
    """``nan-isolation`` and ``isolation``: for each sequence in turn, each per-token,
    per-chunk and per-sequence argument changed in every element of that sequence's part
    (NaN; negated and scaled by 1e4) reaches no other sequence's outputs. ``reference``: ``(pipeline with the
    reference stage, its arguments)`` for a stage of KDA's math, and ``nan-reach``: those
    arguments NaN in one sequence's part all at once reach, in that sequence, every token row
    of the outputs the reference stage's reach (a stage that turns non-finite values into
    numbers fails). Shared chunks: ``nan-reach`` alone (a stage there may rely on its
    arguments' zeros between sequences, which the ``reset`` row checks in a pipeline)."""
    ref = next((x for x in jax.tree.leaves(kw) if hasattr(x, "ndim") and x.ndim >= 4), None)
    if ref is None:
        return
    R, NC = ref.shape[0], ref.shape[2]
    N = len(case.cu) - 1 if case.packed else case.B
    clean_leaves = _leaves(clean)
    leaks = {row: [] for row, _, _ in _CHANGES}
    tried, short = [], []
    for n, x in kw.items():
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)) or isinstance(x, Tokens):
            continue
        owner = _owners(x.shape, case, R, NC, N)
        if owner is None:
            continue
        tried.append(n)
        if case.share:
            continue
        base = np.array(x)
        for seq in range(N):
            mine = np.broadcast_to(owner == seq, x.shape)
            for row, what, change in _CHANGES:
                changed = np.where(mine, change(base), base)
                out = _jit_run(pipe, field, dict(kw, **{n: _device(changed, x.dtype)}))
                for (path, y), (_, y0) in zip(_leaves(out), clean_leaves):
                    theirs = _owners(y.shape, case, R, NC, N)
                    if theirs is None:
                        continue
                    m = np.broadcast_to((theirs != seq) & (theirs >= 0), y.shape)
                    if not _kept(y[m], y0[m]).all():
                        leaks[row].append(f"{n} of sequence {seq} {what} reached {_named(path)} of another sequence")
                        break
    if reference is not None:  # (all of them at once: a stage may read its own of redundant arguments, qg or q)
        for seq in range(N):
            nan = {n: _device(np.where(np.broadcast_to(_owners(kw[n].shape, case, R, NC, N) == seq, kw[n].shape),
                                       np.nan, np.array(kw[n])), kw[n].dtype) for n in tried}
            out = _jit_run(pipe, field, dict(kw, **nan))
            want = _jit_run(reference[0], field, dict(reference[1], **nan))
            missed = _rows_missed(out, want, case, R, NC, N, seq)
            if missed:
                short.append(f"sequence {seq}: {missed}")
    if tried:
        for row, what, _ in () if case.share else _CHANGES:
            col.add(row, name, not leaks[row], "; ".join(leaks[row][:3]) if leaks[row] else
                    f"{', '.join(tried)} of each of {N} sequences {what} in turn: others unchanged")
        if reference is not None:
            col.add("nan-reach", name, not short, f"{', '.join(tried)} NaN in one sequence at a time: "
                    + (f"{'; '.join(short[:3])} finite where the reference stage's are not (non-finite values read "
                       "as numbers)" if short else "non-finite in each token row where the reference stage's are"))


def _transforms(col, pipe, field, stage, kw, out, kw2, out2, case: Case, tol: float):
    """``jit``, ``filter_jit``, ``vmap`` (``kw`` and ``kw2``, two seeds' arguments, stacked)
    and ``grad`` (forward stages) of the stage in ``pipe``, against its outputs ``out``,
    ``out2`` on them."""
    name = case.name
    arrs, static = eqx.partition(kw, eqx.is_array)
    # jax.jit, the stage closed over (its arrays constants)
    try:
        got = jax.jit(lambda a: _run(pipe, field, eqx.combine(a, static)), compiler_options=_compile_options())(arrs)
        col.add("jit", name, *_compare(got, out, max(tol * 1e-2, 1e-13)))
    except Exception as e:
        col.add("jit", name, False, _error(e))
    col.add("filter_jit", name, True, "every stage call of this report runs under eqx.filter_jit")
    # vmap over two cases' arguments stacked
    try:
        arrs2, static2 = eqx.partition(kw2, eqx.is_array)
        if jax.tree.structure(arrs) != jax.tree.structure(arrs2):
            raise ValueError("the two seeds' arguments differ in structure")
        stacked = jax.tree.map(lambda a, b: _device(np.stack([a, b]), a.dtype), arrs, arrs2)
        got = _jit(eqx.filter_vmap(lambda a: _run(pipe, field, eqx.combine(a, static))))(stacked)
        got = jax.tree.map(np.asarray, got)  # (sliced on the host: no program per slice)
        r0 = _compare(jax.tree.map(lambda x: x[0], got), out, max(tol * 1e-2, 1e-12))
        r1 = _compare(jax.tree.map(lambda x: x[1], got), out2, max(tol * 1e-2, 1e-12))
        col.add("vmap", name, r0[0] and r1[0], f"{r0[1]}; {r1[1]}")
    except Exception as e:
        col.add("vmap", name, False, _error(e))
    _grad_row(col, pipe, field, stage, kw, case)


def _grad_row(col, pipe, field, stage, kw, case: Case):
    """``grad`` (forward stages: the derived backward differentiates them): finite, and in
    float64 for a stage of other math the derivative of its outputs (central differences;
    not across infinite gates)."""
    if not STAGES[field].forward:
        return
    name = case.name
    arrs, static = eqx.partition(kw, eqx.is_array)
    try:
        def loss(diff):
            p, a = diff
            o = _run(p, field, eqx.combine(a, static))
            xs = [x for x in jax.tree.leaves(o) if jnp.issubdtype(x.dtype, jnp.floating)]
            return sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0) * _weights(x.shape, x.dtype, 3 + i))
                       for i, x in enumerate(xs))

        grads = _jit(eqx.filter_grad(loss))((pipe, arrs))
        leaves = [(jax.tree_util.keystr(k), np.asarray(x)) for k, x in jax.tree_util.tree_leaves_with_path(grads)
                  if hasattr(x, "dtype")]
        bad = [path for path, x in leaves if not np.isfinite(x).all()]
        finite = not bad
        said = f"{len(leaves)} gradients, " + ("finite" if finite else "NON-FINITE: " + ", ".join(bad[:4]))
        if finite and not _routes.reference_is_exact(field, stage) and jnp.dtype(case.dtype) == jnp.float64 \
                and not case.strong:
            ok, det = _differences(loss, (pipe, arrs), grads)
            col.add("grad", name, ok, f"{said}; {det}" if ok else f"{said}, but not the derivative of the stage's "
                    f"outputs: {det} (a derived backward differentiates this stage: its JAX derivative, a custom_vjp "
                    "included, is the pipeline's gradient)")
        else:
            col.add("grad", name, finite, said)
    except Exception as e:
        if _routes.reference_is_exact(field, stage):  # never differentiated: the derived backward uses the reference stage
            col.add("grad", name, None, f"not differentiable by JAX ({type(e).__name__}): the derived backward "
                                        f"differentiates {STAGES[field].reference.__name__} instead")
        elif _routes.is_autodiff_failure(e):
            col.add("grad", name, None, "not differentiable by JAX: a pipeline with it needs backward stages that "
                                        "transpose it (else DerivedBackwardError)")
        else:
            col.add("grad", name, False, _error(e))


def _differences(loss, x, grads):
    """``(passed, detail)``: JAX's gradient ``grads`` of the scalar ``loss`` at ``x`` (float64)
    against central differences (``_compare.central_differences``)."""
    diff, rest = eqx.partition(x, eqx.is_inexact_array)
    xs = jax.tree.leaves(diff)
    gs = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    f = _jit(lambda d: loss(eqx.combine(d, rest)))
    at = lambda moved: float(f(jax.tree.unflatten(jax.tree.structure(diff), [
        _device(m, a.dtype) for m, a in zip(moved, xs)])))
    return central_differences(at, xs, gs, seed=11)


def _cases_ahead(base, field, cases, cache_ok: bool) -> None:
    """Start compiling the recordings ``_case_checks`` will make (``_runs._ahead``): traced
    here, one after the other, while two workers compile them."""
    for case in cases:
        if case.floor or field != "gate":
            _record_ahead(_pipe_for(base, case), case, cache_ok, backward=not STAGES[field].forward, field=field)


def _stage_runs_ahead(base, field, stage, caps, cases, cache_ok: bool) -> None:
    """Start compiling the stage runs ``_case_checks`` will make on each case (the stage; the
    reference stage, for a stage of KDA's math; both on a tile): each case's recording is
    run first (compiled by now, or being compiled), for the arguments' shapes."""
    reference = STAGES[field].reference()
    exact = _routes.reference_is_exact(field, stage)
    for case in cases:
        if (not case.floor and field == "gate") or (case.share and not caps.reset):
            continue
        try:
            pipe = _pipe_for(base, case)
            full_kw = _record(pipe, case, cache_ok, backward=not STAGES[field].forward, field=field)[0].get(field)
            if full_kw is None:
                continue
            _run_ahead(_with_stage(pipe, field, stage), field, _for_stage(stage, full_kw))
            tile = _tile_of(full_kw) if exact and STAGES[field].forward and caps.tile_safe else None
            for s, kw in [(stage, tile)] + [(reference, full_kw), (reference, tile)] * exact:
                if kw is not None:
                    _run_ahead(_with_stage(pipe, field, s), field, _for_reference(s, stage, kw))
        except Exception:  # (the check reports it)
            pass


def _case_checks(col, base, field, stage, caps, case: Case, cache_ok: bool, first_dtype):
    """The rows of one case: ``contract``, ``finite``, ``reference`` (a stage of KDA's math),
    ``nan-isolation`` and ``isolation`` (dense and packed cases in the first dtype). Returns ``(pipeline with
    the stage, its arguments, its outputs, the recorded arguments)``, or None when the stage
    did not run."""
    if not case.floor and field == "gate":
        return None  # (F1's reset is the floor itself: the "shared" case checks it)
    pipe = _pipe_for(base, case)
    recorded, layout, _, err = _record(pipe, case, cache_ok, backward=not STAGES[field].forward, field=field)
    if field not in recorded:
        col.add("contract", case.name, None if err is None or isinstance(err, UnsupportedCase) else False,
                "the pipeline does not run this stage here" + ("" if err is None else f" ({_error(err)})"))
        return None
    full_kw = recorded[field]
    if case.share and not caps.reset:
        return None
    kw = _for_stage(stage, full_kw)
    P = _with_stage(pipe, field, stage)
    try:
        out = _jit_run(P, field, kw)
    except UnsupportedCase as e:
        _unsupported(col, "contract", case.name, field, stage, e)
        return None
    except StageContractError as e:
        col.add("contract", case.name, False, _error(e))
        return None
    except Exception as e:
        col.add("contract", case.name, False, "raised " + _error(e))
        return None
    col.add("contract", case.name, True, f"{layout} layout: container, shapes, dtypes as the pipeline checks")
    bad = [_named(p) for p, x in _leaves(out) if not np.isfinite(x).all()]
    col.add("finite", case.name, not bad, "all finite" if not bad else f"non-finite: {', '.join(bad[:4])}")
    vjp = _vjp_of_gate(pipe, field, stage, recorded)
    if _routes.reference_is_exact(field, stage) or vjp is not None:
        _reference_checks(col, pipe, field, stage, caps, case, out, full_kw, vjp)
    else:
        info = STAGES[field]
        what = (f"math={getattr(stage, 'math', None)!r}" if info.forward
                else f"transposes={dict(getattr(stage, 'transposes', {}))}")
        col.add("reference", case.name, None, f"{NOT_COMPARED}: {what} is not KDA's, so no check compares its values "
                                              f"with {info.reference.__qualname__} (or any formula)" + (
                                                  "; given base= a pipeline with the F1 it transposes, with that "
                                                  "F1's VJP" if field == "gate_bwd" else ""))
    if case.name.split()[0] in ("dense", "packed", "shared") and jnp.dtype(case.dtype) == jnp.dtype(first_dtype):
        reference = None
        if _routes.reference_is_exact(field, stage):
            r = STAGES[field].reference()
            reference = (_with_stage(pipe, field, r), _for_reference(r, stage, full_kw))
        try:
            _isolation(col, P, field, kw, out, case, case.name, reference)
        except Exception as e:
            col.add("isolation", case.name, False, _error(e))
        if field == "wy_dqkg" and reference is not None:
            try:
                _dw_overflow(col, P, kw, out, reference, case)
            except Exception as e:
                col.add("overflow", case.name, False, _error(e))
        if (reference is not None or STAGES[field].forward) and not case.share:
            try:
                _causal(col, P, field, kw, out, reference, case)
            except Exception as e:
                col.add("causal", case.name, False, _error(e))
    return P, kw, out, full_kw


def _vjp_of_gate(pipe, field, stage, recorded):
    """B5 as JAX's VJP of ``pipe``'s F1 at the arguments it was called with
    (``GateVjpBackward``), where ``stage`` is a B5 transposing that F1's math, not KDA's:
    the formula its values are compared with. Else None."""
    math = getattr(pipe.gate, "math", None)
    if field != "gate_bwd" or "gate" not in recorded or math in (None, KDA) or stage.transposes.get("gate") != math:
        return None
    a = recorded["gate"]
    if any(isinstance(a[n], Tokens) for n in ("q", "k", "g", "beta")):  # (views: a stage it cannot hold)
        return None
    return GateVjpBackward(pipe.gate, a["q"], a["k"], a["g"], a["beta"])


def _transform_checks(col, base, field, stage, first: Case, result: tuple, cache_ok: bool):
    """``jit``, ``filter_jit``, ``vmap``, ``grad`` on the case ``first`` (``result``: what
    ``_case_checks`` returned for it) and the same case with another seed."""
    P, kw, out, _ = result
    c2 = dataclasses.replace(first, seed=1)
    rec2 = _record(_pipe_for(base, c2), c2, cache_ok, backward=not STAGES[field].forward, field=field)[0]
    if field not in rec2:
        return
    kw2 = _for_stage(stage, rec2[field])
    try:
        out2 = _jit_run(P, field, kw2)
        _transforms(col, P, field, stage, kw, out, kw2, out2, first, tolerance(first.dtype))
    except Exception as e:
        col.add("vmap", first.name, False, _error(e))


def _strong_grad_checks(col, field, stage, cases, results, first):
    """``grad`` on the cases with log decays at -1000 and -inf too (a hard forget's
    ``0 * inf`` in a stage's derivative gives NaN: finite is asked)."""
    for case in cases:
        if case.strong and case.name in results and case is not first:
            P, kw, _, _ = results[case.name]
            _grad_row(col, P, field, stage, kw, case)
