"""Oracles: the naive recurrence, the readable chunked form and the input activations."""

from ._chunk import naive_chunk_kda as naive_chunk_kda
from ._gates import (
    L2NORM_EPS as L2NORM_EPS,
    activated_gate as activated_gate,
    beta_activation as beta_activation,
    clamp_log_decay as clamp_log_decay,
    fused_kda_gate as fused_kda_gate,
    log_decay_floor as log_decay_floor,
    kda_gate as kda_gate,
    l2norm as l2norm,
    lower_bound_gate as lower_bound_gate,
    naive_kda_gate as naive_kda_gate,
    naive_kda_lowerbound_gate as naive_kda_lowerbound_gate,
    reset_log_decay as reset_log_decay,
    softplus_gate as softplus_gate,
)
from ._recurrent import compute_dtype as compute_dtype
from ._recurrent import expand_heads as expand_heads
from ._recurrent import naive_recurrent_kda as naive_recurrent_kda
from ._recurrent import recurrent_step as recurrent_step
