"""``KDAPipeline``: the forward stages F1-F5 and backward stages B0-B5 composed (docs/stages.md).
Swap a stage with ``eqx.tree_at(lambda p: p.intra, KDAPipeline.reference(), MyIntra())``."""

import dataclasses
import functools
from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from . import pallas as P
from ._config import KDAConfig, KDAOptions
from ._platform import triton_by_default
from ._layouts.layout import ChunkLayout
from ._layouts.tokens import Tokens, as_chunked, chunked_cotangent
from ._numerics import precision as _precision
from ._numerics.chunk_loops import check_chunk_loops
from . import _plan
from ._stage_protocol.capabilities import capabilities, reads_tokens
from ._runner.contracts import STAGES, check_families
from ._runner.routes import check_transposes
from ._runner.forward import ForwardRoute, backward_hooks, forward_route, on_route
from ._runner.residuals import KDAGrads, KDAResiduals
from ._runner.runner import PipelineState, PipelineWY, run_stage
from ._runner.stage_grads import BackwardParts
from ._runner import vjp as _vjp
from ._annotations import Beta, ChunkK, ChunkState, ChunkV, Gate, QK, Values
from ._validate import check_arrays, final_out, options_of, prepare_forward
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

    Any ``eqx.Module`` implementing a stage's abstract class may fill its field and may hold
    arrays; differentiated, F1 and F5 arrays get exact gradients, backward stages' zero,
    F2-F4's a ``StageGradientError``. Each field's family, the keyword arguments a stage
    takes and each stage's output are checked when traced (``StageContractError``)."""

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
    # On a stage's ``kdax.UnsupportedCase``, run its family's reference stage (a FallbackWarning, once).
    fallback: bool = eqx.field(static=True, default=False)
    # The forward (without gradients) in tiles of about this many (row, head, chunk) blocks,
    # when every forward stage is ``tile_safe`` and of KDA's math (None: whole).
    tile: Optional[int] = eqx.field(static=True, default=None)
    # Precision policy of the products: "auto", "highest", "bfloat16", "float16" (docs/stages.md §10).
    precision: str = eqx.field(static=True, default="auto")
    # Packed varlen input: sequences share chunks (NC = ceil(T / C), each start an exact
    # reset), given stages of KDA's math taking ``reset``; False: each starts its own chunk.
    share_chunks: bool = eqx.field(static=True, default=True)
    # Every route a stage's declaration selects, whatever its math (kdax.testing's checks).
    trust_declarations: bool = eqx.field(static=True, default=False)

    def with_precision(self, precision: str) -> "KDAPipeline":
        """This pipeline under another precision policy."""
        return dataclasses.replace(self, precision=precision)

    def resolved(self, *dtypes) -> "KDAPipeline":
        """This pipeline with its policy resolved for inputs of ``dtypes`` (the one place:
        ``kdax._numerics.precision.resolve``)."""
        policy = _precision.resolve(self.precision, *dtypes)
        return self if policy == self.precision else self.with_precision(policy)

    def __check_init__(self):
        _precision.check_policy(self.precision)
        if self.tile is not None and (isinstance(self.tile, bool) or not hasattr(self.tile, "__index__") or self.tile < 1):
            raise ValueError(f"tile: expected a positive int (the forward's (row, head, chunk) blocks a tile) or None, "
                             f"got {self.tile!r}.")
        check_families(self)

    def run_stage(self, name: str, **kwargs):
        """Run stage ``name`` on keyword arguments through the stage runner, as every stage call does."""
        return run_stage(self, name, **kwargs)

    def stage_as_module(self, name: str):
        """Stage ``name`` ("wy" or "state") as this pipeline runs it: what B0 recomputes with."""
        if name not in ("wy", "state"):
            raise ValueError(f"name: expected 'wy' or 'state', got {name!r}.")
        return (PipelineWY if name == "wy" else PipelineState)(self)

    @classmethod
    def reference(cls, chunk_loops: str = "auto") -> "KDAPipeline":
        """Every stage in plain jnp, the forward in cache-sized tiles on CPU. ``chunk_loops``:
        "flat" groups or "slices" of the chunk axis ("auto": slices under a ``jax.set_mesh``
        mesh with Auto axes)."""
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
        """Every stage a Pallas kernel for ``target`` ("tpu" or "triton"; None: triton on a GPU,
        else tpu), falling back to the reference stage on ``UnsupportedCase``.
        ``interpret=None``: interpret mode exactly when no such accelerator is present.
        ``tuning`` (Triton): a preset of ``kdax.pallas.TUNINGS`` (None: ``"default"``)."""
        target = P.default_target() if target is None else P._common.check_target(target)
        tuned = P.stage_tuning(target, tuning)
        kw = dict(target=target, interpret=P.resolve_interpret(target, interpret))
        pipe = cls(**{name: impl(**kw, **tuned.fields[name]) for name, impl in _PALLAS.items()}, fallback=True)
        return pipe if tuned.precision is None else pipe.with_precision(tuned.precision)

    @classmethod
    def mixed(cls, target: Optional[str] = None, interpret: Optional[bool] = None) -> "KDAPipeline":
        """Pallas for F1, F3, F5, B1, B3, B5 (the odd stages), reference for the others."""
        p, r = cls.pallas(target, interpret), cls.reference()
        return cls(**{n: getattr((p, r)[i % 2], n) for i, n in enumerate(STAGES)}, fallback=True)

    def plan(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, **options) -> _plan.KDAPlan:
        """Which implementation runs each stage for these inputs and options, without running anything."""
        return _plan.plan(self, q, k, v, g, beta, **options)

    def resolved_config(self, *dtypes) -> dict:
        """Every platform-dependent choice as it resolves for inputs of ``dtypes`` (as ``resolved``)."""
        return _plan.resolved_config(self, *dtypes)

    # -- forward ------------------------------------------------------------------------

    def run_forward(self, config: KDAConfig, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens,
                    clean: bool = False, entries: bool = False):
        """Forward on the raw inputs (``h0`` ``[N, HV, K, V]`` or None): ``(o, final [N, HV, K,
        V], residuals with the full cache)``. ``entries``: packed initial states may enter
        shared chunks; ``clean``: non-finite inputs read as zero."""
        check_families(self)  # (a pipeline edited with eqx.tree_at skips __check_init__)
        raw = (q, k, v, g, beta)
        r = forward_route(self, config, raw, h0, A_log, dt_bias, cu_seqlens, clean, entries)
        stages = functools.partial(self._forward_stages, config, r)
        o, final, fw = on_route(r, stages, config, raw, reads_tokens(self, "gate", "wy"))
        o = o.astype(q.dtype)  # (FLA: o.type_as(q))
        return o, r.hooks.final_states(fw, final), KDAResiduals.of_forward(config, r, fw, q.shape[2], cu_seqlens)

    def _forward_stages(self, config: KDAConfig, route: ForwardRoute, chunked, h0, layout: ChunkLayout):
        """F1-F5 on chunked ``(q, k, v, g, beta)`` (q, k expanded to HV heads), the state table
        ``h0`` and ``layout``, the layout's hooks between them: ``(o chunked, _ForwardChunks,
        final states [N, HV, K, V])``."""
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
        oc = self.run_stage("output", scale=config.scale, qg=wy.qg, h=st.h, Aqk=intra.Aqk, v_new=v_out, reset=R)
        return ext.after_output(oc, extra), _ForwardChunks(act, intra, wy, st.h, st.v_new, vc, gc, extra, v_out), st.final

    # -- backward -----------------------------------------------------------------------

    def recomputed(self, res: KDAResiduals) -> ForwardCache:
        """The forward cache of ``res``: ``res.cache`` if kept, else B0's rebuild with this
        pipeline's own F3 and F4 (the one place B0 is called)."""
        if res.cache is not None:
            return res.cache
        act, L = res.act, res.layout
        wy, st = self.run_stage(
            "recompute", q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, h0=res.h0, layout=L,
            G_lo=act.G_lo, reset=L.reset, zero_h0=res.h0_zero, wy=PipelineWY(self, act.G_lo), state=PipelineState(self),
        )
        return ForwardCache.of(act.G, IntraOut(res.Aqk, res.Akk), wy, st.h, st.v_new)

    def backward(self, res: KDAResiduals, do, dht=None) -> KDAGrads:
        """The six-stage backward. ``do`` ``[B, T, HV, V]``; ``dht`` (or None) and the initial
        state's gradient in the forward's state layout, ``[N, HV, K, V]`` (``[N, HV, V, K]``
        after a ``forward`` with ``state_v_first``)."""
        res.check_cotangents(do, dht, res.state_v_first)
        flip = lambda s: jnp.swapaxes(s, -1, -2) if res.state_v_first and s is not None else s
        grads = self.backward_with_parts(res, do, flip(dht))[0]
        return dataclasses.replace(grads, initial_state=flip(grads.initial_state))

    def backward_with_parts(self, res: KDAResiduals, do, dht=None, final=None) -> tuple:
        """``(backward(res, do, dht), BackwardParts)``; ``final`` (``FinalGrads``): the gradients of
        q to beta as the call's results."""
        check_families(self)  # (a pipeline edited with eqx.tree_at skips __check_init__)
        check_transposes(self)
        cfg, L, act = res.config, res.layout, res.act
        res.check_cotangents(do, dht)
        self = self.resolved(*res.in_dtypes[:6])  # the policy chunk_kda resolves, for pipeline.backward
        doc = chunked_cotangent(L, do, res.h0.dtype, any(reads_tokens(self, "dav", "dhu", "wy_dqkg")))
        ext = backward_hooks(res, dht)
        dht = ext.b2_dht(dht, res.h0)
        c = self.recomputed(res)  # B0
        v_out = ext.v_out(c.v_new)
        dAqk, dv_intra = self.run_stage("dav", v_new=v_out, Aqk=res.Aqk, do=doc)  # B1
        dv_intra, extra = ext.after_dav(dv_intra, k=act.k, G=act.G, v_out=v_out, h=c.h)
        start = ext.dh_start(extra) if capabilities(type(self.dhu)).dh_start else None

        def dhu(do_, dv_intra_, dht_, layout, dh_start=None):  # B2
            return self.run_stage("dhu", scale=cfg.scale, qg=c.qg, kg=c.kg, w=c.w, G=act.G, do=do_,
                                  dv_intra=dv_intra_, dht=dht_, layout=layout, reset=L.reset, dh_start=dh_start)

        def dhu_from_states(dht, layout):  # (a layout's extra B2 pass: no do, no dv_intra)
            zeros = jnp.zeros_like(doc)
            return dhu(zeros, zeros, dht, layout())

        dh, extra = ext.after_dhu(dhu(doc, dv_intra, dht, L, start), dhu_from_states, extra, start is not None)
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
        """Forward only, with ``chunk_kda``'s options (keywords, or one ``KDAOptions``):
        ``(o, final_state, residuals)``; ``residuals.read(name)`` gives an intermediate,
        ``pipeline.backward(residuals, do, dht)`` every input gradient."""
        opts = options_of(options, kwargs)
        config, args, opts = prepare_forward(q, k, v, g, beta, opts)
        o, final, res = self.resolved(*args[:6]).run_forward(config, *args)
        return o, final_out(final, config, opts.state_v_first), dataclasses.replace(res, state_v_first=opts.state_v_first)

    def __call__(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, options: Optional[KDAOptions] = None,
                 **kwargs):
        """``kdax.chunk_kda`` with this pipeline on one device (options by keyword, or one
        ``KDAOptions``): ``(o, final state or None)``, differentiable."""
        opts = options_of(options, kwargs)
        check_arrays(q, k, v, g, beta, opts.initial_state, opts.A_log, opts.dt_bias, opts.cu_seqlens)
        return self.apply(q, k, v, g, beta, opts)

    def apply(self, q, k, v, g, beta, options: KDAOptions):
        """The single-device call behind ``chunk_kda`` (``kdax._runner.vjp.apply``)."""
        return _vjp.apply(self, q, k, v, g, beta, options)


class _ForwardChunks(eqx.Module):
    """What F1-F5 produce besides ``o``, chunked: the stage outputs, the packed ``v`` and ``g``."""

    act: Activated
    intra: IntraOut
    wy: WYOut
    h: ChunkState
    v_new: ChunkV
    v: Union[ChunkV, Tokens]  # (views of the caller's v and g: kdax._layouts.tokens)
    g: Union[ChunkK, Tokens]
    extra: object = None  # the layout's own part (the hooks' f4_inputs), e.g. entering states
    v_out: object = None  # what F5 read as v_new (the hooks' v_out)


def default_pipeline() -> KDAPipeline:
    """The pipeline ``chunk_kda(pipeline=None)`` uses, precision "auto": the Pallas Triton
    kernels at their default tuning on a GPU of compute capability 9.0 or more
    (``kdax._platform.triton_by_default``), elsewhere the reference stages (XLA)."""
    return KDAPipeline.pallas("triton") if triton_by_default() else KDAPipeline.reference()
