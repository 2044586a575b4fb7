"""``default_pipeline()``: the reference stages on every platform (on a GPU too, until the
Triton kernels, measured faster on an H200, pass the suite's device cases there; kdax.pipeline
``default_pipeline``), and the per-platform loop settings of the reference stages ("auto")."""

import jax

import kdax
from kdax._numerics.chunk_loops import loop_unroll, resolve_group


def test_default_is_the_reference_pipeline():
    p = kdax.default_pipeline()
    assert p.precision == "auto"
    assert p == kdax.KDAPipeline.reference()


def test_default_on_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    p = kdax.default_pipeline()
    assert p.precision == "auto" and p.tile is None
    assert p == kdax.KDAPipeline.reference()
    # whole chunk groups per loop iteration and unrolled recurrences: the H200 profile
    assert resolve_group(p.intra.group) == 1024 and loop_unroll(p.state.loop_unroll) == 8


def test_auto_loops_on_cpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_group("auto") == 16 and loop_unroll("auto") == 1
    assert resolve_group(None) is None and resolve_group(4) == 4 and loop_unroll(3) == 3
