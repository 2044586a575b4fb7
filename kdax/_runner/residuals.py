"""What the forward keeps for the backward (``KDAResiduals``) and what the backward returns (``KDAGrads``)."""

from typing import Callable, Optional, Union

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._config import KDAConfig
from .._layouts.layout import ChunkLayout, reduce_group, unpack
from .._layouts.tokens import FinalGrads, Tokens, Written, as_chunked
from .._annotations import ChunkMat, ChunkK, ChunkV, SeqState
from ..stages import Activated, ForwardCache


class EntryResiduals(eqx.Module):
    """The backward's part of initial states entering shared chunks: ``h0`` ``[N, HV, K, V]``
    as given, ``ok [N, HV]`` (or None) which heads are finite, the start decays ``a``, the
    first-chunk ``v_new'`` ``[1, HV, M, C, V]`` on the M chunks ``chunks`` (``FirstChunks``)
    and the VJPs of the first-chunk part and of the start decays (their residuals held: not
    run again)."""

    h0: SeqState
    ok: Optional[Bool[Array, "N HV"]]
    a: Float[Array, "N HV K"]
    v_new: Float[Array, "1 HV M C V"]
    entries_vjp: Callable
    decays_vjp: Callable
    chunks: object


class KDAResiduals(eqx.Module):
    """What the backward needs, chunked ``[R, HV, NC, C, ...]``: the activated inputs
    (``act``), v, F1's ``g`` (raw gate or log decays), the gate parameters, ``Aqk``,
    ``Akk``, the state table ``h0`` ``[N, HV, K, V]`` (one zero entry in shared chunks) and
    the layout; ``cache`` (w, u, qg, kg, h, v_new) when kept (``disable_recompute``,
    ``pipeline.forward``). ``read(name)`` gives an intermediate in the user's layout."""

    config: KDAConfig = eqx.field(static=True)
    layout: ChunkLayout
    act: Activated
    v: Union[ChunkV, Tokens]  # (views of the caller's v and g: kdax._layouts.tokens)
    g_raw: Optional[Union[ChunkK, Tokens]]
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
    # States entering shared chunks (or None): ``layout`` is then ``injected_layout``, ``h0`` its table.
    entries: Optional[EntryResiduals] = None
    # ``h0`` is the zeros of a call without initial states (``ForwardRoute.h0_zero``).
    h0_zero: bool = eqx.field(static=True, default=False)
    # ``KDAPipeline.forward`` with ``state_v_first``: its ``backward`` takes and gives states so.
    state_v_first: bool = eqx.field(static=True, default=False)

    # Where each intermediate lives ("h" per chunk, the others per token).
    _WHERE = {
        "q": "act.q", "k": "act.k", "beta": "act.beta", "G": "act.G", "q_rstd": "act.q_rstd",
        "k_rstd": "act.k_rstd", "v": "v", "g": "g_raw", "Aqk": "Aqk", "Akk": "Akk", "G_lo": "act.G_lo",
        "w": "cache.w", "u": "cache.u", "qg": "cache.qg", "kg": "cache.kg", "v_new": "cache.v_new", "h": "cache.h",
    }

    @classmethod
    def of_forward(cls, config: KDAConfig, route, fw, num_qk_heads: int, cu_seqlens) -> "KDAResiduals":
        """The residuals of a forward on ``route`` whose F1-F5 gave ``fw``, with the full cache."""
        cache = ForwardCache.of(fw.act.G, fw.intra, fw.wy, fw.h, fw.v_new)
        L, h0, parts = route.hooks.residuals(route.layout, route.h0, fw.extra)  # (entries: the injected layout, its table)
        return cls(
            config, L, fw.act, fw.v, fw.g, route.A_log, route.dt_bias,
            fw.intra.Aqk, fw.intra.Akk, h0, cache, num_qk_heads, route.in_dtypes, cu_seqlens,
            entries=None if parts is None else EntryResiduals(*parts), h0_zero=route.h0_zero and h0 is route.h0,
        )

    @classmethod
    def names(cls) -> tuple:
        """What ``read`` accepts."""
        return tuple(cls._WHERE)

    def o_shape(self) -> tuple:
        """``[B, T, HV, V]``: the shape of ``o`` and of its cotangent ``do``."""
        L = self.layout
        return (L.valid.shape[0] if L.pos is None else 1, L.T, self.v.shape[1], self.v.shape[-1])

    def check_cotangents(self, do, dht, state_v_first: bool = False) -> None:
        """``ValueError`` unless ``do`` is ``[B, T, HV, V]`` and ``dht`` (or None) ``[N, HV, K, V]``
        (``[N, HV, V, K]``: ``state_v_first``)."""
        L, want = self.layout, self.o_shape()
        if tuple(do.shape) != want:
            raise ValueError(f"do: expected shape [B, T, HV, V] = {want}, got {tuple(do.shape)}.")
        N = self.h0.shape[0] if L.reset is None else self.cu_seqlens.shape[0] - 1  # (shared: h0 is a state table)
        HV, K, V = self.h0.shape[1:]
        want, name = ((N, HV, V, K), "[N, HV, V, K]") if state_v_first else ((N, HV, K, V), "[N, HV, K, V]")
        if dht is not None and tuple(dht.shape) != want:
            raise ValueError(f"dht: expected shape {name} = {want}, got {tuple(dht.shape)}.")

    def read(self, name: str, per_sequence: bool = False) -> Array:
        """Intermediate ``name`` (``names()``) in the user's layout, jit-safe: ``[B, T, HV, ...]``
        (``beta`` ``[B, T, HV]``; ``Aqk``/``Akk``: the token's row of its chunk's matrix,
        ``[B, T, HV, C]``); q, k activated and expanded to HV heads; ``G`` the chunk-local
        cumulative log decay; ``h`` (each chunk's start state) ``[B, NC, HV, K, V]``.
        ``per_sequence``: packed input as ``[N, T, HV, ...]`` (``h``: ``[N, ceil(T / C), HV, K, V]``),
        each sequence first, zeros after."""
        if name not in self._WHERE:
            raise KeyError(f"name: expected one of {self.names()}, got {name!r}.")
        x = self
        for part in self._WHERE[name].split("."):
            x = None if x is None else getattr(x, part)
        if x is None:
            why = ("no cache was kept (chunk_kda's recompute path); use KDAPipeline.forward"
                   if self._WHERE[name].startswith("cache") else "that option is off")
            raise ValueError(f"name: {name!r} is not in these residuals: {why}.")
        x, L, cu = as_chunked(x), self.layout, self.cu_seqlens
        if name == "h":
            y = jnp.moveaxis(x, 2, 1)  # [R, NC, HV, K, V]
        else:
            y = unpack(L, x[..., None] if x.ndim == 4 else x)
            y = y[..., 0] if x.ndim == 4 else y
        if not per_sequence or cu is None:
            return y
        # Each sequence's rows (tokens, or chunks for h) from ``start``, zeros after ``count``.
        if name != "h":
            start, count, width = cu[:-1], cu[1:] - cu[:-1], L.T
        else:
            if L.reset is not None:
                raise ValueError("per_sequence: the sequences of this forward share chunks (no initial_state, "
                                 "output_final_state=False), so a chunk's start state is not one sequence's; "
                                 "read('h') gives it per chunk, or run with share_chunks=False.")
            C = L.chunk_size
            count = (cu[1:] - cu[:-1] + C - 1) // C
            start, width = jnp.cumsum(count) - count, -(-L.T // C)
        j = jnp.arange(width)
        rows = y[0, jnp.clip(start[:, None] + j[None], 0, max(y.shape[1] - 1, 0))]
        ok = j[None] < count[:, None]
        return jnp.where(ok.reshape(ok.shape + (1,) * (rows.ndim - 2)), rows, 0)


class KDAGrads(eqx.Module):
    """Gradients of every differentiable input in ``chunk_kda``'s layouts (float32 or float64;
    the VJP casts them to the inputs' dtypes); None where the input was not given."""

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T HV V"]
    g: Float[Array, "B T HV K"]
    beta: Float[Array, "B T HV"]
    initial_state: Optional[SeqState]
    A_log: Optional[Float[Array, " HV"]]
    dt_bias: Optional[Float[Array, " HVK"]]

    @classmethod
    def unpacked(cls, layout: ChunkLayout, raw, dv, num_qk_heads: int, initial_state: Callable,
                 final: Optional[FinalGrads] = None) -> "KDAGrads":
        """The gradients from B5's ``raw`` and the chunked ``dv``, q and k summed over each group
        of value heads; ``initial_state()`` gives ``[N, HV, K, V]`` or None. ``final``: q's to
        beta's as the call's results (a ``Written`` one as the stage wrote it)."""

        def out(name, x, as_array):
            if isinstance(x, Written):
                return x.x
            return as_array(x) if final is None else final.finish(name, as_array(x))

        return cls(
            q=out("q", raw.dq, lambda x: unpack(layout, reduce_group(x, num_qk_heads))),
            k=out("k", raw.dk, lambda x: unpack(layout, reduce_group(x, num_qk_heads))),
            v=out("v", dv, lambda x: unpack(layout, x)),
            g=out("g", raw.dg, lambda x: unpack(layout, x)),
            beta=out("beta", raw.dbeta, lambda x: unpack(layout, x[..., None])[..., 0]),
            initial_state=initial_state(), A_log=raw.dA_log, dt_bias=raw.ddt_bias,
        )
