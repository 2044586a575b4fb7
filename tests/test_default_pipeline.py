"""``default_pipeline()``: the Pallas Triton kernels on a Hopper or later GPU (their device
cases passed on an H200 in session 66), the reference stages elsewhere, and the
per-platform loop settings of the reference stages ("auto")."""

import jax
import pytest

import kdax
from kdax._numerics.chunk_loops import loop_unroll, resolve_group


def test_default_is_the_reference_pipeline():
    p = kdax.default_pipeline()
    assert p.precision == "auto"
    assert p == kdax.KDAPipeline.reference()


class _Device:
    def __init__(self, cc):
        self.compute_capability = cc


@pytest.mark.parametrize("cc", ["9.0", "10.0"])
def test_default_on_hopper_is_triton(monkeypatch, cc):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(cc)])
    p = kdax.default_pipeline()
    assert p == kdax.KDAPipeline.pallas("triton") and p.precision == "auto"
    assert p.intra.run_interpreted is False  # (compiled: the backend is a GPU)


@pytest.mark.parametrize("cc", ["8.0", "8.9", None])
def test_default_on_gpu(monkeypatch, cc):
    """An older GPU, or one without a CUDA compute capability (ROCm): the reference stages."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(cc) if cc else object()])
    p = kdax.default_pipeline()
    assert p.precision == "auto" and p.tile is None
    assert p == kdax.KDAPipeline.reference()
    # whole chunk groups per loop iteration and unrolled recurrences: the H200 profile
    assert resolve_group(p.intra.group) == 1024 and loop_unroll(p.state.loop_unroll) == 8


def test_auto_loops_on_cpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_group("auto") == 16 and loop_unroll("auto") == 1
    assert resolve_group(None) is None and resolve_group(4) == 4 and loop_unroll(3) == 3
