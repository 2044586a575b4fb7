"""``KimiDeltaAttention``: the KDA layer of Kimi Linear / FLA around ``kdax.chunk_kda``."""

import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .._conv import causal_conv, conv_tail, token_segments
from .._front import chunk_kda
from .._typing import ArrayIn, CuSeqlensIn, typecheck
from .._validate import check_cu_seqlens
from ..parallel import check_axis, conv_halo, sp_conv_tail, sp_token_segments
from ..pipeline import KDAPipeline, default_pipeline
from ..recurrent import fused_recurrent_kda
from ._cache import KDACache, zeros_cache
from ._norm import gated_rms_norm
from ._pretrained import load_layers
from ._weights import check_dtype_option, layer_from_state_dict, layer_state_dict

# Longest call that the recurrent path takes by default (with a cache; FLA's threshold).
RECURRENT_MAX_T = 64


class KimiDeltaAttention(eqx.Module):
    """Kimi Delta Attention layer (Kimi Linear, FLA's ``KimiDeltaAttention``).

    ``x [B, T, hidden]`` → q, k ``[.., H*K]`` and v ``[.., HV*V]`` projections (no bias) →
    depthwise causal short convolutions (width ``conv_size``; a per-channel bias with
    ``conv_bias``, added before the activation as in FLA's ``ShortConvolution``) and SiLU
    (SiLU only with ``use_short_conv=False``) → KDA with the softplus gate in kernel
    (``A_log [HV]``, ``dt_bias [HV*K]``; the lower-bound gate when ``lower_bound`` is set)
    on the low-rank decay input ``f_b(f_a(x))`` ``[.., HV*K]``, beta ``sigmoid(b_proj(x))``
    ``[.., HV]`` (times 2 with ``allow_neg_eigval``), q/k l2norm in kernel → per-head gated
    RMSNorm ``rmsnorm(o) * o_norm * sigmoid(g_b(g_a(x)) + g_b_bias)`` (Kimi K3's full-rank
    gate: ``sigmoid(g_proj(x))``) → ``o_proj``.

    Weights are stored in PyTorch's ``[out, in]`` layout (``y = x @ W.T``); convolution
    weights as ``[channels, W]`` (tap ``W - 1`` multiplies the current token). Parameters
    are float32 unless ``param_dtype`` says otherwise; ``dtype`` (optional) is the
    compute dtype of the projections and the kernel inputs.
    """

    q_proj: Float[Array, "HK D"]
    k_proj: Float[Array, "HK D"]
    v_proj: Float[Array, "HVV D"]
    q_conv: Optional[Float[Array, "HK W"]]
    k_conv: Optional[Float[Array, "HK W"]]
    v_conv: Optional[Float[Array, "HVV W"]]
    q_conv_bias: Optional[Float[Array, " HK"]]
    k_conv_bias: Optional[Float[Array, " HK"]]
    v_conv_bias: Optional[Float[Array, " HVV"]]
    f_a: Float[Array, "R D"]
    f_b: Float[Array, "HVK R"]
    b_proj: Float[Array, "HV D"]
    A_log: Float[Array, " HV"]
    dt_bias: Float[Array, " HVK"]
    g_a: Optional[Float[Array, "R D"]]
    g_b: Optional[Float[Array, "HVV R"]]
    g_b_bias: Optional[Float[Array, " HVV"]]
    g_proj: Optional[Float[Array, "HVV D"]]
    o_norm: Float[Array, " V"]
    o_proj: Float[Array, "D HVV"]

    hidden_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_v_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    head_v_dim: int = eqx.field(static=True)
    conv_size: int = eqx.field(static=True)
    use_short_conv: bool = eqx.field(static=True)
    allow_neg_eigval: bool = eqx.field(static=True)
    lower_bound: Optional[float] = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    dtype: Optional[str] = eqx.field(static=True)
    safe_gate: bool = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    layer_idx: Optional[int] = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        key: Optional[PRNGKeyArray],
        num_v_heads: Optional[int] = None,
        expand_v: float = 1.0,
        conv_size: int = 4,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        lower_bound: Optional[float] = None,
        norm_eps: float = 1e-5,
        gate_bias: Optional[bool] = None,
        conv_bias: bool = False,
        use_full_rank_gate: bool = False,
        safe_gate: bool = False,
        mode: str = "chunk",
        layer_idx: Optional[int] = None,
        dtype=None,
        param_dtype=jnp.float32,
        **fla_options,
    ):
        """Random initialisation as FLA's layer: linear and convolution weights (and
        convolution biases) uniform in ``±1/sqrt(fan_in)`` (PyTorch's default),
        ``A_log = log U(1, 16)``, ``dt_bias`` the inverse softplus of a log-uniform step in
        [1e-3, 0.1], ``o_norm`` ones. ``key=None``: every weight zero (a skeleton to load
        weights into).

        FLA's constructor arguments: ``conv_bias`` (biases on the short convolutions),
        ``safe_gate`` (FLA's promise that the gate lies in ``[lower_bound, 0)``: needs
        ``lower_bound``; kdax's kernels are exact for any gate, so it adds FLA's range
        check on ``lower_bound``), ``mode`` ("chunk", or "fused_recurrent": the path of
        calls longer than 64 tokens, see ``__call__``), ``layer_idx`` (recorded; kdax's
        cache is per layer, so it indexes nothing). Anything else is refused.

        Kimi K3's options (its ``linear_attn_config``): ``lower_bound`` is its
        ``gate_lower_bound`` (with ``safe_gate=True``, as its modelling code passes them to
        FLA's ``chunk_kda``); ``use_full_rank_gate``: the output gate is one full-rank
        projection ``g_proj [HV*V, hidden]`` in place of ``g_b(g_a(x))``. ``gate_bias``
        (the output gate's bias, FLA's ``g_proj.1.bias``): default True with the low-rank
        gate, False with the full-rank one (Kimi K3's has none)."""
        if fla_options:
            raise TypeError(
                f"KimiDeltaAttention: unexpected argument(s) {', '.join(sorted(fla_options))}. kdax's layer takes "
                "FLA's hidden_size, num_heads, head_dim, num_v_heads, expand_v, mode, use_short_conv, "
                "allow_neg_eigval, safe_gate, lower_bound, conv_size, conv_bias, layer_idx and norm_eps (and "
                "key, gate_bias, use_full_rank_gate, dtype, param_dtype); to load a checkpoint use "
                "KimiDeltaAttention.from_pretrained(path, layer_idx=i).")
        check_dtype_option("param_dtype", param_dtype)
        check_dtype_option("dtype", dtype)
        if mode not in ("chunk", "fused_recurrent", "recurrent"):
            raise ValueError(f"mode: expected 'chunk' or 'fused_recurrent', got {mode!r}.")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate: True needs lower_bound (FLA's recommendation: -5).")
        H, K = num_heads, head_dim
        HV = num_heads if num_v_heads is None else num_v_heads
        V = int(round(head_dim * expand_v))
        if min(hidden_size, H, K, HV, V) < 1 or not math.isclose(V, head_dim * expand_v):
            raise ValueError(f"hidden_size, num_heads, head_dim, num_v_heads and head_dim * expand_v must be "
                             f"positive integers, got {hidden_size}, {H}, {K}, {HV}, {head_dim * expand_v}.")
        if HV % H:
            raise ValueError(f"num_v_heads={HV} must be a multiple of num_heads={H}.")
        if conv_size < 2:
            raise ValueError(f"conv_size must be >= 2, got {conv_size}.")
        D = hidden_size
        keys = iter(jax.random.split(key, 16)) if key is not None else None

        def _uniform(shape, bound, lo=None, hi=None):
            if keys is None:
                return jnp.zeros(shape, param_dtype)
            lo, hi = (-bound, bound) if lo is None else (lo, hi)
            return jax.random.uniform(next(keys), shape, param_dtype, lo, hi)

        lin = lambda o, i: _uniform((o, i), 1 / math.sqrt(i))
        self.q_proj, self.k_proj, self.v_proj = lin(H * K, D), lin(H * K, D), lin(HV * V, D)
        if use_short_conv:
            conv = lambda c: _uniform((c, conv_size), 1 / math.sqrt(conv_size))
            self.q_conv, self.k_conv, self.v_conv = conv(H * K), conv(H * K), conv(HV * V)
        else:
            self.q_conv = self.k_conv = self.v_conv = None
        if use_short_conv and conv_bias:
            # nn.Conv1d's bound 1/sqrt(fan_in), fan_in = 1 channel x W taps; keys of their own, so
            # the other weights of a given key are those of a layer without conv_bias.
            bkeys = None if key is None else iter(jax.random.split(jax.random.fold_in(key, 1), 3))
            b = 1 / math.sqrt(conv_size)
            cb = lambda c: (jnp.zeros((c,), param_dtype) if bkeys is None
                            else jax.random.uniform(next(bkeys), (c,), param_dtype, -b, b))
            self.q_conv_bias, self.k_conv_bias, self.v_conv_bias = cb(H * K), cb(H * K), cb(HV * V)
        else:
            self.q_conv_bias = self.k_conv_bias = self.v_conv_bias = None
        self.f_a, self.f_b = lin(V, D), lin(HV * K, V)
        self.b_proj = lin(HV, D)
        if keys is None:
            self.A_log, self.dt_bias = jnp.zeros((HV,), param_dtype), jnp.zeros((HV * K,), param_dtype)
        else:
            self.A_log = jnp.log(_uniform((HV,), None, 1.0, 16.0))
            step = jnp.exp(_uniform((HV * K,), None, math.log(1e-3), math.log(0.1)))
            step = jnp.maximum(step, 1e-4)
            self.dt_bias = step + jnp.log(-jnp.expm1(-step))  # inverse softplus
        if gate_bias is None:
            gate_bias = not use_full_rank_gate
        if use_full_rank_gate:
            self.g_a = self.g_b = None
            self.g_proj = lin(HV * V, D)
        else:
            self.g_a, self.g_b = lin(V, D), lin(HV * V, V)
            self.g_proj = None
        fan_in = D if use_full_rank_gate else V
        self.g_b_bias = _uniform((HV * V,), 1 / math.sqrt(fan_in)) if gate_bias else None
        self.o_norm = jnp.ones((V,), param_dtype)
        self.o_proj = lin(D, HV * V)
        self.hidden_size, self.num_heads, self.num_v_heads = D, H, HV
        self.head_dim, self.head_v_dim, self.conv_size = K, V, conv_size
        self.use_short_conv, self.allow_neg_eigval = use_short_conv, allow_neg_eigval
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.norm_eps = float(norm_eps)
        self.dtype = None if dtype is None else jnp.dtype(dtype).name
        self.safe_gate = bool(safe_gate)
        self.mode = "chunk" if mode == "chunk" else "recurrent"
        self.layer_idx = None if layer_idx is None else int(layer_idx)

    # -- cache ----------------------------------------------------------------------------

    def init_cache(self, batch_size: int, dtype=None) -> KDACache:
        """A zero cache for ``batch_size`` sequences (or pool slots). Convolution states in
        the compute dtype (``dtype``, else the layer's), the recurrent state in float32
        (float64 when computing in float64)."""
        cd = jnp.dtype(dtype) if dtype is not None else self._compute_dtype(None)
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        return zeros_cache(batch_size, self.conv_size, H * K, HV * V, HV, K, V, self.use_short_conv,
                           cd, jnp.result_type(cd, jnp.float32))

    def _compute_dtype(self, x):
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        return jnp.result_type(self.q_proj.dtype, *(() if x is None else (x.dtype,)))

    # -- weights --------------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, state_dict, *, num_heads: int, head_dim: int, naming: Optional[str] = None,
                        prefix: str = "", **options) -> "KimiDeltaAttention":
        """A layer from a mapping of names to arrays (or a ``.safetensors`` path), in
        Moonshot's Kimi-Linear naming or FLA's (see ``kdax.nn.weight_shapes``; None:
        detected from the keys). ``prefix`` is stripped from every key (e.g.
        ``"model.layers.0.self_attn."``); keys without it are ignored.

        Arrays may be numpy, JAX or torch tensors (torch is never imported: tensors that
        require grad are detached, bfloat16 ones widened to float32 exactly) or anything
        with ``__dlpack__``; complex, integer and non-finite weights are refused, naming
        the key.

        ``norm_eps``, ``allow_neg_eigval`` and ``lower_bound`` must be passed: a state dict
        does not record them and no default is safe (FLA's ``KDAConfig`` uses
        ``norm_eps=1e-6``, its layer ``1e-5``); ``from_pretrained`` reads them from the
        checkpoint's ``config.json``. Other ``options`` are the constructor's;
        ``num_v_heads``, ``head_v_dim``, ``hidden_size``, ``conv_size``,
        ``use_short_conv`` and ``conv_bias`` are inferred from the arrays when not given
        (given, they are checked against the arrays)."""
        return layer_from_state_dict(cls, state_dict, naming=naming, num_heads=num_heads, head_dim=head_dim,
                                     prefix=prefix, **options)

    @classmethod
    def from_pretrained(cls, path, layer_idx: int, **options) -> "KimiDeltaAttention":
        """KDA layer ``layer_idx`` (0-based, the model's ``layers[layer_idx]``) of a Hugging
        Face checkpoint: ``path`` a directory (or its ``config.json``) written by FLA
        (``KDAConfig``; keys ``model.layers.{i}.attn.*``) or by Moonshot's Kimi Linear
        (``linear_attn_config``; keys ``model.layers.{i}.self_attn.*``), its weights in
        ``model.safetensors`` or in shards listed by ``model.safetensors.index.json`` (only
        this layer's tensors are read). Every hyper-parameter comes from the checkpoint:
        ``config.json``, with the config class's defaults for keys it leaves out (as
        ``save_pretrained`` does for default values: FLA's ``norm_eps`` 1e-6); where the
        config has no key, the tensors decide (``conv_bias``). A layer that is not a KDA
        layer (FLA's hybrid ``attn`` layers, Kimi Linear's full-attention layers) raises.
        ``options``: ``param_dtype``, ``dtype``. All KDA layers at once:
        ``kdax.nn.load_pretrained``; the hyper-parameters alone: ``kdax.nn.read_config``."""
        return load_layers(cls, path, layers=[layer_idx], **options)[layer_idx]

    def state_dict(self, naming: Optional[str] = None, prefix: str = "") -> dict:
        """The weights as numpy arrays under ``naming``'s names (``from_state_dict``'s
        inverse, exact). ``naming=None`` (default): the naming that holds every weight of
        this layer: Moonshot's (Kimi Linear's) when the output gate has no bias (its
        ``g_b_proj`` has none; a layer built with ``gate_bias=False`` or the full-rank
        gate), else FLA's (``g_proj.1.bias``; a default-built layer)."""
        return layer_state_dict(self, naming, prefix)

    # -- forward --------------------------------------------------------------------------

    @typecheck
    def __call__(
        self,
        x: Float[ArrayIn, "B T D"],
        *,
        attention_mask: Optional[Shaped[ArrayIn, "B S"]] = None,
        cu_seqlens: Optional[CuSeqlensIn] = None,
        cache: Optional[KDACache] = None,
        state_indices: Optional[Int[ArrayIn, " N"]] = None,
        mode: Optional[str] = None,
        return_intermediate_states: bool = False,
        chunk_size: int = 64,
        pipeline: Optional[KDAPipeline] = None,
        seq_axis_name: Optional[str] = None,
    ):
        """``y, cache = layer(x, ...)``; ``y [B, T, hidden]`` in x's dtype (the compute
        dtype if set).

        - ``attention_mask [B, T]`` (1 token, 0 padding; left or right padded, any
          pattern): the rows run as packed variable-length sequences with static shapes
          (new masks never recompile); padding rows of ``y`` are exactly zero. With a
          ``cache``, FLA's mask of the whole history ``[B, S]`` (S > T, as Hugging Face's
          ``generate`` passes it) is accepted too: its last T columns are this call's.
        - ``cu_seqlens [N + 1]``: packed input (B == 1), N sequences (array, list or tuple).
        - ``cache``: a ``KDACache`` with one row per sequence (B, or N); each sequence
          continues from its row. With ``state_indices [N]`` (distinct slots, refused
          otherwise) the cache is a pool and only rows ``state_indices`` are read and
          written (others stay bit-identical).
        - ``mode``: "chunk" (``chunk_kda``) or "recurrent" (``fused_recurrent_kda``; FLA's
          name "fused_recurrent" too); None takes the recurrent path when a cache is
          passed and ``T <= 64`` (decode), else the layer's ``mode`` ("chunk" unless
          built with ``mode="fused_recurrent"``).

        Isolation: every sequence (a row, a masked row, a packed sequence) gets the outputs,
        state and gradients it gets alone, whatever the others hold, NaN or inf included
        (docs/stages.md §1, "Isolation"); a non-finite value makes its own sequence's
        outputs NaN from its token on and leaves the tokens before it exact.
        - ``return_intermediate_states``: also return a ``KDACache`` of arrays
          ``[B, NC, ...]`` whose entry ``[:, c]`` is the cache after the first
          ``c * chunk_size`` tokens of this call (FLA's ``return_intermediate_states``),
          for prefix caching; dense input only (no mask, no ``cu_seqlens``), chunked path.
        - ``seq_axis_name``: sequence parallel inside ``jax.shard_map`` with the token axis
          of ``x`` sharded over that mesh axis: ``x`` and ``y`` are this device's tokens
          ``[B, T / P, D]``, ``cu_seqlens`` the global offsets, the cache (in and out)
          global and identical on every device; the short convolutions take the previous
          device's last ``conv_size - 1`` inputs (one ``ppermute``), ``chunk_kda`` runs
          with ``seq_axis_name``. Chunked path only; no ``attention_mask`` (pack with
          ``cu_seqlens``) or ``return_intermediate_states``. On global arrays:
          ``kdax.parallel.apply_layer``.

        Returns ``(y, new_cache)``, or ``(y, new_cache, intermediate)``.
        """
        B, T, D = x.shape
        if D != self.hidden_size:
            raise ValueError(f"x: expected last dimension hidden_size={self.hidden_size}, got shape {x.shape}.")
        if T < 1:
            raise ValueError(f"x: expected at least one token per row, got shape {x.shape}.")
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("attention_mask and cu_seqlens: pass at most one of them.")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            S = attention_mask.shape[1]
            if attention_mask.shape[0] != B or S < T:
                raise ValueError(f"attention_mask: expected shape [B, T] = {(B, T)} (or, with a cache, FLA's "
                                 f"whole-history mask [B, S >= T]), got {tuple(attention_mask.shape)}.")
            if cache is None:
                raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} covers {S} tokens but x has "
                                 f"{T} and no cache holds the history; pass this call's mask, shape {(B, T)} (or "
                                 f"pass the cache of the earlier tokens).")
            attention_mask = attention_mask[:, S - T:]  # FLA's rule: the last T columns are this call's tokens
        if cu_seqlens is not None and seq_axis_name is None:
            cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, "x")  # kdax.chunk_kda's checks and messages
        elif cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens: packed variable-length input needs B == 1 (x.shape[0]), got B={B}.")
        if mode not in (None, "chunk", "recurrent", "fused_recurrent"):
            raise ValueError(f"mode: expected None, 'chunk' or 'recurrent' ('fused_recurrent'), got {mode!r}.")
        mode = "recurrent" if mode == "fused_recurrent" else mode
        if cu_seqlens is not None and not isinstance(cu_seqlens, jax.Array):
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)  # a list or numpy array, as kdax.chunk_kda takes
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if state_indices is not None:
            if cache is None:
                raise ValueError("state_indices: needs a cache (the pool) to index.")
            if tuple(state_indices.shape) != (N,):
                raise ValueError(f"state_indices: expected shape [N] = ({N},), got {tuple(state_indices.shape)}.")
        if cache is not None:
            self._check_cache(cache, None if state_indices is not None else N)
        if return_intermediate_states and (attention_mask is not None or cu_seqlens is not None or mode == "recurrent"):
            raise ValueError("return_intermediate_states: needs dense input (no attention_mask or cu_seqlens) "
                             "and the chunked path.")
        if seq_axis_name is not None:
            _check_sequence_parallel(seq_axis_name, attention_mask, mode, return_intermediate_states)
            mode = "chunk"
        if mode is None:
            decode = cache is not None and T <= RECURRENT_MAX_T
            mode = "chunk" if return_intermediate_states else ("recurrent" if decode else self.mode)

        if state_indices is not None:
            P = cache.state.shape[0]
            state_indices = jnp.asarray(state_indices, jnp.int32)
            # Out-of-range slots would be clamped on read and dropped on write: refuse them.
            state_indices = eqx.error_if(state_indices, jnp.any((state_indices < 0) | (state_indices >= P)),
                                         f"state_indices: every slot must lie in [0, {P}) (the pool's rows).")
            # Two sequences writing one slot: one state would be silently dropped.
            srt = jnp.sort(state_indices)
            state_indices = eqx.error_if(state_indices, jnp.any(srt[1:] == srt[:-1]),
                                         "state_indices: every slot must be distinct (two sequences cannot share "
                                         "one pool row).")
        rows = cache if state_indices is None else cache.take(state_indices)
        dt = self._compute_dtype(x)
        xin = jnp.asarray(x).astype(dt)
        cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)

        if attention_mask is not None:
            # Tokens of row 0, row 1, ..., then all padding as one trailing dummy sequence:
            # shapes never depend on the mask.
            m = jnp.asarray(attention_mask).astype(bool).reshape(B * T)
            flat = jnp.arange(B * T, dtype=jnp.int32)
            perm = jnp.argsort(jnp.where(m, flat, flat + B * T))
            lens = jnp.sum(jnp.asarray(attention_mask).astype(bool), axis=1, dtype=jnp.int32)
            cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32),
                                  jnp.full((1,), B * T, jnp.int32)])
            xs = jnp.where(m[perm, None], xin.reshape(B * T, D)[perm], jnp.zeros((), dt))[None]
            if rows is not None:
                rows = KDACache(*(None if a is None else jnp.concatenate([a, jnp.zeros_like(a[:1])])
                                  for a in rows._fields()))
        else:
            xs = xin

        ys, new_rows, inter = self._forward(xs, cu, rows, mode, return_intermediate_states, chunk_size, pipeline,
                                            seq_axis_name)

        if attention_mask is not None:
            y = jnp.zeros((B * T, D), ys.dtype).at[perm].set(ys[0])
            y = jnp.where(m[:, None], y, jnp.zeros((), y.dtype)).reshape(B, T, D)
            new_rows = KDACache(*(None if a is None else a[:B] for a in new_rows._fields()))
        else:
            y = ys
        new_cache = new_rows if state_indices is None else cache.put(state_indices, new_rows)
        if return_intermediate_states:
            return y, new_cache, inter
        return y, new_cache

    def _check_cache(self, cache: KDACache, N: Optional[int]):
        H, HV, K, V, W = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim, self.conv_size
        n = cache.state.shape[0] if N is None else N
        want = dict(state=(n, HV, K, V))
        if self.use_short_conv:
            want.update(conv_q=(n, W - 1, H * K), conv_k=(n, W - 1, H * K), conv_v=(n, W - 1, HV * V))
        bad = [f"{f}: expected {s}, got {None if getattr(cache, f) is None else tuple(getattr(cache, f).shape)}"
               for f, s in want.items() if getattr(cache, f) is None or tuple(getattr(cache, f).shape) != s]
        if bad:
            raise ValueError("cache: " + "; ".join(bad) + " (N = sequences, or pool slots with state_indices).")

    @staticmethod
    def _bias(y, b):
        """The short convolution's bias (FLA: nn.Conv1d's, before the activation)."""
        return y if b is None else y + b.astype(y.dtype)

    def _forward(self, xs, cu, rows: Optional[KDACache], mode, inter_states, chunk_size, pipeline, seq_axis=None):
        """The layer on ``xs [Bp, Tp, D]`` (dense rows, or one packed row with ``cu``;
        ``seq_axis``: this device's tokens, ``cu`` global)."""
        Bp, Tp, D = xs.shape
        dt = xs.dtype
        H, HV, K, V, W = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim, self.conv_size
        lin = lambda a, w: a @ w.astype(dt).T
        seq, pos = token_segments(Bp, Tp, cu)
        if cu is None:
            n = Bp
            seg_rows, starts, lens = jnp.arange(n), jnp.zeros((n,), jnp.int32), jnp.full((n,), Tp, jnp.int32)
        else:
            n = cu.shape[0] - 1
            seg_rows, starts, lens = jnp.zeros((n,), jnp.int32), cu[:-1], cu[1:] - cu[:-1]

        pre = (lin(xs, self.q_proj), lin(xs, self.k_proj), lin(xs, self.v_proj))
        biases = (self.q_conv_bias, self.k_conv_bias, self.v_conv_bias)
        if self.use_short_conv and seq_axis is not None:
            states = (None, None, None) if rows is None else (rows.conv_q, rows.conv_k, rows.conv_v)
            weights = (self.q_conv, self.k_conv, self.v_conv)
            # [halo | local tokens]: the previous device's last W - 1 inputs (one ppermute each)
            xx = tuple(jnp.concatenate([conv_halo(p, W, seq_axis), p], axis=1) for p in pre)
            sseq, spos = sp_token_segments(Bp, Tp, W, seq_axis, cu)
            q, k, v = (jax.nn.silu(self._bias(causal_conv(p, w.astype(dt), sseq, spos, s)[:, W - 1:], b))
                       for p, w, s, b in zip(xx, weights, states, biases))
            tails = tuple(sp_conv_tail(p, W, seq_axis, cu, s) for p, s in zip(xx, states))
        elif self.use_short_conv:
            states = (None, None, None) if rows is None else (rows.conv_q, rows.conv_k, rows.conv_v)
            weights = (self.q_conv, self.k_conv, self.v_conv)
            q, k, v = (jax.nn.silu(self._bias(causal_conv(p, w.astype(dt), seq, pos, s), b))
                       for p, w, s, b in zip(pre, weights, states, biases))
            tails = tuple(conv_tail(p, seg_rows, starts, lens, s, W) for p, s in zip(pre, states))
        else:
            q, k, v = (jax.nn.silu(p) for p in pre)
            tails = (None, None, None)
        g = lin(lin(xs, self.f_a), self.f_b)
        beta = lin(xs, self.b_proj)
        q, k = q.reshape(Bp, Tp, H, K), k.reshape(Bp, Tp, H, K)
        v, g = v.reshape(Bp, Tp, HV, V), g.reshape(Bp, Tp, HV, K)

        opts = dict(
            initial_state=None if rows is None else rows.state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            lower_bound=self.lower_bound, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
            cu_seqlens=cu,
        )
        inter = None
        if mode == "recurrent":
            o, final = fused_recurrent_kda(q, k, v, g, beta, **opts)
        elif inter_states:
            o, final, h = _chunk_start_states(pipeline, q, k, v, g, beta, chunk_size, opts)
            NC = h.shape[1]
            at = jnp.arange(NC, dtype=jnp.int32) * chunk_size
            rep = lambda a: None if a is None else jnp.repeat(a, NC, axis=0)
            conv_states = (None, None, None) if rows is None else (rows.conv_q, rows.conv_k, rows.conv_v)
            inter_tails = tuple(
                None if p is None or not self.use_short_conv
                else conv_tail(p, jnp.repeat(seg_rows, NC), jnp.zeros((n * NC,), jnp.int32), jnp.tile(at, n),
                               rep(s), W).reshape(n, NC, W - 1, -1)
                for p, s in zip(pre, conv_states)
            )
            inter = KDACache(*inter_tails, h)
        else:
            o, final = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, pipeline=pipeline, seq_axis_name=seq_axis,
                                 safe_gate=self.safe_gate, **opts)

        gate = lin(xs, self.g_proj) if self.g_proj is not None else lin(lin(xs, self.g_a), self.g_b)
        if self.g_b_bias is not None:
            gate = gate + self.g_b_bias.astype(dt)
        o = gated_rms_norm(o.astype(dt), gate.reshape(Bp, Tp, HV, V), self.o_norm, self.norm_eps)
        y = lin(o.reshape(Bp, Tp, HV * V), self.o_proj)
        if rows is not None:
            final = final.astype(rows.state.dtype)
        return y, KDACache(*tails, final), inter


def _check_sequence_parallel(seq_axis_name, attention_mask, mode, inter_states):
    check_axis(seq_axis_name)
    if attention_mask is not None:
        raise ValueError("attention_mask: not supported with seq_axis_name; pack the sequences with cu_seqlens "
                         "(global offsets) instead.")
    if mode == "recurrent":
        raise ValueError("mode: 'recurrent' (the decode path) is not supported with seq_axis_name; "
                         "sequence parallelism runs the chunked path (mode None or 'chunk').")
    if inter_states:
        raise ValueError("return_intermediate_states: not supported with seq_axis_name.")


def _chunk_start_states(pipeline, q, k, v, g, beta, chunk_size, opts):
    """``chunk_kda`` plus the state at the start of every chunk, ``[B, NC, HV, K, V]``.

    kdax's public ``chunk_kda`` returns only the final state; the per-chunk states are the
    F4 stage's output ``h`` (chunked layout ``[R, HV, NC, K, V]``, R = B for dense input),
    which ``KDAPipeline.forward`` keeps in its residuals (``res.cache.h``). Forward only
    (no custom VJP): this is the serving path."""
    pipe = default_pipeline() if pipeline is None else pipeline
    o, final, res = pipe.forward(q, k, v, g, beta, chunk_size=chunk_size, **opts)
    return o, final, jnp.moveaxis(res.cache.h, 2, 1)


def load_pretrained(path, layers=None, **options) -> dict:
    """``{layer index: KimiDeltaAttention}`` for the KDA layers of a checkpoint (all of
    them, or those in ``layers``; a listed layer that is not a KDA layer raises). Same
    rules as ``KimiDeltaAttention.from_pretrained``; ``options``: ``param_dtype``,
    ``dtype``."""
    return load_layers(KimiDeltaAttention, path, layers, **options)
