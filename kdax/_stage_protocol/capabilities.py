"""Stage capabilities: what a stage accepts beyond its family's required arguments, as
the stage declares it (docs/stages.md, "Capabilities"). The pipeline's stage runner
(``kdax._runner.runner``), its tiles and the shared-chunk layout ask only this."""

import functools
from typing import NamedTuple

from .._layouts.tokens import Tokens, as_chunked
from .._numerics import precision as _precision


class Capabilities(NamedTuple):
    """``G_lo``: the low part of the gate cumsum (``kdax/_numerics/hilo.py``); without it the
    stage gets ``G`` alone (exact in float64; float32-rounded G otherwise), the pipeline
    passing nothing else. ``reset``: the shared-chunk layout's reset table (F1, B5);
    without it a shared layout is refused with ``UnsupportedCase`` (so a pipeline with
    ``fallback`` runs the reference stage, exact, where the stage declares KDA's math).
    ``tile_safe``: correct on any tile of chunks (``KDAPipeline.tile``); without it the
    forward runs whole. ``tokens`` (F1, F3, B0, B1, B2, B3, B5): reads the call's inputs
    and ``do`` from the caller's layout itself, given ``kdax.typing.Tokens`` views in
    place of the chunked arrays (dense input whose T is a multiple of the chunk size);
    without it the stage gets the chunked copies. ``half_stored``: takes the
    intermediates of ``kdax._numerics.precision.STORED`` (``Aqk``, ``Akk``, ``w``, ``u``, ``qg``,
    ``kg``, ``h``, ``v_new``, ``dh``) in the dtype a policy stores them in (bf16 under ``"fast"``), as well
    as in float32; without it the stage gets float32 copies (exact). ``final_grads`` (B3,
    B5): may write its gradients of the call's inputs as the call's results
    (``kdax._layouts.tokens.FinalGrads``, passed as ``final=`` where the caller's layout
    fits: caller's layout and dtype, NaN where ``chunk_kda``'s isolation puts it), each
    returned as a ``Written``; without it, or for a gradient it leaves chunked, the
    pipeline finishes them (the same numbers: unpacked, poisoned, cast). ``zero_h0`` (F4,
    B0): told ``zero_h0=True`` where the call gave no initial states (dense and per-sequence
    layouts; F4 when the forward runs untiled), the stage may start from zero states
    without reading ``h0`` (zeros then): no zero array made for it; without it the stage
    reads the zeros. ``precision`` (every kdax stage): told the pipeline's precision policy,
    resolved (``"highest"``, ``"bfloat16"``, ``"float16"`` or ``"fast"``:
    ``kdax._numerics.precision``), as ``precision=``, to pass on to a kdax stage it
    composes; without it the stage is not told.

    What formula a stage computes is not a capability: forward stages declare ``math``,
    backward stages ``transposes`` (``kdax._runner.routes``). ``reset`` and ``tile_safe`` select a
    route only for a stage whose math is KDA's (``kdax._runner.routes.routed``): a declaration
    only selects among routes that give the same numbers for the declared math."""

    G_lo: bool
    reset: bool
    tile_safe: bool
    tokens: bool = False
    half_stored: bool = False
    final_grads: bool = False
    zero_h0: bool = False
    precision: bool = False


@functools.cache
def capabilities(cls: type) -> Capabilities:
    """The declaration of stage class ``cls``: its ``accepts`` ClassVar, a set drawn from
    ``"G_lo"``, ``"reset"``, ``"tile_safe"``, ``"tokens"``, ``"half_stored"``, ``"final_grads"``, ``"zero_h0"``,
    ``"precision"`` (every family's abstract class
    has one, empty). ``tile_safe`` may also be said as a ``tile_safe = True`` ClassVar;
    either spelling counts. Nothing is read from the stage's signature: a stage that takes
    ``reset=`` without declaring it is not passed one."""
    declared = getattr(cls, "accepts", frozenset())
    if "standard" in declared:
        raise TypeError(
            f"{cls.__qualname__}.accepts: 'standard' is gone (it let the pipeline compute terms of the stage's "
            f"formula itself). A stage that computes its family's own formula declares `math = "
            f"kdax.stages.KDA` instead (docs/stages.md, 'Which formula a stage computes')."
        )
    unknown = set(declared) - set(Capabilities._fields)
    if unknown:
        raise TypeError(f"{cls.__qualname__}.accepts: unknown capabilities {sorted(unknown)}; expected a "
                        f"subset of {Capabilities._fields}.")
    caps = {n: n in declared for n in Capabilities._fields}
    caps["tile_safe"] = caps["tile_safe"] or bool(getattr(cls, "tile_safe", False))
    return Capabilities(**caps)


def negotiated(stage, kwargs: dict) -> dict:
    """``kwargs`` for ``stage``: without ``G_lo`` for a stage that does not accept it,
    ``Tokens`` views as chunked copies for one that does not read them (``tokens``), and
    half-precision stored intermediates as float32 copies for one that does not take them
    (``half_stored``), and without ``final`` for one that does not write final gradients
    (``final_grads``), and without ``zero_h0`` for one that does not start from zero states
    itself (``zero_h0``)."""
    caps = capabilities(type(stage))
    if "final" in kwargs and not caps.final_grads:
        kwargs = {n: x for n, x in kwargs.items() if n != "final"}
    if "zero_h0" in kwargs and not caps.zero_h0:
        kwargs = {n: x for n, x in kwargs.items() if n != "zero_h0"}
    if not caps.half_stored:
        kwargs = _precision.widened(kwargs)
    if "G_lo" in kwargs and not caps.G_lo:
        kwargs = {n: x for n, x in kwargs.items() if n != "G_lo"}
    if not caps.tokens and any(isinstance(x, Tokens) for x in kwargs.values()):
        kwargs = {n: as_chunked(x) for n, x in kwargs.items()}
    return kwargs


def told(stage, precision: str) -> dict:
    """``{"precision": precision}`` for a stage that declares ``precision``, else ``{}``."""
    return {"precision": precision} if capabilities(type(stage)).precision else {}


def reads_tokens(pipeline, *fields: str) -> tuple:
    """Per field of ``pipeline``, whether its stage's class declares ``tokens`` (reads the
    caller's layout through ``Tokens`` views)."""
    return tuple(capabilities(type(getattr(pipeline, n))).tokens for n in fields)
