"""``default_pipeline()`` per platform: the reference stages on CPU (and TPU), the mixed
pipeline on a GPU (benchmarks/NOTES.md, "kdax beside FLA")."""

import jax

import kdax
from kdax import pallas as P
from kdax.stages import ReferenceIntra, ReferenceState


def test_default_on_this_platform():
    p = kdax.default_pipeline()
    assert p.precision == "auto"
    if jax.default_backend() != "gpu":
        assert p == kdax.KDAPipeline.reference()


def test_default_on_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    p = kdax.default_pipeline()
    assert p.precision == "auto" and p.fallback and p.tile is None
    for name in ("gate", "wy", "output", "dav", "wy_dqkg", "gate_bwd"):
        stage = getattr(p, name)
        assert isinstance(stage, P._common.PallasTarget), name
        assert stage.target == "triton" and not stage.interpret, name
    assert isinstance(p.intra, ReferenceIntra) and isinstance(p.state, ReferenceState)
