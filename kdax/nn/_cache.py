"""``KDACache``: what a KDA layer needs to continue a sequence."""

from typing import Optional

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class KDACache(eqx.Module):
    """Per sequence (row n): the last ``W - 1`` inputs of each short convolution, oldest
    first (``conv_q``/``conv_k`` ``[N, W - 1, H*K]``, ``conv_v`` ``[N, W - 1, HV*V]``;
    None without short convolutions) and the recurrent state ``state [N, HV, K, V]``
    (float32, or float64 when the layer computes in float64).

    A cache may be a serving pool larger than a step's batch: pass ``state_indices [N]``
    to the layer to read and write only those rows.
    """

    conv_q: Optional[Float[Array, "N Wm1 DK"]]
    conv_k: Optional[Float[Array, "N Wm1 DK"]]
    conv_v: Optional[Float[Array, "N Wm1 DV"]]
    state: Float[Array, "N HV K V"]

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def take(self, indices: Int[Array, " M"]) -> "KDACache":
        """Rows ``indices`` of every field."""
        return KDACache(*(None if a is None else a[indices] for a in self._fields()))

    def put(self, indices: Int[Array, " M"], rows: "KDACache") -> "KDACache":
        """This cache with rows ``indices`` replaced by ``rows`` (others bit-identical)."""
        return KDACache(*(
            None if a is None else a.at[indices].set(b.astype(a.dtype))
            for a, b in zip(self._fields(), rows._fields())
        ))

    def _fields(self):
        return (self.conv_q, self.conv_k, self.conv_v, self.state)


def zeros_cache(N: int, W: int, DK: int, DV: int, HV: int, K: int, V: int, conv: bool,
                conv_dtype, state_dtype) -> KDACache:
    c = (lambda d: jnp.zeros((N, W - 1, d), conv_dtype)) if conv else (lambda d: None)
    return KDACache(c(DK), c(DK), c(DV), jnp.zeros((N, HV, K, V), state_dtype))
