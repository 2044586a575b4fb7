"""The reference stages' chunk-group loops (``over_chunks``): how many chunks each loop
iteration takes (``resolve_group``), the recurrences' unroll factor (``loop_unroll``),
and the loop's form (a reference stage's ``chunk_loops``: flat groups or chunk-axis
slices)."""

import functools
from typing import Literal, Optional, Union

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import precision as _precision
from .arrays import zeros_after


# A reference stage's ``group``: chunks per iteration of its chunk loop (None: no loop).
ChunkGroup = Union[int, Literal["auto"], None]


def resolve_group(group: ChunkGroup) -> Optional[int]:
    """``"auto"``: 16 chunks at a time on CPU (temporaries that stay in cache), 1024
    elsewhere: on a GPU every loop iteration costs kernel launches, and 16 chunks are far
    too little parallel work (F2 and B4 at (1, 16384, 16) on an H200: the training step
    67 ms with 16, 42 ms with no loop; benchmarks/NOTES.md); 1024 keeps that speed with
    bounded temporaries at large batch."""
    if group == "auto":
        return 16 if jax.default_backend() == "cpu" else 1024
    return group


def loop_unroll(unroll: Union[int, Literal["auto"]]) -> int:
    """A chunk recurrence's ``fori_loop`` unroll factor; ``"auto"``: 1 on CPU, 8 elsewhere
    (a GPU pays a launch and a host round trip per loop iteration)."""
    if unroll == "auto":
        return 1 if jax.default_backend() == "cpu" else 8
    return unroll


def over_chunks(fn, group: ChunkGroup, *xs, into=None, loops: Optional[str] = "auto", consts: tuple = ()):
    """``fn`` over the chunk axes ``[R, HV, NC]`` of ``xs``, about ``group`` chunks at a
    time (a loop; None: all at once). Every ``x`` has those three leading axes, and so
    has every output of ``fn``; ``fn`` must work on any leading axes. On CPU,
    cache-sized groups keep ``fn``'s temporaries out of main memory. Under a mesh whose
    Auto axes may shard rows or heads (``split_rows_and_heads``) the loop walks slices of
    the NC axis, every row and head in each: an array sharded over rows or heads stays
    sharded through it, where a loop over the flattened axes made XLA gather it.
    Elsewhere it walks contiguous groups of the flattened axes, which XLA:CPU runs faster
    (forward ~15% at the benchmark shape).

    ``into``: optional tuple, one entry per output of ``fn`` (a tuple then): an array the
    output is added to (in place, group by group, instead of a new buffer and a separate
    pass), or None. ``loops``: the loop's form (``split_rows_and_heads``; a stage's
    ``chunk_loops`` field). ``consts``: arrays every call of ``fn`` reads whole, passed
    after the chunks' (``fn(*xs_group, *consts)``).

    Differentiated by JAX (a derived backward, ``kdax.stages.GateVjpBackward``), the loop's
    VJP walks the same groups, each group's forward rematerialised (``_walked``): memory
    the size of a group, and no gradient added into a whole-size buffer per group. So
    ``fn`` closes over no floating-point array: it takes them in ``xs`` or ``consts``
    (the backward may be traced in another program than the forward: kdax's eager calls
    compile each)."""
    group = resolve_group(group)
    walk = _over_chunk_slices if split_rows_and_heads(loops) else _over_flat_groups
    R, HV, NC = xs[0].shape[:3]
    if group is None or R * HV * NC <= group:  # one call of fn, no loop
        return walk(_with(fn, consts), group, *xs, into=into)
    _check_closure(fn)
    added = None if into is None else tuple(a is not None for a in into)
    into = None if into is None else tuple(into)
    return _walked(fn, walk, group, _precision.captured(), added, xs, tuple(consts), into)


def _with(fn, consts):
    return (lambda *a: fn(*a, *consts)) if consts else fn


def _check_closure(fn, depth: int = 0) -> None:
    """Raise if ``fn`` closes over a floating-point traced array (``over_chunks``)."""
    cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if c.cell_contents is not None]
    if isinstance(fn, functools.partial):
        cells += [fn.func, *fn.args, *fn.keywords.values()]
    for x in cells:
        if isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(f"over_chunks: {getattr(fn, '__qualname__', fn)} closes over a traced array of shape "
                            f"{x.shape}: pass it in xs (chunked) or consts (read whole).")
        if callable(x) and depth < 3:
            _check_closure(x, depth + 1)


CHUNK_LOOPS = ("auto", "flat", "slices")


def check_chunk_loops(mode: Optional[str], where: str = "chunk_loops") -> None:
    """A reference stage's ``chunk_loops``: None (``"auto"``) or one of ``CHUNK_LOOPS``."""
    if mode is not None and mode not in CHUNK_LOOPS:
        raise ValueError(f"{where}: expected None or one of {CHUNK_LOOPS}, got {mode!r}.")


def split_rows_and_heads(mode: Optional[str] = "auto") -> bool:
    """Whether ``over_chunks`` keeps the row and head axes whole (see there). ``"auto"``
    (or None): only when traced under a mesh set with ``jax.set_mesh`` that has an Auto
    axis of more than one device, where ``jit`` may shard rows or heads (sharding
    propagation then keeps them sharded through the loop; a loop over the flattened axes
    made XLA gather them). Elsewhere the flat groups: one device, ``jax.shard_map`` (each
    device's arrays are its own), Explicit meshes (``chunk_kda`` runs per shard). The
    slices double XLA:CPU's compile time of the training step (16 s against 8 s at the
    benchmark shape). ``"slices"`` / ``"flat"`` force a form (``jit`` on an Auto mesh
    without ``jax.set_mesh``: ``"slices"`` keeps rows and heads sharded)."""
    check_chunk_loops(mode)
    if mode in (None, "auto"):
        mesh = jax.sharding.get_abstract_mesh()
        return any(t == jax.sharding.AxisType.Auto and n > 1 for n, t in zip(mesh.axis_sizes, mesh.axis_types))
    return mode == "slices"


def _over_flat_groups(fn, group, *xs, into=None):
    lead = xs[0].shape[:3]
    n = lead[0] * lead[1] * lead[2]
    if group is None or n <= group:
        out = fn(*xs)
        return out if into is None else _add_into(out, into)
    # A divisor of n keeps the split a free reshape (grouping by striding would transpose).
    g = next(d for d in range(group, 0, -1) if n % d == 0)
    if 2 * g < group:
        g = group
    m = n // g * g
    flat = tuple(x.reshape(n, *x.shape[3:]) for x in xs)
    split = tuple(x[:m].reshape(n // g, g, *x.shape[1:]) for x in flat)
    shapes, tree = jax.tree.flatten(jax.eval_shape(fn, *(x[0] for x in split)))
    acc = (None,) * len(shapes) if into is None else tuple(a if a is None else a.reshape(n, *a.shape[3:]) for a in into)
    init = tuple(
        zeros_after((n // g, *s.shape), s.dtype, xs, j) if a is None else a[:m].reshape(n // g, g, *a.shape[1:])
        for j, (s, a) in enumerate(zip(shapes, acc))
    )

    def step(i, outs):
        res = jax.tree.leaves(fn(*(jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in split)))
        return tuple(
            jax.lax.dynamic_update_index_in_dim(
                o, r if a is None else jax.lax.dynamic_index_in_dim(o, i, keepdims=False) + r, i, 0
            )
            for o, r, a in zip(outs, res, acc)
        )

    out = [o.reshape(m, *o.shape[2:]) for o in jax.lax.fori_loop(0, n // g, step, init)]
    if m < n:
        rest = jax.tree.leaves(fn(*(x[m:] for x in flat)))
        rest = _add_into(rest, tuple(None if a is None else a[m:] for a in acc))
        out = [jnp.concatenate([a, b]) for a, b in zip(out, rest)]
    return jax.tree.unflatten(tree, [o.reshape(*lead, *o.shape[1:]) for o in out])


def _over_chunk_slices(fn, group, *xs, into=None):
    R, HV, NC = xs[0].shape[:3]
    if group is None or R * HV * NC <= group:
        out = fn(*xs)
        return out if into is None else _add_into(out, into)
    want = max(1, group // (R * HV))
    # A divisor of NC gives equal slices and no remainder call (one more trace of fn).
    gc = next(d for d in range(want, 0, -1) if NC % d == 0)
    if 2 * gc < want:
        gc = want
    m = NC // gc * gc
    part = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * gc, gc, axis=2)
    shapes, tree = jax.tree.flatten(jax.eval_shape(fn, *(x[:, :, :gc] for x in xs)))
    acc = (None,) * len(shapes) if into is None else tuple(into)
    init = tuple(
        zeros_after((R, HV, NC, *s.shape[3:]), s.dtype, xs, j) if a is None else a
        for j, (s, a) in enumerate(zip(shapes, acc))
    )

    def step(i, outs):
        res = jax.tree.leaves(fn(*(part(x, i) for x in xs)))
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(o, r if a is None else part(o, i) + r, i * gc, axis=2)
            for o, r, a in zip(outs, res, acc)
        )

    out = list(jax.lax.fori_loop(0, NC // gc, step, init))
    if m < NC:
        rest = jax.tree.leaves(fn(*(x[:, :, m:] for x in xs)))
        out = [o.at[:, :, m:].set(r if a is None else o[:, :, m:] + r) for o, r, a in zip(out, rest, acc)]
    return jax.tree.unflatten(tree, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _walked(fn, walk, group, scope, added, xs, consts, into):
    """``walk(fn, group, *xs, into=into)`` (``fn`` given ``consts`` too), whose VJP walks
    the same groups: each group's forward rematerialised and differentiated alone, its
    input gradients written in place (``_walked_bwd``). JAX's own VJP of the loop kept
    every group's intermediates and added each group's gradient into zeros the size of
    the whole input (a quadratic cost: F1's VJP 105 ms against 34 ms this way at the main job's
    shape). ``scope``: the precision scope the forward ran under
    (``precision.captured``), to trace the backward under the same; ``added``: which
    outputs ``into`` adds to (None: no ``into``)."""
    return walk(_with(fn, consts), group, *xs, into=into)


def _walked_fwd(fn, walk, group, scope, added, xs, consts, into):
    values = tuple(x.value for x in xs)
    const_values = tuple(c.value for c in consts)
    into = None if into is None else tuple(None if a is None else a.value for a in into)
    # (which inputs are differentiated, kept as the residuals' structure: None where not)
    mark = lambda x: jnp.zeros((), x.value.dtype) if x.perturbed and jnp.issubdtype(x.value.dtype, jnp.inexact) else None
    res = (values, const_values, tuple(mark(x) for x in xs), tuple(mark(c) for c in consts))
    return walk(_with(fn, const_values), group, *values, into=into), res


def _walked_bwd(fn, walk, group, scope, added, res, g):
    xs, consts, marks, const_marks = res
    diff = tuple(m is not None for m in marks)
    leaves, tree = jax.tree.flatten(g, is_leaf=lambda c: isinstance(c, SymbolicZero))
    dense = [_zeros(c.aval) if isinstance(c, SymbolicZero) else c for c in leaves]
    d_into = None if added is None else tuple(
        None if not a or isinstance(c, SymbolicZero) else c for c, a in zip(leaves, added))
    with _precision.restored(scope):
        if any(m is not None for m in const_marks):
            # (a differentiated const: its gradient sums over the groups, JAX's VJP of the loop)
            _, vjp = jax.vjp(lambda x, c: walk(_with(fn, c), group, *x), xs, consts)
            d_xs, d_consts = vjp(jax.tree.unflatten(tree, dense))
            return d_xs, d_consts, d_into
        if not any(diff):
            return (None,) * len(xs), (None,) * len(consts), d_into

        def group_vjp(*args):
            x, ct = args[: len(xs)], jax.tree.unflatten(tree, args[len(xs):])

            def f(*d):
                it = iter(d)
                return fn(*(next(it) if k else a for a, k in zip(x, diff)), *consts)

            return jax.vjp(f, *(a for a, k in zip(x, diff) if k))[1](ct)

        grads = iter(walk(group_vjp, group, *xs, *dense))
    return tuple(next(grads) if k else None for k in diff), (None,) * len(consts), d_into


def _zeros(aval):
    """Zeros of ``aval`` (a symbolic zero's), varying over the manual mesh axes it does."""
    z = jnp.zeros(aval.shape, aval.dtype)
    vma = tuple(sorted(getattr(aval, "vma", ()) or ()))
    return jax.lax.pcast(z, vma, to="varying") if vma else z


_walked.defvjp(_walked_fwd, _walked_bwd, symbolic_zeros=True)


def _add_into(out, into):
    return tuple(o if a is None else a + o for o, a in zip(out, into))
