"""``KDAPipeline``: the forward stages F1-F5 and backward stages B0-B5 composed, and
``chunk_kda``, differentiable through an ``eqx.filter_custom_vjp`` that runs the six-stage
backward (the pipeline's own arrays: ``kdax._runner.stage_grads``).

Any stage can be swapped for another implementation of its abstract class::

    pipe = eqx.tree_at(lambda p: p.intra, KDAPipeline.reference(), MyIntra())

See docs/stages.md for the stages' contracts, tiles, fallback, ``plan`` and intermediates.
"""

import dataclasses
import functools
import typing
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from . import pallas as P
from ._config import KDAConfig, KDAOptions
from ._layouts.layout import ChunkLayout
from ._layouts.tokens import Tokens, as_chunked, chunked_cotangent
from ._numerics import precision as _precision
from ._numerics.chunk_loops import check_chunk_loops
from . import _plan
from ._plan import KDAPlan
from ._stage_protocol.capabilities import reads_tokens
from ._runner.contracts import STAGES, check_families
from ._runner.routes import check_transposes
from ._runner.forward import ForwardRoute, backward_hooks, forward_route, on_route
from ._runner.residuals import KDAGrads, KDAResiduals
from ._runner.runner import PipelineState, PipelineWY, run_stage
from ._runner.stage_grads import BackwardParts
from ._runner import vjp as _vjp
from ._annotations import Beta, ChunkK, ChunkState, ChunkV, Gate, QK, Values
from ._validate import final_out, options_of, prepare_forward
from .stages import (
    AbstractDAv,
    AbstractDhu,
    AbstractGate,
    AbstractGateBackward,
    AbstractIntra,
    AbstractIntraBackward,
    AbstractOutput,
    AbstractRecompute,
    AbstractState,
    AbstractWY,
    AbstractWYDqkg,
    Activated,
    ForwardCache,
    IntraOut,
    WYOut,
)


# Each stage field's Pallas implementation (``KDAPipeline.pallas``).
_PALLAS = dict(
    gate=P.PallasGate, intra=P.PallasIntra, wy=P.PallasWY, state=P.PallasState, output=P.PallasOutput,
    recompute=P.PallasRecompute, dav=P.PallasDAv, dhu=P.PallasDhu, wy_dqkg=P.PallasWYDqkg,
    intra_bwd=P.PallasIntraBackward, gate_bwd=P.PallasGateBackward,
)


class KDAPipeline(eqx.Module):
    """The chunked KDA algorithm as eleven swappable stages (see ``docs/stages.md``).

    Any ``eqx.Module`` implementing a stage's abstract class may fill its field; a stage may
    hold arrays (a gain, a mask, a table), and a pipeline may sit inside a model under
    ``eqx.filter_jit``/``eqx.filter_grad``/``vmap``/``scan``. Differentiated, F1 and F5
    arrays get their exact gradients, the backward stages' arrays zero (exact), F2-F4
    arrays a ``StageGradientError`` (``kdax._runner.stage_grads``).

    The pipeline checks, when it is traced: each field's family (here, and again at each
    call for pipelines edited with ``eqx.tree_at``), that each stage takes the keyword
    arguments it passes, and each stage's output (container, shapes, dtypes) before the
    next stage runs (``StageContractError``, naming the field and the class).
    """

    gate: AbstractGate
    intra: AbstractIntra
    wy: AbstractWY
    state: AbstractState
    output: AbstractOutput
    recompute: AbstractRecompute
    dav: AbstractDAv
    dhu: AbstractDhu
    wy_dqkg: AbstractWYDqkg
    intra_bwd: AbstractIntraBackward
    gate_bwd: AbstractGateBackward
    # On a stage's ``kdax.UnsupportedCase`` (a case its implementation cannot run), run the
    # reference stage of the same family instead (with a FallbackWarning, once); any other
    # exception propagates. ``plan`` says beforehand which stages will fall back.
    fallback: bool = eqx.field(static=True, default=False)
    # The forward in tiles of about this many (row, head, chunk) blocks, the state carried
    # between tiles (None: each stage once over the whole input; CPUs gain from tiles that
    # fit in cache). Only when every forward stage is ``tile_safe`` and of KDA's math (the
    # one rule of routes, ``kdax._runner.routes``); a training step runs whole (_vjp_fwd).
    tile: Optional[int] = eqx.field(static=True, default=None)
    # Precision policy of the products (kdax._numerics.precision): "auto" (half-precision
    # operands, float32 accumulation where safe for bf16/fp16 inputs), "highest", "bfloat16", "float16".
    precision: str = eqx.field(static=True, default="auto")
    # Packed varlen input (cu_seqlens): sequences share chunks, NC = ceil(T / C), each start
    # an exact reset, so short sequences cost what their tokens cost; final and initial
    # states too (``kdax._layouts.shared_states``). Needs stages of KDA's math taking
    # ``reset`` (``kdax._runner.routes.shares_chunks``). False: every sequence starts its
    # own chunk. ``plan`` says which ran.
    share_chunks: bool = eqx.field(static=True, default=True)
    # Every route a stage's declaration selects, whatever its math (kdax.testing's checks).
    trust_declarations: bool = eqx.field(static=True, default=False)

    def with_precision(self, precision: str) -> "KDAPipeline":
        """This pipeline under another precision policy (see ``kdax._numerics.precision``)."""
        return dataclasses.replace(self, precision=precision)

    def resolved(self, dtype) -> "KDAPipeline":
        """This pipeline with its precision policy resolved for inputs of ``dtype``
        (``kdax._numerics.precision.resolve``): the one place the policy is resolved, for the
        forward, the backward, the stage arrays' gradients and ``kdax.parallel`` alike."""
        if self.precision != "auto":
            return self
        return self.with_precision(_precision.resolve(self.precision, jnp.dtype(dtype)))

    def __check_init__(self):
        _precision.check_policy(self.precision)
        check_families(self)

    def run_stage(self, name: str, **kwargs):
        """Run stage ``name`` (a field) on keyword arguments through the stage runner
        (``kdax._runner.runner.run_stage``: checks, capabilities, fallback, contract, plan
        recording), as everything that calls a stage does, B0 and ``kdax.parallel`` included."""
        return run_stage(self, name, **kwargs)

    def stage_as_module(self, name: str):
        """Stage ``name`` as this pipeline runs it (``run_stage``), as a module of its
        family: what B0 recomputes with (``"wy"``, ``"state"``)."""
        if name not in ("wy", "state"):
            raise ValueError(f"name: expected 'wy' or 'state', got {name!r}.")
        return (PipelineWY if name == "wy" else PipelineState)(self)

    @classmethod
    def reference(cls, chunk_loops: str = "auto") -> "KDAPipeline":
        """Every stage in plain jnp (the default on CPU), the forward in cache-sized tiles on
        CPU (``tile``). ``chunk_loops``: the form of the stages' chunk-group loops, "flat"
        groups or "slices" of the chunk axis ("auto": slices under a ``jax.set_mesh`` mesh
        with Auto axes, ``kdax._numerics.chunk_loops.split_rows_and_heads``)."""
        check_chunk_loops(chunk_loops)
        loops = lambda c: dict(chunk_loops=chunk_loops) if "chunk_loops" in c.__dataclass_fields__ else {}
        stages = {name: info.reference(**loops(info.reference)) for name, info in STAGES.items()}
        return cls(**stages, tile=32 if jax.default_backend() == "cpu" else None)

    def untiled(self) -> "KDAPipeline":
        """This pipeline with every stage called once over the whole input (``tile=None``)."""
        return dataclasses.replace(self, tile=None)

    @classmethod
    def pallas(cls, target: Optional[str] = None, interpret: Optional[bool] = None,
               tuning: Optional[str] = None) -> "KDAPipeline":
        """Every stage a Pallas kernel for ``target`` ("tpu" or "triton"; None: triton on a
        GPU, else tpu). ``interpret=None``: interpret mode exactly when no accelerator of
        that kind is present. A case a kernel cannot run (K or V over 128 in the Triton
        kernels, shared chunks in a stage without ``reset``) raises ``UnsupportedCase``
        and falls back to the reference stage. ``tuning`` (Triton): a preset of
        ``kdax.pallas.TUNINGS`` (None: ``"default"``; see ``kdax.pallas._tuning``)."""
        target = P.default_target() if target is None else P._common.check_target(target)
        tuned = P.stage_tuning(target, tuning)
        kw = dict(target=target, interpret=P.resolve_interpret(target, interpret))
        pipe = cls(**{name: impl(**kw, **tuned.fields[name]) for name, impl in _PALLAS.items()}, fallback=True)
        return pipe if tuned.precision is None else pipe.with_precision(tuned.precision)

    @classmethod
    def mixed(cls, target: Optional[str] = None, interpret: Optional[bool] = None) -> "KDAPipeline":
        """Odd stages Pallas, even stages reference, in the order F1 gate, F2 intra,
        F3 wy, F4 state, F5 output, B0 recompute, B1 dav, B2 dhu, B3 wy_dqkg, B4 intra_bwd,
        B5 gate_bwd: Pallas for F1, F3, F5, B1, B3, B5."""
        p, r = cls.pallas(target, interpret), cls.reference()
        return cls(**{n: getattr((p, r)[i % 2], n) for i, n in enumerate(STAGES)}, fallback=True)

    def plan(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, **options) -> KDAPlan:
        """Which implementation runs each stage for these inputs and options, without
        running anything: a ``KDAPlan`` (``kdax._plan.plan``)."""
        return _plan.plan(self, q, k, v, g, beta, **options)

    def resolved_config(self, dtype=jnp.float32) -> dict:
        """Every platform-dependent choice as it resolves for inputs of ``dtype``
        (``kdax._plan.resolved_config``: what ``plan`` reports)."""
        return _plan.resolved_config(self, dtype)

    # -- forward ------------------------------------------------------------------------

    def run_forward(self, config: KDAConfig, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens,
                    clean: bool = False, entries: bool = False):
        """Forward on the raw inputs (``h0`` ``[N, HV, K, V]`` or None). Returns
        ``(o, final [N, HV, K, V], residuals with the full cache)``. ``entries``: packed
        initial states may enter shared chunks (``kdax._layouts.shared_states``; ``chunk_kda``'s
        VJP, whose backward takes them), else they keep one sequence per chunk.
        ``clean``: non-finite inputs read as zero (``kdax._numerics.isolation``). The layout,
        casts, hooks and tiles are decided first (``kdax._runner.forward``)."""
        check_families(self)  # (a pipeline edited with eqx.tree_at skips __check_init__)
        raw = (q, k, v, g, beta)
        r = forward_route(self, config, raw, h0, A_log, dt_bias, cu_seqlens, clean, entries)
        stages = functools.partial(self._forward_stages, config, r)
        o, final, fw = on_route(r, stages, config, raw, reads_tokens(self, "gate", "wy"))
        o = o.astype(v.dtype)
        return o, r.hooks.final_states(fw, final), KDAResiduals.of_forward(config, r, fw, q.shape[2], cu_seqlens)

    def _forward_stages(self, config: KDAConfig, route: ForwardRoute, chunked, h0, layout: ChunkLayout):
        """F1-F5 on chunked inputs ``(q, k, v, g, beta)`` (q, k already expanded to HV
        heads) and the state table ``h0``, with the layout's reset table (shared chunks: exact
        zeros across sequences, kdax._layouts.resets) and what the layout adds between them
        (``route.hooks``): ``(o chunked, _ForwardChunks, final states [N, HV, K, V])``."""
        (qc, kc, vc, gc, bc), ext, A_log, dt_bias, R = chunked, route.hooks, route.A_log, route.dt_bias, layout.reset
        act = self.run_stage("gate", config=config, q=qc, k=kc, g=gc, beta=bc, A_log=A_log, dt_bias=dt_bias,
                             valid=layout.valid, reset=R)
        intra = self.run_stage("intra", scale=config.scale, q=act.q, k=act.k, beta=act.beta, G=act.G, G_lo=act.G_lo,
                               reset=R)
        wy = self.run_stage("wy", q=act.q, k=act.k, v=vc, beta=act.beta, G=act.G, Akk=intra.Akk, G_lo=act.G_lo, reset=R)
        h0, L, extra = ext.f4_inputs(h0, layout, act=act, intra=intra, v=vc, g=gc, A_log=A_log, dt_bias=dt_bias)
        st = self.run_stage("state", w=wy.w, u=wy.u, kg=wy.kg, G=act.G, h0=h0, layout=L, reset=R,
                            zero_h0=route.h0_zero and h0 is route.h0)  # (the call's zeros, not a tile's carry)
        v_out = ext.v_out(st.v_new, extra)
        oc = self.run_stage("output", scale=config.scale, qg=wy.qg, h=st.h, Aqk=intra.Aqk, v_new=v_out)
        return ext.after_output(oc, extra), _ForwardChunks(act, intra, wy, st.h, st.v_new, vc, gc, extra, v_out), st.final

    # -- backward -----------------------------------------------------------------------

    def recomputed(self, res: KDAResiduals) -> ForwardCache:
        """The forward cache of ``res``: ``res.cache`` when the forward kept it, else B0's
        rebuild with this pipeline's own F3 and F4, on the forward's ``G_lo`` and reset
        table. The one place B0 is called (the backward, ``kdax.parallel``), so that
        recompute and ``disable_recompute`` agree to the bit wherever it runs."""
        if res.cache is not None:
            return res.cache
        act, L = res.act, res.layout
        wy, st = self.run_stage(
            "recompute", q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, h0=res.h0, layout=L,
            G_lo=act.G_lo, reset=L.reset, zero_h0=res.h0_zero, wy=PipelineWY(self, act.G_lo), state=PipelineState(self),
        )
        return ForwardCache.of(act.G, IntraOut(res.Aqk, res.Akk), wy, st.h, st.v_new)

    def backward(self, res: KDAResiduals, do, dht=None) -> KDAGrads:
        """The six-stage backward. ``do`` ``[B, T, HV, V]``; ``dht`` ``[N, HV, K, V]`` or
        None (no loss on the final state)."""
        return self.backward_with_parts(res, do, dht)[0]

    def backward_with_parts(self, res: KDAResiduals, do, dht=None, final=None) -> tuple:
        """``(backward(res, do, dht), parts)``: ``parts`` (``_runner.stage_grads.BackwardParts``: packed ``do``,
        B0's ``qg, h, v_new``, B4's gradients of F1's outputs, the stage arrays' cotangents). ``final``
        (``kdax._layouts.tokens.FinalGrads``): the gradients of q to beta as the call's results."""
        check_families(self)  # (a pipeline edited with eqx.tree_at skips __check_init__)
        check_transposes(self)
        cfg, L, act = res.config, res.layout, res.act
        res.check_cotangents(do, dht)
        self = self.resolved(res.in_dtypes[0])  # the policy chunk_kda resolves, for pipeline.backward
        # What the layout adds between the stages (shared chunks: final states, entering states).
        doc = chunked_cotangent(L, do, res.h0.dtype, any(reads_tokens(self, "dav", "dhu", "wy_dqkg")))
        ext = backward_hooks(res, dht)
        dht = ext.b2_dht(dht, res.h0)
        c = self.recomputed(res)  # B0
        v_out = ext.v_out(c.v_new)
        dAqk, dv_intra = self.run_stage("dav", v_new=v_out, Aqk=res.Aqk, do=doc)  # B1
        dv_intra, extra = ext.after_dav(dv_intra, k=act.k, G=act.G, v_out=v_out, h=c.h)

        def dhu(do_, dv_intra_, dht_, layout):  # B2
            return self.run_stage("dhu", scale=cfg.scale, qg=c.qg, kg=c.kg, w=c.w, G=act.G, do=do_,
                                  dv_intra=dv_intra_, dht=dht_, layout=layout, reset=L.reset)

        def dhu_from_states(dht, layout):  # (a layout's extra B2 pass: no do, no dv_intra)
            zeros = jnp.zeros_like(doc)
            return dhu(zeros, zeros, dht, layout())

        dh, extra = ext.after_dhu(dhu(doc, dv_intra, dht, L), dhu_from_states, extra)
        grads = self.run_stage(  # B3
            "wy_dqkg", scale=cfg.scale, q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, qg=c.qg,
            kg=c.kg, h=c.h, dh=dh.dh, v_new=c.v_new, do=doc, dv_new=dh.dv_new, G_lo=act.G_lo, reset=L.reset, final=final,
        )
        grads, extra = ext.after_wy_dqkg(grads, extra, dv_intra=dv_intra, doc=doc, Akk=res.Akk)
        grads = self.run_stage(  # B4
            "intra_bwd", scale=cfg.scale, q=act.q, k=act.k, beta=act.beta, G=act.G, dAqk=dAqk, grads=grads,
            G_lo=act.G_lo, reset=L.reset,
        )
        raw = self.run_stage(  # B5
            "gate_bwd", config=cfg, act=act, g=res.g_raw, A_log=res.A_log, dt_bias=res.dt_bias, valid=L.valid,
            dq=grads.dq, dk=grads.dk, dbeta=grads.dbeta, dG=grads.dG, reset=L.reset, final=final,
        )
        raw = ext.after_gate_bwd(raw, extra)
        parts = BackwardParts(doc=as_chunked(doc), qg=c.qg, h=c.h, v_new=v_out, act_grads=grads)
        dh0 = functools.partial(ext.initial_state, dh, extra)
        return KDAGrads.unpacked(L, raw, grads.dv, res.num_qk_heads, dh0, final), parts

    # -- public entry points ------------------------------------------------------------

    def forward(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, options: Optional[KDAOptions] = None, **kwargs):
        """Forward only, with ``chunk_kda``'s options (keywords, or one ``KDAOptions``).
        Returns ``(o, final_state, residuals)``; ``residuals.cache`` holds every
        intermediate, ``residuals.read(name)`` gives one in the ``[B, T, ...]`` layout, and
        ``pipeline.backward(residuals, do, dht)`` gives every input gradient."""
        opts = options_of(options, kwargs)
        config, args, opts = prepare_forward(q, k, v, g, beta, opts)
        o, final, res = self.resolved(q.dtype).run_forward(config, *args)
        return o, final_out(final, config, opts.state_v_first), res

    def __call__(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, options: Optional[KDAOptions] = None,
                 **kwargs):
        """``kdax.chunk_kda`` with this pipeline, on one device (options by keyword, or one
        ``KDAOptions``; ``kdax.chunk_kda`` adds FLA's positional order, sharded inputs and
        ``seq_axis_name``): ``(o, final state or None)``, differentiable."""
        return self.apply(q, k, v, g, beta, options_of(options, kwargs))

    def apply(self, q, k, v, g, beta, options: KDAOptions):
        """The single-device call behind ``chunk_kda`` (``kdax._runner.vjp.apply``):
        validation, then the forward, differentiable through the six-stage backward.
        Returns ``(o, final state or None)`` in ``chunk_kda``'s layouts."""
        return _vjp.apply(self, q, k, v, g, beta, options)


class _ForwardChunks(eqx.Module):
    """What F1-F5 produce besides ``o``, in the chunked layout: the stage outputs, and the
    packed ``v`` and ``g`` (the backward's residuals)."""

    act: Activated
    intra: IntraOut
    wy: WYOut
    h: ChunkState
    v_new: ChunkV
    v: typing.Union[ChunkV, Tokens]  # (views of the caller's v and g: kdax._layouts.tokens)
    g: typing.Union[ChunkK, Tokens]
    extra: object = None  # the layout's own part (ForwardHooks.f4_inputs), e.g. entering states
    v_out: object = None  # what F5 read as v_new (ForwardHooks.v_out)


def default_pipeline() -> KDAPipeline:
    """The pipeline ``chunk_kda(pipeline=None)`` uses: the reference stages (XLA) on every
    platform, precision policy "auto" (``kdax._numerics.precision``). On a GPU they run whole chunk
    groups per loop iteration and unroll the recurrences (``kdax._numerics.chunk_loops.resolve_group``,
    ``loop_unroll``). On an H200 the Triton pipeline is faster (bf16, B=1 T=16384 H=16
    K=V=128, a training step: 27.4 ms here, 20.1 ms ``KDAPipeline.pallas("triton")``, 15.1 ms
    with ``tuning="candidate"``; benchmarks/results/gpu_h200/triton_candidates/), but its
    kernels have run compiled on a GPU only on dense bf16 calls: the default stays here until
    the suite's device cases pass on a GPU (``benchmarks/gpu_candidate_run.sh --tests``)."""
    return KDAPipeline.reference()
