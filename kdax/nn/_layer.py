"""``KimiDeltaAttention``: the KDA layer of Kimi Linear / FLA around ``kdax.chunk_kda``."""

from typing import Optional

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Shaped

from .._runner.runner import active_recordings
from .._annotations import ArrayIn, CuSeqlensIn, typecheck
from .._errors import reverse_mode_only
from .._numerics.arrays import at_least_float32
from .._platform import in_eager_shard_map
from ..parallel import batch_shards
from ..pipeline import KDAPipeline
from ..recurrent import concrete_call
from ._arguments import check_call
from ._cache import KDACache, checked_slots, zeros_cache
from ._forward import layer_forward
from ._padded import pack_padded, unpack_padded
from ._params import check_layer_options, init_params
from ._pretrained import load_layers
from ._weights import layer_from_state_dict, layer_state_dict


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
        HV, V = check_layer_options(hidden_size, num_heads, head_dim, num_v_heads, expand_v, conv_size,
                                    lower_bound, safe_gate, mode, dtype, param_dtype, fla_options, norm_eps)
        D, H, K = hidden_size, num_heads, head_dim
        if gate_bias is None:
            gate_bias = not use_full_rank_gate
        params = init_params(key, D, H, HV, K, V, conv_size, use_short_conv=use_short_conv, conv_bias=conv_bias,
                             gate_bias=gate_bias, use_full_rank_gate=use_full_rank_gate, param_dtype=param_dtype)
        for field, value in params.items():  # every array field (None: absent in this variant)
            setattr(self, field, value)
        self.hidden_size, self.num_heads, self.num_v_heads = int(D), int(H), int(HV)
        self.head_dim, self.head_v_dim, self.conv_size = int(K), V, int(conv_size)
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
        ``dtype``, else the layer's ``dtype`` if set, else its parameters' (the compute
        dtype of an input in that dtype); the recurrent state in float32 (float64 when
        computing in float64). A call keeps the dtypes of the cache it is given."""
        if isinstance(batch_size, bool) or not hasattr(batch_size, "__index__") or batch_size < 0:
            raise ValueError(f"batch_size: expected a number of sequences (an integer >= 0), got {batch_size!r}.")
        cd = jnp.dtype(dtype) if dtype is not None else self._compute_dtype(None)
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        return zeros_cache(batch_size, self.conv_size, H * K, HV * V, HV, K, V, self.use_short_conv,
                           cd, at_least_float32(cd))

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
        """``y, cache = layer(x, ...)``; ``y [B, T, hidden]`` in the compute dtype: the
        layer's ``dtype`` if set, else ``jnp.result_type`` of its parameters and ``x``
        (float32 parameters and bf16 ``x``: float32). A cache passed in comes back in its
        own dtypes (``init_cache``'s convolution states in the parameters' dtype unless
        told: ``init_cache(B, dtype=...)`` for another compute dtype).

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

        - ``x`` sharded over the batch on an Explicit mesh: the rows run per shard
          (``jax.shard_map``, parameters replicated), as ``chunk_kda``'s inputs do; there
          a pool slot out of range or shared makes its sequence's output and state NaN
          (an error would abort a program over several devices).

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
        attention_mask, cu_seqlens, mode = check_call(self, x.shape, attention_mask, cu_seqlens, cache, state_indices,
                                                      mode, return_intermediate_states, seq_axis_name)
        arrays = (x, attention_mask, cu_seqlens, cache, state_indices, pipeline)
        # Called eagerly (a decode loop without jit), one compiled program cached by shapes,
        # dtypes and options, as chunk_kda's eager calls (kdax._runner.vjp.apply): op by op a
        # decode step took ~0.1 s a token. Every check above has run on the caller's values.
        # Not while a pipeline's plan records the stage calls (a cached trace makes none).
        # In an eager jax.shard_map body too (kdax._platform.in_eager_shard_map).
        eager = not active_recordings() and (concrete_call(self, arrays) or in_eager_shard_map(arrays))
        return (_compiled_call if eager else _call)(self, *arrays, mode, return_intermediate_states, chunk_size,
                                                    seq_axis_name)


def _call(layer: KimiDeltaAttention, x, attention_mask, cu_seqlens, cache: Optional[KDACache], state_indices,
          pipeline: Optional[KDAPipeline], mode: str, inter_states: bool, chunk_size: int,
          seq_axis_name: Optional[str]):
    """``KimiDeltaAttention.__call__`` after ``check_call``: its arguments checked and
    normalised (``attention_mask`` this call's ``[B, T]``, ``cu_seqlens`` int32, ``mode``
    "chunk" or "recurrent")."""
    shards = None if seq_axis_name is not None else batch_shards(x, eqx.filter(layer, eqx.is_array))
    if state_indices is not None:
        if shards is not None:
            cache, state_indices = shards.replicated((cache, state_indices))
        state_indices, faults = checked_slots(state_indices, cache.state.shape[0])
    rows = cache if state_indices is None else cache._take(state_indices).nan_rows(faults)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)

    def on_rows(layer, x, attention_mask, cu, rows, pipeline):
        return _on_rows(layer, x, attention_mask, cu, rows, pipeline, mode, inter_states, chunk_size, seq_axis_name)

    if shards is None:
        y, new_rows, inter = on_rows(layer, x, attention_mask, cu, rows, pipeline)
    else:  # (x sharded over Explicit mesh axes: per batch shard, as chunk_kda runs)
        y, new_rows, inter = shards.run(on_rows, layer, x, attention_mask, cu, rows, pipeline)
        new_rows = new_rows if state_indices is None else shards.replicated(new_rows)
    new_cache = new_rows if state_indices is None else cache._put(state_indices, new_rows)
    if inter_states:
        return y, new_cache, inter
    return y, new_cache


def _on_rows(layer, x, attention_mask, cu, rows, pipeline, mode, inter_states, chunk_size, seq_axis_name):
    """``(y, new_rows, intermediate)``: the layer on ``x`` with ``rows`` its cache rows (one
    per batch row, or per packed sequence), masked rows packed and unpacked around it."""
    B, T, _ = x.shape
    xin = jnp.asarray(x).astype(layer._compute_dtype(x))
    if attention_mask is not None:
        # Padded rows run as one packed row: shapes never depend on the mask.
        xs, cu, rows, order = pack_padded(xin, attention_mask, rows)
    else:
        xs = xin
    y, new_rows, inter = layer_forward(layer, xs, cu, rows, mode, inter_states, chunk_size, pipeline, seq_axis_name)
    if attention_mask is not None:
        y, new_rows = unpack_padded(y, new_rows, order, B, T)
    return y, new_rows, inter


# eqx.filter_jit: the layer and a pipeline hold static fields and, a pipeline, any leaves.
# (jax.jvp of it meets chunk_kda's custom VJP in JAX's trace, not in kdax's: named here too)
_compiled_call = reverse_mode_only(eqx.filter_jit(_call))


def load_pretrained(path, layers=None, **options) -> dict:
    """``{layer index: KimiDeltaAttention}`` for the KDA layers of a checkpoint (all of
    them, or those in ``layers``; a listed layer that is not a KDA layer raises). Same
    rules as ``KimiDeltaAttention.from_pretrained``; ``options``: ``param_dtype``,
    ``dtype``."""
    return load_layers(KimiDeltaAttention, path, layers, **options)
