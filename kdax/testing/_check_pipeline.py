"""``check_pipeline``: a pipeline's gradients against the exact gradients of its own
forward, and its outputs across layouts."""

import dataclasses
import functools
import math as _math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import UnsupportedCase
from .._numerics import precision as _precision
from .._runner import routes as _routes
from .._runner.contracts import STAGES
from .._runner.routes import unsafe_for_tiles
from .._runner.runner import recording
from .._annotations import typecheck
from .._config import KDAOptions
from .._validate import prepare_options
from ..pipeline import KDAPipeline
from ._cases import (
    _CU, _CU_LONG, _DENSE, _FLA, _HEADS, _LONG, _WIDE, Case, _dtname, _Packed, _weights, check_dtypes, holds_no_array,
    tolerance,
)
from ._compare import _compare, _rel, central_differences
from ._report import Report, _Collector, _error
from ._runs import (
    _ahead, _call, _call_of, _jit, _outputs_ahead, _outputs_program, _pipeline_outputs, release_near_the_mapping_limit,
)


@typecheck
def check_pipeline(
    pipeline: KDAPipeline,
    *,
    dtype: Any = jnp.float64,
    full: bool = False,
    tol: Optional[float] = None,
) -> Report:
    """Check ``pipeline`` end to end, in ``dtype`` (float64 by default):

    * ``gradients``: ``jax.grad`` of ``chunk_kda(..., pipeline=pipeline)`` (loss
      ``sum(o w) + sum(ht wh)``, fixed random weights) against the exact gradients of the
      pipeline's own forward: ``jax.vjp`` through its forward stages, one sequence per
      chunk, the same-math Pallas stages replaced by their reference twins
      (``kdax._runner.routes.differentiable_forward``), for dense inputs with initial and
      final states (grouped value heads, K != V, ``scale=0.3``), packed varlen inputs with
      initial states and without (at chunk 64: two sequences shorter than a chunk, one
      of 32 chunks), FLA's in-kernel options with the softplus gate and
      ``allow_neg_eigval``, the lower-bound gate without ``A_log``, three value heads
      over one q/k head when the pipeline holds no array (``full``: the lower-bound gate with it,
      chunk 32, 33 chunks of 64 at K = V = 128, strong gates);
    * ``differences`` (float64; every case but the 33-chunk ones): the same gradients against
      central differences of ``chunk_kda`` itself along two random directions of every
      input and array option: no JAX derivative enters (a forward stage's ``custom_vjp``
      runs on both sides of ``gradients``);
    * ``forward``: the outputs against that differentiable forward's;
    * ``layouts``: the outputs (o, final states) of dense rows against the same sequences
      packed, per-sequence and sharing chunks, and a tiled forward (tiles of one chunk)
      against the whole one.

    A float64 ``dtype`` needs JAX's 64-bit mode (a ``ValueError`` otherwise). ``tol``
    (default ``tolerance(dtype)``; gradients 10x) on the relative RMS of every
    array; ``.ok`` exactly when every comparison is within it (a case the pipeline does
    not run, ``UnsupportedCase``, is a skip that says so).
    """
    check_dtypes((dtype,), "dtype", "check_pipeline")
    release_near_the_mapping_limit()  # (checks in a loop: each compiles programs JAX keeps)
    col = _Collector()
    tol = tolerance(dtype) if tol is None else tol
    pipeline = pipeline.with_precision(_precision.resolve(pipeline.precision, dtype))
    d = _dtname(dtype)
    sh = pipeline.share_chunks
    cases = [
        Case(f"dense {d}", dtype, **_DENSE),
        Case(f"packed+h0 {d}", dtype, B=1, T=_CU[-1], cu=_CU, share=sh),
        Case(f"packed chunk64 {d}", dtype, B=1, cu=_CU_LONG, share=sh, h0=False, **_LONG),
        Case(f"softplus {d}", dtype, options=_FLA + (("allow_neg_eigval", True),)),
        Case(f"lower-bound-noA {d}", dtype, options=_FLA + (("lower_bound", -5.0),), A_log=False),
    ]
    if holds_no_array(pipeline):  # (no per-head parameter: three value heads, not two)
        cases.append(Case(f"heads {d}", dtype, **_HEADS))
    if full:
        cases += [Case(f"lower-bound {d}", dtype, options=_FLA + (("lower_bound", -5.0),)),
                  Case(f"chunk32 {d}", dtype, T=100, chunk=32, K=16, V=16),
                  Case(f"chunk64 {d}", dtype, B=1, **_LONG, **_WIDE),
                  Case(f"strong {d}", dtype, T=40, strong=True)]
    subject = f"check_pipeline({', '.join(f'{n}={type(getattr(pipeline, n)).__name__}' for n in STAGES)})"
    # (every program, traced first and compiled meanwhile: kdax.testing._runs._ahead)
    for case in cases:
        _outputs_ahead(dataclasses.replace(pipeline, share_chunks=case.share), case, True)
        _exact_ahead(pipeline, case)
    for P, case in _layout_runs(pipeline, dtype):
        _outputs_ahead(P, case, False)
    for case in cases:
        _gradient_checks(col, pipeline, case, tol)
    dense = _layout_checks(col, pipeline, dtype, tol)
    return Report(subject, col.rows, {c.name: c.describe() for c in cases + [dense]})


def _gradient_checks(col, pipeline: KDAPipeline, case: Case, tol: float):
    """``forward`` and ``gradients`` rows of one case: ``chunk_kda``'s outputs and
    gradients through ``pipeline`` against its differentiable forward's (gradients ``10 tol``)."""
    gtol = 10 * tol
    P = dataclasses.replace(pipeline, share_chunks=case.share)
    try:
        o, ht, dgot, meta = _pipeline_outputs(P, case, True)
    except UnsupportedCase as e:
        col.add("gradients", case.name, None, f"UnsupportedCase ({e}): a case this pipeline does not run")
        return
    except Exception as e:
        col.add("gradients", case.name, False, "chunk_kda raised " + _error(e))
        return
    try:
        o_x, ht_x, (dx, darr) = _exact_grads(pipeline, case)
    except Exception as e:
        col.add("gradients", case.name, None if _routes.is_autodiff_failure(e) else False,
                "cannot differentiate the forward stages: " + _error(e))
        return
    route = _routes.backward_route(P)
    by_jax = [what for what, on in (("F5's transpose", route.output_vjp), ("B5 as F1's VJP", route.gate_vjp)) if on]
    path = "derived" if meta["derived"] else "six-stage" + (f" ({', '.join(by_jax)} by jax.vjp)" if by_jax else "")
    ok, det = _compare((o, ht), (o_x, ht_x), tol)
    col.add("forward", case.name, ok, f"{meta['layout']} layout vs the differentiable forward: {det}")
    got = dict(zip(_GRAD_NAMES, dgot[0]), **dgot[1])
    want = dict(zip(_GRAD_NAMES, dx), **darr)
    worst, where = _worst_gradient(got, want)
    col.add("gradients", case.name, worst <= gtol, f"{path} backward vs jax.vjp of its forward stages: worst "
                                                   f"d{where} rel-RMS {worst:.1e}, tol {gtol:.0e}")
    if "chunk64" not in case.name and jnp.dtype(case.dtype) == jnp.float64:  # (chunk64: 4 long forwards more)
        try:
            col.add("differences", case.name, *_differences(P, case, dgot))
        except Exception as e:
            col.add("differences", case.name, False, _error(e))


def _differences(P: KDAPipeline, case: Case, grads):
    """``differences`` (float64): ``jax.grad`` of the loss through ``P`` (``grads``) against
    central differences of ``chunk_kda`` itself along two random directions of every input
    and array option (``_compare.central_differences``). Independent of any JAX derivative:
    a forward stage's wrong ``custom_vjp``, which the differentiable forward runs too, fails
    here."""
    x, arrays, options = _call_of(case)
    names = list(_GRAD_NAMES) + sorted(arrays)
    at = dict(zip(_GRAD_NAMES, x), **arrays)
    g = dict(zip(_GRAD_NAMES, grads[0]), **grads[1])

    def loss(moved):
        moved = {n: jnp.asarray(m, at[n].dtype) for n, m in zip(names, moved)}
        o, ht, _, _ = _call(_outputs_program(), P, tuple(moved[n] for n in _GRAD_NAMES),
                            {n: moved[n] for n in arrays}, options, False)
        return float(np.sum(np.asarray(o, np.float64) * np.asarray(_weights(o.shape, jnp.float64, 1)))
                     + np.sum(np.asarray(ht) * np.asarray(_weights(ht.shape, ht.dtype, 2))))

    ok, det = central_differences(loss, [at[n] for n in names], [g[n] for n in names], seed=13)
    return ok, f"jax.grad of chunk_kda in {', '.join(names)}, {det}"


def _worst_gradient(got: dict, want: dict):
    """``(worst relative RMS, its input's name)`` of gradients ``got`` against ``want``
    (by input name; inf for a wrong shape or a non-finite gradient)."""
    worst, where = 0.0, ""
    for n, x in want.items():
        if x is None:
            continue
        y = np.asarray(got.get(n), np.float64)
        x = np.asarray(x, np.float64)
        if y.shape != x.shape or not np.isfinite(y).all():
            return _math.inf, n
        e = _rel(y, x)
        if e > worst:
            worst, where = e, n
    return worst, where


def _layout_checks(col, pipeline: KDAPipeline, dtype, tol: float):
    """``layouts`` rows: dense rows against the same sequences packed (per-sequence, shared
    chunks), and tiles of one chunk against the whole forward."""
    d = _dtname(dtype)
    (_, dense), *packed, tiled = _layout_runs(pipeline, dtype)
    try:
        od, hd, _, _ = _pipeline_outputs(pipeline.untiled(), dense, False)
        for P, pk in packed:
            op, hp, _, meta = _pipeline_outputs(P, pk, False)
            ok, det = _compare((op.reshape(od.shape), hp), (od, hd), tol)
            col.add("layouts", f"packed {'shared' if P.share_chunks else 'per-sequence'} {d}", ok,
                    f"{meta['layout']} layout vs dense rows: {det}")
        if unsafe_for_tiles(pipeline):
            col.add("layouts", f"tiles {d}", None, f"not tile-safe: {unsafe_for_tiles(pipeline)}")
        else:
            ot, ht_, _, _ = _pipeline_outputs(*tiled, False)
            ok, det = _compare((ot, ht_), (od, hd), tol)
            col.add("layouts", f"tiles {d}", ok, f"tiles of one chunk vs whole: {det}")
    except Exception as e:
        col.add("layouts", f"dense {d}", False, _error(e))
    return dense


def _layout_runs(pipeline: KDAPipeline, dtype) -> list:
    """``[(pipeline, case)]`` of the layout rows: the dense rows (untiled), the same
    sequences packed per-sequence and in shared chunks, the dense rows in tiles of one
    chunk."""
    dense = Case(f"dense {_dtname(dtype)}", dtype, **_DENSE)
    whole = pipeline.untiled()
    return ([(whole, dense)] + [(dataclasses.replace(whole, share_chunks=share), _Packed(dense, share))
                                for share in (False, True)]
            + [(dataclasses.replace(pipeline, tile=dense.B * dense.HV), dense)])


_GRAD_NAMES = ("q", "k", "v", "g", "beta")


def _exact_grads(pipeline: KDAPipeline, case: Case):
    """``(o, ht, (d inputs, d arrays))``: the forward of ``pipeline`` (untiled, one sequence
    per chunk, same-math Pallas stages as their references) differentiated by ``jax.vjp``
    at the cotangents ``_pipeline_outputs`` uses."""
    return _call(_exact_program(), *_exact_args(pipeline, case))


def _exact_ahead(pipeline: KDAPipeline, case: Case) -> None:
    """Start compiling what ``_exact_grads`` will run."""
    try:
        args = _exact_args(pipeline, case)
    except Exception:  # (the check reports it)
        return
    _ahead(_exact_program(), *args)


def _exact_args(pipeline: KDAPipeline, case: Case) -> tuple:
    diff, _ = _routes.differentiable_forward(pipeline)
    return (dataclasses.replace(diff, share_chunks=False), *_call_of(case))


def _exact_run(diff: KDAPipeline, x, arrays, options):
    """What ``_exact_grads`` compiles."""
    static = options.kw
    with recording(quiet=True):
        config, args, _ = prepare_options(*x, KDAOptions.from_kwargs(**static, **arrays))
        h0, A_log, dt_bias, cu = args[5:]

        def fwd(x, arrays):
            h0_ = arrays.get("initial_state")
            if h0_ is not None and static.get("state_v_first"):
                h0_ = jnp.swapaxes(h0_, -1, -2)
            o, final, _ = diff.run_forward(config, *x, h0_, arrays.get("A_log"), arrays.get("dt_bias"), cu)
            return o, final

        (o, ht), vjp = jax.vjp(fwd, x, arrays)
        wt = jnp.float64 if o.dtype == jnp.float64 else jnp.float32
        do = _weights(o.shape, wt, 1).astype(o.dtype)
        dht = _weights(ht.shape, ht.dtype, 2)
        return o, ht, vjp((do, dht))


@functools.cache
def _exact_program():
    # (one jitted function: cases of equal options and shapes share a program)
    return _jit(_exact_run)
