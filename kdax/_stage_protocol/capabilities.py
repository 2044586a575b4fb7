"""Stage capabilities: what a stage accepts beyond its family's required arguments, as
the stage declares it (docs/stages.md, "Capabilities"). The pipeline's stage runner
(``kdax._runner.runner``), its tiles and the shared-chunk layout ask only this."""

import functools
from typing import NamedTuple

from .._layouts.tokens import Tokens, as_chunked
from .._numerics import precision as _precision


class Capabilities(NamedTuple):
    """What a stage class declares it accepts (its ``accepts``; docs/stages.md,
    "Capabilities", says what the pipeline then passes and what it does without each):
    ``G_lo`` the gate cumsum's low part (``kdax._numerics.hilo``); ``reset`` the
    shared-chunk layout's reset table; ``tile_safe`` correct on any tile of chunks;
    ``tokens`` ``kdax.typing.Tokens`` views of the caller's arrays for chunked copies;
    ``half_stored`` the stored intermediates (``kdax._numerics.precision.STORED``) in a
    policy's half dtype; ``final_grads`` (B3, B5) may write its gradients of the call's
    inputs as the call's results (``kdax._layouts.tokens.FinalGrads``); ``zero_h0`` (F4,
    B0) told where the call gave no initial states, so it need not read the zeros;
    ``precision`` (every kdax stage) told the pipeline's policy, resolved, as
    ``precision=``, to pass on to a kdax stage it composes.

    What formula a stage computes is not a capability: forward stages declare ``math``,
    backward stages ``transposes`` (``kdax._runner.routes``); ``reset`` and ``tile_safe``
    select a route only for a stage whose math is KDA's (``kdax._runner.routes.routed``)."""

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
    """The declaration of stage class ``cls``: its ``accepts`` ClassVar, a subset of
    ``Capabilities``' fields (every family's abstract class has one, empty); ``tile_safe``
    may also be said as a ``tile_safe = True`` ClassVar. Nothing is read from the stage's
    signature: a stage that takes ``reset=`` without declaring it is not passed one."""
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
    """``kwargs`` for ``stage``, as its capabilities allow: without ``final``, ``zero_h0``
    or ``G_lo`` unless it accepts them, float32 copies of half-stored intermediates unless
    ``half_stored``, chunked copies of ``Tokens`` views unless ``tokens``."""
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
