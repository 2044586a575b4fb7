"""benchmarks/gpu_profile.py's attribution of a trace's kernels to stages, on the CPU: the
Pallas kernels' names as a GPU trace shows them (session 67's profile read 99% of the time
"unmapped"), and XLA's kernels through the compiled module's scopes."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax
from kdax._runner.contracts import STAGES

from ._load import BENCH, load_benchmark

Event = collections.namedtuple("Event", "name stats")


@pytest.fixture(scope="module")
def gp():
    return load_benchmark("gpu_profile")


def test_pallas_kernels_by_stage_class(gp):
    """Every kdax kernel name in session 67's H200 profile maps to its stage (B0 runs F4's
    and F3's kernels again, under the suffix ``__1``)."""
    text = (BENCH / "results" / "gpu_h200" / "session67" / "rows16" / "profile_rows16.txt").read_text()
    names = sorted(set(re.findall(r"kdax_\w+", text)))
    got = {n: gp._scope_of(Event(n, []), {}) for n in names}
    assert got == {
        "kdax_PallasDAv_kernel": "dav", "kdax_PallasDhu_kernel": "dhu", "kdax_PallasGateBackward_kernel": "gate_bwd",
        "kdax_PallasGate_kernel": "gate", "kdax_PallasIntraBackward_kernel": "intra_bwd",
        "kdax_PallasIntra_kernel": "intra", "kdax_PallasIntra_kernel_solve": "intra",
        "kdax_PallasOutput_kernel": "output", "kdax_PallasState_kernel": "state", "kdax_PallasState_kernel__1": "state",
        "kdax_PallasWYDqkg_kernel": "wy_dqkg", "kdax_PallasWY_kernel": "wy", "kdax_PallasWY_kernel__1": "wy"}, got
    # a stage scope wins over the kernel's class; names that only look like one are unmapped
    assert gp._scope_of(Event("kdax_PallasState_kernel__1", [("tf_op", "jit(step)/kdax_recompute/pallas")]), {}) \
        == "recompute"
    for name in ("kdax_intra_chunk_kernel", "kdax_NotAStage_kernel", "kdax_Products_kernel", "fusion_3"):
        assert gp._scope_of(Event(name, []), {}) == "(unmapped)", name


def test_xla_kernels_by_compiled_scopes(gp):
    """XLA's kernels are named after their HLO instructions with ``_`` for ``.``: the
    compiled module's scopes are keyed both ways, and each fusion of a reference training
    step maps to a stage or to the glue outside them."""
    r = np.random.default_rng(0)
    B, T, H, K = 1, 32, 1, 8
    q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-r.uniform(0.1, 1.0, size=(B, T, H, K)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, H)), jnp.float32)

    def loss(q, k, v, g, beta):
        return kdax.chunk_kda(q, k, v, g, beta, chunk_size=16, pipeline=kdax.KDAPipeline.reference())[0].sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, k, v, g, beta).compile().as_text()
    scopes = gp.hlo_scopes(text)
    fusions = [n for n in scopes if "fusion" in n and "." in n]
    assert fusions, sorted(scopes)[:20]
    for n in fusions:  # (GPU kernels: loop_dynamic_update_slice_fusion_2 for ...-slice_fusion.2)
        assert scopes[re.sub(r"[.-]", "_", n)] == scopes[n], n
    stages = set(scopes.values())
    # (B0 counts the F3 and F4 it runs, the outer scope; F5 is not in a gradient of sum(o))
    assert {"gate", "intra", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd"} <= stages, stages
    assert stages <= set(STAGES) | {"(outside stages)"}, stages  # (the eleven stage fields, nothing else)
    name = next(n for n in fusions if scopes[n] == "intra_bwd")
    assert gp._scope_of(Event(re.sub(r"[.-]", "_", name), [("hlo_module", "jit_loss")]), scopes) == "intra_bwd"
