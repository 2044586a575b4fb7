"""What the stage families share: the declarations every stage makes (``AbstractStage`` and
its forward and backward kinds, which each family's abstract class subclasses) and the typed
containers for the data that travels between stages (chunked layout).

Shapes use R rows, HV heads, NC chunks, C chunk size, K/V feature dims, N sequences.
"""

from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

import equinox as eqx
from jaxtyping import Array, Float

from .._annotations import ChunkK, ChunkMat, ChunkScalar, ChunkState, ChunkV, SeqState

# The math id of KDA's own formulas: a forward stage that computes its family's formula
# exactly declares ``math = KDA``; a backward stage declares the forward math it is the
# transpose of, per forward field (``transposes = {"output": KDA}``). See
# ``kdax._runner.routes``: a pipeline whose backward stages do not transpose its forward
# stages derives its backward from the forward stages themselves.
KDA = "kda"


class AbstractStage(eqx.Module):
    """What every stage family declares beside its ``__call__`` (the families' abstract
    classes subclass this, their forward or backward kind below)."""

    # What the stage accepts beyond the required arguments (docs/stages.md,
    # "Capabilities"): a subset of the fields of kdax._stage_protocol.capabilities.Capabilities.
    accepts: ClassVar[frozenset] = frozenset()


class AbstractForwardStage(AbstractStage):
    """What a forward stage (F1-F5) declares: its math and whether it runs on tiles."""

    # Which formula the stage computes: ``KDA`` (the family's formula, exactly as the
    # reference stage computes it), or None (any other math: the backward stages do not
    # transpose it, and the pipeline derives its backward, ``kdax._runner.routes``).
    math: ClassVar[Optional[str]] = None

    # Whether the stage may be called on a tile (a few chunks at a time, the state carried
    # in h0): see docs/stages.md. A pipeline runs its forward whole if any stage is not.
    tile_safe: ClassVar[bool] = False


class AbstractBackwardStage(AbstractStage):
    """What a backward stage (B1-B5) declares: the forward math it transposes."""

    # The forward math this stage is the transpose of, per forward field it transposes
    # (``{"output": KDA}``): empty declares nothing, and a pipeline with this stage
    # derives its backward from the forward stages (``kdax._runner.routes``).
    transposes: ClassVar[Mapping[str, str]] = MappingProxyType({})


class Activated(eqx.Module):
    """F1 output: the inputs after the in-kernel activations, and ``G``, the chunk-local
    cumsum of the (activated, padding-masked) log decay. ``q_rstd``/``k_rstd``
    ``[R, HV, NC, C, 1]``: the l2norm statistics (None without in-kernel l2norm).
    ``G_lo``: optional low part, ``G + G_lo`` the cumsum to ~1e-9 in float32 (see
    ``kdax._numerics.hilo``; None: G alone, as float64 and the Pallas gates give)."""

    q: ChunkK
    k: ChunkK
    beta: ChunkScalar
    G: ChunkK
    q_rstd: Optional[Float[Array, "R HV NC C 1"]] = None
    k_rstd: Optional[Float[Array, "R HV NC C 1"]] = None
    G_lo: Optional[ChunkK] = None


class IntraOut(eqx.Module):
    """F2 output: ``Aqk`` (scaled, lower triangular incl. diagonal) and ``Akk = (I + L)^-1``."""

    Aqk: ChunkMat
    Akk: ChunkMat


class WYOut(eqx.Module):
    """F3 output: ``w = Akk (beta k e^G)``, ``u = Akk (beta v)``, ``qg = q e^G``,
    ``kg = k e^(Γ - G)``."""

    w: ChunkK
    u: ChunkV
    qg: ChunkK
    kg: ChunkK


class StateOut(eqx.Module):
    """F4 output: ``h`` the state at each chunk start (after any sequence reset),
    ``v_new = u - w h``, and the final state of each sequence."""

    h: ChunkState
    v_new: ChunkV
    final: SeqState


class ForwardCache(eqx.Module):
    """Every forward intermediate (what ``disable_recompute=True`` keeps for backward)."""

    G: ChunkK
    Aqk: ChunkMat
    Akk: ChunkMat
    w: ChunkK
    u: ChunkV
    qg: ChunkK
    kg: ChunkK
    h: ChunkState
    v_new: ChunkV

    @classmethod
    def of(cls, G: ChunkK, intra: "IntraOut", wy: "WYOut", h: ChunkState, v_new: ChunkV) -> "ForwardCache":
        """The cache from F1's ``G``, F2's and F3's outputs and F4's ``h``, ``v_new`` (the
        one place it is assembled: the forward, the forward with entries, B0)."""
        return cls(G, intra.Aqk, intra.Akk, wy.w, wy.u, wy.qg, wy.kg, h, v_new)


class DhuOut(eqx.Module):
    """B2 output: ``dh`` the gradient of the state at each chunk's end, ``dh0`` of each
    sequence's initial state, and the full ``dv_new``."""

    dh: ChunkState
    dh0: SeqState
    dv_new: ChunkV


class ChunkGrads(eqx.Module):
    """Gradients with respect to the activated chunked inputs (B3 and B4 outputs).
    ``dL`` (B3 only) is the gradient of the strictly lower ``L`` with ``Akk = (I + L)^-1``."""

    dq: ChunkK
    dk: ChunkK
    dv: ChunkV
    dbeta: ChunkScalar
    dG: ChunkK
    dL: Optional[ChunkMat] = None


class RawGrads(eqx.Module):
    """B5 output: gradients with respect to the raw (pre-activation) chunked inputs and
    the gate parameters (None where the option is off)."""

    dq: ChunkK
    dk: ChunkK
    dg: ChunkK
    dbeta: ChunkScalar
    dA_log: Optional[Float[Array, " HV"]] = None
    ddt_bias: Optional[Float[Array, " HVK"]] = None
