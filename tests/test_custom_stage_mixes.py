"""Seeded random mixes of user-written stages, routes and ``chunk_kda``'s options, each
against ``fused_recurrent_kda`` in float64: outputs, final states, every input's gradient
and a stage parameter's. ``test_option_mixes.py`` does this for the
shipped pipelines; here one to three fields hold stages a user would write:

* forward stages of other math that compute KDA's formula through the reference stage
  (the backward then derived by ``jax.vjp``, F1's and F5's transposes alone where the
  route allows), an F1 with a learned per-head temperature (``g * tau``: the oracle is
  KDA at that gate), an F5 of other math (``2 o``) and an F5 of KDA's math written from
  its formula;
* backward stages declaring the transposes they compute (B1, B4, B5 wrapping the
  reference) and a B1 declaring nothing (derived again);

on the reference pipeline whole and in tiles, the Pallas TPU pipeline in interpret mode,
segmented F4/B2, and sequence parallel over 4 of the suite's host devices (reference
and Pallas stages); with ``-m slow`` also the Pallas Triton pipeline, alone and sequence
parallel. An F4 of other math there is refused by name. The search that found
the sequence-parallel derived backward's dh0 at 4x (3 of 90 cases) was this one."""

import random
from types import MappingProxyType
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import kdax
from kdax.stages import (
    KDA,
    AbstractDAv,
    AbstractGate,
    AbstractGateBackward,
    AbstractIntra,
    AbstractIntraBackward,
    AbstractOutput,
    AbstractState,
    AbstractWY,
    ReferenceDAv,
    ReferenceGate,
    ReferenceGateBackward,
    ReferenceIntra,
    ReferenceIntraBackward,
    ReferenceOutput,
    ReferenceState,
    ReferenceWY,
)

from ._util import assert_close
from .test_option_mixes import CHUNK_ONLY, _loss_and_grads, mix

MINE = "mine"  # the math id of stages that compute KDA's formula but do not say so


class MineGate(AbstractGate):
    math: ClassVar = MINE

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g, beta, A_log, dt_bias, valid)


class TemperedGate(AbstractGate):
    """F1 of the reference on ``g * tau`` (``tau [HV]`` learned): KDA at that gate."""

    tau: Float[Array, " HV"]
    math: ClassVar = "tempered"

    def __call__(self, config, q, k, g, beta, A_log, dt_bias, valid):
        return ReferenceGate()(config, q, k, g * self.tau[None, :, None, None, None], beta, A_log, dt_bias, valid)


class MineIntra(AbstractIntra):
    math: ClassVar = MINE

    def __call__(self, scale, q, k, beta, G):
        return ReferenceIntra()(scale, q, k, beta, G)


class MineWY(AbstractWY):
    math: ClassVar = MINE

    def __call__(self, q, k, v, beta, G, Akk):
        return ReferenceWY()(q, k, v, beta, G, Akk)


class MineState(AbstractState):
    math: ClassVar = MINE

    def __call__(self, w, u, kg, G, h0, layout):
        return ReferenceState()(w, u, kg, G, h0, layout)


class MineOutput(AbstractOutput):
    math: ClassVar = MINE

    def __call__(self, scale, qg, h, Aqk, v_new):
        return ReferenceOutput()(scale, qg, h, Aqk, v_new)


class DoubledOutput(AbstractOutput):
    """``2 o``: other math (the oracle doubles the reference's output)."""

    math: ClassVar = "doubled"

    def __call__(self, scale, qg, h, Aqk, v_new):
        return 2 * ReferenceOutput()(scale, qg, h, Aqk, v_new)


class FormulaOutput(AbstractOutput):
    """KDA's F5 from its formula, tile-safe."""

    math: ClassVar = KDA
    accepts: ClassVar[frozenset] = frozenset({"tile_safe"})

    def __call__(self, scale, qg, h, Aqk, v_new):
        exact = jax.lax.Precision.HIGHEST
        return scale * jnp.matmul(qg, h, precision=exact) + jnp.matmul(jnp.tril(Aqk), v_new, precision=exact)


class DeclaredDAv(AbstractDAv):
    transposes: ClassVar = MappingProxyType({"output": KDA})

    def __call__(self, v_new, Aqk, do):
        return ReferenceDAv()(v_new, Aqk, do)


class UndeclaredDAv(AbstractDAv):
    def __call__(self, v_new, Aqk, do):
        return ReferenceDAv()(v_new, Aqk, do)


class DeclaredIntraBackward(AbstractIntraBackward):
    transposes: ClassVar = MappingProxyType({"intra": KDA})

    def __call__(self, scale, q, k, beta, G, dAqk, grads):
        return ReferenceIntraBackward()(scale, q, k, beta, G, dAqk, grads)


class DeclaredGateBackward(AbstractGateBackward):
    transposes: ClassVar = MappingProxyType({"gate": KDA})

    def __call__(self, config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG):
        return ReferenceGateBackward()(config, act, g, A_log, dt_bias, valid, dq, dk, dbeta, dG)


# kind -> (field, stage maker taking HV and a random.Random)
KINDS = {
    "F1 mine": ("gate", lambda HV, r: MineGate()),
    "F1 tempered": ("gate", lambda HV, r: TemperedGate(jnp.asarray([r.choice([0.5, 1.0, 2.0]) for _ in range(HV)]))),
    "F2 mine": ("intra", lambda HV, r: MineIntra()),
    "F3 mine": ("wy", lambda HV, r: MineWY()),
    "F4 mine": ("state", lambda HV, r: MineState()),
    "F5 mine": ("output", lambda HV, r: MineOutput()),
    "F5 doubled": ("output", lambda HV, r: DoubledOutput()),
    "F5 formula": ("output", lambda HV, r: FormulaOutput()),
    "B1 declared": ("dav", lambda HV, r: DeclaredDAv()),
    "B1 undeclared": ("dav", lambda HV, r: UndeclaredDAv()),
    "B4 declared": ("intra_bwd", lambda HV, r: DeclaredIntraBackward()),
    "B5 declared": ("gate_bwd", lambda HV, r: DeclaredGateBackward()),
}
BASES = {
    "reference": kdax.KDAPipeline.reference,
    "untiled": lambda: kdax.KDAPipeline.reference().untiled(),
    "pallas_tpu": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
    "segmented": lambda: kdax.KDAPipeline.reference().untiled(),
    "sequence_parallel": kdax.KDAPipeline.reference,
    "sequence_parallel_pallas": lambda: kdax.KDAPipeline.pallas("tpu", interpret=True),
    # (-m slow only) the Triton stages in interpret mode, alone and sequence parallel
    "pallas_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
    "sequence_parallel_triton": lambda: kdax.KDAPipeline.pallas("triton", interpret=True),
}
DEVICES = 4
SEEDS = range(25)
# The fast core: between them every kind and every route (the rest: -m slow).
CORE = {"reference": (5,), "untiled": (0,), "pallas_tpu": (11,), "segmented": (14,), "sequence_parallel": (13,),
        "sequence_parallel_pallas": (3,), "pallas_triton": (), "sequence_parallel_triton": ()}


def stage_mix(seed: int):
    """``{field: stage}`` of one to three user-written stages, distinct fields; ``what``."""
    r = random.Random(50_000 + seed)
    kinds = [sorted(KINDS)[seed % len(KINDS)]]  # (each kind first in turn, then 0-2 others)
    for kind in r.sample(sorted(KINDS), r.choice([0, 1, 2])):
        if KINDS[kind][0] not in {KINDS[k][0] for k in kinds}:
            kinds.append(kind)
    return kinds, r


def _pipeline(base: str, stages: dict):
    fields = tuple(stages)
    pipe = eqx.tree_at(lambda p: tuple(getattr(p, f) for f in fields), BASES[base](), tuple(stages.values()))
    return kdax.stages.segmented(pipe, 3) if base == "segmented" else pipe


def _with_tau(pipe, tau):
    """``pipe`` with the tempered gate's ``tau`` (under ``segmented``: its base pipeline's)."""
    gate = (lambda p: p.gate.tau) if isinstance(pipe.gate, TemperedGate) else (lambda p: p.base.gate.tau)
    return pipe if tau is None else eqx.tree_at(gate, pipe, tau)


def _call(base: str, pipe, C: int):
    if not base.startswith("sequence_parallel"):
        return lambda tau=None, **kw: kdax.chunk_kda(**kw, chunk_size=C, pipeline=_with_tau(pipe, tau))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("tokens",))
    return lambda q, k, v, g, beta, tau=None, **kw: kdax.parallel.chunk_kda(
        mesh, "tokens", q, k, v, g, beta, **kw, chunk_size=C, pipeline=_with_tau(pipe, tau))


@pytest.mark.filterwarnings("ignore::kdax.FallbackWarning")
@pytest.mark.parametrize("base,seed", [
    pytest.param(b, s, marks=() if s in CORE[b] else pytest.mark.slow, id=f"{b}-{s}") for b in BASES for s in SEEDS])
def test_custom_stage_mix_against_reference(base, seed):
    kinds, r = stage_mix(seed)
    with jax.enable_x64(True):
        x, options, C, what = mix(seed, DEVICES if base.startswith("sequence_parallel") else 1)
        stages = {KINDS[k][0]: KINDS[k][1](what["HV"], r) for k in kinds}
        tau = stages["gate"].tau if isinstance(stages.get("gate"), TemperedGate) else None
        doubled = isinstance(stages.get("output"), DoubledOutput)
        what = f"{base} {kinds} {what}"
        if "state" in stages and base.startswith(("segmented", "sequence_parallel")):
            # affine summaries join the pieces: exact for KDA's F4 alone, so named and refused
            with pytest.raises(ValueError, match=r"F4 `state` \(MineState\).*math = kdax\.stages\.KDA"):
                _call(base, _pipeline(base, stages), C)(**x, **options)
            return
        N = x["v"].shape[0] if "cu_seqlens" not in options else len(options["cu_seqlens"]) - 1
        K, V, HV = x["q"].shape[-1], x["v"].shape[-1], x["v"].shape[2]
        state = (N, HV) + ((V, K) if options["state_v_first"] else (K, V))
        rng = np.random.default_rng(2000 + seed)  # the cotangents of o and of the final states
        w, wf = jnp.asarray(rng.normal(size=x["v"].shape)), jnp.asarray(rng.normal(size=state))
        xt = dict(x, **({} if tau is None else {"tau": tau}))
        o, final, grads = _loss_and_grads(_call(base, _pipeline(base, stages), C), xt, options, w, wf)

        def oracle(g, tau=None, **kw):
            g = g if tau is None else g * tau[None, None, :, None]
            o, final = kdax.fused_recurrent_kda(g=g, **kw)
            return (2 * o if doubled else o), final

        recurrent = {n: v for n, v in options.items() if n not in CHUNK_ONLY}
        o_ref, final_ref, grads_ref = _loss_and_grads(oracle, xt, recurrent, w, wf)
    assert_close(o, o_ref, 1e-10, f"o {what}")
    if options["output_final_state"]:
        assert_close(final, final_ref, 1e-10, f"final state {what}")
    for name in xt:
        assert_close(grads[name], grads_ref[name], 1e-10, f"d{name} {what}")
