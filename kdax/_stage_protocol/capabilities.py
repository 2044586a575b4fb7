"""Stage capabilities: what a stage accepts beyond its family's arguments (docs/stages.md, "Capabilities")."""

import functools
from typing import NamedTuple

from .._layouts.tokens import Tokens, as_chunked
from .._numerics import precision as _precision


class Capabilities(NamedTuple):
    """What a stage class declares it accepts (its ``accepts``): ``G_lo``, ``reset``,
    ``tile_safe``, ``tokens`` (``Tokens`` views), ``half_stored``, ``final_grads`` (B3, B5),
    ``zero_h0`` (F4, B0), ``dh_start`` (B2), ``precision`` (every kdax stage). docs/stages.md
    says what each selects. A stage's formula is not a capability (``math``/``transposes``)."""

    G_lo: bool
    reset: bool
    tile_safe: bool
    tokens: bool = False
    half_stored: bool = False
    final_grads: bool = False
    zero_h0: bool = False
    dh_start: bool = False
    precision: bool = False


@functools.cache
def capabilities(cls: type) -> Capabilities:
    """Stage class ``cls``'s declaration: its ``accepts`` ClassVar (``tile_safe`` also as a
    ``tile_safe = True`` ClassVar); nothing is read from its signature."""
    declared = getattr(cls, "accepts", frozenset())
    if isinstance(declared, str):  # (iterated, its letters would read as names)
        raise TypeError(f"{cls.__qualname__}.accepts: expected a frozenset of names, e.g. frozenset({{{declared!r}}}).")
    unknown = set(declared) - set(Capabilities._fields)
    if unknown:  # ('standard' let the pipeline compute terms of a stage's formula itself)
        raise TypeError(f"{cls.__qualname__}.accepts: " + ("'standard' is gone (a stage that computes its family's "
                        "own formula declares `math = kdax.stages.KDA`: docs/stages.md)" if "standard" in unknown else
                        f"unknown capabilities {sorted(unknown)}; expected a subset of {Capabilities._fields}") + ".")
    tile_safe = bool(getattr(cls, "tile_safe", False))  # (the ClassVar)
    return Capabilities(**{n: n in declared or (n == "tile_safe" and tile_safe) for n in Capabilities._fields})


def negotiated(stage, kwargs: dict) -> dict:
    """``kwargs`` as ``stage``'s capabilities allow: no ``final``, ``zero_h0``, ``dh_start``, ``G_lo``
    unless accepted, float32 copies of half-stored arrays and chunked copies of views unless declared."""
    caps = capabilities(type(stage))
    unaccepted = {"final": not caps.final_grads, "zero_h0": not caps.zero_h0, "dh_start": not caps.dh_start,
                  "G_lo": not caps.G_lo}
    kwargs = {n: x for n, x in kwargs.items() if not unaccepted.get(n)}
    if not caps.half_stored:
        kwargs = _precision.widened(kwargs)
    if not caps.tokens and any(isinstance(x, Tokens) for x in kwargs.values()):
        kwargs = {n: as_chunked(x) for n, x in kwargs.items()}
    return kwargs


def told(stage, precision: str) -> dict:
    """``{"precision": precision}`` for a stage that declares ``precision``, else ``{}``."""
    return {"precision": precision} if capabilities(type(stage)).precision else {}


def reads_tokens(pipeline, *fields: str) -> tuple:
    """Per field of ``pipeline``, whether its stage declares ``tokens``."""
    return tuple(capabilities(type(getattr(pipeline, n))).tokens for n in fields)
