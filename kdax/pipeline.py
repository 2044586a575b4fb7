"""``KDAPipeline``: the forward stages F1-F5 and backward stages B0-B5 composed, and
``chunk_kda``, differentiable through an ``eqx.filter_custom_vjp`` that runs the six-stage
backward (the pipeline, any Equinox module, is non-differentiated configuration).

Any stage can be swapped for another implementation of its abstract class::

    pipe = eqx.tree_at(lambda p: p.intra, KDAPipeline.reference(), MyIntra())

See docs/stages.md for the stages' contracts, tiles, fallback, ``plan`` and intermediates.
"""

import dataclasses
import functools
import inspect
import warnings
from typing import ClassVar, NamedTuple, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from . import _isolation, _precision
from ._config import KDAConfig, KDAOptions
from ._contracts import STAGES, check_arguments, check_family, check_output, expected_output
from ._errors import FallbackWarning, UnsupportedCase
from ._layout import ChunkLayout, expand_group, make_layout, make_shared_layout, pack, reduce_group, unpack
from ._tiles import Tiles
from ._typing import (
    ALogIn, ArrayIn, Beta, ChunkK, ChunkMat, ChunkState, ChunkV, CuSeqlensIn, Gate, QK, Scalar, SeqState, State,
    Values, typecheck,
)
from ._validate import resolve_deprecated, validate
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
from .stages._hilo import _takes, exponent, with_G_lo
from .stages._ops import mT, zeros_after


class KDAResiduals(eqx.Module):
    """What the backward needs, in the chunked layout ``[R, HV, NC, C, ...]`` (see
    ``docs/stages.md``). Always: the activated inputs (``act``: q, k, beta, G and the l2norm
    statistics), v, the raw gate input when the gate is in-kernel, the gate parameters,
    ``Aqk``, ``Akk``, the initial states ``h0`` ``[N, HV, K, V]`` (one zero entry when the
    sequences share chunks: ``layout.reset``) and the layout. ``cache``
    holds the rest of the forward (w, u, qg, kg, h, v_new) when it was kept
    (``disable_recompute=True``, or ``pipeline.forward``).

    ``read(name)`` gives any intermediate in the user's layout (``[B, T, HV, ...]``, or per
    sequence), jit-safe."""

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
    cu_seqlens: Optional[Int[Array, " N1"]] = None

    # Token-level intermediates: where each lives. "h" (per chunk) is handled apart.
    _TOKEN = {
        "q": "act.q", "k": "act.k", "beta": "act.beta", "G": "act.G", "q_rstd": "act.q_rstd",
        "k_rstd": "act.k_rstd", "v": "v", "g": "g_raw", "Aqk": "Aqk", "Akk": "Akk", "G_lo": "act.G_lo",
        "w": "cache.w", "u": "cache.u", "qg": "cache.qg", "kg": "cache.kg", "v_new": "cache.v_new",
    }

    @classmethod
    def names(cls) -> tuple:
        """What ``read`` accepts."""
        return tuple(cls._TOKEN) + ("h",)

    def read(self, name: str, per_sequence: bool = False) -> Array:
        """Intermediate ``name`` (``names()``) in the user's layout, jit-safe.

        Token-level quantities come as ``[B, T, HV, ...]`` (``beta`` ``[B, T, HV]``; a row of
        ``Aqk``/``Akk``: ``[B, T, HV, C]``, the token's row of its chunk's matrix, columns
        the chunk's positions); q, k are the activated ones, expanded to the HV value
        heads; ``G`` the chunk-local cumulative log decay. ``h``, the state at the start
        of each chunk, comes as ``[B, NC, HV, K, V]``.

        ``per_sequence``: packed varlen input (``cu_seqlens``) as ``[N, T, HV, ...]``,
        sequence n's tokens first and zeros after (``h``: ``[N, ceil(T / C), HV, K, V]``,
        its chunks first); dense input is already one sequence per row."""
        if name == "h":
            return self._read_h(per_sequence)
        if name not in self._TOKEN:
            raise KeyError(f"name: expected one of {self.names()}, got {name!r}.")
        x = self
        for part in self._TOKEN[name].split("."):
            if x is None:
                break
            x = getattr(x, part)
        if x is None:
            why = ("no cache was kept (chunk_kda's recompute path); use KDAPipeline.forward"
                   if self._TOKEN[name].startswith("cache") else "that option is off")
            raise ValueError(f"name: {name!r} is not in these residuals: {why}.")
        y = unpack(self.layout, x[..., None] if x.ndim == 4 else x)
        y = y[..., 0] if x.ndim == 4 else y
        if not per_sequence or self.cu_seqlens is None:
            return y
        T = self.layout.T
        t = jnp.arange(T)
        cu = self.cu_seqlens
        idx = cu[:-1, None] + t[None]
        ok = idx < cu[1:, None]
        rows = y[0, jnp.clip(idx, 0, max(T - 1, 0))]
        return jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - 2)), rows, 0)

    def _read_h(self, per_sequence: bool):
        if self.cache is None:
            raise ValueError("name: 'h' is not in these residuals: no cache was kept (chunk_kda's "
                             "recompute path); use KDAPipeline.forward.")
        h = jnp.moveaxis(self.cache.h, 2, 1)  # [R, NC, HV, K, V]
        if not per_sequence or self.cu_seqlens is None:
            return h
        if self.layout.reset is not None:
            raise ValueError("per_sequence: the sequences of this forward share chunks (no initial_state, "
                             "output_final_state=False), so a chunk's start state is not one sequence's; "
                             "read('h') gives it per chunk, or run with share_chunks=False.")
        C = self.layout.chunk_size
        cu = self.cu_seqlens
        lens = cu[1:] - cu[:-1]
        nchunks = (lens + C - 1) // C
        cstart = jnp.cumsum(nchunks) - nchunks
        j = jnp.arange(-(-self.layout.T // C))
        idx = cstart[:, None] + j[None]
        ok = j[None] < nchunks[:, None]
        rows = h[0, jnp.clip(idx, 0, h.shape[1] - 1)]
        return jnp.where(ok[..., None, None, None], rows, 0)


class KDAGrads(eqx.Module):
    """Gradients of every differentiable input, in ``chunk_kda``'s layouts (float32 or
    float64; ``chunk_kda``'s VJP casts them to the inputs' dtypes). ``initial_state`` is
    ``[N, HV, K, V]``; entries are None where the input was not given (``initial_state``:
    None also after a forward with shared chunks, which had none)."""

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T HV V"]
    g: Float[Array, "B T HV K"]
    beta: Float[Array, "B T HV"]
    initial_state: Optional[SeqState]
    A_log: Optional[Float[Array, " HV"]]
    dt_bias: Optional[Float[Array, " HVK"]]


class _Recorder:
    """Collects, while ``stage_inputs`` or ``plan`` runs, each stage's keyword arguments
    (first call) and which implementation ran it (and why, after a fallback)."""

    def __init__(self, quiet: bool = False):
        self.inputs: dict = {}
        self.ran: dict = {}
        self.quiet = quiet  # no fallback warnings (plan)
        self.layout: Optional[str] = None  # which layout the forward ran (plan)


_RECORDERS: list = []
# (stage field, implementation, reason) of every fallback warned about: each warns once.
_WARNED: set = set()


def _fallback_warning(name: str, stage, reason: str) -> None:
    if any(r.quiet for r in _RECORDERS):
        return
    key = (name, f"{type(stage).__module__}.{type(stage).__qualname__}", reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    ref = type(getattr(_reference(), name)).__qualname__
    warnings.warn(
        f"KDAPipeline.{name} ({STAGES[name].step}): {type(stage).__qualname__} cannot run this case "
        f"({reason}); running {ref} instead.",
        FallbackWarning, stacklevel=2,
    )


class KDAPipeline(eqx.Module):
    """The chunked KDA algorithm as eleven swappable stages (see ``docs/stages.md``).

    Any ``eqx.Module`` implementing a stage's abstract class may fill its field; a stage may
    hold arrays (a gain, a mask, a table): they are non-differentiated configuration, held
    under ``lax.stop_gradient`` by ``chunk_kda`` (their gradient is zero), so a pipeline may
    sit inside a model under ``eqx.filter_jit``/``eqx.filter_grad``/``vmap``/``scan``.

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
    # The forward in tiles of about this many (row, head, chunk) blocks, every stage called
    # tile by tile with the state carried between tiles (None: each stage once over the
    # whole input). CPUs gain from tiles that fit in cache; accelerators want whole arrays.
    # Only when every forward stage's class is ``tile_safe``; else the forward runs whole.
    # A training step (chunk_kda under a gradient) runs whole: see _vjp_fwd.
    tile: Optional[int] = eqx.field(static=True, default=None)
    # Precision policy of the products (kdax._precision): "auto" (half-precision operands
    # with float32 accumulation where safe for bf16/fp16 inputs, else "highest"),
    # "highest", "bfloat16" or "float16".
    precision: str = eqx.field(static=True, default="auto")
    # Packed varlen input (cu_seqlens) with no initial_state (a training step's usual
    # call): sequences share chunks, NC = ceil(T / C), each sequence start an exact reset
    # (``_layout.make_shared_layout``, ``stages._segments``), so many short sequences cost what their
    # tokens cost. Final states (``chunk_kda``'s ``output_final_state``) are read from the
    # chunk of each sequence's last token; a loss on them makes the backward rerun the
    # forward with one sequence per chunk. Needs every stage but F5/B1 to take ``reset``
    # (or ``fallback``, which runs the reference ones). False, an initial state, or
    # ``KDAPipeline.forward`` with ``output_final_state``: every sequence starts its own
    # chunk. ``plan`` says which ran.
    share_chunks: bool = eqx.field(static=True, default=True)

    def with_precision(self, precision: str) -> "KDAPipeline":
        """This pipeline under another precision policy (see ``kdax._precision``)."""
        return dataclasses.replace(self, precision=precision)

    def __check_init__(self):
        _precision.check_policy(self.precision)
        for name in STAGES:
            check_family(name, getattr(self, name))

    def _stage(self, name: str, **kwargs):
        """Run stage ``name`` by keyword: fallback on ``UnsupportedCase``, contract checks.
        ``G_lo`` goes only to stages that take it (``stages._hilo``)."""
        stage = getattr(self, name)
        check_family(name, stage)
        full, kwargs = kwargs, with_G_lo(stage, kwargs)
        # ``reset`` (shared chunks) only to stages that take it; one that does not cannot
        # run this layout (raised below, inside the fallback's reach).
        takes_reset = _takes(type(stage), "reset")
        needs_reset = kwargs.get("reset") is not None and not takes_reset
        if "reset" in kwargs and not takes_reset:
            kwargs = {n: x for n, x in kwargs.items() if n != "reset"}
        for rec in _RECORDERS:
            rec.inputs.setdefault(name, kwargs)
        # The named scope labels every op of the stage in HLO dumps and profiles. Products
        # run at full precision in any stage, a user's too (see stages._ops.full_precision),
        # unless the precision policy lets this stage take half-precision operands.
        policy = "highest" if self.precision == "auto" else self.precision  # unresolved: safe
        with jax.named_scope(f"kdax_{name}"), _precision.stage_scope(policy, name):
            ran, reason = stage, None
            try:
                if needs_reset:
                    raise UnsupportedCase(
                        "packed sequences sharing chunks (cu_seqlens without initial_state) need a stage whose "
                        "__call__ takes `reset`"
                    )
                check_arguments(name, stage, kwargs)
                out = stage(**kwargs)
            except UnsupportedCase as e:
                if not self.fallback:
                    raise
                ran, reason = getattr(_reference(), name), str(e) or type(e).__name__
                _fallback_warning(name, stage, reason)
                out = ran(**with_G_lo(ran, full))
        for rec in _RECORDERS:
            rec.ran.setdefault(name, (stage, ran, reason))
        check_output(name, ran, out, expected_output(name, kwargs, kwargs.get("config")))
        return out

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
        kernels) raises ``UnsupportedCase`` and falls back to the reference stage."""
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

    def plan(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, **options) -> "KDAPlan":
        """Which implementation runs each stage for these inputs and options, without
        running anything (the forward and backward are traced abstractly): a ``KDAPlan``
        whose ``str`` is a table, with the reason of each fallback. Inputs may be arrays or
        ``jax.ShapeDtypeStruct``."""
        opts = KDAOptions.from_kwargs(**options)
        rec = _Recorder(quiet=True)
        _RECORDERS.append(rec)
        try:
            def loss(diff):
                q_, k_, v_, g_, b_, h0 = diff
                o, ht = chunk_kda(q_, k_, v_, g_, b_, pipeline=self, **_with(opts, initial_state=h0))
                out = jnp.sum(o)
                return out if ht is None else out + jnp.sum(ht)

            diff = (q, k, v, g, beta, opts.initial_state)
            jax.eval_shape(jax.grad(loss), diff)
        finally:
            _RECORDERS.remove(rec)
        forward = [self.tile is not None and not self._unsafe_for_tiles(), self._unsafe_for_tiles()]
        rows = []
        for name, info in STAGES.items():
            got = rec.ran.get(name)
            if got is None:
                why = "not run: the forward's cache is kept (disable_recompute=True)" if name == "recompute" else "not run"
                rows.append(PlanRow(name, info.step, type(getattr(self, name)).__qualname__, None, why))
            else:
                stage, ran, reason = got
                rows.append(PlanRow(name, info.step, type(stage).__qualname__, type(ran).__qualname__, reason))
        return KDAPlan(tuple(rows), self.tile if forward[0] else None, forward[1], rec.layout)

    # -- forward ------------------------------------------------------------------------

    def run_forward(self, config: KDAConfig, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens,
                    shared_finals: bool = False):
        """Forward on the raw inputs (``h0`` ``[N, HV, K, V]`` or None). Returns
        ``(o, final [N, HV, K, V], residuals with the full cache)``. ``shared_finals``: the
        caller can differentiate final states of a shared layout (``chunk_kda``'s VJP)."""
        for name in STAGES:  # a pipeline edited with eqx.tree_at skips __check_init__
            check_family(name, getattr(self, name))
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        dt = compute_dtype(q, k, v, g, beta, h0)
        shared = self.shares_chunks(config, h0, cu_seqlens, shared_finals)
        if shared:  # one stream of T tokens: a state table of one entry, zero
            layout = make_shared_layout(T, config.chunk_size, cu_seqlens)
            N = cu_seqlens.shape[0] - 1
        else:
            layout = make_layout(B, T, config.chunk_size, cu_seqlens)
            N = layout.empty.shape[0]
        for rec in _RECORDERS:  # (the forward's: a backward's rerun does not count)
            if rec.layout is None:
                rec.layout = "shared" if shared else ("dense" if cu_seqlens is None else "per-sequence")
        h0_in, A_log_in, dt_bias_in = h0, A_log, dt_bias
        A_log = None if A_log is None else A_log.astype(dt)
        dt_bias = None if dt_bias is None else dt_bias.astype(dt)
        h0 = _initial_states(h0, (1 if shared else N, HV, K, V), dt)
        raw = (q, k, v, g, beta)
        nt = self._tile_chunks(layout.valid.shape[0] * HV, layout.num_chunks)
        if nt is not None and not layout.dense and h0.shape[0] > nt * config.chunk_size:
            nt = None  # each tile's state table, O(N), would cost more than its tokens
        if nt is None:
            chunked = _pack_inputs(layout, raw, HV, dt)
            oc, fw, final = self._forward_stages(config, chunked, A_log, dt_bias, h0, layout)
            o = unpack(layout, oc)
        else:
            o, final, fw = self._forward_tiled(config, layout, raw, HV, dt, A_log, dt_bias, h0, nt)
        o = o.astype(v.dtype)
        if shared and config.output_final_state:
            final = _shared_finals(layout, cu_seqlens, fw.act.k, fw.act.G, fw.act.G_lo, fw.v_new, fw.h)
        elif shared:  # not asked for: the sequences' initial states
            final = jnp.zeros((N, HV, K, V), dt)
        act, intra, wy = fw.act, fw.intra, fw.wy
        cache = ForwardCache(act.G, intra.Aqk, intra.Akk, wy.w, wy.u, wy.qg, wy.kg, fw.h, fw.v_new)
        in_dtypes = tuple(None if x is None else jnp.dtype(x.dtype) for x in (q, k, v, g, beta, h0_in, A_log_in, dt_bias_in))
        res = KDAResiduals(
            config, layout, act, fw.v, fw.g if config.use_gate_in_kernel else None, A_log, dt_bias,
            intra.Aqk, intra.Akk, h0, cache, H, in_dtypes, cu_seqlens,
        )
        return o, final, res

    def shares_chunks(self, config: KDAConfig, initial_state, cu_seqlens, finals: bool = True) -> bool:
        """Whether a call with these options packs its sequences into shared chunks
        (``share_chunks``): packed varlen input, no ``initial_state``, no final state asked
        for unless ``finals`` (``chunk_kda``: True; ``forward``, whose residuals must take
        a ``dht``: False), and every stage given ``reset`` taking it (``_RESET_STAGES``; or
        ``fallback`` to the reference ones)."""
        if not self.share_chunks or cu_seqlens is None or initial_state is not None:
            return False
        if config.output_final_state and not finals:
            return False
        return self.fallback or all(_takes(type(getattr(self, n)), "reset") for n in _RESET_STAGES)

    def _tile_chunks(self, rows_heads: int, num_chunks: int) -> Optional[int]:
        """Chunks per forward tile, or None to run each stage once over everything."""
        if self.tile is None or self._unsafe_for_tiles():
            return None
        n = max(1, self.tile // max(rows_heads, 1))
        return None if n >= num_chunks else n

    def _unsafe_for_tiles(self) -> tuple:
        """The forward stages whose class does not declare ``tile_safe = True``: with any,
        the forward runs whole (untiled)."""
        return tuple(n for n, i in STAGES.items() if i.forward and not getattr(type(getattr(self, n)), "tile_safe", False))

    def _forward_stages(self, config: KDAConfig, chunked, A_log, dt_bias, h0, layout: ChunkLayout):
        """F1-F5 on chunked inputs ``(q, k, v, g, beta)`` (q, k already expanded to HV
        heads): ``(o chunked, _ForwardChunks, final states [N, HV, K, V])``."""
        qc, kc, vc, gc, bc = chunked
        act = self._stage("gate", config=config, q=qc, k=kc, g=gc, beta=bc, A_log=A_log, dt_bias=dt_bias,
                          valid=layout.valid, reset=layout.reset)
        # reset (shared chunks): exact zeros across sequences (stages._segments).
        R = layout.reset
        intra = self._stage("intra", scale=config.scale, q=act.q, k=act.k, beta=act.beta, G=act.G, G_lo=act.G_lo,
                            reset=R)
        wy = self._stage("wy", q=act.q, k=act.k, v=vc, beta=act.beta, G=act.G, Akk=intra.Akk, G_lo=act.G_lo, reset=R)
        st = self._stage("state", w=wy.w, u=wy.u, kg=wy.kg, G=act.G, h0=h0, layout=layout, reset=R)
        oc = self._stage("output", scale=config.scale, qg=wy.qg, h=st.h, Aqk=intra.Aqk, v_new=st.v_new)
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
        for name in STAGES:  # a pipeline edited with eqx.tree_at skips __check_init__
            check_family(name, getattr(self, name))
        cfg, L, act = res.config, res.layout, res.act
        want = (L.valid.shape[0] if L.pos is None else 1, L.T, res.v.shape[1], res.v.shape[-1])
        if tuple(do.shape) != want:
            raise ValueError(f"do: expected shape [B, T, HV, V] = {want}, got {tuple(do.shape)}.")
        if dht is not None and L.reset is not None:
            raise ValueError("dht: this forward packed its sequences into shared chunks (no initial_state, "
                             "output_final_state=False), which keeps no final states; run it with "
                             "output_final_state=True for a loss on them.")
        if dht is not None and tuple(dht.shape) != tuple(res.h0.shape):
            raise ValueError(f"dht: expected shape [N, HV, K, V] = {tuple(res.h0.shape)}, got {tuple(dht.shape)}.")
        if self.precision == "auto":  # the policy chunk_kda resolves, for pipeline.backward
            self = self.with_precision(_precision.resolve(self.precision, res.in_dtypes[0]))
        dt = res.h0.dtype
        doc = pack(L, do, dt)
        dht = jnp.zeros_like(res.h0) if dht is None else dht.astype(dt)
        if res.cache is None:  # B0, with this pipeline's own F3 and F4
            wy, st = self._stage(
                "recompute", q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, h0=res.h0, layout=L,
                G_lo=act.G_lo, reset=L.reset, wy=_PipelineWY(self, act.G_lo), state=_PipelineState(self),
            )
            w, qg, kg, h, v_new = wy.w, wy.qg, wy.kg, st.h, st.v_new
        else:
            c = res.cache
            w, qg, kg, h, v_new = c.w, c.qg, c.kg, c.h, c.v_new
        dAqk, dv_intra = self._stage("dav", v_new=v_new, Aqk=res.Aqk, do=doc)  # B1
        dhu = self._stage(  # B2
            "dhu", scale=cfg.scale, qg=qg, kg=kg, w=w, G=act.G, do=doc, dv_intra=dv_intra, dht=dht, layout=L,
            reset=L.reset,
        )
        grads = self._stage(  # B3
            "wy_dqkg", scale=cfg.scale, q=act.q, k=act.k, v=res.v, beta=act.beta, G=act.G, Akk=res.Akk, qg=qg,
            kg=kg, h=h, dh=dhu.dh, v_new=v_new, do=doc, dv_new=dhu.dv_new, G_lo=act.G_lo, reset=L.reset,
        )
        grads = self._stage(  # B4
            "intra_bwd", scale=cfg.scale, q=act.q, k=act.k, beta=act.beta, G=act.G, dAqk=dAqk, grads=grads,
            G_lo=act.G_lo, reset=L.reset,
        )
        raw = self._stage(  # B5
            "gate_bwd", config=cfg, act=act, g=res.g_raw, A_log=res.A_log, dt_bias=res.dt_bias, valid=L.valid,
            dq=grads.dq, dk=grads.dk, dbeta=grads.dbeta, dG=grads.dG, reset=L.reset,
        )
        H = res.num_qk_heads
        return KDAGrads(
            q=unpack(L, reduce_group(raw.dq, H)),
            k=unpack(L, reduce_group(raw.dk, H)),
            v=unpack(L, grads.dv),
            g=unpack(L, raw.dg),
            beta=unpack(L, raw.dbeta[..., None])[..., 0],
            initial_state=None if L.reset is not None else dhu.dh0,  # shared chunks: no initial_state given
            A_log=raw.dA_log,
            dt_bias=raw.ddt_bias,
        )

    # -- public entry points ------------------------------------------------------------

    def forward(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, options: Optional[KDAOptions] = None, **kwargs):
        """Forward only, with ``chunk_kda``'s options (keywords, or one ``KDAOptions``).
        Returns ``(o, final_state, residuals)``; ``residuals.cache`` holds every
        intermediate, ``residuals.read(name)`` gives one in the ``[B, T, ...]`` layout, and
        ``pipeline.backward(residuals, do, dht)`` gives every input gradient."""
        opts = _options(options, kwargs)
        _check_arrays(q, k, v, g, beta, opts.initial_state, opts.A_log, opts.dt_bias, opts.cu_seqlens)
        config, args, opts = _prepare_options(q, k, v, g, beta, opts)
        B, T, _, K = q.shape
        for name, n in (("q", B), ("q", K), ("v", v.shape[-1])):
            if n == 0:
                raise ValueError(f"{name}: KDAPipeline.forward needs B, K and V > 0 (chunk_kda handles size 0), "
                                 f"got q {tuple(q.shape)}, v {tuple(v.shape)}.")
        o, final, res = self.with_precision(_precision.resolve(self.precision, q.dtype)).run_forward(config, *args)
        return o, _final_out(final, config, opts.state_v_first), res

    def __call__(self, q: QK, k: QK, v: Values, g: Gate, beta: Beta, *args, **kwargs):
        """``chunk_kda`` with this pipeline."""
        return chunk_kda(q, k, v, g, beta, *args, pipeline=self, **kwargs)


# The stages given the shared layout's ``reset`` (all but F5 and B1: stages._segments).
_RESET_STAGES = ("gate", "intra", "wy", "state", "recompute", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


@functools.cache
def _reference() -> KDAPipeline:
    """The fallback stages, built on first use (``reference()`` asks JAX for its backend,
    which must not happen at import)."""
    return KDAPipeline.reference()


class _PipelineWY(AbstractWY):
    """F3 as the pipeline runs it (fallback, contract checks): what B0 recomputes with.
    ``G_lo``: the forward's, used when B0 calls F3 on the forward's G without passing it
    (a B0 written before ``G_lo``), so that B0 still recomputes exactly the forward's F3."""

    tile_safe: ClassVar[bool] = True
    pipeline: KDAPipeline
    G_lo: Optional[ChunkK] = None

    def __call__(self, q, k, v, beta, G, Akk, G_lo=None, reset=None):
        if G_lo is None and self.G_lo is not None and self.G_lo.shape == G.shape:
            G_lo = self.G_lo
        return self.pipeline._stage("wy", q=q, k=k, v=v, beta=beta, G=G, Akk=Akk, G_lo=G_lo, reset=reset)


class _PipelineState(AbstractState):
    """F4 as the pipeline runs it (fallback, contract checks): what B0 recomputes with."""

    tile_safe: ClassVar[bool] = True
    pipeline: KDAPipeline

    def __call__(self, w, u, kg, G, h0, layout, reset=None):
        return self.pipeline._stage("state", w=w, u=u, kg=kg, G=G, h0=h0, layout=layout, reset=reset)


class PlanRow(NamedTuple):
    """One stage of a ``KDAPlan``: the field, its step (F1..B5), the implementation in the
    pipeline, the one that runs (None: the stage does not run) and why it differs."""

    field: str
    step: str
    requested: str
    runs: Optional[str]
    reason: Optional[str]


class KDAPlan(NamedTuple):
    """What ``KDAPipeline.plan`` found. ``rows``: one ``PlanRow`` per stage; ``tile``: the
    forward's tile size when ``chunk_kda`` runs without gradients (None: whole);
    ``not_tile_safe``: the forward stages that keep the forward whole; ``layout``: how the
    tokens sit in chunks: "dense" (one sequence per row), "per-sequence" (packed varlen,
    each sequence from a chunk boundary) or "shared" (packed varlen, sequences sharing
    chunks: ``KDAPipeline.share_chunks``)."""

    rows: tuple
    tile: Optional[int]
    not_tile_safe: tuple
    layout: Optional[str] = None

    @property
    def fallbacks(self) -> dict:
        """Stage field -> reason, for every stage that falls back."""
        return {r.field: r.reason for r in self.rows if r.runs is not None and r.reason}

    def __str__(self) -> str:
        head = f"{'step':<5}{'field':<11}{'implementation':<24}{'runs':<24}note"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            runs = "-" if r.runs is None else ("same" if r.runs == r.requested and not r.reason else r.runs)
            lines.append(f"{r.step:<5}{r.field:<11}{r.requested:<24}{runs:<24}{r.reason or ''}")
        if self.not_tile_safe:
            lines.append(f"forward: whole (not tile-safe: {', '.join(self.not_tile_safe)})")
        else:
            lines.append("forward: " + ("whole" if self.tile is None else f"tiles of ~{self.tile} blocks without gradients, whole under one"))
        if self.layout is not None:
            what = {"dense": "one sequence per row", "per-sequence": "each packed sequence from a chunk boundary",
                    "shared": "packed sequences share chunks, NC = ceil(T / C)"}[self.layout]
            lines.append(f"layout: {self.layout}: {what}")
        return "\n".join(lines)


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
    ``chunk_kda(q, k, v, g, beta, **options)`` (loss ``sum(o * w)``, ``w`` fixed random,
    the pipeline untiled), run eagerly: a dict from stage field (``"gate"``, ...,
    ``"gate_bwd"``) to its positional arguments in its abstract ``__call__``'s order, so
    that ``getattr(pipeline, name)(*args)`` runs (or times) one stage alone, as
    ``kdax.bench --stages`` does. B0's keyword-only ``wy``/``state`` are left out (a direct
    call uses the stage's own defaults)."""
    pipeline = pipeline.untiled()  # whole-input arguments, not a tile's
    # Loss sum(o * w), w fixed random weights: the backward stages get a cotangent like a
    # real loss's rather than a constant.
    w = jax.random.normal(jax.random.key(1), v.shape, jnp.float32)
    rec = _Recorder()
    _RECORDERS.append(rec)
    try:
        loss = lambda *a: jnp.sum(chunk_kda(*a, pipeline=pipeline, **options)[0].astype(jnp.float32) * w)
        jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    finally:
        _RECORDERS.remove(rec)
    out = {}
    for name, kw in rec.inputs.items():
        params = list(inspect.signature(STAGES[name].family.__call__).parameters.values())[1:]
        # (a parameter the stage does not take, G_lo, is not in kw: stages._hilo)
        out[name] = tuple(kw[p.name] for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name in kw)
    return out


@typecheck
def _check_arrays(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    initial_state: Optional[State],
    A_log: Optional[ALogIn],
    dt_bias: Optional[Float[ArrayIn, "_"]],
    cu_seqlens: Optional[CuSeqlensIn],
) -> None:
    """The shape/dtype checks of ``chunk_kda``'s signature, for ``KDAPipeline.forward``."""


def _initial_states(h0, shape, dt):
    """The initial states ``[N, HV, K, V]`` in the compute dtype (zeros when not given)."""
    return jnp.zeros(shape, dt) if h0 is None else h0.astype(dt)


def _final_out(final, config: KDAConfig, state_v_first: bool):
    if not config.output_final_state:
        return None
    return jnp.swapaxes(final, -1, -2) if state_v_first else final


def _options(options: Optional[KDAOptions], kwargs: dict) -> KDAOptions:
    if options is None:
        return KDAOptions.from_kwargs(**kwargs)
    if kwargs:
        raise TypeError(f"options: give a KDAOptions or keywords, not both (got {', '.join(kwargs)}).")
    return options


def _with(options: KDAOptions, **changes) -> dict:
    """``options`` as keywords, with ``changes``."""
    kw = {n: getattr(options, n) for n in KDAOptions.names()}
    kw.update(changes)
    return kw


def _no_grad(pipeline: KDAPipeline) -> KDAPipeline:
    """The pipeline's arrays under ``stop_gradient``: stage fields are configuration."""
    return jax.tree.map(lambda x: jax.lax.stop_gradient(x) if eqx.is_inexact_array(x) else x, pipeline)


@eqx.filter_custom_vjp
def _differentiable(diff, pipeline: KDAPipeline, config: KDAConfig, cu_seqlens):
    """``(o, final)`` of ``diff = (q, k, v, g, beta, h0, A_log, dt_bias)``; the pipeline
    (any Equinox module: its arrays are non-differentiated), the static config and
    ``cu_seqlens`` are not differentiated."""
    o, final, _ = pipeline.run_forward(config, *diff, cu_seqlens, shared_finals=True)
    return o, final


@_differentiable.def_fwd
def _vjp_fwd(perturbed, diff, pipeline: KDAPipeline, config: KDAConfig, cu_seqlens):
    del perturbed
    # Whole: in a training step XLA then shares F3/F4 with B0's recompute (the CPU step was
    # ~15% slower with a tiled forward; a tiled B1-B5 too was still 5-10% slower).
    o, final, res = pipeline.untiled().run_forward(config, *diff, cu_seqlens, shared_finals=True)
    if not config.disable_recompute:
        # Keep what FLA keeps (inputs, G, Aqk, Akk, l2norm statistics, h0); B0 rebuilds the rest.
        res = eqx.tree_at(lambda r: r.cache, res, None, is_leaf=lambda x: x is None)
    return (o, final), res


@_differentiable.def_bwd
def _vjp_bwd(res, cotangents, perturbed, diff, pipeline: KDAPipeline, config: KDAConfig, cu_seqlens):
    del perturbed
    do, dht = cotangents
    if do is None:  # only the final state carries a loss
        L = res.layout
        do = jnp.zeros((L.valid.shape[0] if L.pos is None else 1, L.T) + res.v.shape[1:2] + res.v.shape[-1:], res.h0.dtype)
    dht = dht if config.output_final_state else None
    # A non-finite cotangent stays in its sequence (kdax._isolation).
    do, dht, poison = _isolation.clean_cotangents(do, dht, cu_seqlens, res.num_qk_heads)
    if dht is not None and res.layout.reset is not None:
        # A loss on the final states of shared chunks: rerun the forward with one sequence
        # per chunk, whose backward takes dht (only such a loss pays for it).
        pipeline = dataclasses.replace(pipeline, share_chunks=False).untiled()
        res = pipeline.run_forward(config, *diff, cu_seqlens)[2]
    grads = poison(pipeline.backward(res, do, dht))
    out = (grads.q, grads.k, grads.v, grads.g, grads.beta, grads.initial_state, grads.A_log, grads.dt_bias)
    return tuple(None if d is None or x is None else x.astype(d) for x, d in zip(out, res.in_dtypes))


def _shared_finals(layout: ChunkLayout, cu_seqlens, k, G, G_lo, v_new, h):
    """Final states ``[N, HV, K, V]`` of the sequences of a shared layout (zero initial
    states), from the chunk c of each one's last token e: ``sum_j (k_j e^(G_e - G_j))
    v_new_j^T`` over its own tokens in chunk c, plus ``e^(G_e) h_c`` if it began before
    chunk c (``h_c`` then its state), masked in the exponent: exact. ``N C K V`` work per
    head, in batches of sequences."""
    C = layout.chunk_size
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    lo = G_lo if G_lo is not None else jnp.zeros_like(G)

    def one(n):
        s, e = cu[n], cu[n + 1] - 1
        c, i = jnp.maximum(e, 0) // C, jnp.maximum(e, 0) % C
        at = lambda x: jax.lax.dynamic_index_in_dim(x[0], c, 1, keepdims=False)  # [HV, C, ...] / [HV, K, V]
        kc, Gc, lc, vc, hc = at(k), at(G), at(lo), at(v_new), at(h)
        Ge, le = Gc[:, i], lc[:, i]  # [HV, K]
        j = jnp.arange(C)
        mine = (j <= i) & (c * C + j >= s) & (e >= s)
        x = jnp.where(mine[None, :, None], exponent(Ge[:, None], Gc, le[:, None], lc), -jnp.inf)
        S = mT(kc * jnp.exp(x)) @ vc
        zero = jnp.zeros_like(Ge)
        x0 = jnp.where((s < c * C) & (e >= s), exponent(Ge, zero, le, zero), -jnp.inf)
        return S + jnp.exp(x0)[..., None] * hc

    N = cu.shape[0] - 1
    return jax.lax.map(one, jnp.arange(N), batch_size=min(max(N, 1), 64))


def _prepare(q, k, v, g, beta, **options):
    """``(config, args)`` of ``_prepare_options`` from keyword options."""
    return _prepare_options(q, k, v, g, beta, KDAOptions.from_kwargs(**options))[:2]


def _prepare_options(q, k, v, g, beta, options: KDAOptions):
    """Validated ``(config, (q, k, v, g, beta, h0 [N, HV, K, V], A_log [HV], dt_bias, cu),
    normalised options)``."""
    dims, opts = validate(q, k, v, g, beta, options)
    config = opts.config(dims.scale)
    asarr = lambda x: None if x is None else jnp.asarray(x)
    h0 = asarr(opts.initial_state)
    if h0 is not None and opts.state_v_first:
        h0 = jnp.swapaxes(h0, -1, -2)
    args = (asarr(q), asarr(k), asarr(v), asarr(g), asarr(beta), h0, asarr(opts.A_log), asarr(opts.dt_bias),
            opts.cu_seqlens)
    return config, args, opts


def default_pipeline() -> KDAPipeline:
    """The pipeline ``chunk_kda(pipeline=None)`` uses: the reference stages (XLA) on every
    platform, precision policy "auto" (``kdax._precision``). On a GPU they run whole chunk
    groups per loop iteration and unroll the recurrences (``stages._ops.resolve_group``,
    ``loop_unroll``); beside FLA on an H200 (bf16, B=1 T=16384 H=16 K=V=128) that was the
    fastest training step measured, 25.0 ms against 26.8-53 ms for every mix of Pallas
    stages tried (benchmarks/NOTES.md, "GPU, third pass")."""
    return KDAPipeline.reference()


def _fla_only(return_intermediate_states, cp_context, use_graph, max_num_seqs, N: int) -> None:
    """FLA's arguments that kdax takes for positional compatibility (docs/fla_arguments.md)."""
    if return_intermediate_states:
        raise ValueError("return_intermediate_states: not supported by chunk_kda; use KDAPipeline.forward and "
                         "residuals.read('h') for the state at each chunk's start.")
    if cp_context is not None:
        raise ValueError("cp_context: FLA's context parallelism is not supported by kdax's chunk_kda.")
    del use_graph  # kdax's varlen shapes never depend on cu_seqlens' values: always graph-safe
    if max_num_seqs is not None and max_num_seqs != N:
        raise ValueError(f"max_num_seqs: must equal the number of sequences len(cu_seqlens) - 1 = {N}, "
                         f"got {max_num_seqs} (pad cu_seqlens with empty sequences instead).")


@typecheck
def chunk_kda(
    q: QK,
    k: QK,
    v: Values,
    g: Gate,
    beta: Beta,
    scale: Optional[Scalar] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[Union[float, int]] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[CuSeqlensIn] = None,
    cu_seqlens_cpu: Optional[CuSeqlensIn] = None,
    cp_context: None = None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    *,
    A_log: Optional[ALogIn] = None,
    dt_bias: Optional[Float[ArrayIn, "_"]] = None,
    chunk_size: int = 64,
    pipeline: Optional[KDAPipeline] = None,
    transpose_state_layout: Optional[bool] = None,
    seq_axis_name: Optional[str] = None,
) -> tuple[Float[ArrayIn, "B T HV V"], Optional[Float[ArrayIn, "N HV _S1 _S2"]]]:
    """Chunked KDA (FLA's ``chunk_kda`` arguments, order and layouts: the arguments after
    ``beta`` may be given positionally in FLA's order; see docs/fla_arguments.md).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g ``[B, T, HV, K]``
    (log decay, or the raw gate input with ``use_gate_in_kernel``: softplus gate with
    ``A_log [HV]`` (or ``[1, 1, HV, 1]``) and optional ``dt_bias [HV*K]``, lower-bound gate
    whenever ``lower_bound`` is set); beta ``[B, T, HV]`` (raw with
    ``use_beta_sigmoid_in_kernel``); states ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``; ``transpose_state_layout`` is its deprecated FLA alias);
    ``cu_seqlens`` ``[N + 1]`` (array, list or tuple; checked inside the compiled program
    when traced) packs N sequences into B == 1. ``chunk_size`` in {16, 32, 64, 128}.
    ``safe_gate`` is FLA's promise that the gate lies in ``[lower_bound, 0)`` with
    ``-5 <= lower_bound < 0``; kdax's kernels are exact for any gate, so it only adds FLA's
    checks. ``scale``: any real number (Python, numpy, concrete 0-d JAX), default K^-1/2.
    FLA's ``cu_seqlens_cpu`` and ``use_graph`` are accepted and need nothing;
    ``return_intermediate_states`` and ``cp_context`` are refused.

    Returns ``o [B, T, HV, V]`` in v's dtype and the final state (float32, or float64 for
    float64 inputs) or None. ``jax.grad`` runs the six-stage backward of ``pipeline``
    (default: ``default_pipeline()``; its arrays are not differentiated);
    ``disable_recompute=True`` keeps the forward intermediates instead of recomputing them.
    Zero-size inputs (B, T, K or V = 0) give zero outputs and pass the states through.

    ``seq_axis_name``: inside ``jax.shard_map`` with the token axis sharded over that mesh
    axis, q, k, v, g, beta and o are this device's tokens, ``cu_seqlens`` the global
    offsets, the states global (identical on every device): sequence parallel, exact
    (see ``kdax.parallel``).
    """
    routed = route(chunk_kda, locals())  # first: locals() is the arguments alone
    if routed is not None:  # sequence parallel, or sharded over an Explicit mesh
        return routed
    kw = dict(locals())
    if transpose_state_layout is not None:
        kw = resolve_deprecated({**kw, "transpose_state_layout": transpose_state_layout})
    options = KDAOptions(**{n: kw[n] for n in KDAOptions.names()})
    config, args, opts = _prepare_options(q, k, v, g, beta, options)
    q, k, v, g, beta, h0, A_log, dt_bias, cu = args
    N = v.shape[0] if cu is None else cu.shape[0] - 1
    _fla_only(return_intermediate_states, cp_context, use_graph, max_num_seqs, N)
    pipeline = default_pipeline() if pipeline is None else pipeline
    if not isinstance(pipeline, KDAPipeline):
        raise TypeError(f"pipeline: expected a KDAPipeline, got {type(pipeline).__name__}.")
    pipeline = pipeline.with_precision(_precision.resolve(pipeline.precision, q.dtype))
    B, T, _, K = q.shape
    if 0 in (B, T, K, v.shape[-1]):
        # Nothing for any stage to do: o is zero (empty sums, or no tokens), every state
        # passes through unchanged, and so does its gradient.
        final = _initial_states(h0, (N, v.shape[2], K, v.shape[-1]), compute_dtype(q, k, v, g, beta, h0))
        return jnp.zeros(v.shape, v.dtype), _final_out(final, config, opts.state_v_first)
    # Non-finite inputs stay in their own sequence, from their token on (kdax._isolation).
    run = lambda *x: _differentiable((*x, h0, A_log, dt_bias), _no_grad(pipeline), config, cu)
    o, final = _isolation.isolate_call(config, (q, k, v, g, beta), cu, run)
    return o, _final_out(final, config, opts.state_v_first)
