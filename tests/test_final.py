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
