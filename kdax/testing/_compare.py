"""Comparing two outputs of a stage or a pipeline: relative RMS over every array leaf,
non-finite values at the same places and of the same kind (NaN, +inf, -inf)."""

import dataclasses

import jax
import numpy as np

from ..stages import Activated


def _named(path: str) -> str:
    """A leaf's path from ``_leaves`` as a report says it (a single array's path is empty)."""
    return path or "the output"


def _leaves(out) -> list:
    """``[(path, float64 numpy array)]`` of an output, made comparable: ``Activated``'s
    ``G`` as ``G + G_lo`` (a gate may return G alone, or split it), ``G_lo`` left out."""
    lo = None
    if isinstance(out, Activated):
        lo = None if out.G_lo is None else np.asarray(out.G_lo, np.float64)
        out = dataclasses.replace(out, G_lo=None)
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    got = [(jax.tree_util.keystr(p), np.asarray(x, np.float64)) for p, x in flat if hasattr(x, "shape")]
    if lo is not None:
        got = [(p, x + lo if p == ".G" else x) for p, x in got]
    return got


def _rel(x, ref) -> float:
    """Relative RMS over the positions where both are finite (NaN positions compared apart)."""
    ok = np.isfinite(x) & np.isfinite(ref)
    if not ok.any():
        return 0.0
    d = np.sqrt(np.mean((x[ok] - ref[ok]) ** 2))
    den = np.sqrt(np.mean(ref[ok] ** 2))
    return float(d / den) if den > 0 else float(d)


def _compare(out, ref, tol: float):
    """``(passed, detail)``: every leaf of ``out`` within ``tol`` (relative RMS) of
    ``ref``'s, non-finite at the same places and of the same kind (NaN, +inf, -inf)."""
    a, b = _leaves(out), dict(_leaves(ref))
    worst, where = 0.0, ""
    for key, x in a:
        if key not in b:
            continue
        y, path = b[key], _named(key)
        if x.shape != y.shape:
            return False, f"{path}: shape {x.shape} != {y.shape}"
        bad = np.isfinite(x) != np.isfinite(y)
        if bad.any():
            return False, f"{path}: non-finite at {int(bad.sum())} places where the other is finite"
        other = ~np.isfinite(x) & (x != y) & ~(np.isnan(x) & np.isnan(y))
        if other.any():
            i = np.argwhere(other)[0]
            return False, (f"{path}: non-finite of another kind at {int(other.sum())} places ({x[tuple(i)]} where "
                           f"the other has {y[tuple(i)]}, at {tuple(int(j) for j in i)})")
        e = _rel(x, y)
        if not e <= worst:
            worst, where = e, path
    return worst <= tol, f"rel-RMS {worst:.1e} ({where or '-'}), tol {tol:.0e}"


def central_differences(loss, xs, gs, seed: int, step: float = 1e-6, tol: float = 1e-6):
    """``(passed, detail)``: gradients ``gs`` of ``loss`` (a float from a list of float64
    arrays like ``xs``) at ``xs`` against central differences along two random directions,
    each array's part scaled by its values' RMS: ``|fd - g.d|`` over ``sum |g d|`` (no
    cancellation hides an error) at most ``tol`` (float64 rounding and the step's
    truncation: ~1e-10). For a float64 check only."""
    xs = [np.asarray(a, np.float64) for a in xs]
    gs = [np.asarray(g, np.float64) for g in gs]
    rng, worst = np.random.default_rng(seed), 0.0
    for _ in range(2):
        ds = [rng.standard_normal(a.shape) * (np.sqrt(np.mean(np.square(a))) or 1.0) for a in xs]
        fd = (loss([a + step * d for a, d in zip(xs, ds)]) - loss([a - step * d for a, d in zip(xs, ds)])) / (2 * step)
        ad = sum(float(np.sum(g * d)) for g, d in zip(gs, ds))
        size = sum(float(np.sum(np.abs(g * d))) for g, d in zip(gs, ds)) or 1.0
        worst = max(worst, abs(fd - ad) / size)
    return worst <= tol, f"against central differences along 2 random directions: {worst:.1e} (tol {tol:.0e})"
