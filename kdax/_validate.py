"""Argument checks shared by ``fused_recurrent_kda`` and ``chunk_kda``.

Everything here runs before any kernel is traced, and every error names the argument
and what was expected. Shapes that jaxtyping can express (matching B, T, H, HV, K, V) are
already checked by the ``typecheck`` decorator on the public functions.
"""

from typing import NamedTuple, Optional

import jax
import numpy as np

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


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_cu_seqlens_values(cu_seqlens, T: int) -> None:
    """Values are checked only when concrete; under jit they are data (no recompile)."""
    if not _is_concrete(cu_seqlens):
        return
    cu = np.asarray(cu_seqlens)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got cu_seqlens[0]={int(cu[0])}.")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {cu.tolist()}.")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens: must end at T={T} (q.shape[1]), got cu_seqlens[-1]={int(cu[-1])}.")


def validate_kda_args(
    q, k, v, g, beta, *,
    scale: Optional[float],
    initial_state,
    use_gate_in_kernel: bool,
    A_log,
    dt_bias,
    lower_bound: Optional[float],
    cu_seqlens,
    state_v_first: bool,
    safe_gate: bool = False,
    chunk_size: Optional[int] = None,
) -> Dims:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(
            f"v: the number of value heads HV={HV} (v.shape[2]) must be a positive multiple "
            f"of the query/key heads H={H} (q.shape[2])."
        )
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed variable-length input needs B == 1 (q.shape[0]), got B={B}.")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected shape [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}.")
        check_cu_seqlens_values(cu_seqlens, T)
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
            raise ValueError(
                f"initial_state: expected shape {layout} = {want}, got {tuple(initial_state.shape)}."
            )
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError(
                "A_log: use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound "
                "(lower-bound gate); neither was given."
            )
        if A_log is not None and tuple(A_log.shape) != (HV,):
            raise ValueError(f"A_log: expected shape [HV] = ({HV},), got {tuple(A_log.shape)}.")
        if dt_bias is not None and tuple(dt_bias.shape) != (HV * K,):
            raise ValueError(f"dt_bias: expected shape [HV * K] = ({HV * K},), got {tuple(dt_bias.shape)}.")
        if safe_gate and lower_bound is None:
            raise ValueError("lower_bound: safe_gate=True with use_gate_in_kernel=True needs lower_bound (e.g. -5).")
    else:
        for name, val in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if val is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True; it would be ignored.")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound: must be negative (the gate is lower_bound * sigmoid(...)), got {lower_bound}.")
    if chunk_size is not None and chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {SUPPORTED_CHUNK_SIZES}, got {chunk_size}.")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a Python float, got {type(scale).__name__}.")
    return Dims(B, T, H, HV, K, V, N, K**-0.5 if scale is None else float(scale))
