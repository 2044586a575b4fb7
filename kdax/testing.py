"""Conformance checks for stage authors (docs/stages.md, "Checking a stage").

``check_stage(stage, field)`` runs one stage on the arguments a pipeline gives its field
(recorded from a forward and backward of ``base``, the reference pipeline by default, over
a matrix of cases: dense, packed per-sequence and shared-chunk layouts, float64 / float32 /
bf16 inputs, FLA's in-kernel options, grouped value heads) and checks what the stage says
of itself: its output contract, every capability it declares, NaN isolation between
sequences, ``jax.jit`` / ``eqx.filter_jit`` / ``vmap`` / ``grad``, and, when it declares
KDA's math (``math = KDA``, or ``transposes`` KDA for a backward stage), its values against
its family's reference stage on the same arguments.

``check_pipeline(pipeline)`` compares a pipeline's gradients with the exact gradients of
its own forward (``jax.vjp`` through its forward stages, the same-math Pallas stages
differentiated as their reference twins: ``kdax._runner.derived.differentiable_forward``) and
its outputs across layouts (dense rows, packed per-sequence, shared chunks, tiles).

Both return a ``Report``: ``.ok`` (no check failed; skipped ones say why), ``.failed``,
and a table when printed, one row per (check, case).
"""

import dataclasses
import math as _math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._config import KDAOptions
from ._errors import StageContractError, UnsupportedCase
from ._layouts.layout import ChunkLayout
from ._layouts.tiles import Tiles
from ._layouts.tokens import Tokens, as_chunked
from ._numerics import precision as _precision
from ._runner import derived as _derived
from ._runner.capabilities import capabilities, negotiated
from ._runner.contracts import STAGES
from ._runner.runner import recording, run_stage
from ._typing import typecheck
from .pipeline import _RESET_FIELDS, KDAPipeline, _prepare
from .stages import KDA, AbstractGate, Activated, ReferenceGate

__all__ = ["Check", "Report", "Case", "check_stage", "check_pipeline", "default_cases", "tolerance"]


# -- reports ------------------------------------------------------------------------------


class Check(NamedTuple):
    """One row of a report: ``passed`` True, False, or None (skipped: ``detail`` says why)."""

    name: str
    case: str
    passed: Optional[bool]
    detail: str


class Report:
    """What ``check_stage`` / ``check_pipeline`` found: ``checks`` (one ``Check`` per
    check and case), ``ok`` (none failed), ``failed``, ``names_failed``; ``str(report)``
    is a table."""

    def __init__(self, subject: str, checks: Sequence[Check]):
        self.subject = subject
        self.checks = tuple(checks)

    @property
    def ok(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    @property
    def failed(self) -> tuple:
        return tuple(c for c in self.checks if c.passed is False)

    @property
    def names_failed(self) -> set:
        return {c.name for c in self.failed}

    def __str__(self) -> str:
        rows = [("check", "case", "result", "detail")]
        for c in self.checks:
            rows.append((c.name, c.case, {True: "pass", False: "FAIL", None: "skip"}[c.passed], c.detail))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{self.subject}: {'ok' if self.ok else f'{len(self.failed)} FAILED'}"]
        lines += ["  ".join(r[i].ljust(w[i]) for i in range(3)) + "  " + r[3] for r in rows]
        return "\n".join(lines)

    __repr__ = __str__


class _Collector:
    def __init__(self):
        self.rows: list = []

    def add(self, name, case, passed, detail=""):
        self.rows.append(Check(name, case, passed, detail))
        return passed


# -- cases ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration: shapes, layout, dtype and options of a ``chunk_kda`` call
    whose stage arguments a check runs on. ``cu`` packed ``cu_seqlens`` (B must be 1);
    ``share`` the pipeline's ``share_chunks``; ``options`` FLA's flags as
    ``(("use_qk_l2norm_in_kernel", True), ...)``; ``strong``: some log decays -1000."""

    name: str
    dtype: Any = jnp.float64
    B: int = 2
    T: int = 32
    H: int = 2
    HV: int = 2
    K: int = 8
    V: int = 8
    chunk: int = 16
    cu: Optional[tuple] = None
    share: bool = False
    h0: bool = True
    options: tuple = ()
    strong: bool = False
    seed: int = 0
    # Shared chunks: False records the arguments from a pipeline whose F1 leaves out the
    # log decay floor at sequence starts, so that every other stage's reset must be exact
    # on its own (the floor alone hides a dropped reset: e^floor is below rounding).
    floor: bool = True

    @property
    def opts(self) -> dict:
        return dict(self.options)

    @property
    def packed(self) -> bool:
        return self.cu is not None

    def inputs(self) -> tuple:
        """``(q, k, v, g, beta)`` and the keyword options of the call (in ``dtype``;
        ``A_log``, ``dt_bias`` float32 unless float64)."""
        r = np.random.default_rng(self.seed)
        B, T, H, HV, K, V = self.B, self.T, self.H, self.HV, self.K, self.V
        o = self.opts
        q = r.normal(size=(B, T, H, K))
        k = r.normal(size=(B, T, H, K)) / np.sqrt(K)
        v = r.normal(size=(B, T, HV, V))
        beta = r.normal(size=(B, T, HV)) if o.get("use_beta_sigmoid_in_kernel") else r.uniform(0.05, 0.95, (B, T, HV))
        if o.get("use_gate_in_kernel"):
            g = r.normal(size=(B, T, HV, K))
        else:
            g = -r.uniform(0.01, 0.5, size=(B, T, HV, K))
            if self.strong:
                g[r.uniform(size=g.shape) < 0.05] = -1000.0
        dt = jnp.dtype(self.dtype)
        pt = jnp.float64 if dt == jnp.float64 else jnp.float32
        kw = dict(chunk_size=self.chunk, output_final_state=True, **o)
        N = B if self.cu is None else len(self.cu) - 1
        if self.h0:
            kw["initial_state"] = jnp.asarray(r.normal(size=(N, HV, K, V)) * 0.3, pt)
        if o.get("use_gate_in_kernel"):
            kw["A_log"] = jnp.asarray(r.uniform(-1.0, 0.5, size=(HV,)), pt)
            kw["dt_bias"] = jnp.asarray(r.normal(size=(HV * K,)) * 0.5, pt)
        if self.cu is not None:
            kw["cu_seqlens"] = jnp.asarray(self.cu, jnp.int32)
        return tuple(jnp.asarray(x, dt) for x in (q, k, v, g, beta)), kw


_FLA = (("use_qk_l2norm_in_kernel", True), ("use_gate_in_kernel", True), ("use_beta_sigmoid_in_kernel", True))
_CU = (0, 7, 23, 40)


def _dtname(dt) -> str:
    return {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(jnp.dtype(dt).name,
                                                                                        jnp.dtype(dt).name)


def default_cases(dtypes=(jnp.float64, jnp.float32, jnp.bfloat16), full: bool = False, shared: bool = True) -> tuple:
    """The case matrix: dense rows in each dtype (float32 with -1000 gates); in the first
    dtype (every dtype with ``full``) packed varlen per-sequence, shared chunks (when
    ``shared``), FLA's in-kernel options, grouped value heads (HV = 2H). ``full`` adds a
    larger chunk, the lower-bound gate, shared chunks with initial states and strong gates."""
    dtypes = tuple(dtypes)
    cases = [Case(f"dense {_dtname(d)}", d, strong=jnp.dtype(d) == jnp.float32) for d in dtypes]
    for d in (dtypes if full else dtypes[:1]):
        n = _dtname(d)
        cases.append(Case(f"packed {n}", d, B=1, T=40, cu=_CU))
        if shared:
            cases.append(Case(f"shared {n}", d, B=1, T=40, cu=_CU, share=True, h0=False))
            cases.append(Case(f"shared-exact {n}", d, B=1, T=40, cu=_CU, share=True, h0=False, floor=False))
        cases.append(Case(f"fla-options {n}", d, options=_FLA))
        cases.append(Case(f"grouped {n}", d, H=1, HV=2))
    if full:
        d = dtypes[0]
        n = _dtname(d)
        cases += [
            Case(f"chunk32 {n}", d, T=100, chunk=32, K=16, V=16),
            Case(f"lower-bound {n}", d, options=_FLA + (("lower_bound", -5.0),)),
            Case(f"strong {n}", d, strong=True),
        ]
        if shared:
            cases.append(Case(f"shared+h0 {n}", d, B=1, T=40, cu=_CU, share=True, h0=True))
    return tuple(cases)


def tolerance(dtype) -> float:
    """Relative-RMS tolerance of a comparison of two computations of the same math from
    inputs of ``dtype`` (compute in float64 / float32): 1e-10, 1e-5, bf16/f16 5e-3."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return 1e-10
    if dtype == jnp.float32:
        return 1e-5
    return 5e-3


# -- recording the arguments of each stage ----------------------------------------------------


def _base(base: Optional[KDAPipeline]) -> KDAPipeline:
    return (KDAPipeline.reference() if base is None else base).untiled()


def _pipe_for(base: KDAPipeline, case: Case) -> KDAPipeline:
    p = dataclasses.replace(base, share_chunks=case.share, tile=None)
    if not case.floor:
        p = eqx.tree_at(lambda p: p.gate, p, _UnflooredGate())
    return p.with_precision(_precision.resolve(base.precision, case.dtype))


class _UnflooredGate(AbstractGate):
    """KDA's F1 without the log decay floor at sequence starts (``Case.floor``): G runs on
    through a chunk's earlier sequence, which the other stages' resets must cut exactly."""

    math: ClassVar[Optional[str]] = KDA
    accepts: ClassVar[frozenset] = frozenset({"reset", "tile_safe"})

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid, reset=None):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


_RECORDED: dict = {}


def _weights(shape, dtype, seed: int):
    """Fixed random loss weights, made with numpy: the same bits in every program (a
    ``jax.random`` draw may round differently once fused into two different programs)."""
    w = np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32)
    return jnp.asarray(w).astype(dtype)


def _record(pipe: KDAPipeline, case: Case, cache: bool):
    """The keyword arguments each stage of ``pipe`` got in one forward and backward
    (``loss = sum(o w) + sum(ht wh)``, fixed random weights), jitted; and what ran:
    ``(kwargs by field, layout, derived, error or None)``."""
    key = (case,)
    if cache and key in _RECORDED:
        return _RECORDED[key]
    (q, k, v, g, beta), kw = case.inputs()
    arrays = {n: x for n, x in kw.items() if n in ("initial_state", "A_log", "dt_bias")}
    static = {n: x for n, x in kw.items() if n not in arrays}
    meta = {}

    def run(x, arrays):
        with recording(quiet=True) as rec:
            opts = KDAOptions.from_kwargs(**static, **arrays)

            def loss(x):
                o, ht = pipe.apply(*x, opts)
                return (jnp.sum(o.astype(jnp.float32) * _weights(o.shape, jnp.float32, 1))
                        + jnp.sum(ht.astype(jnp.float32) * _weights(ht.shape, jnp.float32, 2)))

            err = None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if _derived.mismatches(pipe):  # derived backward: no backward stage runs
                        pipe.apply(*x, opts)
                    else:
                        jax.grad(loss)(x)
            except Exception as e:  # the stage under test may break the run: keep what was recorded
                err = e
        meta.update(layout=rec.layout, derived=rec.derived, error=err)
        return rec.inputs

    inputs = eqx.filter_jit(run)((q, k, v, g, beta), arrays)
    out = (inputs, meta.get("layout"), meta.get("derived"), meta.get("error"))
    if cache:
        _RECORDED[key] = out
    return out


# -- calling a stage -------------------------------------------------------------------------


def _with_stage(base: KDAPipeline, field: str, stage) -> KDAPipeline:
    return eqx.tree_at(lambda p: getattr(p, field), dataclasses.replace(base, fallback=False), stage)


def _for_stage(stage, kwargs: dict) -> dict:
    """``kwargs`` (what the reference pipeline passed) as the stage runner negotiates them
    for ``stage``: ``G_lo`` only if accepted, ``reset`` only if accepted (a stage that
    does not accept it is not run on shared chunks)."""
    kwargs = negotiated(stage, dict(kwargs))
    if "reset" in kwargs and not capabilities(type(stage)).reset:
        kwargs = {n: x for n, x in kwargs.items() if n != "reset"}
    return kwargs


def _run(pipe, field, kwargs):
    # (the stage as it declares itself: reset passed by its declaration, whatever its
    # math, and none of the pipeline's reset masks, which would hide a false one)
    with recording(quiet=True), _derived.as_declared():
        return run_stage(pipe, field, **kwargs)


_jit_run = eqx.filter_jit(_run)


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
    ``ref``'s, non-finite at the same places."""
    a, b = _leaves(out), dict(_leaves(ref))
    worst, where = 0.0, ""
    for path, x in a:
        if path not in b:
            continue
        y = b[path]
        if x.shape != y.shape:
            return False, f"{path}: shape {x.shape} != {y.shape}"
        bad = np.isfinite(x) != np.isfinite(y)
        if bad.any():
            return False, f"{path}: non-finite at {int(bad.sum())} places where the other is finite"
        e = _rel(x, y)
        if not e <= worst:
            worst, where = e, path
    return worst <= tol, f"rel-RMS {worst:.1e} ({where or '-'}), tol {tol:.0e}"


def _tile_of(kw: dict) -> Optional[dict]:
    """The arguments a forward stage gets on a tile of the input ``kw`` was recorded on
    (``kdax._layouts.tiles``: the pipeline's tiles are KDA problems with an initial state): chunks
    ``[c0, NC)``, ``c0`` where a packed sequence goes on from the chunk before (a carry),
    the arrays sliced, the layout as ``Tiles`` makes it and the state table with one
    carry per row (a fixed random state: any finite state may start a tile). None for a
    single chunk."""
    kw = {n: as_chunked(x) if isinstance(x, Tokens) else x for n, x in kw.items()}
    arrays = [x for n, x in kw.items() if n not in ("h0", "layout") and hasattr(x, "ndim") and x.ndim >= 3]
    if not arrays:
        return None
    NC = arrays[0].shape[1] if arrays[0].ndim == 3 else arrays[0].shape[2]
    if NC < 2:
        return None
    c0 = max(1, NC - 2)
    out = {}
    for n, x in kw.items():
        if n in ("h0", "layout") or not (hasattr(x, "ndim") and x.ndim >= 3):
            out[n] = x
        elif x.ndim == 3:  # valid, reset [R, NC, C]
            out[n] = x[:, c0:]
        else:  # [R, HV, NC, ...]
            out[n] = x[:, :, c0:]
    L = kw.get("layout")
    if isinstance(L, ChunkLayout):
        h0 = kw["h0"]
        tiles = Tiles(L, h0.shape[0], NC - c0)
        R = L.valid.shape[0]
        carry = 0.3 * _weights((R,) + tuple(h0.shape[1:]), h0.dtype, 5)
        out["layout"] = tiles.layout_of(c0, NC - c0, True)
        out["h0"] = tiles.table(h0, carry)
    return out


def _tile_read(out, tile: dict):
    """What the pipeline reads of a stage's output on a tile: of F4's final states, only
    the entries that end in the tile (``kdax._layouts.tiles``: ``collect``, ``carry_of``; the
    others are no sequence's there, their values unspecified)."""
    L = tile.get("layout")
    if not isinstance(L, ChunkLayout) or getattr(out, "final", None) is None:
        return out
    ends = np.unique(np.asarray(L.last))
    return dataclasses.replace(out, final=out.final[ends[ends >= 0]])


def _error(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


# -- check_stage --------------------------------------------------------------------------


def _owner_mask(shape, case: Case, R: int, NC: int, N: int, bad_seq: int):
    """Which elements of an output of ``shape`` belong to sequences other than
    ``bad_seq`` (None: not indexed by sequence)."""
    C = case.chunk
    if len(shape) >= 3 and shape[0] == R and shape[2] == NC:
        if not case.packed:
            m = np.arange(R) != bad_seq
            return m.reshape((R,) + (1,) * (len(shape) - 1))
        # per-sequence layout: sequence n occupies chunks [start_n, start_n + ceil(len_n / C))
        owner = np.full(NC, -1)
        c = 0
        for n in range(len(case.cu) - 1):
            m = -(-(case.cu[n + 1] - case.cu[n]) // C)
            owner[c:c + m] = n
            c += m
        m = owner != bad_seq
        return m.reshape((1, 1, NC) + (1,) * (len(shape) - 3))
    if len(shape) == 4 and shape[0] == N:
        m = np.arange(N) != bad_seq
        return m.reshape((N, 1, 1, 1))
    return None


def _nan_isolation(col, pipe, field, kw, clean, case: Case, name: str):
    """A NaN in one sequence's part of each per-token / per-chunk argument reaches no other
    sequence's outputs."""
    layout = kw.get("layout")
    ref = next((x for x in jax.tree.leaves(kw) if hasattr(x, "ndim") and x.ndim >= 4), None)
    if ref is None:
        return
    R, NC = ref.shape[0], ref.shape[2]
    N = len(case.cu) - 1 if case.packed else case.B
    bad_seq = 1 if case.packed else 0
    chunk = 1 if case.packed else 0
    row = 0 if case.packed else bad_seq
    clean_leaves = _leaves(clean)
    leaks = []
    tried = []
    for n, x in kw.items():
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 4
                and x.shape[0] == R and x.shape[2] == NC) or isinstance(x, Tokens):
            continue
        tried.append(n)
        idx = (row, 0, chunk) + (0,) * (x.ndim - 3)
        out = _jit_run(pipe, field, dict(kw, **{n: x.at[idx].set(jnp.nan)}))
        for (path, y), (_, y0) in zip(_leaves(out), clean_leaves):
            m = _owner_mask(y.shape, case, R, NC, N, bad_seq)
            if m is None:
                continue
            m = np.broadcast_to(m, y.shape)
            same = (y[m] == y0[m]) | (np.isnan(y[m]) & np.isnan(y0[m]))
            if not same.all():
                leaks.append(f"NaN in {n} reached {path} of another sequence")
                break
    del layout
    if tried:
        col.add("nan-isolation", name, not leaks,
                "; ".join(leaks[:3]) if leaks else f"NaN in sequence {bad_seq}'s {', '.join(tried)}: others unchanged")


def _transforms(col, pipe, field, stage, kw, out, kw2, out2, case: Case, tol: float):
    name = case.name
    arrs, static = eqx.partition(kw, eqx.is_array)
    # jax.jit, the stage closed over (its arrays constants)
    try:
        got = jax.jit(lambda a: _run(pipe, field, eqx.combine(a, static)))(arrs)
        col.add("jit", name, *_compare(got, out, max(tol * 1e-2, 1e-13)))
    except Exception as e:
        col.add("jit", name, False, _error(e))
    col.add("filter_jit", name, True, "every stage call of this report runs under eqx.filter_jit")
    # vmap over two cases' arguments stacked
    try:
        arrs2, static2 = eqx.partition(kw2, eqx.is_array)
        if jax.tree.structure(arrs) != jax.tree.structure(arrs2):
            raise ValueError("the two seeds' arguments differ in structure")
        stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), arrs, arrs2)
        got = eqx.filter_jit(eqx.filter_vmap(lambda a: _run(pipe, field, eqx.combine(a, static))))(stacked)
        r0 = _compare(jax.tree.map(lambda x: x[0], got), out, max(tol * 1e-2, 1e-12))
        r1 = _compare(jax.tree.map(lambda x: x[1], got), out2, max(tol * 1e-2, 1e-12))
        col.add("vmap", name, r0[0] and r1[0], f"{r0[1]}; {r1[1]}")
    except Exception as e:
        col.add("vmap", name, False, _error(e))
    # grad (forward stages: the derived backward differentiates them)
    if not STAGES[field].forward:
        return
    try:
        def loss(diff):
            p, a = diff
            o = _run(p, field, eqx.combine(a, static))
            xs = [x for x in jax.tree.leaves(o) if jnp.issubdtype(x.dtype, jnp.floating)]
            return sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0) * _weights(x.shape, x.dtype, 3 + i))
                       for i, x in enumerate(xs))

        grads = eqx.filter_jit(eqx.filter_grad(loss))((pipe, arrs))
        leaves = [np.asarray(x) for x in jax.tree.leaves(grads) if hasattr(x, "dtype")]
        finite = all(np.isfinite(x).all() for x in leaves)
        col.add("grad", name, finite, f"{len(leaves)} gradients, " + ("finite" if finite else "NON-FINITE"))
    except Exception as e:
        if _derived.reference_is_exact(field, stage):  # never differentiated: the derived backward uses the reference stage
            col.add("grad", name, None, f"not differentiable by JAX ({type(e).__name__}): the derived backward "
                                        f"differentiates {STAGES[field].reference.__name__} instead")
        elif _derived.is_autodiff_failure(e):
            col.add("grad", name, None, "not differentiable by JAX: a pipeline with it needs backward stages that "
                                        "transpose it (else DerivedBackwardError)")
        else:
            col.add("grad", name, False, _error(e))


def _pipeline_outputs(P: KDAPipeline, case: Case, grads: bool):
    """``(o, ht, grads or None, meta)`` of ``chunk_kda`` with pipeline ``P`` on ``case``'s
    inputs (loss ``sum(o w) + sum(ht wh)``), jitted; ``meta``: layout, derived, which
    implementation ran each field."""
    (q, k, v, g, beta), kw = case.inputs()
    arrays = {n: x for n, x in kw.items() if n in ("initial_state", "A_log", "dt_bias")}
    static = {n: x for n, x in kw.items() if n not in arrays}
    meta = {}

    def run(P, x, arrays):
        with recording(quiet=True) as rec, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opts = KDAOptions.from_kwargs(**static, **arrays)

            def loss(x, arrays):
                o, ht = P.apply(*x, KDAOptions.from_kwargs(**static, **arrays))
                val = (jnp.sum(o.astype(jnp.float64 if o.dtype == jnp.float64 else jnp.float32)
                               * _weights(o.shape, jnp.float64 if o.dtype == jnp.float64 else jnp.float32, 1))
                       + jnp.sum(ht * _weights(ht.shape, ht.dtype, 2)))
                return val, (o, ht)

            if grads:
                d, (o, ht) = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, arrays)
            else:
                o, ht = P.apply(*x, opts)
                d = None
        meta.update(layout=rec.layout, derived=rec.derived, ran={n: type(r[1]) for n, r in rec.ran.items()})
        return o, ht, d

    o, ht, d = eqx.filter_jit(run)(P, (q, k, v, g, beta), arrays)
    return o, ht, d, meta


def _capability_checks(col, base, field, stage, caps, dtype, full):
    """Every declared capability against the per-sequence layout / the untiled forward, in
    pipelines that take the routes the declaration selects whatever the stage's math
    (``kdax._runner.derived.as_declared``; a pipeline takes them only for KDA's math)."""
    with _derived.as_declared():
        _declared_capabilities(col, base, field, stage, caps, dtype, full)


def _declared_capabilities(col, base, field, stage, caps, dtype, full):
    P = _with_stage(base, field, stage)
    forward = STAGES[field].forward
    tol = tolerance(dtype)
    d = _dtname(dtype)
    if caps.reset and field in _RESET_FIELDS:
        case = Case(f"packed {d}", dtype, B=1, T=40, cu=_CU, h0=False)
        # (and with F1's floor left out, where the stage's own reset must be exact: Case.floor)
        for floor in (True, False) if field != "gate" else (True,):
            name = case.name if floor else f"{case.name} no-floor"
            try:
                Ps = P if floor else eqx.tree_at(lambda p: p.gate, P, _UnflooredGate())
                o1, h1, g1, m1 = _pipeline_outputs(dataclasses.replace(Ps, share_chunks=True), case, True)
                o0, h0, g0, m0 = _pipeline_outputs(dataclasses.replace(P, share_chunks=False), case, True)
                if m1["layout"] != "shared":
                    col.add("reset", name, None, f"the pipeline ran the {m1['layout']} layout, not shared chunks")
                elif not forward and (m1["derived"] or m1["ran"].get(field) is not type(stage)):
                    col.add("reset", name, None, "the pipeline did not run this backward stage (derived backward: "
                            "pass base= a pipeline whose forward it transposes)")
                else:
                    ok, det = _compare((o1, h1, g1), (o0, h0, g0), tol)
                    col.add("reset", name, ok, ("shared chunks vs per-sequence, outputs and gradients: " + det)
                            if ok else f"declares `reset` but shared chunks give other numbers than the per-sequence "
                                       f"layout: {det}")
            except UnsupportedCase as e:
                col.add("reset", name, None, f"UnsupportedCase ({e}): the pipeline falls back")
            except Exception as e:
                col.add("reset", name, False, _error(e))
    if caps.tile_safe and forward:
        if P._unsafe_for_tiles():
            col.add("tile_safe", "-", None, f"the base pipeline has stages that are not tile-safe: "
                                            f"{P._unsafe_for_tiles()}")
        else:
            cases = [Case(f"dense {d}", dtype, T=40), Case(f"packed {d}", dtype, B=1, T=40, cu=_CU)]
            if full and caps.reset and field in _RESET_FIELDS:
                cases.append(Case(f"shared {d}", dtype, B=1, T=40, cu=_CU, share=True, h0=False))
            for case in cases:
                try:
                    Pc = dataclasses.replace(P, share_chunks=case.share)
                    R = case.B if not case.packed else 1
                    ow, hw, _, _ = _pipeline_outputs(Pc, case, False)
                    ot, ht, _, _ = _pipeline_outputs(dataclasses.replace(Pc, tile=R * case.HV), case, False)
                    ok, det = _compare((ot, ht), (ow, hw), tol)
                    col.add("tile_safe", case.name, ok, ("tiles of one chunk vs whole: " + det) if ok else
                            f"declares `tile_safe` but tiles of one chunk give other numbers than the whole "
                            f"forward: {det}")
                except UnsupportedCase as e:
                    col.add("tile_safe", case.name, None, f"UnsupportedCase ({e}): the pipeline falls back")
                except Exception as e:
                    col.add("tile_safe", case.name, False, _error(e))
    if caps.half_stored:
        _half_stored_check(col, base, field, stage)


def _half_stored_check(col, base, field, stage):
    """``half_stored``: in a pipeline under ``"fast"`` (bf16 inputs), the stage given the
    stored intermediates in bf16 gives what it gives on their float32 copies (exact
    widenings: only the stage's own rounding differs)."""
    case = Case("dense bfloat16", jnp.bfloat16)
    try:
        P = _with_stage(_pipe_for(base, case), field, stage).with_precision("fast")
        kw = _record(P, case, False)[0].get(field) or {}
        half = sorted(n for n, x in kw.items() if n in _precision.STORED and getattr(x, "dtype", None) == jnp.bfloat16)
        if not half:
            col.add("half_stored", case.name, None, "the pipeline passes no bf16 intermediates to this field here")
            return
        ok, det = _compare(_jit_run(P, field, kw), _jit_run(P, field, _precision.widened(kw)), tolerance(case.dtype))
        col.add("half_stored", case.name, ok, (f"bf16 {', '.join(half)} vs float32 copies: " + det) if ok else
                f"declares `half_stored` but bf16 {', '.join(half)} give other numbers than float32 copies: {det}")
    except UnsupportedCase as e:
        col.add("half_stored", case.name, None, f"UnsupportedCase ({e}): the pipeline falls back")
    except Exception as e:
        col.add("half_stored", case.name, False, _error(e))


@typecheck
def check_stage(
    stage: eqx.Module,
    field: str,
    *,
    dtypes: Sequence[Any] = (jnp.float64, jnp.float32, jnp.bfloat16),
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
    ``default_cases(dtypes, full)``; shared chunks only when the stage declares
    ``reset``). Checks, one report row per check and case:

    * ``family``, ``declarations``: the class, ``accepts``, ``math`` / ``transposes``;
    * ``contract``: the output's container, shapes and dtypes (the pipeline's own check);
      a stage that raises ``UnsupportedCase`` is skipped there (the pipeline falls back);
    * ``finite``: finite outputs;
    * ``reference`` (a stage declaring KDA's math: ``math = KDA``; backward stages
      ``transposes`` KDA; B0 always): its outputs equal the reference stage's on the same
      arguments (``tolerance``: 1e-10 float64, 1e-5 float32, 5e-3 bf16 inputs), also on
      shared chunks without F1's floor (``shared-exact``: each stage's reset exact on its
      own) and, for a forward stage declaring ``tile_safe``, on a tile of each case (a
      carried state): the routes the pipeline takes on these declarations are KDA problems;
    * ``nan-isolation``: a NaN in one sequence's part of each per-token argument reaches no
      other sequence's outputs (dense rows; packed per-sequence chunks);
    * ``jit``, ``filter_jit``, ``vmap`` (two cases' arguments stacked), ``grad`` (forward
      stages; skipped where JAX cannot differentiate it);
    * declared capabilities, in pipelines that take the routes they select whatever the
      stage's math (``kdax._runner.derived.as_declared``): ``reset`` (shared chunks give the
      per-sequence layout's outputs and gradients, with F1's floor and without),
      ``tile_safe`` (tiles of one chunk give the whole forward's outputs), ``G_lo`` (float32: with G_lo no farther from the stage's own
      float64 output than without), ``tokens`` (views give the chunked copies' outputs),
      ``half_stored`` (under ``"fast"``, bf16 stored intermediates give what their float32
      copies give).
    """
    col = _Collector()
    if field not in STAGES:
        raise ValueError(f"field: expected one of {tuple(STAGES)}, got {field!r}.")
    info = STAGES[field]
    subject = f"check_stage({type(stage).__qualname__}, {field!r}: {info.step})"
    if not col.add("family", "-", isinstance(stage, info.family),
                   f"{type(stage).__qualname__} implements {info.family.__name__}"
                   if isinstance(stage, info.family) else f"not an implementation of {info.family.__name__}"):
        return Report(subject, col.rows)
    try:
        caps = capabilities(type(stage))
        says = (f"math={stage.math!r}" if info.forward else f"transposes={dict(getattr(stage, 'transposes', {}))}")
        decl = f"accepts {sorted(n for n in caps._fields if getattr(caps, n))}; {says}"
        readers = [f for f, bs in _derived.TRANSPOSED_BY.items() if field in bs]
        extra = [] if info.forward else [f for f in getattr(stage, "transposes", {}) if f not in readers]
        col.add("declarations", "-", not extra, decl + (f"; transposes fields it does not read: {extra} "
                                                       f"(it reads {readers})" if extra else ""))
    except Exception as e:
        col.add("declarations", "-", False, _error(e))
        return Report(subject, col.rows)
    kda = _derived.reference_is_exact(field, stage)
    cache_ok = base is None
    base = _base(base)
    if cases is None:
        cases = default_cases(dtypes, full, shared=caps.reset and field in _RESET_FIELDS)
    reference = info.reference()
    results = {}
    for case in cases:
        if not case.floor and field == "gate":
            continue  # (F1's reset is the floor itself: the "shared" case checks it)
        pipe = _pipe_for(base, case)
        recorded, layout, _, err = _record(pipe, case, cache_ok)
        if field not in recorded:
            col.add("contract", case.name, None if err is None or isinstance(err, UnsupportedCase) else False,
                    "the pipeline does not run this stage here" + ("" if err is None else f" ({_error(err)})"))
            continue
        full_kw = recorded[field]
        if case.share and not caps.reset:
            continue
        kw = _for_stage(stage, full_kw)
        P = _with_stage(pipe, field, stage)
        try:
            out = _jit_run(P, field, kw)
        except UnsupportedCase as e:
            col.add("contract", case.name, None, f"UnsupportedCase ({e}): the pipeline falls back")
            continue
        except StageContractError as e:
            col.add("contract", case.name, False, _error(e))
            continue
        except Exception as e:
            col.add("contract", case.name, False, "raised " + _error(e))
            continue
        col.add("contract", case.name, True, f"{layout} layout: container, shapes, dtypes as the pipeline checks")
        leaves = _leaves(out)
        bad = [p for p, x in leaves if not np.isfinite(x).all()]
        col.add("finite", case.name, not bad, "all finite" if not bad else f"non-finite: {', '.join(bad[:4])}")
        tol = tolerance(case.dtype)
        if kda:
            try:
                want = _jit_run(_with_stage(pipe, field, reference), field, _for_stage(reference, full_kw))
                ok, det = _compare(out, want, tol)
                col.add("reference", case.name, ok, f"vs {reference.__class__.__name__}: {det}" if ok else
                        f"declares KDA's math but differs from {reference.__class__.__name__}: {det}")
            except Exception as e:
                col.add("reference", case.name, False, _error(e))
            # and on a tile of it, where the pipeline runs a tile-safe forward stage
            tile = _tile_of(full_kw) if info.forward and caps.tile_safe else None
            if tile is not None:
                try:
                    got = _jit_run(P, field, _for_stage(stage, tile))
                    want = _jit_run(_with_stage(pipe, field, reference), field, _for_stage(reference, tile))
                    ok, det = _compare(_tile_read(got, tile), _tile_read(want, tile), tol)
                    col.add("reference", case.name + " tile", ok, f"a tile (carried state) vs "
                            f"{reference.__class__.__name__}: {det}" if ok else f"declares KDA's math but differs from "
                            f"{reference.__class__.__name__} on a tile (carried state): {det}")
                except Exception as e:
                    col.add("reference", case.name + " tile", False, _error(e))
        if case.name.startswith(("dense", "packed")) and jnp.dtype(case.dtype) == jnp.dtype(dtypes[0]):
            try:
                _nan_isolation(col, P, field, kw, out, case, case.name)
            except Exception as e:
                col.add("nan-isolation", case.name, False, _error(e))
        results[case.name] = (P, kw, out, full_kw)
    # transformations, on the first dense case
    first = next((c for c in cases if c.name.startswith("dense") and c.name in results), None)
    if first is not None:
        P, kw, out, _ = results[first.name]
        c2 = dataclasses.replace(first, seed=1)
        rec2 = _record(_pipe_for(base, c2), c2, cache_ok)[0]
        if field in rec2:
            kw2 = _for_stage(stage, rec2[field])
            try:
                out2 = _jit_run(P, field, kw2)
                _transforms(col, P, field, stage, kw, out, kw2, out2, first, tolerance(first.dtype))
            except Exception as e:
                col.add("vmap", first.name, False, _error(e))
    _capability_checks(col, base, field, stage, caps, dtypes[0], full)
    # G_lo: float32 with strong gates, against the stage's own float64 output
    f32 = next((c for c in cases if c.name.startswith("dense") and jnp.dtype(c.dtype) == jnp.float32), None)
    if caps.G_lo and f32 is not None and f32.name in results:
        P, kw, out, full_kw = results[f32.name]
        if "G_lo" not in full_kw or full_kw["G_lo"] is None:
            col.add("G_lo", f32.name, None, "the pipeline passes no G_lo to this field")
        else:
            try:
                twin = dataclasses.replace(f32, name=f32.name + "->f64", dtype=jnp.float64)
                (x32, kw32) = f32.inputs()
                rec64 = _record(_pipe_for(base, twin), _Twin(twin, x32, kw32), False)[0]
                truth = _jit_run(_with_stage(_pipe_for(base, twin), field, stage), field,
                                 _for_stage(stage, rec64[field]))
                without = _jit_run(P, field, {n: x for n, x in kw.items() if n != "G_lo"})
                e_with = max(_rel(x, y) for (_, x), (_, y) in zip(_leaves(out), _leaves(truth)))
                e_without = max(_rel(x, y) for (_, x), (_, y) in zip(_leaves(without), _leaves(truth)))
                ok = e_with <= 1.5 * e_without + 1e-7
                col.add("G_lo", f32.name, ok, f"float32 error vs its float64 output: {e_with:.1e} with G_lo, "
                                              f"{e_without:.1e} without" + ("" if ok else " (G_lo makes it worse)"))
            except Exception as e:
                col.add("G_lo", f32.name, False, _error(e))
    # tokens: views of the caller's arrays, in a pipeline with the stage
    if caps.tokens:
        case = Case(f"dense {_dtname(dtypes[0])}", dtypes[0])
        try:
            P = _with_stage(_pipe_for(base, case), field, stage)
            rec = _record(P, case, False)[0]
            kw = rec.get(field)
            if kw is None or not any(isinstance(x, Tokens) for x in kw.values()):
                col.add("tokens", case.name, None, "the pipeline passes no Tokens views to this field here")
            else:
                views = _jit_run(P, field, kw)
                copies = _jit_run(P, field, {n: as_chunked(x) for n, x in kw.items()})
                ok, det = _compare(views, copies, tolerance(case.dtype))
                col.add("tokens", case.name, ok, "views vs chunked copies: " + det)
        except Exception as e:
            col.add("tokens", case.name, False, _error(e))
    return Report(subject, col.rows)


class _Twin:
    """A case whose inputs are another case's, cast (the float64 twin of a float32 case)."""

    def __init__(self, case: Case, x, kw):
        self.case, self.x, self.kw = case, x, kw

    def __getattr__(self, name):
        return getattr(self.case, name)

    def inputs(self):
        dt = self.case.dtype
        return (tuple(a.astype(dt) for a in self.x),
                {n: (a.astype(dt) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a)
                 for n, a in self.kw.items()})


# -- check_pipeline ---------------------------------------------------------------------------


_GRAD_NAMES = ("q", "k", "v", "g", "beta")


def _exact_grads(pipeline: KDAPipeline, case: Case):
    """``(o, ht, (d inputs, d arrays))``: the forward of ``pipeline`` (untiled, one sequence
    per chunk, same-math Pallas stages as their references) differentiated by ``jax.vjp``
    at the cotangents ``_pipeline_outputs`` uses."""
    diff, _ = _derived.differentiable_forward(pipeline)
    diff = dataclasses.replace(diff, share_chunks=False)
    (q, k, v, g, beta), kw = case.inputs()
    arrays = {n: x for n, x in kw.items() if n in ("initial_state", "A_log", "dt_bias")}
    static = {n: x for n, x in kw.items() if n not in arrays}

    def run(x, arrays):
        with recording(quiet=True):
            config, args = _prepare(*x, **static, **arrays)
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

    return eqx.filter_jit(run)((q, k, v, g, beta), arrays)


class _Packed:
    """The dense case's sequences packed into one row (cu_seqlens [0, T, 2T])."""

    def __init__(self, case: Case, share: bool):
        self.case = dataclasses.replace(case, name=f"{case.name} packed", B=1, T=2 * case.T,
                                        cu=(0, case.T, 2 * case.T), share=share)
        self.dense = case

    def __getattr__(self, name):
        return getattr(self.case, name)

    def inputs(self):
        x, kw = self.dense.inputs()
        x = tuple(a.reshape((1, -1) + a.shape[2:]) for a in x)
        kw = dict(kw, cu_seqlens=jnp.asarray(self.case.cu, jnp.int32))
        return x, kw


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
      (``kdax._runner.derived.differentiable_forward``), for dense inputs with initial and
      final states, packed varlen inputs with and without initial states, FLA's in-kernel
      options (``full``: grouped value heads, a larger chunk);
    * ``forward``: the outputs against that differentiable forward's;
    * ``layouts``: the outputs (o, final states) of dense rows against the same sequences
      packed, per-sequence and sharing chunks, and a tiled forward (tiles of one chunk)
      against the whole one.

    ``tol`` (default ``tolerance(dtype)``; gradients 10x) on the relative RMS of every
    array; ``.ok`` exactly when every comparison is within it.
    """
    col = _Collector()
    tol = tolerance(dtype) if tol is None else tol
    gtol = 10 * tol
    pipeline = pipeline.with_precision(_precision.resolve(pipeline.precision, dtype))
    d = _dtname(dtype)
    cases = [
        Case(f"dense {d}", dtype, T=40),
        Case(f"packed+h0 {d}", dtype, B=1, T=40, cu=_CU, share=pipeline.share_chunks),
        Case(f"packed {d}", dtype, B=1, T=40, cu=_CU, share=pipeline.share_chunks, h0=False),
        Case(f"fla-options {d}", dtype, options=_FLA),
    ]
    if full:
        cases += [Case(f"grouped {d}", dtype, H=1, HV=2, T=40),
                  Case(f"chunk32 {d}", dtype, T=100, chunk=32, K=16, V=16),
                  Case(f"strong {d}", dtype, T=40, strong=True)]
    subject = f"check_pipeline({', '.join(f'{n}={type(getattr(pipeline, n)).__name__}' for n in STAGES)})"
    for case in cases:
        P = dataclasses.replace(pipeline, share_chunks=case.share)
        try:
            o, ht, dgot, meta = _pipeline_outputs(P, case, True)
        except UnsupportedCase as e:
            col.add("gradients", case.name, None, f"UnsupportedCase ({e}): a case this pipeline does not run")
            continue
        except Exception as e:
            col.add("gradients", case.name, False, "chunk_kda raised " + _error(e))
            continue
        try:
            o_x, ht_x, (dx, darr) = _exact_grads(pipeline, case)
        except Exception as e:
            col.add("gradients", case.name, None if _derived.is_autodiff_failure(e) else False,
                    "cannot differentiate the forward stages: " + _error(e))
            continue
        path = "derived" if meta["derived"] else "six-stage"
        ok, det = _compare((o, ht), (o_x, ht_x), tol)
        col.add("forward", case.name, ok, f"{meta['layout']} layout vs the differentiable forward: {det}")
        worst, where, okg = 0.0, "", True
        got = dict(zip(_GRAD_NAMES, dgot[0]), **dgot[1])
        want = dict(zip(_GRAD_NAMES, dx), **darr)
        for n, x in want.items():
            if x is None:
                continue
            y = np.asarray(got.get(n), np.float64)
            x = np.asarray(x, np.float64)
            if y.shape != x.shape or not np.isfinite(y).all():
                okg, where, worst = False, n, _math.inf
                break
            e = _rel(y, x)
            if e > worst:
                worst, where = e, n
        okg = okg and worst <= gtol
        col.add("gradients", case.name, okg, f"{path} backward vs jax.vjp of its forward stages: worst d{where} "
                                             f"rel-RMS {worst:.1e}, tol {gtol:.0e}")
    # layouts: dense rows vs the same sequences packed (per-sequence, shared), tiles
    dense = Case(f"dense {d}", dtype, T=40)
    try:
        od, hd, _, _ = _pipeline_outputs(pipeline.untiled(), dense, False)
        for share in (False, True):
            pk = _Packed(dense, share)
            P = dataclasses.replace(pipeline.untiled(), share_chunks=share)
            op, hp, _, meta = _pipeline_outputs(P, pk, False)
            ok, det = _compare((op.reshape(od.shape), hp), (od, hd), tol)
            col.add("layouts", f"packed {'shared' if share else 'per-sequence'} {d}", ok,
                    f"{meta['layout']} layout vs dense rows: {det}")
        if pipeline._unsafe_for_tiles():
            col.add("layouts", f"tiles {d}", None, f"not tile-safe: {pipeline._unsafe_for_tiles()}")
        else:
            ot, ht_, _, _ = _pipeline_outputs(dataclasses.replace(pipeline, tile=dense.B * dense.HV), dense, False)
            ok, det = _compare((ot, ht_), (od, hd), tol)
            col.add("layouts", f"tiles {d}", ok, f"tiles of one chunk vs whole: {det}")
    except Exception as e:
        col.add("layouts", f"dense {d}", False, _error(e))
    return Report(subject, col.rows)
