"""The gate kernels' (F1, B5) small operands: the token masks, and the per-head gate
parameters A_log and dt_bias with their block specs."""

from .._config import KDAConfig
from .._layouts.resets import per_head
from .._layouts.tokens import Tokens
from ._common import feature_pad, flat, head_spec


def _token_masks(valid, reset, HV: int, dtype) -> list:
    """``valid`` (None: no padding, ``_all_valid``) and, for shared chunks, ``reset``
    (``[R, NC, C]``) per value head as the kernels' ``[R * HV, NC, C, 1]`` inputs in
    ``dtype``."""
    return [flat(per_head(m, HV).astype(dtype)) for m in (valid, reset) if m is not None]


def _all_valid(reset, *xs) -> bool:
    """Whether every token of the chunks is valid, known without reading ``valid``: a
    ``Tokens`` view among ``xs`` (made only for dense input whose T is a multiple of the
    chunk size: no padding, ``kdax._layouts.tokens``) and no shared chunks. The kernels
    then take no ``valid`` input: the mask XLA would build for them (a fusion and its
    launch, 1 MiB at the GPU benchmark's shape, F1 and B5 each) selects every element."""
    return reset is None and any(isinstance(x, Tokens) for x in xs)


def _params(cfg: KDAConfig, target: str, HV: int, K: int, A_log, dt_bias):
    """Per-head parameter arrays and specs: A_log ``[HV, 1, 1]``, dt_bias ``[HV, 1, Kp]``,
    and which of the two there are."""
    arrays, specs = [], []
    if cfg.use_gate_in_kernel and A_log is not None:
        arrays.append(A_log.reshape(HV, 1, 1))
        specs.append(head_spec((1, 1), HV))
    if cfg.use_gate_in_kernel and dt_bias is not None:
        d = feature_pad(target, dt_bias.reshape(HV, 1, K))
        arrays.append(d)
        specs.append(head_spec((1, d.shape[-1]), HV))
    has = (cfg.use_gate_in_kernel and A_log is not None, cfg.use_gate_in_kernel and dt_bias is not None)
    return arrays, specs, has


def _param_refs(refs, has: tuple):
    """``(A_log ref [1, 1], dt_bias ref [1, Kp])`` from the per-head parameter refs that
    ``_params`` made, None where absent (``has``: which of the two are)."""
    it = iter(refs)
    return tuple(next(it) if h else None for h in has)
