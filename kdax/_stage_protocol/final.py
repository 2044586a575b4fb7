"""Concrete stages are final (the Equinox family's abstract/final pattern): a user's stage
subclasses the abstract class of its family and composes a concrete one (calls it from
its own ``__call__``), so that a change inside a concrete stage never silently changes a
subclass of it.

kdax's concrete stages also take the pipeline's precision policy as the keyword
``precision`` (the capability ``"precision"``, declared here for every one of them) and
trace their own products under it (``kdax._numerics.precision``): the policy is kdax's
choice for kdax's products, and a user's stage, which is never final, keeps the caller's
matmul precision for its own."""

import functools
import inspect

import jax

from .._numerics import precision as _precision


def final(cls: type) -> type:
    """Mark stage class ``cls`` final: defining a subclass raises ``TypeError`` saying to
    compose it instead. Its ``__call__`` must take ``precision: str = "highest"`` (keyword,
    the resolved policy) and runs under ``precision.matmul_precision`` for its family."""
    family = next((b.__qualname__ for b in cls.__mro__[1:] if b.__name__.startswith("Abstract")), "its Abstract* class")

    def __init_subclass__(sub, **kwargs):
        raise TypeError(
            f"{sub.__qualname__}: {cls.__qualname__} is final. Subclass {family} and call {cls.__qualname__}() "
            f"from your __call__ (compose it; docs/stages.md §4)."
        )

    call = cls.__call__
    if "precision" not in inspect.signature(call).parameters:
        raise TypeError(f"{cls.__qualname__}.__call__: a final stage takes `precision: str = \"highest\"`.")

    @functools.wraps(call)
    def __call__(self, *args, precision: str = "highest", **kwargs):
        with jax.default_matmul_precision(_precision.matmul_precision(precision, cls)):
            return call(self, *args, precision=precision, **kwargs)

    cls.__init_subclass__ = classmethod(__init_subclass__)
    cls.__call__ = __call__
    cls.accepts = frozenset(getattr(cls, "accepts", frozenset())) | {"precision"}
    return cls
