"""Concrete stages are final (the Equinox family's abstract/final pattern): a user's stage
subclasses the abstract class of its family and composes a concrete one (calls it from
its own ``__call__``), so that a change inside a concrete stage never silently changes a
subclass of it."""


def final(cls: type) -> type:
    """Mark stage class ``cls`` final: defining a subclass raises ``TypeError`` saying to
    compose it instead."""
    family = next((b.__qualname__ for b in cls.__mro__[1:] if b.__name__.startswith("Abstract")), "its Abstract* class")

    def __init_subclass__(sub, **kwargs):
        raise TypeError(
            f"{sub.__qualname__}: {cls.__qualname__} is final. Subclass {family} and call {cls.__qualname__}() "
            f"from your __call__ (compose it; docs/stages.md §4)."
        )

    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls
