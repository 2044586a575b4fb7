"""Issue 25, sequence parallel: over 4 simulated devices, a huge or non-finite value at
one token of a sequence that crosses a device edge reaches no other sequence; the bad
sequence is exact before the token and NaN after it on the later devices too."""

import jax
import jax.numpy as jnp
import pytest

import kdax

from .._util import make_inputs
from ..test_isolation import NAMES, VALUES, _check_isolated, _inject, _runner, _sequences
from .test_chunk import CU, UNTILED, _mesh
from ..test_isolation import oracle_kda

BAD_SEQ, BAD_T = 6, 30  # sequence 6 (tokens 24..60) crosses the edge at 48 of 4 x 24 tokens


@pytest.mark.parametrize("values", ["core", pytest.param("all", marks=pytest.mark.slow)])
def test_bad_sequence_crossing_a_device_edge(values):
    mesh = _mesh(4)
    x = make_inputs(0, B=1, T=CU[-1], H=1, HV=2, K=8, V=8, N=len(CU) - 1, h0=True)
    opts = dict(cu_seqlens=jnp.asarray(CU, jnp.int32), chunk_size=16, output_final_state=True, pipeline=UNTILED)
    sp = lambda *a, **kw: kdax.parallel.chunk_kda(mesh, "sp", *a, **kw)
    f = _runner(sp, opts, final_loss=True)
    f_ref = _runner(oracle_kda, dict(cu_seqlens=CU, output_final_state=True), final_loss=True)
    r = jax.random.split(jax.random.key(2))
    W = jax.random.normal(r[0], x["v"].shape, jnp.float64)
    Wh = jax.random.normal(r[1], x["initial_state"].shape, jnp.float64)
    names = NAMES if values == "all" else ("k", "v")
    vals = VALUES if values == "all" else {"x1e30": None, "nan": float("nan")}
    for name in names:
        for label, value in vals.items():
            y = _inject(x, name, value, (0, BAD_T, 0))
            _check_isolated(f(y, W, Wh), f_ref(y, W, Wh), _sequences(CU, 1), BAD_SEQ, BAD_T,
                            bad_exact=value is not None)


@pytest.mark.parametrize("prefix", ["gather", "doubling"])
@pytest.mark.parametrize("at", [30, 65, 80], ids=["forward", "backward-device-2", "backward-device-3"])
def test_overflowing_sequence_reaches_no_other_across_devices(at, prefix):
    """A huge finite beta (x1e30, no sigmoid) makes its sequence's state overflow. At token
    30 (sequence 6, devices 1-2) its state entered device 2, where sequence 8 starts and
    leaves for device 3: the summaries' prefix multiplied that inf by device 2's zero M,
    and sequence 8's outputs were NaN. At token 80 (sequence 8, devices 2-3) its
    cotangent crossed device 2's zero M back into sequence 6: dbeta of sequence 6 off by
    5e-2 (finite); at token 65 (sequence 8 on device 2) too, through device 2's own
    summary, whose M the overflow had made non-zero. The prefix now drops the value
    entering a device no sequence runs through, and that device's M (``exclusive_prefix(...,
    live=)``); all fail before."""
    mesh = _mesh(4)
    x = make_inputs(0, B=1, T=CU[-1], H=1, HV=2, K=8, V=8, N=len(CU) - 1, h0=True)
    opts = dict(cu_seqlens=jnp.asarray(CU, jnp.int32), chunk_size=16, output_final_state=True, pipeline=UNTILED)
    f = _runner(lambda *a, **kw: kdax.parallel.chunk_kda(mesh, "sp", *a, prefix=prefix, **kw), opts, final_loss=True)
    f_ref = _runner(oracle_kda, dict(cu_seqlens=CU, output_final_state=True), final_loss=True)
    r = jax.random.split(jax.random.key(2))
    W = jax.random.normal(r[0], x["v"].shape, jnp.float64)
    Wh = jax.random.normal(r[1], x["initial_state"].shape, jnp.float64)
    y = _inject(x, "beta", None, (0, at, 0))
    bad = sum(c <= at for c in CU) - 1
    # (bad_exact=False: a huge finite value is no non-finite one, whose sequence is exact before it)
    _check_isolated(f(y, W, Wh), f_ref(y, W, Wh), _sequences(CU, 1), bad, at, bad_exact=False)


def test_global_wrapper_takes_what_chunk_kda_takes():
    """``kdax.parallel.chunk_kda`` takes ``cu_seqlens`` as a list or numpy array and
    Kimi's ``A_log [1, 1, HV, 1]``, as ``kdax.chunk_kda`` does."""
    import numpy as np

    mesh = _mesh(4)
    x = make_inputs(1, B=1, T=CU[-1], H=1, HV=2, K=8, V=8, N=len(CU) - 1, h0=False, gate="raw", A_log=True)
    pos = tuple(x[n] for n in NAMES)
    opts = dict(chunk_size=16, use_gate_in_kernel=True, pipeline=UNTILED)
    want = kdax.chunk_kda(*pos, cu_seqlens=CU, A_log=x["A_log"], **opts)[0]
    for cu, A_log in ((CU, x["A_log"].reshape(1, 1, 2, 1)), (np.asarray(CU), x["A_log"])):
        o = kdax.parallel.chunk_kda(mesh, "sp", *pos, cu_seqlens=cu, A_log=A_log, **opts)[0]
        assert np.allclose(np.asarray(o), np.asarray(want), rtol=1e-10, atol=1e-12)
