"""``KDACache``: what a KDA layer needs to continue a sequence."""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._annotations import ArrayIn
from .._platform import spans_devices
from ._weights import as_numpy


class KDACache(eqx.Module):
    """Per sequence (row n): the last ``W - 1`` inputs of each short convolution, oldest
    first (``conv_q``/``conv_k`` ``[N, W - 1, H*K]``, ``conv_v`` ``[N, W - 1, HV*V]``;
    None without short convolutions) and the recurrent state ``state [N, HV, K, V]``
    (float32, or float64 when the layer computes in float64).

    A cache may be a serving pool larger than a step's batch: pass ``state_indices [N]``
    to the layer to read and write only those rows.

    FLA keeps a layer's cache as ``{"recurrent_state": [N, HV, V, K], "conv_state": (q, k,
    v)}`` with each convolution state ``[N, D, W]`` (the last W inputs, oldest first; slot
    0, the input W tokens back, is never read again): ``KDACache.from_fla`` and
    ``KDACache.to_fla`` convert exactly, so a server can hand a sequence between the two.
    """

    conv_q: Optional[Float[Array, "N Wm1 DK"]]
    conv_k: Optional[Float[Array, "N Wm1 DK"]]
    conv_v: Optional[Float[Array, "N Wm1 DV"]]
    state: Float[Array, "N HV K V"]

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def take(self, indices: Int[ArrayIn, " M"]) -> "KDACache":
        """Rows ``indices`` of every field (a row may be taken twice: a sequence forked).
        An index outside ``[0, N)`` is an error (JAX would clamp it: another row's state)."""
        indices, faults = checked_slots(indices, self.batch_size, "indices", distinct=False)
        return self._take(indices).nan_rows(faults)

    def _take(self, indices):  # (indices checked by the caller: the layer's state_indices)
        return KDACache(*(None if a is None else a[indices] for a in self._fields()))

    def put(self, indices: Int[ArrayIn, " M"], rows: "KDACache") -> "KDACache":
        """This cache with rows ``indices`` replaced by ``rows`` (others bit-identical). The
        indices must be distinct and in ``[0, N)`` (JAX would drop an out-of-range write and
        keep one of two to the same row), ``rows`` one per index, of this cache's layout."""
        indices, faults = checked_slots(indices, self.batch_size, "indices")
        rows = rows.nan_rows(faults)
        want = tuple(None if a is None else (indices.shape[0],) + a.shape[1:] for a in self._fields())
        got = tuple(None if b is None else tuple(b.shape) for b in rows._fields())
        if got != want:
            raise ValueError(f"rows: expected a KDACache of {indices.shape[0]} rows shaped as this cache's "
                             f"(conv_q, conv_k, conv_v, state) {want}, got {got}.")
        return self._put(indices, rows)

    def _put(self, indices, rows: "KDACache") -> "KDACache":  # (indices and rows checked by the caller)
        return KDACache(*(
            None if a is None else a.at[indices].set(b.astype(a.dtype))
            for a, b in zip(self._fields(), rows._fields())
        ))

    def _fields(self):
        return (self.conv_q, self.conv_k, self.conv_v, self.state)

    def nan_rows(self, faults) -> "KDACache":
        """This cache with the rows where ``faults [N]`` is True NaN (None: as it is)."""
        if faults is None:
            return self
        nan = lambda a: jnp.where(faults.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.asarray(jnp.nan, a.dtype), a)
        return KDACache(*(None if a is None else nan(a) for a in self._fields()))

    @classmethod
    def from_fla(cls, layer_cache=None, *, recurrent_state=None, conv_state=None, state_v_first: bool = True,
                 conv_dtype=None, state_dtype=None) -> "KDACache":
        """A ``KDACache`` from FLA's cache of one layer: ``layer_cache`` is
        ``past_key_values[layer_idx]`` (a dict with ``"recurrent_state"`` and
        ``"conv_state"``), or pass ``recurrent_state`` ``[N, HV, V, K]`` (``[N, HV, K, V]``
        with ``state_v_first=False``, as ``chunk_kda`` called directly returns it) and
        ``conv_state`` ``(q [N, HK, W], k [N, HK, W], v [N, HVV, W])`` (or None without short
        convolutions). Arrays may be torch tensors (torch is not imported), numpy or JAX;
        they keep their dtype unless ``conv_dtype``/``state_dtype`` say otherwise (kdax's
        layer computes the state in float32). Exact: every value is copied, none rounded.

        ``[N, HV, V, K]`` is the state of an FLA layer passing ``state_v_first=True`` to its
        kernels (FLA's current one); one that keeps ``[N, HV, K, V]`` needs
        ``state_v_first=False``. With K == V the two have one shape: no check can tell."""
        if layer_cache is not None:
            if recurrent_state is not None or conv_state is not None:
                raise ValueError("from_fla: pass FLA's layer cache or recurrent_state/conv_state, not both.")
            recurrent_state, conv_state = layer_cache["recurrent_state"], layer_cache.get("conv_state")
        if recurrent_state is None:
            raise ValueError("from_fla: recurrent_state is missing (FLA's cache 'recurrent_state' [N, HV, V, K]).")
        st = jnp.asarray(as_numpy(recurrent_state, "recurrent_state", "values"))
        if st.ndim != 4:
            raise ValueError(f"recurrent_state: expected [N, HV, V, K], got shape {tuple(st.shape)}.")
        st = jnp.swapaxes(st, -1, -2) if state_v_first else st
        st = st if state_dtype is None else st.astype(state_dtype)
        if conv_state is None:
            return cls(None, None, None, st)
        if len(conv_state) != 3:
            raise ValueError(f"conv_state: expected FLA's (q, k, v) tuple, got {len(conv_state)} entries.")
        convs = []
        for name, c in zip(("q", "k", "v"), conv_state):
            c = jnp.asarray(as_numpy(c, f"conv_state[{name}]", "values"))
            if c.ndim != 3 or c.shape[0] != st.shape[0] or c.shape[2] < 2:
                raise ValueError(f"conv_state[{name}]: expected [N={st.shape[0]}, D, W >= 2], got shape "
                                 f"{tuple(c.shape)}.")
            # FLA's slot w holds the input W - w tokens back; the next token reads slots 1..W-1.
            c = jnp.swapaxes(c[:, :, 1:], 1, 2)
            convs.append(c if conv_dtype is None else c.astype(conv_dtype))
        return cls(*convs, st)

    def to_fla(self, state_v_first: bool = True) -> dict:
        """This cache in FLA's layout, ``{"recurrent_state": [N, HV, V, K], "conv_state":
        (q, k, v) or None}`` with each convolution state ``[N, D, W]``, as JAX arrays
        (``torch.from_dlpack`` takes them without a copy on the same device). Slot 0 of a
        convolution state, the input W tokens back, is one kdax does not keep and FLA
        never reads again: it is zero. ``state_v_first=False``: ``[N, HV, K, V]``."""
        st = jnp.swapaxes(self.state, -1, -2) if state_v_first else self.state
        if self.conv_q is None:
            return {"recurrent_state": st, "conv_state": None}
        conv = tuple(jnp.concatenate([jnp.zeros_like(c[:, :1]), c], axis=1).swapaxes(1, 2)
                     for c in (self.conv_q, self.conv_k, self.conv_v))
        return {"recurrent_state": st, "conv_state": conv}


def checked_slots(indices, P: int, name: str = "state_indices", distinct: bool = True) -> tuple:
    """``(indices as int32, faults)``: a row outside the ``P`` rows of a cache (a pool) or,
    ``distinct``, two sequences sharing one, refused by a runtime error (``eqx.error_if``,
    eager or compiled; ``faults`` None); in a program partitioned over several devices,
    where that error would abort the process (``kdax._platform.spans_devices``), ``faults
    [N]`` marks each such sequence instead, for the caller to make its rows NaN."""
    indices = jnp.asarray(indices, jnp.int32)
    if indices.ndim != 1:
        raise ValueError(f"{name}: expected a 1-d array of row indices, got shape {tuple(indices.shape)}.")
    # Out-of-range rows would be clamped on read and dropped on write; two sequences writing
    # one slot: one state would be silently dropped.
    outside = (indices < 0) | (indices >= P)
    shared = jnp.sum(indices[:, None] == indices[None], axis=1) > 1 if distinct else jnp.zeros_like(outside)
    if spans_devices(indices):
        return indices, outside | shared
    indices = eqx.error_if(indices, jnp.any(outside), f"{name}: every slot must lie in [0, {P}) (the pool's rows).")
    return eqx.error_if(indices, jnp.any(shared),
                        f"{name}: every slot must be distinct (two sequences cannot share one pool row)."), None



# jax.export serializes a program's calling convention: a decode step exported with its
# cache as argument and result needs KDACache's tree node named. Every cache flattens with
# the same aux data (no static fields), so it travels as nothing and is rebuilt here. (The
# package's own name in the key: a copy loaded beside it, as the A/B benchmarks load
# another revision, registers its own.)
jax.export.register_pytree_node_serialization(
    KDACache, serialized_name=f"{__name__.split('.')[0]}.nn.KDACache", serialize_auxdata=lambda aux: b"",
    deserialize_auxdata=lambda _: jax.tree_util.tree_structure(KDACache(None, None, None, jnp.zeros((0,) * 4)))
    .node_data()[1])


def zeros_cache(N: int, W: int, DK: int, DV: int, HV: int, K: int, V: int, conv: bool,
                conv_dtype, state_dtype) -> KDACache:
    c = (lambda d: jnp.zeros((N, W - 1, d), conv_dtype)) if conv else (lambda d: None)
    return KDACache(c(DK), c(DK), c(DV), jnp.zeros((N, HV, K, V), state_dtype))
