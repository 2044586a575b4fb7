"""The helpers of the families' ``output_spec``, checked by the stage runner at every call."""

from typing import Any, NamedTuple

import jax

from .._numerics import precision as _precision
from ..ref import compute_dtype


class Maybe(NamedTuple):
    """In an output spec: an output that may be None (else must match ``spec``)."""

    spec: Any


class Specs(NamedTuple):
    """Builds a family's ``output_spec`` under the precision ``policy``: intermediates of
    ``STORED`` in their storage dtype, every other output in its argument's dtype."""

    policy: str = "highest"

    def like(self, x, shape=None, stored: bool = False) -> jax.ShapeDtypeStruct:
        """``x``'s dtype (stored: its storage dtype) and shape (or ``shape``)."""
        dtype = _precision.storage(x.dtype, self.policy) if stored else x.dtype
        return jax.ShapeDtypeStruct(tuple(x.shape if shape is None else shape), dtype)

    def computed(self, x, shape, stored: bool = False) -> jax.ShapeDtypeStruct:
        """In the compute dtype of ``x`` (which may arrive stored in bf16)."""
        return self.like(jax.ShapeDtypeStruct(tuple(shape), compute_dtype(x)), stored=stored)
