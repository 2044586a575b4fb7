"""Concrete stages are final (kdax/_stage_protocol/final.py): subclassing one raises, naming the family
to subclass instead; the abstract families stay open."""

import inspect

import pytest

from kdax import pallas, stages


def _concrete():
    for mod in (stages, pallas):
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and name.startswith(("Reference", "Pallas", "Segmented")) and name != "PallasTarget":
                yield obj


@pytest.mark.parametrize("cls", list(_concrete()), ids=lambda c: c.__name__)
def test_concrete_stages_are_final(cls):
    with pytest.raises(TypeError, match=rf"{cls.__name__} is final\. Subclass Abstract\w+ and call"):
        type("Mine", (cls,), {})


def test_abstract_stages_stay_open():
    class MyState(stages.AbstractState):
        def __call__(self, w, u, kg, G, h0, layout):
            return stages.ReferenceState()(w, u, kg, G, h0, layout)

    assert MyState().__class__.__mro__[1] is stages.AbstractState


@pytest.mark.parametrize("cls", list(_concrete()), ids=lambda c: c.__name__)
def test_concrete_stages_are_told_the_precision_policy(cls):
    """Every concrete stage declares the capability ``precision`` and takes it as a keyword
    (``kdax._numerics.precision``: the policy is an argument, issue 52)."""
    from kdax._stage_protocol.capabilities import capabilities

    assert capabilities(cls).precision
    param = inspect.signature(cls.__call__).parameters["precision"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default == "highest"


def test_a_final_stage_must_take_precision():
    from kdax._stage_protocol.capabilities import capabilities
    from kdax._stage_protocol.final import final

    class Loose(stages.AbstractOutput):
        def __call__(self, scale, qg, h, Aqk, v_new):
            raise AssertionError

    with pytest.raises(TypeError, match=r"Loose\.__call__: a final stage takes `precision"):
        final(Loose)
    assert not capabilities(Loose).precision  # (a user's stage is told only if it declares it)
