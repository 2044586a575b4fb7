"""``chunk_kda``, the front door with FLA's signature: its arguments, by name, into
``KDAOptions``; sharded inputs and ``seq_axis_name`` go to ``kdax.parallel`` (``routed``),
the rest to ``KDAPipeline.apply`` on one device."""

from typing import Optional

import jax
import numpy as np
from jaxtyping import Float

from ._config import KDAOptions, state_v_first_of
from ._errors import HeadFirstLayoutWarning, warn_caller
from ._chunk_states import chunk_start_states
from ._annotations import ALogIn, ArrayIn, Beta, ChunkKDAOut, CuSeqlensIn, Gate, QK, Scalar, State, Values, typecheck
from .parallel._shard import routed
from .pipeline import KDAPipeline, default_pipeline


def _fla_only(cp_context, max_num_seqs, N: int, cu_seqlens, cu_seqlens_cpu) -> None:
    """FLA's arguments that kdax takes for positional compatibility (docs/fla_arguments.md;
    ``use_graph`` changes nothing: kdax's varlen shapes never depend on cu_seqlens' values)."""
    if cp_context is not None:
        raise ValueError("cp_context: FLA's context parallelism is not supported by kdax's chunk_kda.")
    if max_num_seqs is not None and max_num_seqs != N:
        raise ValueError(f"max_num_seqs: must equal the number of sequences len(cu_seqlens) - 1 = {N}, "
                         f"got {max_num_seqs} (pad cu_seqlens with empty sequences instead).")
    known = not any(isinstance(c, jax.core.Tracer) for c in (cu_seqlens, cu_seqlens_cpu))
    if cu_seqlens_cpu is not None and (cu_seqlens is None or known and not np.array_equal(cu_seqlens, cu_seqlens_cpu)):
        raise ValueError("cu_seqlens_cpu: FLA's host copy of cu_seqlens, which kdax does not need; it must equal "
                         "cu_seqlens (given alone, the input would have run as one dense batch).")


def _warn_head_first(q) -> None:
    """FLA's check: fewer tokens than heads suggests the old head-first ``[B, H, T, K]``."""
    if not all(isinstance(d, int) for d in q.shape):  # (first: jax.export's symbolic sizes)
        raise ValueError(f"q: shape {tuple(q.shape)} has symbolic dimensions (jax.export); chunk_kda needs sizes to "
                         "chunk: export per shape, or use fused_recurrent_kda (the layer's mode='fused_recurrent').")
    T, H = q.shape[1], q.shape[2]
    if 0 < T < H:
        warn_caller(
            f"q: shape {tuple(q.shape)} read as [B, T, H, K] has T={T} tokens < H={H} heads: is it FLA's old "
            f"head-first layout [B, H, T, K]? kdax (as FLA today) takes [B, T, H, K]; transpose with "
            f"jnp.swapaxes(x, 1, 2) (q, k, v, g, beta alike). A genuine input this short can ignore this "
            f"warning (kdax.HeadFirstLayoutWarning).", HeadFirstLayoutWarning)


@typecheck
@routed  # sequence parallel (seq_axis_name) or sharded inputs: decided before the body
def chunk_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    scale: Optional[Scalar] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[Scalar] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[CuSeqlensIn] = None,
    cu_seqlens_cpu: Optional[CuSeqlensIn] = None,
    cp_context: None = None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    *,
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, "_"]] = None,
    chunk_size: int = 64,
    pipeline: Optional[KDAPipeline] = None,
    transpose_state_layout: Optional[bool] = None,
    seq_axis_name: Optional[str] = None,
    check_inputs: bool = True,
) -> ChunkKDAOut:
    """Chunked KDA, with FLA's ``chunk_kda`` arguments, order and layouts (docs/fla_arguments.md).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]``
    (log decay, or the raw gate with ``use_gate_in_kernel``: softplus gate with ``A_log``
    ``[HV]`` (or ``[1, 1, HV, 1]``) and optional ``dt_bias [HV*K]``, lower-bound gate when
    ``lower_bound`` is set); beta ``[B, T, HV]`` (raw with ``use_beta_sigmoid_in_kernel``);
    states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``, deprecated alias
    ``transpose_state_layout``); ``cu_seqlens`` ``[N + 1]`` packs N sequences into B == 1
    (checked inside the program when traced). ``chunk_size`` in {16, 32, 64, 128}.
    ``safe_gate``: FLA's promise that g lies in ``[lower_bound, 0)``, ``-5 <= lower_bound <
    0`` (kdax is exact for any gate; only FLA's checks). ``scale``: any real number, default
    K^-1/2. ``cu_seqlens_cpu``, ``use_graph``: accepted, unneeded; ``cp_context``: refused.

    Returns ``o [B, T, HV, V]`` in q's dtype (FLA's) and the final state (float32, or float64) or
    None; with ``return_intermediate_states`` also FLA's ``h``, each chunk's start state
    (forward only; layouts: ``kdax._chunk_states``). ``jax.grad`` runs ``pipeline``'s six-stage backward (default
    ``default_pipeline()``); ``disable_recompute=True`` keeps the forward intermediates.
    Zero-size inputs give zero outputs and pass the states through.

    ``seq_axis_name``: inside ``jax.shard_map`` with the tokens sharded over that axis,
    sequence parallel and exact (``kdax.parallel``): q to beta and o this device's tokens,
    ``cu_seqlens`` and the states global.

    ``check_inputs``: g's and beta's domain (g <= 0, beta in [0, 1], unless activated in the
    kernel) is checked eagerly before any kernel and, under ``jit``, inside the program
    (``eqx.error_if``; with several devices a bad value reads as NaN, its sequence's outputs
    NaN); ``False`` skips the in-program check. q in FLA's old head-first layout (T < H)
    gets a ``HeadFirstLayoutWarning``."""
    _warn_head_first(q)
    options = KDAOptions(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        disable_recompute=disable_recompute, state_v_first=state_v_first_of(state_v_first, transpose_state_layout),
        check_inputs=check_inputs,
    )
    N = v.shape[0] if cu_seqlens is None else np.shape(cu_seqlens)[0] - 1  # (a bad one: apply's error)
    _fla_only(cp_context, max_num_seqs, N, cu_seqlens, cu_seqlens_cpu)
    pipeline = default_pipeline() if pipeline is None else pipeline
    if not isinstance(pipeline, KDAPipeline):
        raise TypeError(f"pipeline: expected a KDAPipeline, got {type(pipeline).__name__}.")
    states = chunk_start_states if return_intermediate_states else KDAPipeline.apply  # (FLA's: forward only)
    return states(pipeline, q, k, v, g, beta, options)
