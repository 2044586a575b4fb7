"""jaxtyping aliases for the shapes in DESIGN.md §1 and the one typecheck decorator.

Dimension names: B batch, T time, H query/key heads, HV value heads, K key dim, V value
dim, N sequences (B, or len(cu_seqlens) - 1). Inside the chunked pipeline: R rows of the
chunked layout, NC chunks per row, C chunk size.
"""

import numbers
import typing

import jax
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, Real, jaxtyped

ArrayIn = typing.Union[jax.Array, np.ndarray]

# Public (FLA layout) arguments.
QK = Float[ArrayIn, "B T H K"]
Values = Float[ArrayIn, "B T HV V"]
Gate = Float[ArrayIn, "B T HV K"]
Beta = Float[ArrayIn, "B T HV"]
# [N, HV, K, V], or [N, HV, V, K] with state_v_first; the order is checked by _validate.
State = Float[ArrayIn, "N HV _S1 _S2"]
ALog = Float[ArrayIn, "HV"]
# A_log as given: [HV], or [1, 1, HV, 1] (Kimi Linear's shape).
ALogIn = typing.Union[Float[ArrayIn, "HV"], Float[ArrayIn, "1 1 HV 1"]]
CuSeqlens = Int[ArrayIn, "N1"]
# cu_seqlens as given: an int array, or a Python list/tuple of ints (as FLA's tests pass).
CuSeqlensIn = typing.Union[Int[ArrayIn, "N1"], list, tuple]
# A static number: Python or numpy scalar, or a concrete 0-d JAX array.
Scalar = typing.Union[numbers.Real, Real[ArrayIn, ""]]

# Chunked layout used between stages: [rows, heads, chunks, chunk, feature].
ChunkK = Float[Array, "R HV NC C K"]
ChunkV = Float[Array, "R HV NC C V"]
ChunkScalar = Float[Array, "R HV NC C"]
ChunkMat = Float[Array, "R HV NC C C"]
ChunkState = Float[Array, "R HV NC K V"]
SeqState = Float[Array, "N HV K V"]
ChunkValid = Bool[Array, "R NC C"]

_F = typing.TypeVar("_F")


def typecheck(fn: _F) -> _F:
    """jaxtyping + beartype: shapes, ranks and dtypes are checked when a call is traced;
    a failure names the argument and the expected shape."""
    return jaxtyped(typechecker=beartype)(fn)


__all__ = [
    "Array", "ArrayIn", "Bool", "Float", "Int", "QK", "Values", "Gate", "Beta", "State",
    "ALog", "ALogIn", "CuSeqlens", "CuSeqlensIn", "Scalar", "ChunkK", "ChunkV", "ChunkScalar", "ChunkMat",
    "ChunkState", "SeqState", "ChunkValid", "typecheck",
]
