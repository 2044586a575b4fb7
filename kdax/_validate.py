"""Argument checks shared by ``fused_recurrent_kda``, ``chunk_kda`` and ``KDAPipeline.forward``:
run when a call is traced, before any kernel, each error naming the argument. Shapes
jaxtyping can express are checked by ``typecheck`` on the public functions; a traced
``cu_seqlens``' values and g's and beta's domain inside the compiled program."""

import dataclasses
import functools
import numbers
from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float

from ._config import KDAOptions
from ._errors import Float64Warning, UnstableDeltaRuleWarning, warn_caller
from ._platform import spans_devices
from ._numerics.arrays import varying_axes
from ._annotations import QK, ALogIn, ArrayIn, Beta, CuSeqlensIn, Gate, State, Values, typecheck

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)


class Dims(NamedTuple):
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    scale: float


def checked_cu_seqlens(cu, T: int, what: str = "q"):
    """``cu`` (int32), its values checked: concrete ones eagerly (the error ends with the
    offending value), traced ones inside the program (the same messages)."""
    messages = ("cu_seqlens: must start at 0", "cu_seqlens: must be non-decreasing",
                f"cu_seqlens: must end at T={T} ({what}.shape[1])")
    if concrete := not isinstance(cu, jax.core.Tracer):  # (asked first: under jit jnp.asarray makes a list a tracer)
        c = np.asarray(cu)
        if c[0] != 0:
            raise ValueError(f"{messages[0]}, got cu_seqlens[0]={int(c[0])}.")
        if np.any(np.diff(c) < 0):
            raise ValueError(f"{messages[1]}, got {c.tolist()}.")
        if c[-1] != T:
            raise ValueError(f"{messages[2]}, got cu_seqlens[-1]={int(c[-1])}.")
    cu = jnp.asarray(cu, jnp.int32)
    # Per-device offsets inside shard_map (kdax.parallel derives them from the global
    # cu_seqlens, which it checks with this function before): the error branch cannot be
    # typed as varying over the mesh axes. Over several devices: read as NaN (_in_program).
    if concrete or varying_axes(cu) or spans_devices(cu):
        return cu
    bad = _cu_faults(cu, T)
    return eqx.branched_error_if(cu, jnp.any(bad), jnp.argmax(bad), tuple(f"{m}." for m in messages))


def _cu_faults(cu, T: int):
    return jnp.stack([cu[0] != 0, jnp.any(cu[1:] < cu[:-1]), cu[-1] != T])


def _real(name: str, x) -> float:
    """``x`` (a Python or numpy real, or a concrete 0-d array: static configuration) as a float."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name}: must be a concrete number (it is static configuration), got a traced array.")
    x = x.item() if isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 0 else x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number (Python, numpy or 0-d JAX scalar), got {type(x).__name__}.")
    return float(x)


def _scale(scale, K: int) -> float:
    if scale is None:  # (any scale multiplies an empty sum when K == 0)
        return K**-0.5 if K > 0 else 1.0
    if not np.isfinite(scale := _real("scale", scale)):  # (every output NaN)
        raise ValueError(f"scale: expected a finite number, got {scale}.")
    return scale


def check_cu_seqlens(cu_seqlens, B: int, T: int, what: str = "q"):
    """``cu_seqlens`` (array, list or tuple of N + 1 integers) as int32 for B == 1 rows of T
    tokens, every check done (``what``: the argument holding the tokens)."""
    cu = np.asarray(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else cu_seqlens
    if B != 1:
        raise ValueError(f"cu_seqlens: packed variable-length input needs B == 1 ({what}.shape[0]), got B={B}.")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, got {tuple(cu.shape)}.")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens: expected integers, got {cu.dtype}.")
    return checked_cu_seqlens(cu, T, what)


def _value_of(x):
    """``x``'s concrete value, or None under ``jit``/``vmap`` (an eager ``jax.grad``'s tracers
    hold their concrete primal)."""
    return x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x


def _warn_unstable(k, beta, options: KDAOptions) -> None:
    """Eagerly, without the in-kernel l2 norm: ``UnstableDeltaRuleWarning`` where ``beta * |k|^2 > 2``."""
    kv, bv = _value_of(k), _value_of(beta)
    if options.use_qk_l2norm_in_kernel or kv is None or bv is None or np.size(kv) == 0:
        return
    k2 = np.sum(np.square(np.asarray(kv, np.float64)), axis=-1)  # [B, T, H]
    b = np.asarray(bv, np.float64)
    if b.ndim == 4:  # (fused_recurrent_kda's head-wise beta [B, T, HV, V])
        b = b.max(axis=-1)
    if options.use_beta_sigmoid_in_kernel:
        b = (2.0 if options.allow_neg_eigval else 1.0) / (1.0 + np.exp(-b))
    k2 = np.repeat(k2, b.shape[2] // k2.shape[2], axis=2)
    worst = np.max(np.where(np.isfinite(b * k2), b * k2, 0.0), initial=0.0)
    if worst > 2:
        warn_caller(f"k, beta: beta * |k|^2 reaches {worst:.4g} > 2 (keys not normalised): the delta rule's state "
                    f"can grow without bound and the outputs turn NaN. Pass use_qk_l2norm_in_kernel=True (as Kimi "
                    f"Linear does) or normalise k yourself.", UnstableDeltaRuleWarning)


# The domains of g and beta (non-finite values are left to isolation); the messages' first
# part is the same eagerly (then the value) and inside the program.
_G = "g: must be a log decay <= 0 (the natural log of each channel's decay in (0, 1])"
_BETA = "beta: must lie in [0, 1] (the delta rule's write strength)"


def _bad(name: str, x, xp):
    """The elements of g or beta (``name``) outside their domain; ``xp``: numpy or jax.numpy."""
    return (x > 0) & (x < xp.inf) if name == "g" else ((x < 0) | (x > 1)) & xp.isfinite(x)


def check_domain(g, beta, options: KDAOptions) -> None:
    """Eagerly, a named ``ValueError`` for g > 0 without ``use_gate_in_kernel`` or beta outside
    [0, 1] without ``use_beta_sigmoid_in_kernel``: the chunked algorithm assumes both (a
    random-normal g and beta gave NaN in 70-90% of the outputs). Traced: ``checked_domain``."""
    gv, bv = _value_of(g), _value_of(beta)
    if gv is None or bv is None or np.size(gv) == 0:
        return
    # On the host; bfloat16 and integers as float32.
    host = lambda x: x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
    if not options.use_gate_in_kernel:
        gv = host(np.asarray(gv))
        if (bad := gv[_bad("g", gv, np)]).size:
            raise ValueError(
                f"{_G}, got a value {bad.max():.4g} > 0. Pass an activated gate (e.g. g = jax.nn.log_sigmoid(x), "
                f"or -exp(A_log) * softplus(x + dt_bias)), or the raw gate with use_gate_in_kernel=True (and A_log, "
                f"dt_bias or lower_bound).")
    if not options.use_beta_sigmoid_in_kernel:
        bv = host(np.asarray(bv))
        if (bad := bv[_bad("beta", bv, np)]).size:
            raise ValueError(
                f"{_BETA}, got a value {bad.min() if bad.min() < 0 else bad.max():.4g}. Pass beta = "
                f"jax.nn.sigmoid(x), or the raw x with use_beta_sigmoid_in_kernel=True (beta in [0, 2] with "
                f"allow_neg_eigval=True as well).")


def _in_program(g, beta, options: KDAOptions):
    """``(g, beta, errors, one device)`` of the domain check inside the program. ``errors``:
    ``(name, bad elements, message)`` per input checked there (none without ``check_inputs``
    or with g and beta concrete: checked eagerly). With several devices (or values varying
    over shard_map's axes) an error cannot be raised: it would abort the process."""
    if not options.check_inputs or (_value_of(g) is not None and _value_of(beta) is not None):
        return g, beta, [], True
    g, beta = jnp.asarray(g), jnp.asarray(beta)
    errors = []
    if not options.use_gate_in_kernel:
        errors.append(("g", _bad("g", g, jnp), f"{_G}; a finite value > 0 was found (checked inside the compiled "
                       "program). Pass an activated gate (e.g. jax.nn.log_sigmoid(x)), or the raw gate with "
                       "use_gate_in_kernel=True; check_inputs=False skips this check."))
    if not options.use_beta_sigmoid_in_kernel:
        errors.append(("beta", _bad("beta", beta, jnp), f"{_BETA}; a finite value outside it was found (checked "
                       "inside the compiled program). Pass jax.nn.sigmoid(x), or the raw x with "
                       "use_beta_sigmoid_in_kernel=True; check_inputs=False skips this check."))
    one_device = jax.device_count() == 1 and not any(varying_axes(bad) for _, bad, _ in errors)
    cu = options.cu_seqlens  # (unchecked by checked_cu_seqlens in a program over several devices)
    if isinstance(cu, jax.core.Tracer) and not varying_axes(cu) and spans_devices(cu):
        errors.append(("cu_seqlens", jnp.any(_cu_faults(cu, g.shape[1])), "cu_seqlens: invalid offsets"))
    return g, beta, errors, one_device


def domain_flag(g, beta, options: KDAOptions):
    """The domain check inside the program as a scalar that is False or raises
    (``eqx.error_if``), for a caller that puts it where the program's last step reads it
    (the NaN masks, so the reductions run beside the stages); None where no such check runs."""
    _, _, errors, one_device = _in_program(g, beta, options)
    if not (errors and one_device):
        return None
    # (Each error on a scalar: eqx.error_if on g itself made XLA copy it, +16 MiB peak.)
    stop = [eqx.error_if(jnp.asarray(False), jnp.any(bad), msg) for _, bad, msg in errors]
    return functools.reduce(jnp.logical_or, stop)


def checked_domain(g, beta, options: KDAOptions, *, flagged: bool = False):
    """``(g, beta)``, their domain also checked inside the program when traced: on one device
    an error naming the argument (``flagged``: the caller reads ``domain_flag`` instead);
    with several devices, where an error aborts the process, each bad value reads as NaN."""
    g, beta, errors, one_device = _in_program(g, beta, options)
    if one_device:
        if flagged or not errors:
            return g, beta
        # Beta, the small input ([B, T, HV]), carries the error to the stages.
        return g, jnp.where(domain_flag(g, beta, options), jnp.asarray(jnp.nan, beta.dtype), beta)
    # Several devices: each bad value read as NaN, elementwise (no reduction, so no
    # collective over sharded inputs).
    bads = {name: bad for name, bad, _ in errors}
    nan = lambda x, name: jnp.where(bads[name], jnp.asarray(jnp.nan, x.dtype), x) if name in bads else x
    return nan(g, "g"), nan(nan(beta, "beta"), "cu_seqlens")  # (invalid offsets: every output)


def _warn_float64(**arrays) -> None:
    """``Float64Warning`` for float64 numpy inputs while JAX's 64-bit mode is off."""
    names = [n for n, x in arrays.items() if isinstance(x, np.ndarray) and x.dtype == np.float64]
    if names and not jax.config.jax_enable_x64:
        warn_caller(f"{', '.join(names)}: float64 input{'s' if len(names) > 1 else ''} with JAX's 64-bit mode off "
                      f"compute in float32; call jax.config.update('jax_enable_x64', True) first to compute in "
                      f"float64.", Float64Warning)


def validate(q, k, v, g, beta, options: KDAOptions, *, chunked: bool = True) -> tuple[Dims, KDAOptions]:
    """Check ``options`` against the inputs: ``(Dims, normalised options)`` (``scale`` a float,
    ``A_log`` ``[HV]``, ``cu_seqlens`` int32). ``chunked``: ``chunk_kda``'s options, else
    ``fused_recurrent_kda``'s."""
    o = options
    _warn_float64(q=q, k=k, v=v, g=g, beta=beta, initial_state=o.initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v: the number of value heads HV={HV} (v.shape[2]) must be a positive multiple "
                         f"of the query/key heads H={H} (q.shape[2]).")
    cu = None if o.cu_seqlens is None else check_cu_seqlens(o.cu_seqlens, B, T)
    N = B if cu is None else cu.shape[0] - 1
    h0 = o.initial_state
    if h0 is not None:
        want = (N, HV, V, K) if o.state_v_first else (N, HV, K, V)
        if tuple(h0.shape) != want:
            layout = "[N, HV, V, K] (state_v_first=True)" if o.state_v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state: expected shape {layout} = {want}, got {tuple(h0.shape)}.")
    A_log, lb = o.A_log, None if o.lower_bound is None else _real("lower_bound", o.lower_bound)
    if lb is not None and not lb < 0:  # (-inf: every token forgets exactly, tests/test_hardening.py)
        raise ValueError(f"lower_bound: must be negative (the gate is lower_bound * sigmoid(...)), got {lb}.")
    if o.safe_gate and not chunked:
        raise TypeError("safe_gate: a chunk_kda option only.")
    if o.use_gate_in_kernel:
        if A_log is None and lb is None:
            raise ValueError("A_log: use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound "
                             "(lower-bound gate); neither was given.")
        # [HV], or [1, 1, HV, 1] (Kimi Linear's and FLA's varlen tests' shape).
        if A_log is not None and tuple(A_log.shape) not in ((HV,), (1, 1, HV, 1)):
            raise ValueError(f"A_log: expected shape [HV] = ({HV},) or [1, 1, HV, 1], got {tuple(A_log.shape)}.")
        A_log = None if A_log is None else A_log.reshape(HV)
        if o.dt_bias is not None and tuple(o.dt_bias.shape) != (HV * K,):
            raise ValueError(f"dt_bias: expected shape [HV * K] = ({HV * K},), got {tuple(o.dt_bias.shape)}.")
        if o.safe_gate and lb is None:
            raise ValueError("lower_bound: safe_gate=True with use_gate_in_kernel=True needs lower_bound (e.g. -5).")
    else:
        # FLA accepts lower_bound with safe_gate and a gate applied outside the kernel: a
        # promise about g, which kdax's kernels do not need.
        unused = [("A_log", A_log), ("dt_bias", o.dt_bias)] + ([] if o.safe_gate else [("lower_bound", lb)])
        for name, val in unused:
            if val is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True; it would be ignored.")
    if o.safe_gate and lb is not None and not -5 <= lb < 0:  # (FLA's range)
        raise ValueError(f"lower_bound: safe_gate=True needs -5 <= lower_bound < 0 (as FLA), got {lb}.")
    if o.allow_neg_eigval and not o.use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (beta = 2 * sigmoid(beta)), "
                         "as in FLA.")
    if chunked and o.chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {SUPPORTED_CHUNK_SIZES}, got {o.chunk_size}.")
    scale = _scale(o.scale, K)
    check_domain(g, beta, o)
    _warn_unstable(k, beta, o)
    o = dataclasses.replace(o, scale=scale, A_log=A_log, cu_seqlens=cu, lower_bound=lb)
    return Dims(B, T, H, HV, K, V, N, scale), o


def options_of(options: Optional[KDAOptions], kwargs: dict) -> KDAOptions:
    """One ``KDAOptions`` from ``options`` or keywords (``TypeError`` given both)."""
    if options is None:
        return KDAOptions.from_kwargs(**kwargs)
    if kwargs:
        raise TypeError(f"options: give a KDAOptions or keywords, not both (got {', '.join(kwargs)}).")
    return options


def prepare_options(q, k, v, g, beta, options: KDAOptions, *, flagged: bool = False):
    """Validated ``(config, (q, k, v, g, beta, h0 [N, HV, K, V], A_log [HV], dt_bias, cu),
    options)``; ``flagged``: the caller reads ``domain_flag``."""
    dims, opts = validate(q, k, v, g, beta, options)
    g, beta = checked_domain(g, beta, opts, flagged=flagged)
    config = opts.config(dims.scale)
    asarr = lambda x: None if x is None else jnp.asarray(x)
    h0 = asarr(opts.initial_state)
    if h0 is not None and opts.state_v_first:
        h0 = jnp.swapaxes(h0, -1, -2)
    args = (asarr(q), asarr(k), asarr(v), asarr(g), asarr(beta), h0, asarr(opts.A_log), asarr(opts.dt_bias),
            opts.cu_seqlens)
    return config, args, opts


@typecheck
def check_arrays(q: QK, k: QK, v: Values, g: Gate, beta: Beta, initial_state: Optional[State],
                 A_log: Optional[ALogIn], dt_bias: Optional[Float[ArrayIn, "_"]],
                 cu_seqlens: Optional[CuSeqlensIn]) -> None:
    """The shape/dtype checks of ``chunk_kda``'s signature, for ``KDAPipeline.forward``."""


def final_out(final, config, state_v_first: bool):
    """The final states as ``chunk_kda`` returns them (None unless asked for; ``[N, HV, V, K]``
    under ``state_v_first``)."""
    if not config.output_final_state:
        return None
    return jnp.swapaxes(final, -1, -2) if state_v_first else final


def prepare_forward(q, k, v, g, beta, opts: KDAOptions) -> tuple:
    """``KDAPipeline.forward``'s checks (B, K, V > 0 too) and ``prepare_options``' result."""
    check_arrays(q, k, v, g, beta, opts.initial_state, opts.A_log, opts.dt_bias, opts.cu_seqlens)
    out = prepare_options(q, k, v, g, beta, opts)
    for name, n in (("q", q.shape[0]), ("q", q.shape[3]), ("v", v.shape[-1])):
        if n == 0:
            raise ValueError(f"{name}: KDAPipeline.forward needs B, K and V > 0 (chunk_kda handles size 0), "
                             f"got q {tuple(q.shape)}, v {tuple(v.shape)}.")
    return out
