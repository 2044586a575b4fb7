"""kdax: Kimi Delta Attention in JAX."""

from . import ref as ref
from .recurrent import fused_recurrent_kda as fused_recurrent_kda
from .pipeline import (
    KDAGrads as KDAGrads,
    KDAPipeline as KDAPipeline,
    KDAResiduals as KDAResiduals,
    chunk_kda as chunk_kda,
    default_pipeline as default_pipeline,
)
from ._config import KDAConfig as KDAConfig
from ._layout import ChunkLayout as ChunkLayout
from . import stages as stages
