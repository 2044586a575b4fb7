"""Seeded random mixes of ``chunk_kda``'s options, each against ``fused_recurrent_kda`` in
float64: the outputs, the final states and every input's gradient. Each option has its own
test elsewhere (``test_pipeline.py``'s grid); these look for interactions: packed input
with empty and one-token sequences sharing chunks, hard decays (``g = -inf``) and zero
decays, in-kernel gates and betas, grouped value heads, T = 1, every chunk size,
``disable_recompute`` and ``safe_gate`` (chunk_kda's own, not given to the recurrence); on the
reference pipeline whole and in tiles, the Pallas TPU one, segmented F4/B2 and sequence
parallel over host devices; with ``-m slow`` also the Pallas Triton one (default and
candidate kernels), alone and sequence parallel."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdax

from ._util import assert_close

PIPELINES = {
    "reference": kdax.KDAPipeline.reference,
    "untiled": lambda: kdax.KDAPipeline.reference().untiled(),
    "pallas_tpu": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
    "segmented": lambda: kdax.stages.segmented(kdax.KDAPipeline.reference().untiled(), 3),
    # kdax.parallel.chunk_kda, the tokens over 4 of the suite's host devices
    "sequence_parallel": kdax.KDAPipeline.reference,
    # the Triton stages in interpret mode: the default tuning, the candidate's kernels (its
    # "fast" precision policy set back to "auto", exact in float64), sequence parallel
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
    "triton_candidate": lambda: kdax.KDAPipeline.pallas("triton", interpret=True, tuning="candidate").with_precision(
        "auto"),
    "sequence_parallel_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
}
DEVICES = {"sequence_parallel": 4, "sequence_parallel_triton": 4}
CHUNK_ONLY = ("disable_recompute", "safe_gate")


def mix(seed: int, multiple: int = 1):
    """``(inputs, options, chunk_size, what)`` of one random case (``what``: its description),
    T a ``multiple`` (tokens added to the last sequence)."""
    r, rng = random.Random(seed), np.random.default_rng(seed)
    H = r.choice([1, 2])
    HV, K, V, C = H * r.choice([1, 2]), r.choice([8, 16, 24]), r.choice([8, 12, 16]), r.choice([16, 32, 64, 128])
    if r.random() < 0.5:  # packed, empty and one-token sequences among them
        lens = [r.choice([0, 1, 5, 16, 17, 40, 70]) for _ in range(r.choice([1, 2, 3, 4]))]
        lens[0] += 3 * (sum(lens) == 0)
        lens[-1] += -sum(lens) % multiple
        B, T, N, cu = 1, sum(lens), len(lens), np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    else:
        B, T, cu = r.choice([1, 2]), r.choice([1, 7, 16, 33, 64, 100, 130]), None
        T += -T % multiple
        N = B
    o = dict(use_qk_l2norm_in_kernel=r.random() < 0.5, use_gate_in_kernel=r.random() < 0.5,
             use_beta_sigmoid_in_kernel=r.random() < 0.5, state_v_first=r.random() < 0.3,
             output_final_state=r.random() < 0.7, scale=r.choice([None, 0.3, -0.7]))
    o["allow_neg_eigval"] = o["use_beta_sigmoid_in_kernel"] and r.random() < 0.4
    q, k = rng.normal(size=(B, T, H, K)), rng.normal(size=(B, T, H, K)) / np.sqrt(K)
    if not o["use_qk_l2norm_in_kernel"]:
        q = q / np.sqrt(K)
    x = dict(q=q, k=k, v=rng.normal(size=(B, T, HV, V)))
    if o["use_gate_in_kernel"]:
        x["g"] = rng.normal(size=(B, T, HV, K))
        x["A_log"] = 0.5 * rng.normal(size=(HV,))
        if r.random() < 0.7:
            x["dt_bias"] = rng.normal(size=(HV * K,))
        if r.random() < 0.4:
            o["lower_bound"] = -r.choice([1.0, 5.0])
    else:
        g = -rng.uniform(0, r.choice([0.1, 1.0, 8.0]), size=(B, T, HV, K))
        if r.random() < 0.25:  # hard forgets
            g[rng.uniform(size=g.shape) < 0.1] = -np.inf
        if r.random() < 0.15:  # no decay
            g[rng.uniform(size=g.shape) < 0.2] = 0.0
        x["g"] = g
    x["beta"] = rng.normal(size=(B, T, HV)) if o["use_beta_sigmoid_in_kernel"] else rng.uniform(0, 1, size=(B, T, HV))
    if r.random() < 0.6:
        x["initial_state"] = rng.normal(size=(N, HV, V, K) if o["state_v_first"] else (N, HV, K, V))
    if cu is not None:
        o["cu_seqlens"] = jnp.asarray(cu)
    # chunk_kda's own options (drawn last: the draws above stay as they were)
    o["disable_recompute"] = r.random() < 0.3
    o["safe_gate"] = "lower_bound" in o and r.random() < 0.5
    what = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, C=C, cu=None if cu is None else cu.tolist(),
                h0="initial_state" in x, **{n: v for n, v in o.items() if n != "cu_seqlens"})
    return {n: jnp.asarray(a) for n, a in x.items()}, o, C, what


def _loss_and_grads(fn, x, options, w, wf):
    names = tuple(x)

    def loss(*arrays):
        kw = dict(zip(names, arrays))
        out, final = fn(**kw, **options)
        value = jnp.sum(out * w)
        return (value if final is None else value + jnp.sum(final * wf)), (out, final)

    (_, (out, final)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True))(
        *x.values())
    return out, final, dict(zip(names, grads))


SEEDS = range(40)
# The fast core: cases that together hold every option, packed input with empty and
# one-token sequences, hard and zero decays, T = 1 and every chunk size (the rest: -m slow).
CORE = {"reference": (7, 23, 25, 31), "untiled": (6, 37), "pallas_tpu": (8, 10, 29), "segmented": (10,),
        "sequence_parallel": (23,), "pallas_triton": (), "triton_candidate": (), "sequence_parallel_triton": ()}


def _chunk_kda(pipe: str, C: int):
    """``chunk_kda`` with keyword arrays, on pipeline ``pipe`` (sequence parallel: over a mesh)."""
    pipeline = PIPELINES[pipe]()
    if pipe not in DEVICES:
        return lambda **kw: kdax.chunk_kda(**kw, chunk_size=C, pipeline=pipeline)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES[pipe]]), ("tokens",))
    return lambda q, k, v, g, beta, **kw: kdax.parallel.chunk_kda(mesh, "tokens", q, k, v, g, beta, **kw, chunk_size=C,
                                                                   pipeline=pipeline)


@pytest.mark.parametrize("pipe,seed", [
    pytest.param(p, s, marks=() if s in CORE[p] else pytest.mark.slow, id=f"{p}-{s}")
    for p in PIPELINES for s in SEEDS])
def test_option_mix_against_recurrence(pipe, seed):
    with jax.enable_x64(True):
        x, options, C, what = mix(seed, DEVICES.get(pipe, 1))
        N = what["B"] if what["cu"] is None else len(what["cu"]) - 1
        state = (N, what["HV"]) + ((what["V"], what["K"]) if options["state_v_first"] else (what["K"], what["V"]))
        rng = np.random.default_rng(1000 + seed)  # the cotangents of o and of the final states
        w, wf = jnp.asarray(rng.normal(size=x["v"].shape)), jnp.asarray(rng.normal(size=state))
        o, final, grads = _loss_and_grads(_chunk_kda(pipe, C), x, options, w, wf)
        recurrent = {n: v for n, v in options.items() if n not in CHUNK_ONLY}
        o_ref, final_ref, grads_ref = _loss_and_grads(kdax.fused_recurrent_kda, x, recurrent, w, wf)
    assert_close(o, o_ref, 1e-10, f"o {what}")
    if options["output_final_state"]:
        assert_close(final, final_ref, 1e-10, f"final state {what}")
    for name in x:
        assert_close(grads[name], grads_ref[name], 1e-10, f"d{name} {what}")
