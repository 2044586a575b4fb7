"""jaxtyping aliases for the shapes in DESIGN.md §1 and the one typecheck decorator.

Dimension names: B batch, T time, H query/key heads, HV value heads, K key dim, V value
dim, N sequences (B, or len(cu_seqlens) - 1). Inside the chunked pipeline: R rows of the
chunked layout, NC chunks per row, C chunk size.
"""

import difflib
import functools
import inspect
import numbers
import re
import types
import typing

import jax
import numpy as np
from beartype import beartype
from jaxtyping import AbstractArray, Array, Bool, Float, Int, Integer, Real, TypeCheckError, jaxtyped

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
CuSeqlensIn = typing.Union[Integer[ArrayIn, "N1"], list, tuple]  # (unsigned too: cast to int32 once checked)
# A static number: Python or numpy scalar, or a concrete 0-d JAX array.
Scalar = typing.Union[numbers.Real, Real[ArrayIn, ""]]
# chunk_kda's results: o, the final state or None, and with return_intermediate_states
# each chunk's start state ([B, NC, HV, ...], packed [1, NT, HV, ...]).
_Out, _Final = Float[ArrayIn, "B T HV V"], typing.Optional[Float[ArrayIn, "N HV _S1 _S2"]]
ChunkKDAOut = typing.Union[tuple[_Out, _Final], tuple[_Out, _Final, Float[ArrayIn, "_ _ HV _S1 _S2"]]]

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
    """jaxtyping + beartype: shapes, ranks and dtypes are checked when a call is traced.
    A failure is a ``TypeCheckError`` whose first line names the argument, the expected
    layout and the axis that disagrees (``shape_summary``), or the argument, the types it
    takes and the value given (``value_summary``); jaxtyping's report follows."""
    checked = jaxtyped(typechecker=beartype)(fn)
    params = inspect.signature(fn).parameters
    open_ = any(p.kind == p.VAR_KEYWORD for p in params.values())

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        unknown = [] if open_ else [n for n in kwargs if n not in params]
        if unknown:  # (Python's TypeError names neither the function nor what it takes)
            near = difflib.get_close_matches(unknown[0], list(params), n=1)
            raise TypeError(f"{fn.__qualname__}: unexpected keyword argument {unknown[0]!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f"; its arguments are {', '.join(n for n in params if n != 'self')}.")
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as e:
            line = shape_summary(str(e)) or value_summary(fn, args, kwargs, str(e))
            if line is None:
                raise
            raise TypeCheckError(f"{line}\n\n{e}") from None

    return wrapper


def _bindings(report: str) -> dict:
    """jaxtyping's axis values (``B=2`` lines at the report's end) as ``{name: size}``."""
    tail = report.rpartition("are as follows.")[2]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)=(\d+)$", tail, re.M)}


def shape_summary(report: str) -> typing.Optional[str]:
    """One line from a jaxtyping report on a parameter: the argument, the layout it
    expects and the first axis that disagrees with the sizes bound by the arguments before
    it (or its rank or dtype); None when the report is not about a parameter's array."""
    param = re.search(r"typechecking parameter '(\w+)'", report)
    actual = re.search(r"Actual value: (\w+)\[([\d,]*)\]", report)
    expected = re.findall(r"(\w+)\[[\w.]+, '([^']*)'\]", report.partition("Expected type:")[2].partition("\n")[0])
    if not (param and actual and expected):
        return None
    name, dtype = param[1], actual[1]
    shape = tuple(int(n) for n in actual[2].split(",") if n)
    bound = _bindings(report)
    layouts = list(dict.fromkeys(dims for _, dims in expected))
    want = " or ".join("[" + ", ".join(d.split()) + "]" for d in layouts)
    kinds = {kind for kind, _ in expected}
    for dims in layouts:
        axes = dims.split()
        if len(axes) != len(shape):
            continue
        for i, (axis, n) in enumerate(zip(axes, shape)):
            size = int(axis) if axis.isdigit() else bound.get(axis)
            if size is not None and size != n:
                known = "" if axis.isdigit() else f" (from the arguments before it: {axis}={size})"
                return (f"{name}: expected layout {want}, got shape {shape}: axis {i} ({axis}) is {n}, "
                        f"expected {size}{known}.")
        kind = "Bool" if dtype == "bool" else "Float" if dtype[0] == "f" or dtype.startswith("bf") else "Int"
        if kind not in kinds and not (kind != "Bool" and "Real" in kinds):
            return f"{name}: expected {_a('/'.join(sorted(kinds)).lower())} array of layout {want}, got {dtype}{list(shape)}."
        return None
    return f"{name}: expected layout {want} ({' or '.join(str(len(d.split())) for d in layouts)} axes), got shape {shape}."


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _words(t) -> str:
    """An annotation as a reader says it: ``a real number or a 0-d real array or None``."""
    if t is type(None):
        return "None"
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_words(a) for a in typing.get_args(t)))
    if isinstance(t, type) and issubclass(t, AbstractArray):
        dims, kind = t.dim_str.split(), t.dtype.__name__.lower()
        return f"{_a(kind)} array [{', '.join(dims)}]" if dims else f"a 0-d {kind} array"
    if t is numbers.Real:
        return "a real number"
    return t.__name__ if isinstance(t, type) else str(t)


def value_summary(fn, args, kwargs, report: str) -> typing.Optional[str]:
    """One line from a jaxtyping report on a parameter that ``shape_summary`` does not
    explain (a string for a number, an int for a bool): the argument, what it takes, what
    it got; None when the report names no parameter of ``fn``."""
    param = re.search(r"typechecking parameter '(\w+)'", report)
    if param is None:
        return None
    try:
        value = inspect.signature(fn).bind(*args, **kwargs).arguments[param[1]]
        hint = typing.get_type_hints(fn)[param[1]]
    except (TypeError, KeyError):
        return None
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # (an array: its dtype and shape, not its values)
        got = f"{type(value).__name__} of {value.dtype}{list(value.shape)}"
    else:
        got = f"{type(value).__name__} " + (repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "...")
    return f"{param[1]}: expected {_words(hint)}, got {got}."


__all__ = [
    "Array", "ArrayIn", "Bool", "Float", "Int", "QK", "Values", "Gate", "Beta", "State",
    "ALog", "ALogIn", "CuSeqlens", "CuSeqlensIn", "Scalar", "ChunkK", "ChunkV", "ChunkScalar", "ChunkMat",
    "ChunkState", "SeqState", "ChunkValid", "typecheck",
]
