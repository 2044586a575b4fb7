"""``KDAPipeline``: the forward stages F1-F5 and backward stages B0-B5 composed, and
``chunk_kda``, differentiable through a ``jax.custom_vjp`` that runs the six-stage backward.

Any stage can be swapped for another implementation of its abstract class::

    pipe = eqx.tree_at(lambda p: p.intra, KDAPipeline.reference(), MyIntra())
"""

import dataclasses
import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._config import KDAConfig
from ._layout import ChunkLayout, expand_group, make_layout, pack, reduce_group, unpack
from ._tiles import Tiles
from ._typing import ALog, ArrayIn, Beta, ChunkK, ChunkMat, ChunkState, ChunkV, CuSeqlens, Gate, QK, SeqState, State, Values, typecheck
from ._validate import validate_kda_args
from .parallel._shard import route
from .ref._recurrent import compute_dtype
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
    ReferenceDAv,
    ReferenceDhu,
    ReferenceGate,
    ReferenceGateBackward,
    ReferenceIntra,
    ReferenceIntraBackward,
    ReferenceOutput,
    ReferenceRecompute,
    ReferenceState,
    ReferenceWY,
    ReferenceWYDqkg,
    WYOut,
)
from .stages._ops import zeros_after


class KDAResiduals(eqx.Module):
    """What the backward needs, in the chunked layout. Always: the activated inputs
    (``act``: q, k, beta, G and the l2norm statistics), v, the raw gate input when the
    gate is in-kernel, the gate parameters, ``Aqk``, ``Akk``, the initial states ``h0``
    ``[N, HV, K, V]`` and the layout. ``cache`` holds the rest of the forward (w, u, qg,
    kg, h, v_new) when it was kept (``disable_recompute=True``, or ``pipeline.forward``)."""

    config: KDAConfig = eqx.field(static=True)
    layout: ChunkLayout
    act: Activated
    v: ChunkV
    g_raw: Optional[ChunkK]
    A_log: Optional[Float[Array, " HV"]]
    dt_bias: Optional[Float[Array, " HVK"]]
    Aqk: ChunkMat
    Akk: ChunkMat
    h0: SeqState
    cache: Optional[ForwardCache]
    num_qk_heads: int = eqx.field(static=True)
    # dtypes of (q, k, v, g, beta, initial_state, A_log, dt_bias) as given (None if absent)
    in_dtypes: tuple = eqx.field(static=True)


class KDAGrads(eqx.Module):
    """Gradients of every differentiable input, in ``chunk_kda``'s layouts (float32 or
    float64; ``chunk_kda``'s VJP casts them to the inputs' dtypes). ``initial_state`` is
    ``[N, HV, K, V]``; entries are None where the input was not given."""

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T HV V"]
    g: Float[Array, "B T HV K"]
    beta: Float[Array, "B T HV"]
    initial_state: SeqState
    A_log: Optional[Float[Array, " HV"]]
    dt_bias: Optional[Float[Array, " HVK"]]


# A dict while ``stage_inputs`` runs: each stage's first arguments, by stage name.
_STAGE_TAP: Optional[dict] = None


class KDAPipeline(eqx.Module):
    """The chunked KDA algorithm as eleven swappable stages (see DESIGN.md §2)."""

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
    # On a stage's NotImplementedError (a case its target cannot run), use the reference
    # stage of the same family instead of failing.
    fallback: bool = eqx.field(static=True, default=False)
    # The forward in tiles of about this many (row, head, chunk) blocks, every stage called
    # tile by tile with the state carried between tiles (None: each stage once over the
    # whole input). CPUs gain from tiles that fit in cache; accelerators want whole arrays.
    # A training step (chunk_kda under a gradient) runs whole: see _vjp_fwd.
    tile: Optional[int] = eqx.field(static=True, default=None)

    def _stage(self, name: str, *args):
        if _STAGE_TAP is not None:
            _STAGE_TAP.setdefault(name, args)
        # The named scope labels every op of the stage in HLO dumps and profiles. Products
        # run at full precision in any stage, a user's too (see stages._ops.full_precision).
        with jax.named_scope(f"kdax_{name}"), jax.default_matmul_precision("highest"):
            try:
                return getattr(self, name)(*args)
            except NotImplementedError:
                if not self.fallback:
                    raise
                return getattr(_reference(), name)(*args)

    @classmethod
    def reference(cls) -> "KDAPipeline":
        """Every stage in plain jnp (the default on CPU), the forward in cache-sized tiles on
        CPU (``tile``)."""
        return cls(
            gate=ReferenceGate(), intra=ReferenceIntra(), wy=ReferenceWY(), state=ReferenceState(),
            output=ReferenceOutput(), recompute=ReferenceRecompute(), dav=ReferenceDAv(),
            dhu=ReferenceDhu(), wy_dqkg=ReferenceWYDqkg(), intra_bwd=ReferenceIntraBackward(),
            gate_bwd=ReferenceGateBackward(), tile=32 if jax.default_backend() == "cpu" else None,
        )

    def untiled(self) -> "KDAPipeline":
        """This pipeline with every stage called once over the whole input (``tile=None``)."""
        return dataclasses.replace(self, tile=None)

    @classmethod
    def pallas(cls, target: Optional[str] = None, interpret: Optional[bool] = None) -> "KDAPipeline":
        """Every stage a Pallas kernel for ``target`` ("tpu" or "triton"; None: triton on a
        GPU, else tpu). ``interpret=None``: interpret mode exactly when no accelerator of
        that kind is present. A case a kernel cannot run (packed varlen in the TPU state
        kernels) falls back to the reference stage."""
        from . import pallas as P

        target = P.default_target() if target is None else P._common.check_target(target)
        kw = dict(target=target, interpret=P.resolve_interpret(target, interpret))
        return cls(
            gate=P.PallasGate(**kw), intra=P.PallasIntra(**kw), wy=P.PallasWY(**kw), state=P.PallasState(**kw),
            output=P.PallasOutput(**kw), recompute=P.PallasRecompute(**kw), dav=P.PallasDAv(**kw),
            dhu=P.PallasDhu(**kw), wy_dqkg=P.PallasWYDqkg(**kw), intra_bwd=P.PallasIntraBackward(**kw),
            gate_bwd=P.PallasGateBackward(**kw), fallback=True,
        )

    @classmethod
    def mixed(cls, target: Optional[str] = None, interpret: Optional[bool] = None) -> "KDAPipeline":
        """Odd stages Pallas, even stages reference, in the order F1 gate, F2 intra,
        F3 wy, F4 state, F5 output, B0 recompute, B1 dav, B2 dhu, B3 wy_dqkg, B4 intra_bwd,
        B5 gate_bwd: Pallas for F1, F3, F5, B1, B3, B5."""
        p, r = cls.pallas(target, interpret), cls.reference()
        return cls(
            gate=p.gate, intra=r.intra, wy=p.wy, state=r.state, output=p.output, recompute=r.recompute,
            dav=p.dav, dhu=r.dhu, wy_dqkg=p.wy_dqkg, intra_bwd=r.intra_bwd, gate_bwd=p.gate_bwd, fallback=True,
        )

    # -- forward ------------------------------------------------------------------------

    def run_forward(self, config: KDAConfig, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens):
        """Forward on the raw inputs (``h0`` ``[N, HV, K, V]`` or None). Returns
        ``(o, final [N, HV, K, V], residuals with the full cache)``."""
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        dt = compute_dtype(q, k, v, g, beta, h0)
        layout = make_layout(B, T, config.chunk_size, cu_seqlens)
        N = layout.empty.shape[0]
        h0_in, A_log_in, dt_bias_in = h0, A_log, dt_bias
        A_log = None if A_log is None else A_log.astype(dt)
        dt_bias = None if dt_bias is None else dt_bias.astype(dt)
        h0 = _initial_states(h0, (N, HV, K, V), dt)
        raw = (q, k, v, g, beta)
        nt = self._tile_chunks(layout.valid.shape[0] * HV, layout.num_chunks)
        if nt is None:
            chunked = _pack_inputs(layout, raw, HV, dt)
            oc, fw, final = self._forward_stages(config, chunked, A_log, dt_bias, h0, layout)
            o = unpack(layout, oc)
        else:
            o, final, fw = self._forward_tiled(config, layout, raw, HV, dt, A_log, dt_bias, h0, nt)
        o = o.astype(v.dtype)
        act, intra, wy = fw.act, fw.intra, fw.wy
        cache = ForwardCache(act.G, intra.Aqk, intra.Akk, wy.w, wy.u, wy.qg, wy.kg, fw.h, fw.v_new)
        in_dtypes = tuple(None if x is None else jnp.dtype(x.dtype) for x in (q, k, v, g, beta, h0_in, A_log_in, dt_bias_in))
        res = KDAResiduals(
            config, layout, act, fw.v, fw.g if config.use_gate_in_kernel else None, A_log, dt_bias,
            intra.Aqk, intra.Akk, h0, cache, H, in_dtypes,
        )
        return o, final, res

    def _tile_chunks(self, rows_heads: int, num_chunks: int) -> Optional[int]:
        """Chunks per forward tile, or None to run each stage once over everything."""
        if self.tile is None:
            return None
        n = max(1, self.tile // rows_heads)
        return None if n >= num_chunks else n

    def _forward_stages(self, config: KDAConfig, chunked, A_log, dt_bias, h0, layout: ChunkLayout):
        """F1-F5 on chunked inputs ``(q, k, v, g, beta)`` (q, k already expanded to HV
        heads): ``(o chunked, _ForwardChunks, final states [N, HV, K, V])``."""
        qc, kc, vc, gc, bc = chunked
        act = self._stage("gate", config, qc, kc, gc, bc, A_log, dt_bias, layout.valid)
        intra = self._stage("intra", config.scale, act.q, act.k, act.beta, act.G)
        wy = self._stage("wy", act.q, act.k, vc, act.beta, act.G, intra.Akk)
        st = self._stage("state", wy.w, wy.u, wy.kg, act.G, h0, layout)
        oc = self._stage("output", config.scale, wy.qg, st.h, intra.Aqk, st.v_new)
        return oc, _ForwardChunks(act, intra, wy, st.h, st.v_new, vc, gc), st.final

    def _forward_tiled(self, config: KDAConfig, layout: ChunkLayout, raw, HV: int, dt, A_log, dt_bias, h0, nt: int):
        """F1-F5 on ``nt`` chunks at a time, the state carried from tile to tile (see
        ``_tiles``). On CPU this keeps a tile's intermediates in cache instead of writing
        whole-sequence arrays to main memory (the forward 1.4x faster at the benchmark
        shape); every intermediate is still written to a full-size output, which XLA drops
        where nothing reads it (``chunk_kda`` without gradients).

        Returns ``(o [B, T, HV, V], final, _ForwardChunks of full size)``."""
        tiles = Tiles(layout, h0.shape[0], nt)
        if not tiles.dense:
            packed = _pack_inputs(layout, raw, HV, dt)

        def stages(c0, n, tail, h_carry):
            tl = tiles.layout_of(c0, n, tail)
            if tiles.dense:
                chunked = _pack_inputs(tl, tuple(tiles.tokens(x, c0, n, tail) for x in raw), HV, dt)
            else:
                chunked = tuple(tiles.chunks(x, c0, n) for x in packed)
            oc, fw, table = self._forward_stages(config, chunked, A_log, dt_bias, tiles.table(h0, h_carry), tl)
            return oc, fw, table, tl

        def step(c0, n, tail, state):
            (h_carry, finals), (o, outs) = state
            oc, fw, table, tl = stages(c0, n, tail, h_carry)
            if not tiles.dense:  # the final states of the sequences that end in this tile
                finals = tiles.collect(finals, tl, table)
            o = tiles.put(o, tl, oc, c0)
            outs = tuple(jax.lax.dynamic_update_slice_in_dim(b, x, c0, 2) for b, x in zip(outs, jax.tree.leaves(fw)))
            return (tiles.carry_of(tl, table), finals), (o, outs)

        # Full-size outputs, shaped after one tile, zeros made where they are used.
        oc, fw = jax.eval_shape(lambda: stages(0, nt, False, h0[: tiles.R])[:2])
        shapes, tree = jax.tree.flatten(fw)
        deps = tuple(raw) + (h0,)
        o = zeros_after(tiles.buffer_shape(oc.shape), oc.dtype, deps)
        outs = tuple(zeros_after(x.shape[:2] + (tiles.NC,) + x.shape[3:], x.dtype, deps, j + 1)
                     for j, x in enumerate(shapes))
        carry = (h0, None) if tiles.dense else (jnp.zeros((tiles.R,) + h0.shape[1:], h0.dtype), h0)
        (h_last, finals), (o, outs) = tiles.run(step, (carry, (o, outs)))
        # A sequence of length 0 keeps its initial state.
        final = h_last if tiles.dense else jnp.where(layout.empty[:, None, None, None], h0, finals)
        return tiles.finish(o), final, jax.tree.unflatten(tree, outs)

    # -- backward -----------------------------------------------------------------------

    def backward(self, res: KDAResiduals, do, dht=None) -> KDAGrads:
        """The six-stage backward. ``do`` ``[B, T, HV, V]``; ``dht`` ``[N, HV, K, V]`` or
        None (no loss on the final state)."""
        cfg, L, act = res.config, res.layout, res.act
        want = (L.valid.shape[0] if L.pos is None else 1, L.T, res.v.shape[1], res.v.shape[-1])
        if tuple(do.shape) != want:
            raise ValueError(f"do: expected shape [B, T, HV, V] = {want}, got {tuple(do.shape)}.")
        if dht is not None and tuple(dht.shape) != tuple(res.h0.shape):
            raise ValueError(f"dht: expected shape [N, HV, K, V] = {tuple(res.h0.shape)}, got {tuple(dht.shape)}.")
        dt = res.h0.dtype
        doc = pack(L, do, dt)
        dht = jnp.zeros_like(res.h0) if dht is None else dht.astype(dt)
        if res.cache is None:  # B0
            wy, st = self._stage("recompute", act.q, act.k, res.v, act.beta, act.G, res.Akk, res.h0, L)
            w, qg, kg, h, v_new = wy.w, wy.qg, wy.kg, st.h, st.v_new
        else:
            c = res.cache
            w, qg, kg, h, v_new = c.w, c.qg, c.kg, c.h, c.v_new
        dAqk, dv_intra = self._stage("dav", v_new, res.Aqk, doc)  # B1
        dhu = self._stage("dhu", cfg.scale, qg, kg, w, act.G, doc, dv_intra, dht, L)  # B2
        grads = self._stage(  # B3
            "wy_dqkg",
            cfg.scale, act.q, act.k, res.v, act.beta, act.G, res.Akk, qg, kg, h, dhu.dh, v_new, doc, dhu.dv_new
        )
        grads = self._stage("intra_bwd", cfg.scale, act.q, act.k, act.beta, act.G, dAqk, grads)  # B4
        raw = self._stage(  # B5
            "gate_bwd",
            cfg, act, res.g_raw, res.A_log, res.dt_bias, L.valid, grads.dq, grads.dk, grads.dbeta, grads.dG
        )
        H = res.num_qk_heads
        return KDAGrads(
            q=unpack(L, reduce_group(raw.dq, H)),
            k=unpack(L, reduce_group(raw.dk, H)),
            v=unpack(L, grads.dv),
            g=unpack(L, raw.dg),
            beta=unpack(L, raw.dbeta[..., None])[..., 0],
            initial_state=dhu.dh0,
            A_log=raw.dA_log,
            dt_bias=raw.ddt_bias,
        )

    # -- public entry points ------------------------------------------------------------

    def forward(self, q, k, v, g, beta, **options):
        """Forward only, with ``chunk_kda``'s arguments. Returns ``(o, final_state,
        residuals)``; ``residuals.cache`` holds every intermediate for inspection and
        ``pipeline.backward(residuals, do, dht)`` gives every input gradient."""
        _check_arrays(q, k, v, g, beta, options.get("initial_state"), options.get("A_log"),
                      options.get("dt_bias"), options.get("cu_seqlens"))
        config, args = _prepare(q, k, v, g, beta, **options)
        o, final, res = self.run_forward(config, *args)
        return o, _final_out(final, config, options.get("state_v_first", False)), res

    def __call__(self, q, k, v, g, beta, **options):
        """``chunk_kda`` with this pipeline."""
        return chunk_kda(q, k, v, g, beta, pipeline=self, **options)


@functools.cache
def _reference() -> KDAPipeline:
    """The fallback stages, built on first use (``reference()`` asks JAX for its backend,
    which must not happen at import)."""
    return KDAPipeline.reference()


class _ForwardChunks(eqx.Module):
    """What F1-F5 produce besides ``o``, in the chunked layout: the stage outputs, and the
    packed ``v`` and ``g`` (the backward's residuals)."""

    act: Activated
    intra: IntraOut
    wy: WYOut
    h: ChunkState
    v_new: ChunkV
    v: ChunkV
    g: ChunkK


def _pack_inputs(layout: ChunkLayout, raw, HV: int, dt):
    """``(q, k, v, g, beta)`` in the chunked layout, in the compute dtype, q and k
    expanded to the HV value heads."""
    q, k, v, g, beta = raw
    return (
        expand_group(pack(layout, q, dt), HV),
        expand_group(pack(layout, k, dt), HV),
        pack(layout, v, dt),
        pack(layout, g, dt),
        pack(layout, beta[..., None], dt)[..., 0],
    )


@typecheck
def stage_inputs(pipeline: KDAPipeline, q: QK, k: QK, v: Values, g: Gate, beta: Beta, **options) -> dict:
    """The arguments each of ``pipeline``'s stages receives in one forward and backward of
    ``chunk_kda(q, k, v, g, beta, **options)`` (loss ``sum(o * w)``, ``w`` fixed random),
    run eagerly: a dict from stage name (``"gate"``, ..., ``"gate_bwd"``) to its argument
    tuple, for running or timing one stage alone (``kdax.bench --stages``)."""
    global _STAGE_TAP
    pipeline = pipeline.untiled()  # whole-input arguments, not a tile's
    # Loss sum(o * w), w fixed random weights: the backward stages get a cotangent like a
    # real loss's rather than a constant.
    w = jax.random.normal(jax.random.key(1), v.shape, jnp.float32)
    _STAGE_TAP = taps = {}
    try:
        loss = lambda *a: jnp.sum(chunk_kda(*a, pipeline=pipeline, **options)[0].astype(jnp.float32) * w)
        jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    finally:
        _STAGE_TAP = None
    return taps


@typecheck
def _check_arrays(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    initial_state: Optional[State],
    A_log: Optional[ALog],
    dt_bias: Optional[Float[ArrayIn, "_"]],
    cu_seqlens: Optional[CuSeqlens],
) -> None:
    """The shape/dtype checks of ``chunk_kda``'s signature, for ``KDAPipeline.forward``."""


def _initial_states(h0, shape, dt):
    """The initial states ``[N, HV, K, V]`` in the compute dtype (zeros when not given)."""
    return jnp.zeros(shape, dt) if h0 is None else h0.astype(dt)


def _final_out(final, config: KDAConfig, state_v_first: bool):
    if not config.output_final_state:
        return None
    return jnp.swapaxes(final, -1, -2) if state_v_first else final


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_kda_vjp(pipeline, config, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens):
    o, final, _ = pipeline.run_forward(config, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens)
    return o, final


def _vjp_fwd(pipeline, config, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens):
    # Whole: in a training step XLA then shares F3/F4 with B0's recompute (the CPU step was
    # ~15% slower with a tiled forward; a tiled B1-B5 too was still 5-10% slower).
    pipeline = pipeline.untiled()
    o, final, res = pipeline.run_forward(config, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens)
    if not config.disable_recompute:
        # Keep what FLA keeps (inputs, G, Aqk, Akk, l2norm statistics, h0); B0 rebuilds the rest.
        res = eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda x: x is None)
    return (o, final), res


def _vjp_bwd(pipeline, config, res, cotangents):
    do, dht = cotangents
    grads = pipeline.backward(res, do, dht if config.output_final_state else None)
    out = (grads.q, grads.k, grads.v, grads.g, grads.beta, grads.initial_state, grads.A_log, grads.dt_bias)
    out = tuple(None if d is None else x.astype(d) for x, d in zip(out, res.in_dtypes))
    return out + (None,)


_chunk_kda_vjp.defvjp(_vjp_fwd, _vjp_bwd)


def _prepare(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
    cu_seqlens=None, chunk_size=64, disable_recompute=False, state_v_first=False,
):
    dims = validate_kda_args(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        safe_gate=safe_gate, chunk_size=chunk_size,
    )
    config = KDAConfig(
        scale=dims.scale, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=None if lower_bound is None else float(lower_bound),
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, output_final_state=output_final_state, disable_recompute=disable_recompute,
    )
    asarr = lambda x: None if x is None else jnp.asarray(x)
    h0 = asarr(initial_state)
    if h0 is not None and state_v_first:
        h0 = jnp.swapaxes(h0, -1, -2)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    args = (asarr(q), asarr(k), asarr(v), asarr(g), asarr(beta), h0, asarr(A_log), asarr(dt_bias), cu)
    return config, args


def default_pipeline() -> KDAPipeline:
    """The pipeline ``chunk_kda(pipeline=None)`` uses on this platform."""
    return KDAPipeline.reference()


@typecheck
def chunk_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[ALog] = None,
    dt_bias: Optional[Float[ArrayIn, "_"]] = None,
    lower_bound: Optional[float] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    cu_seqlens: Optional[CuSeqlens] = None,
    chunk_size: int = 64,
    disable_recompute: bool = False,
    state_v_first: bool = False,
    pipeline: Optional[KDAPipeline] = None,
    seq_axis_name: Optional[str] = None,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "N HV _S1 _S2"]]]:
    """Chunked KDA (FLA's ``chunk_kda`` arguments and layouts).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]``
    (log decay, or the raw gate input with ``use_gate_in_kernel``: softplus gate with
    ``A_log [HV]`` and optional ``dt_bias [HV*K]``, lower-bound gate whenever
    ``lower_bound`` is set); beta ``[B, T, HV]`` (raw with ``use_beta_sigmoid_in_kernel``);
    states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``); ``cu_seqlens``
    ``[N + 1]`` packs N sequences into B == 1. ``chunk_size`` in {16, 32, 64, 128}.
    ``safe_gate`` is FLA's promise that the gate lies in about [-5, 0); kdax's kernels are
    exact for any gate, so it only adds FLA's check that ``lower_bound`` is set.

    Returns ``o [B, T, HV, V]`` in v's dtype and the final state (float32, or float64 for
    float64 inputs) or None. ``jax.grad`` runs the six-stage backward of ``pipeline``
    (default: ``default_pipeline()``); ``disable_recompute=True`` keeps the forward
    intermediates instead of recomputing them.

    ``seq_axis_name``: inside ``jax.shard_map`` with the token axis sharded over that mesh
    axis, q, k, v, g, beta and o are this device's tokens, ``cu_seqlens`` the global
    offsets, the states global (identical on every device): sequence parallel, exact
    (see ``kdax.parallel``).
    """
    routed = route(chunk_kda, locals())  # first: locals() is the arguments alone
    if routed is not None:  # sequence parallel, or sharded over an Explicit mesh
        return routed
    config, args = _prepare(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        disable_recompute=disable_recompute, state_v_first=state_v_first,
    )
    pipeline = default_pipeline() if pipeline is None else pipeline
    if q.shape[1] == 0:
        # No tokens (every sequence empty): nothing for any stage to do; every state
        # passes through unchanged, and so does its gradient.
        q, k, v, g, beta, h0, _, _, cu = args
        N = v.shape[0] if cu is None else cu.shape[0] - 1
        final = _initial_states(h0, (N, v.shape[2], q.shape[-1], v.shape[-1]), compute_dtype(q, k, v, g, beta, h0))
        return jnp.zeros(v.shape, v.dtype), _final_out(final, config, state_v_first)
    o, final = _chunk_kda_vjp(pipeline, config, *args)
    return o, _final_out(final, config, state_v_first)
