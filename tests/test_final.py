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


@pytest.mark.parametrize("cls", list(_concrete()), ids=lambda c: c.__name__)
def test_concrete_stages_take_their_familys_contract(cls):
    """The family's ``__call__`` is the one source of a stage's parameters and their
    shapes: a concrete stage's parameters begin with the family's, in order, and every
    annotation it leaves out is the family's (so its shape checks are the family's)."""
    family = next(b for b in cls.__mro__[1:] if b.__name__.startswith("Abstract"))
    contract = inspect.signature(family.__call__)
    own = inspect.signature(cls.__call__)
    names = [n for n, p in own.parameters.items() if p.kind is not p.KEYWORD_ONLY]
    assert names == list(contract.parameters)[: len(names)] + names[len(contract.parameters):]
    for name, p in own.parameters.items():
        assert name == "self" or p.annotation is not inspect.Parameter.empty, (cls.__name__, name)
    assert own.return_annotation is contract.return_annotation
    if cls.__name__.startswith("Reference"):  # (they state no annotation of their own)
        for name in names[1:]:
            assert own.parameters[name].annotation is contract.parameters[name].annotation, (cls.__name__, name)


def _final_output(body_params: str, annotate: dict = None):
    from kdax._stage_protocol.final import final

    ns = {}
    exec(f"def __call__(self, {body_params}, *, precision: str = 'highest'):\n    return scale * qg", ns)
    fn = ns["__call__"]
    fn.__annotations__.update(annotate or {})
    return final(type("MyOutput", (stages.AbstractOutput,), {"__call__": fn, "__module__": __name__}))


def test_final_fills_the_familys_annotations_and_checks_shapes():
    import jax.numpy as jnp

    Mine = _final_output("scale, qg, h, Aqk, v_new")
    want = inspect.signature(stages.AbstractOutput.__call__)
    got = inspect.signature(Mine.__call__)
    for name in ("qg", "h", "Aqk", "v_new"):
        assert got.parameters[name].annotation is want.parameters[name].annotation
    assert got.return_annotation is want.return_annotation
    R, HV, NC, C, K, V = 1, 2, 3, 4, 8, 8
    qg, h = jnp.ones((R, HV, NC, C, K)), jnp.ones((R, HV, NC, K, V))
    Aqk, v_new = jnp.ones((R, HV, NC, C, C)), jnp.ones((R, HV, NC, C, V))
    with pytest.raises(Exception, match="qg"):  # the family's shape check, filled in: qg's rank is wrong
        Mine()(1.0, qg[0], h, Aqk, v_new)


def test_final_refuses_parameters_out_of_the_familys_order():
    with pytest.raises(TypeError, match=r"must begin with AbstractOutput\.__call__'s"):
        _final_output("scale, h, qg, Aqk, v_new")
    # (its own parameters come after the family's, the optional ones too: F5's reset)
    with pytest.raises(TypeError, match=r"must begin with AbstractOutput\.__call__'s"):
        _final_output("scale, qg, h, Aqk, v_new, extra=None", {"extra": object})
    with pytest.raises(TypeError, match=r"annotate `extra`"):
        _final_output("scale, qg, h, Aqk, v_new, reset=None, extra=None")
    _final_output("scale, qg, h, Aqk, v_new, reset=None, extra=None", {"extra": object})  # its own, annotated: fine
    _final_output("scale, qg, h, Aqk, v_new")  # (a trailing optional one left out: fine)
