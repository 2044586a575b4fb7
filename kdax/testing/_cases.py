"""The inputs the checks run on: ``Case`` (one configuration of a ``chunk_kda`` call and
its random inputs), the default matrix of cases, the tolerance of a comparison, and the
fixed random weights of the checks' losses."""

import dataclasses
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    """One input configuration: shapes, layout, dtype and options of a ``chunk_kda`` call
    whose stage arguments a check runs on. ``cu`` packed ``cu_seqlens`` (B must be 1);
    ``share`` the pipeline's ``share_chunks``; ``options`` FLA's flags as
    ``(("use_qk_l2norm_in_kernel", True), ...)``; ``strong``: some log decays -1000 or -inf;
    ``scale`` the call's ``scale`` (None: the default ``K ** -0.5``); ``A_log``: with the
    in-kernel gate, pass ``A_log`` (False: the lower-bound gate's form without it);
    ``precision`` the pipeline's precision policy (None: the base pipeline's);
    ``overflow`` ``(input, sequence, size)``: that packed sequence's tokens of that input
    set to ``±size`` (their signs kept), finite values whose products overflow."""

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
    scale: Optional[float] = None
    A_log: bool = True
    precision: Optional[str] = None
    overflow: Optional[tuple] = None

    def describe(self) -> str:
        """One line: what the case gives the stages (its row of a report's legend)."""
        parts = [f"{jnp.dtype(self.dtype).name}", f"B={self.B} T={self.T} H={self.H} HV={self.HV} "
                 f"K={self.K} V={self.V} chunk={self.chunk}"]
        if self.cu is not None:
            parts.append(f"cu_seqlens={list(self.cu)} " + ("shared chunks" if self.share else "per-sequence"))
        if not self.floor:
            parts.append("F1 without the floor at sequence starts")
        parts.append("scale=" + ("K**-0.5" if self.scale is None else f"{self.scale:g}"))
        parts.append("initial states" if self.h0 else "no initial states")
        o = self.opts
        if o.get("use_gate_in_kernel"):
            form = "lower-bound" if o.get("lower_bound") is not None else "softplus"
            parts.append(f"{form} gate in kernel ({'A_log, ' if self.A_log else 'no A_log, '}dt_bias"
                         + (f", lower_bound={o['lower_bound']:g})" if o.get("lower_bound") is not None else ")"))
        for flag, what in (("use_qk_l2norm_in_kernel", "l2norm"), ("use_beta_sigmoid_in_kernel", "beta sigmoid"),
                           ("allow_neg_eigval", "allow_neg_eigval")):
            if o.get(flag):
                parts.append(what)
        if self.strong:
            parts.append("5% of log decays -1000 or -inf")
        if self.precision is not None:
            parts.append(f"precision {self.precision!r}")
        if self.overflow is not None:
            parts.append("sequence {1}'s {0} at ±{2:g}".format(*self.overflow))
        return ", ".join(parts)

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
        if o.get("use_gate_in_kernel"):  # (wide: softplus and sigmoid past their linear parts, |x| > 5)
            g = r.normal(size=(B, T, HV, K)) * 2.5
        else:
            g = -r.uniform(0.01, 0.5, size=(B, T, HV, K))
            if self.strong:  # below float32's floor; -inf too: a hard forget (the recurrence's exp(g) = 0)
                u = r.uniform(size=g.shape)
                g[u < 0.05] = -1000.0
                g[u < 0.02] = -np.inf
        if self.overflow is not None:
            name, n, size = self.overflow
            x = dict(q=q, k=k, v=v)[name]
            x[:, self.cu[n]:self.cu[n + 1]] = np.where(x[:, self.cu[n]:self.cu[n + 1]] < 0, -size, size)
        dt = jnp.dtype(self.dtype)
        pt = jnp.float64 if dt == jnp.float64 else jnp.float32
        kw = dict(chunk_size=self.chunk, output_final_state=True, **o)
        if self.scale is not None:
            kw["scale"] = self.scale
        N = B if self.cu is None else len(self.cu) - 1
        if self.h0:
            kw["initial_state"] = _device(r.normal(size=(N, HV, K, V)) * 0.3, pt)
        if o.get("use_gate_in_kernel"):
            A_log = _device(r.uniform(-1.0, 0.5, size=(HV,)), pt)
            if self.A_log:
                kw["A_log"] = A_log
            kw["dt_bias"] = _device(r.normal(size=(HV * K,)) * 0.5, pt)
        if self.cu is not None:
            kw["cu_seqlens"] = _device(self.cu, jnp.int32)
        return tuple(_device(x, dt) for x in (q, k, v, g, beta)), kw


# FLA's in-kernel options, all on; six packed sequences of 7, 16, 17, 4, 2 and 6 tokens
# (at chunk 16: shorter than a chunk, exactly one, longer than one; then more, as a stage
# may treat the first few alike).
_FLA = (("use_qk_l2norm_in_kernel", True), ("use_gate_in_kernel", True), ("use_beta_sigmoid_in_kernel", True))
_CU = (0, 7, 23, 40, 44, 46, 52)
# The dense cases' shapes: grouped value heads (HV = 2H), K != V and a scale other than
# the default, so that a stage reading a width or the scale from the wrong place (V ** -0.5
# for K ** -0.5, its own K ** -0.5 for the call's scale) gives other numbers.
_DENSE = dict(T=40, H=1, HV=2, K=8, V=4, scale=0.3)
# Every other case has two value heads, as a stage may hold per-head parameters. A stage or
# pipeline that holds no array gets this one besides: three value heads over one q/k head
# (B = 2 rows), so that one which takes the head count for 2 (a literal, a reshape) fails.
_HEADS = dict(_DENSE, HV=3)
# The API's default chunk size over 33 chunks (2064 tokens), at Kimi Linear's widths
# (``_WIDE``) where a stage is checked alone: past every block of up to 32 chunks and of
# up to 64 channels a stage may loop over, carrying a state, a sum or an index from block
# to block (a kernel whose grid walks blocks, right on the other cases' 1-3 chunks of 8
# channels). Two heads, as in the other cases (a stage may hold per-head parameters).
_LONG = dict(T=2064, chunk=64)
_WIDE = dict(K=128, V=128)
# Packed at chunk 64: two sequences shorter than a chunk, then one of 32 chunks (in shared
# chunks, three sequences in the first chunk).
_CU_LONG = (0, 7, 40, 2064)


def holds_no_array(module) -> bool:
    """Whether ``module`` (a stage or a pipeline) holds no array: no per-head parameter
    that would fix its head count (the ``heads`` case is for such modules alone)."""
    return not jax.tree.leaves(eqx.filter(module, eqx.is_array))


def _dtname(dt) -> str:
    """A dtype's short name in case names: f64, f32, bf16, f16."""
    return {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(jnp.dtype(dt).name,
                                                                                        jnp.dtype(dt).name)


DTYPES = (jnp.float64, jnp.float32, jnp.bfloat16, jnp.float16)


def default_cases(dtypes=DTYPES, full: bool = False, shared: bool = True, heads: bool = False) -> tuple:
    """The case matrix (``Case.describe`` says what each gives the stages):

    * ``dense`` in each dtype: B = 2, T = 40 (a partial last chunk), grouped value heads
      (HV = 2H), K = 8 != V = 4, ``scale=0.3``, initial states (float32 with gates at
      -1000 and -inf);
    * with ``heads`` (for a stage that ``holds_no_array``), ``heads`` in the first dtype:
      ``dense`` with three value heads (HV = 3H; every other case has two);
    * in the first dtype (every dtype with ``full``): ``packed`` varlen per-sequence with
      initial states (six sequences; log decays at -1000 and -inf); ``shared`` and ``shared-exact`` chunks (when
      ``shared``: F1's floor at sequence starts, and without it); ``softplus`` (FLA's
      in-kernel options: l2norm, softplus gate with ``A_log``/``dt_bias``, beta sigmoid,
      ``allow_neg_eigval``; chunk 32); ``lower-bound`` (the lower-bound gate with
      ``A_log``; V = 16 > K = 8) and ``lower-bound-noA`` (without ``A_log``, nor initial
      states: the one dense case without them); ``chunk64``
      (the API's default chunk size, T = 2064: 33 chunks, K = V = 128); ``short`` (T = 12
      <= C = 16: one partial chunk; log decays at -1000 and -inf);
    * ``full`` adds strong gates in the first dtype and shared chunks with initial states.
    """
    dtypes = tuple(dtypes)
    cases = [Case(f"dense {_dtname(d)}", d, strong=jnp.dtype(d) == jnp.float32, **_DENSE) for d in dtypes]
    if heads:
        cases.append(Case(f"heads {_dtname(dtypes[0])}", dtypes[0], **_HEADS))
    for d in (dtypes if full else dtypes[:1]):
        n = _dtname(d)
        cases.append(Case(f"packed {n}", d, B=1, T=_CU[-1], cu=_CU, strong=True))
        if shared:
            cases.append(Case(f"shared {n}", d, B=1, T=_CU[-1], cu=_CU, share=True, h0=False))
            cases.append(Case(f"shared-exact {n}", d, B=1, T=_CU[-1], cu=_CU, share=True, h0=False, floor=False))
        cases += [
            Case(f"softplus {n}", d, T=40, chunk=32, options=_FLA + (("allow_neg_eigval", True),)),
            Case(f"lower-bound {n}", d, V=16, options=_FLA + (("lower_bound", -5.0),)),
            Case(f"lower-bound-noA {n}", d, options=_FLA + (("lower_bound", -5.0),), A_log=False, h0=False),
            Case(f"chunk64 {n}", d, B=1, **_LONG, **_WIDE),
            Case(f"short {n}", d, T=12, strong=True),
        ]
    if full:
        d = dtypes[0]
        n = _dtname(d)
        cases.append(Case(f"strong {n}", d, strong=True))
        if shared:
            cases.append(Case(f"shared+h0 {n}", d, B=1, T=_CU[-1], cu=_CU, share=True, h0=True))
    return tuple(cases)


def x64_on() -> bool:
    """Whether JAX's 64-bit mode is on (in this thread: ``jax.enable_x64`` counts)."""
    return bool(jax.config.read("jax_enable_x64"))


def _said(dtypes) -> str:
    """``dtypes`` by name for an error message (``repr`` of what is no dtype)."""
    def name(d):
        try:
            return repr(d) if d is None else jnp.dtype(d).name
        except TypeError:
            return repr(d)

    try:
        return "(" + ", ".join(name(d) for d in dtypes) + ")"
    except TypeError:
        return repr(dtypes)


def check_dtypes(dtypes, argument: str, caller: str) -> None:
    """A ``ValueError`` naming ``argument`` when ``dtypes`` is empty, holds a dtype outside
    ``DTYPES`` (an integer dtype ran and failed 9 of 11 rows of a correct stage), or float64
    while JAX's 64-bit mode is off (those cases would compute in float32 and be compared
    at float64's tolerance, so a correct stage would fail: the reference F1's ``reset`` and
    ``tile_safe`` rows did, at 3e-7)."""
    try:  # (None is no dtype here, though numpy reads it as float64)
        got = None if any(d is None for d in dtypes) else tuple(jnp.dtype(d) for d in dtypes)
    except TypeError:
        got = None
    allowed = tuple(jnp.dtype(d) for d in DTYPES)
    if not got or any(d not in allowed for d in got):
        raise ValueError(f"{argument}: {caller} expected one or more of {', '.join(d.name for d in allowed)}, got "
                         f"{_said(dtypes)}.")
    if jnp.dtype(jnp.float64) in got and not x64_on():
        raise ValueError(
            f"{argument}: {caller} was asked for float64 cases, but JAX's 64-bit mode is off, so they would "
            f"compute in float32 and be compared at float64's tolerance (1e-10). Call jax.config.update("
            f"'jax_enable_x64', True) at the start of the program (the checks' float64 oracles need it), or leave "
            f"float64 out of {argument}.")


def tolerance(dtype) -> float:
    """Relative-RMS tolerance of a comparison of two computations of the same math from
    inputs of ``dtype`` (compute in float64 / float32): 1e-10, 1e-5, bf16/f16 5e-3."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return 1e-10
    if dtype == jnp.float32:
        return 1e-5
    return 5e-3


def _device(x, dtype):
    """``x`` cast on the host and put on the device: no program compiled (``jnp.asarray``
    with a dtype, or ``astype`` on a device array, compiles a small one per shape)."""
    return jax.device_put(np.asarray(x).astype(jnp.dtype(dtype)))


def _weights(shape, dtype, seed: int):
    """Fixed random loss weights, made with numpy: the same bits in every program (a
    ``jax.random`` draw may round differently once fused into two different programs)."""
    return jnp.asarray(_host_weights(shape, np.float32, seed)).astype(dtype)


def _host_weights(shape, dtype, seed: int) -> np.ndarray:
    """``_weights`` on the host (numpy, in ``dtype``)."""
    return np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np.float32).astype(jnp.dtype(dtype))


class _Twin:
    """A case whose inputs are another case's, cast (the float64 twin of a float32 case)."""

    def __init__(self, case: Case, x, kw):
        self.case, self.x, self.kw = case, x, kw

    def __getattr__(self, name):
        return getattr(self.case, name)

    def inputs(self):
        dt = self.case.dtype
        return (tuple(_device(a, dt) for a in self.x),
                {n: (_device(a, dt) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a)
                 for n, a in self.kw.items()})


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
        x = tuple(_device(np.asarray(a).reshape((1, -1) + a.shape[2:]), a.dtype) for a in x)
        kw = dict(kw, cu_seqlens=_device(self.case.cu, jnp.int32))
        return x, kw
