"""Concrete stages are final (Equinox's abstract/final pattern): a user's stage subclasses
its family's abstract class and composes a concrete one. A family's contract is its
abstract ``__call__``; a concrete ``__call__`` names its parameters and annotates only
what differs (``final`` checks the names and fills in the rest). kdax's concrete stages
take ``precision`` and trace their products under it; a user's stage keeps the caller's."""

import functools
import inspect

import jax

from .._annotations import typecheck
from .._numerics import precision as _precision

_EMPTY = inspect.Parameter.empty


def final(cls: type) -> type:
    """Mark stage class ``cls`` final (subclassing raises ``TypeError``); its ``__call__`` takes
    ``precision: str = "highest"`` and runs under ``precision.matmul_precision``."""
    def __init_subclass__(sub, **kwargs):
        raise TypeError(
            f"{sub.__qualname__}: {cls.__qualname__} is final. Subclass {family.__qualname__} and call "
            f"{cls.__qualname__}() from your __call__ (compose it; docs/stages.md §4)."
        )

    call = cls.__call__
    if "precision" not in inspect.signature(call).parameters:
        raise TypeError(f"{cls.__qualname__}.__call__: a final stage takes `precision: str = \"highest\"`.")
    family = next(b for b in cls.__mro__[1:] if b.__name__.startswith("Abstract"))
    call = typecheck(_with_contract(cls, call, family))

    @functools.wraps(call)
    def __call__(self, *args, precision: str = "highest", **kwargs):
        with jax.default_matmul_precision(_precision.matmul_precision(precision, cls)):
            return call(self, *args, precision=precision, **kwargs)

    cls.__init_subclass__ = classmethod(__init_subclass__)
    cls.__call__ = __call__
    cls.accepts = frozenset(getattr(cls, "accepts", frozenset())) | {"precision"}
    return cls


def _with_contract(cls: type, call, family: type):
    """``call`` with the annotations it leaves out taken from ``family.__call__``, after checking
    its parameters begin with the family's, in order (a trailing optional one may be left
    out; its own come after, annotated)."""
    contract = inspect.signature(family.__call__).parameters
    own = [p for p in inspect.signature(call).parameters.values() if p.kind != p.KEYWORD_ONLY]
    names, want = [p.name for p in own], list(contract)
    shared = names[: len(want)]
    required = [n for n in want if contract[n].default is _EMPTY]
    if shared != want[: len(shared)] or len(shared) < len(required):
        raise TypeError(f"{cls.__qualname__}.__call__: its parameters {tuple(names)} must begin with "
                        f"{family.__qualname__}.__call__'s {tuple(want)} in that order (the family's contract).")
    fn = inspect.unwrap(call)
    for p in inspect.signature(fn).parameters.values():
        if p.annotation is _EMPTY and p.name != "self":
            if p.name not in contract or contract[p.name].annotation is _EMPTY:
                raise TypeError(f"{cls.__qualname__}.__call__: annotate `{p.name}` (not a parameter of "
                                f"{family.__qualname__}.__call__).")
            fn.__annotations__[p.name] = contract[p.name].annotation
    if "return" not in fn.__annotations__:
        fn.__annotations__["return"] = inspect.signature(family.__call__).return_annotation
    return call
