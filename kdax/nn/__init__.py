"""``kdax.nn``: the Kimi Delta Attention layer around the kernel.

``KimiDeltaAttention`` (projections, short convolutions, in-kernel gate, gated RMSNorm,
output projection; Kimi Linear's and FLA's weights, ``from_pretrained`` checkpoints),
``KDACache`` (convolution and recurrent states, serving pools, FLA's cache layout),
``load_pretrained`` (every KDA layer of a checkpoint), ``read_config``, ``gated_rms_norm``,
``weight_shapes``, ``load_safetensors``.
"""

from ._cache import KDACache as KDACache
from ._layer import KimiDeltaAttention as KimiDeltaAttention, load_pretrained as load_pretrained
from ._norm import gated_rms_norm as gated_rms_norm
from ._pretrained import (
    KDACheckpointConfig as KDACheckpointConfig,
    read_config as read_config,
)
from ._weights import load_safetensors as load_safetensors, weight_shapes as weight_shapes
