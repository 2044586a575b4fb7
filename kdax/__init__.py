"""kdax: Kimi Delta Attention in JAX.

``chunk_kda`` (chunked forward, six-stage backward), ``fused_recurrent_kda`` (token by
token), ``KDAPipeline`` (the stages, swappable one at a time), ``kdax.ref`` (float64
oracles), ``kdax.stages`` (abstract stages and reference implementations),
``kdax.pallas`` (Pallas implementations).
"""

from ._platform import avoid_ynn_fusions as _avoid_ynn_fusions

_avoid_ynn_fusions()  # before any computation (kdax._platform)

from . import nn as nn  # noqa: E402
from . import pallas as pallas, ref as ref, stages as stages, typing as typing
from . import parallel as parallel
from ._config import KDAConfig as KDAConfig
from ._config import KDAOptions as KDAOptions
from ._errors import DerivedBackwardError as DerivedBackwardError
from ._errors import FallbackWarning as FallbackWarning
from ._errors import Float64Warning as Float64Warning
from ._errors import ForwardModeError as ForwardModeError
from ._errors import HeadFirstLayoutWarning as HeadFirstLayoutWarning
from ._errors import StageContractError as StageContractError
from ._errors import StageGradientError as StageGradientError
from ._errors import UnsupportedCase as UnsupportedCase
from ._errors import UnstableDeltaRuleWarning as UnstableDeltaRuleWarning
from ._layouts.layout import ChunkLayout as ChunkLayout
from ._plan import KDAPlan as KDAPlan, PlanRow as PlanRow
from ._platform import reuse_freed_memory as reuse_freed_memory
from ._runner.residuals import KDAGrads as KDAGrads, KDAResiduals as KDAResiduals
from ._runner.runner import stage_inputs as stage_inputs
from .pipeline import KDAPipeline as KDAPipeline, default_pipeline as default_pipeline
from . import testing as testing
from ._chunk_kda import chunk_kda as chunk_kda
from .recurrent import fused_recurrent_kda as fused_recurrent_kda
from .ref import fused_kda_gate as fused_kda_gate, kda_gate as kda_gate
