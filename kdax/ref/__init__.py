"""Oracles: the naive recurrence, the readable chunked form and the input activations."""

from ._chunk import naive_chunk_kda as naive_chunk_kda
from ._gates import (
    beta_activation as beta_activation,
    kda_gate as kda_gate,
    l2norm as l2norm,
    lower_bound_gate as lower_bound_gate,
    softplus_gate as softplus_gate,
)
from ._recurrent import naive_recurrent_kda as naive_recurrent_kda
