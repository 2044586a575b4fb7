"""Typed containers for the data that travels between stages (chunked layout).

Shapes use R rows, HV heads, NC chunks, C chunk size, K/V feature dims, N sequences.
"""

from typing import Optional

import equinox as eqx
from jaxtyping import Array, Float


class Activated(eqx.Module):
    """F1 output: the inputs after the in-kernel activations, and ``G``, the chunk-local
    cumsum of the (activated, padding-masked) log decay. ``q_rstd``/``k_rstd``
    ``[R, HV, NC, C, 1]``: the l2norm statistics (None without in-kernel l2norm)."""

    q: Float[Array, "R HV NC C K"]
    k: Float[Array, "R HV NC C K"]
    beta: Float[Array, "R HV NC C"]
    G: Float[Array, "R HV NC C K"]
    q_rstd: Optional[Float[Array, "R HV NC C 1"]] = None
    k_rstd: Optional[Float[Array, "R HV NC C 1"]] = None


class IntraOut(eqx.Module):
    """F2 output: ``Aqk`` (scaled, lower triangular incl. diagonal) and ``Akk = (I + L)^-1``."""

    Aqk: Float[Array, "R HV NC C C"]
    Akk: Float[Array, "R HV NC C C"]


class WYOut(eqx.Module):
    """F3 output: ``w = Akk (beta k e^G)``, ``u = Akk (beta v)``, ``qg = q e^G``,
    ``kg = k e^(Γ - G)``."""

    w: Float[Array, "R HV NC C K"]
    u: Float[Array, "R HV NC C V"]
    qg: Float[Array, "R HV NC C K"]
    kg: Float[Array, "R HV NC C K"]


class StateOut(eqx.Module):
    """F4 output: ``h`` the state at each chunk start (after any sequence reset),
    ``v_new = u - w h``, and the final state of each sequence."""

    h: Float[Array, "R HV NC K V"]
    v_new: Float[Array, "R HV NC C V"]
    final: Float[Array, "N HV K V"]


class ForwardCache(eqx.Module):
    """Every forward intermediate (what ``disable_recompute=True`` keeps for backward)."""

    G: Float[Array, "R HV NC C K"]
    Aqk: Float[Array, "R HV NC C C"]
    Akk: Float[Array, "R HV NC C C"]
    w: Float[Array, "R HV NC C K"]
    u: Float[Array, "R HV NC C V"]
    qg: Float[Array, "R HV NC C K"]
    kg: Float[Array, "R HV NC C K"]
    h: Float[Array, "R HV NC K V"]
    v_new: Float[Array, "R HV NC C V"]


class DhuOut(eqx.Module):
    """B2 output: ``dh`` the gradient of the state at each chunk's end, ``dh0`` of each
    sequence's initial state, and the full ``dv_new``."""

    dh: Float[Array, "R HV NC K V"]
    dh0: Float[Array, "N HV K V"]
    dv_new: Float[Array, "R HV NC C V"]


class ChunkGrads(eqx.Module):
    """Gradients with respect to the activated chunked inputs (B3 and B4 outputs).
    ``dL`` (B3 only) is the gradient of the strictly lower ``L`` with ``Akk = (I + L)^-1``."""

    dq: Float[Array, "R HV NC C K"]
    dk: Float[Array, "R HV NC C K"]
    dv: Float[Array, "R HV NC C V"]
    dbeta: Float[Array, "R HV NC C"]
    dG: Float[Array, "R HV NC C K"]
    dL: Optional[Float[Array, "R HV NC C C"]] = None


class RawGrads(eqx.Module):
    """B5 output: gradients with respect to the raw (pre-activation) chunked inputs and
    the gate parameters (None where the option is off)."""

    dq: Float[Array, "R HV NC C K"]
    dk: Float[Array, "R HV NC C K"]
    dg: Float[Array, "R HV NC C K"]
    dbeta: Float[Array, "R HV NC C"]
    dA_log: Optional[Float[Array, " HV"]] = None
    ddt_bias: Optional[Float[Array, " HVK"]] = None
