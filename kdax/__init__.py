"""kdax: Kimi Delta Attention in JAX."""

from . import ref as ref
from .recurrent import fused_recurrent_kda as fused_recurrent_kda
