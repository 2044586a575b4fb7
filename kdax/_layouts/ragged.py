"""Per-sequence products over spans of packed tokens (for ``kdax._layouts.shared_states``):
sequence n owns the span ``start[n]``, ``count[n]`` and a state ``[K, V]``.

- ``matvec(A, Y, spans)``: ``out_t = A_t Y_n`` for each token t of span n, zero outside;
- ``outer(U, X, spans, N)``: ``S_n = sum_t U_t^T X_t`` over span n.

Each is the other's transpose (their VJPs). Both run over blocks of ``W`` tokens from each
span's start, ``[N, W, K] x [N, K, V]`` products, never forming ``[T, K, V]``; the loop
has a static length (a static bound, ``longest``) so it has a reverse-mode derivative
(second-order gradients differentiate the VJPs), and skips blocks past the longest span
at run time. ``W`` is ``WIDE``, or ``narrow`` when every span fits one such block
(chosen at run time). Token arrays ``[HV, TT, D]``, states ``[N, HV, K, V]``."""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

# Tokens per block, when a span is longer than the narrow block; HI: float32 products (a GPU's default: TF32).
WIDE, HI = 16, "highest"


class Spans(NamedTuple):
    """Per sequence ``[N]`` int32: the first token of its span and the span's length."""

    start: jax.Array
    count: jax.Array


def narrow_width(T: int, N: int) -> int:
    """The narrowest power-of-2 block (at most ``WIDE``) holding a span of N sequences' average length in T."""
    avg = -(-T // max(N, 1))
    return min(WIDE, 1 << (max(avg, 1) - 1).bit_length())


def _by_width(spans: Spans, narrow: int, longest: Optional[int], TT: int, run):
    """``run(W, n)``: W = ``narrow`` when every span fits it (n = 1), else ``WIDE`` (n blocks for
    ``longest``, a static bound on the spans' lengths, at most TT; None: TT)."""
    longest = TT if longest is None else min(int(longest), TT)
    wide = lambda: run(WIDE, max(1, -(-longest // WIDE)))
    if narrow >= WIDE:
        return wide()
    if longest <= narrow:  # (known at trace time)
        return run(narrow, 1)
    fits = jnp.max(spans.count, initial=0) <= narrow
    return jax.lax.cond(fits, lambda: run(narrow, 1), wide)


def _over_blocks(spans: Spans, W: int, n: int, first, more):
    """``more(b, ..more(1, first)..)`` over the blocks b < n some span reaches: a static-length
    loop, the blocks past the longest span skipped at run time."""
    if n <= 1:
        return first
    reached = (jnp.max(spans.count, initial=0) + W - 1) // W
    step = lambda b, acc: jax.lax.cond(b < reached, more, lambda b, acc: acc, b, acc)
    return jax.lax.fori_loop(1, n, step, first)  # (Python bounds: a scan)


def _gather_block(x, spans: Spans, b, W: int):
    """``x [M, HV, TT, D]`` at tokens ``start + b W + (0..W-1)`` of each span: ``[N, HV, M W, D]``
    (positions past a span clipped; callers mask them)."""
    t = jnp.clip(spans.start[:, None] + b * W + jnp.arange(W, dtype=jnp.int32)[None], 0, x.shape[2] - 1)
    g = jnp.transpose(x[:, :, t], (2, 1, 0, 3, 4))  # [N, HV, M, W, D]
    return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])


def token_slots(spans: Spans, TT: int):
    """Per token: its span n, its offset d in it, whether it is in one."""
    t = jnp.arange(TT, dtype=jnp.int32)
    n = jnp.clip(jnp.searchsorted(spans.start, t, side="right") - 1, 0, spans.start.shape[0] - 1)
    d = t - spans.start[n]
    return n, d, (d >= 0) & (d < spans.count[n])


def _matvec(A, Y, spans: Spans, narrow: int, longest: int, transpose: bool = False, ok=None):
    """Stacked: ``A [M, HV, TT, K]`` -> ``[M, HV, TT, V]`` (``transpose``: ``A_t Y_n^T``); zero
    where ``ok [N, HV]`` is False. Products, also for a cotangent ``Y`` (read as a multiply
    and a reduction fused with its producer, a step with a loss on the final states took
    1.2-1.5x as long at 16 packed sequences, 8.4x at 1024)."""
    M, HV, TT = A.shape[:3]
    n, d, inside = token_slots(spans, TT)
    keep = inside[None] if ok is None else inside[None] & ok[n].T  # [1 or HV, TT]
    N, D = Y.shape[0], Y.shape[-2] if transpose else Y.shape[-1]

    def run(W, nb):
        def block(b, out):
            a = _gather_block(A, spans, b, W)  # [N, HV, M W, K]
            mine = keep & (d // W == b)[None]
            w = jnp.clip(d - b * W, 0, W - 1)
            if transpose:  # the states as the left operand, as stored (XLA:CPU copied all N
                # states to transpose them when they were the right one)
                cols = jnp.einsum("nhkv,nhwv->nhkw", Y, a, precision=HI).reshape(N, HV, D, M, W)
                got = jnp.transpose(cols[n, :, :, :, w], (3, 1, 0, 2))  # [TT, HV, D, M] -> [M, HV, TT, D]
            else:
                rows = jnp.einsum("nhwk,nhkv->nhwv", a, Y, precision=HI)
                got = jnp.transpose(rows.reshape(N, HV, M, W, D)[n, :, :, w], (2, 1, 0, 3))  # [TT, HV, M, D] -> ...
            return out + jnp.where(mine[None, :, :, None], got, jnp.zeros((), out.dtype))

        out = jnp.zeros((M, HV, TT, D), jnp.result_type(A, Y))
        return _over_blocks(spans, W, nb, block(0, out), block)

    return _by_width(spans, narrow, longest, TT, run)


def _outer(U, X, spans: Spans, N: int, narrow: int, longest: int):
    """Stacked: ``sum_m sum_t U[m]_t^T X[m]_t`` (``U [M, HV, TT, K]``, ``X [M, HV, TT, V]``)."""

    def run(W, nb):
        def part(b):  # (ok [N, 1, M W, 1]: the block's positions inside each span, for each of M arrays)
            ok = jnp.tile((b * W + jnp.arange(W, dtype=jnp.int32))[None] < spans.count[:, None], (1, U.shape[0]))[:, None, :, None]
            Ub, Xb = _gather_block(U, spans, b, W), _gather_block(X, spans, b, W)
            return jnp.einsum("nhwk,nhwv->nhkv", jnp.where(ok, Ub, jnp.zeros((), U.dtype)),
                              jnp.where(ok, Xb, jnp.zeros((), X.dtype)), precision=HI)

        # Block 0 starts the sum (it is zero for an empty span): a state-sized array of
        # zeros to add into would cost a pass over N states.
        return _over_blocks(spans, W, nb, part(0), lambda b, S: S + part(b))

    return _by_width(spans, narrow, longest, U.shape[2], run)


def _custom_vjp(primal, bwd, nondiff: tuple):
    """``primal`` with the VJP ``bwd(*its nondiff args, (its other args), cotangent)``."""
    f = jax.custom_vjp(primal, nondiff_argnums=nondiff)
    f.defvjp(lambda *a: (primal(*a), tuple(x for i, x in enumerate(a) if i not in nondiff)), bwd)
    return f


def _matvec_bwd(narrow, longest, res, dout):
    A, Y, spans, ok = res
    dA = _matvec(dout, Y, spans, narrow, longest, transpose=True, ok=ok)
    dY = _outer(A, dout, spans, Y.shape[0], narrow, longest)  # every stacked array's part in one pass
    return dA.astype(A.dtype), dY.astype(Y.dtype), None, None


def _outer_bwd(N, narrow, longest, res, dS):
    U, X, spans = res
    dU = _matvec(X, dS, spans, narrow, longest, transpose=True)
    dX = _matvec(U, dS, spans, narrow, longest)
    return dU.astype(U.dtype), dX.astype(X.dtype), None


_matvec_vjp = _custom_vjp(lambda A, Y, spans, ok, narrow, longest: _matvec(A, Y, spans, narrow, longest, ok=ok),
                          _matvec_bwd, (4, 5))
_outer_vjp = _custom_vjp(_outer, _outer_bwd, (3, 4, 5))


def matvec(A, Y, spans: Spans, narrow: int = WIDE, ok=None, longest: Optional[int] = None):
    """``out [HV, TT, V]``: ``A_t Y_n`` (``A [HV, TT, K]``, ``Y [N, HV, K, V]``) for each token t
    of span n, zero elsewhere. ``A`` may be a tuple (each block of ``Y`` read once for all).
    ``ok [N, HV]`` (or None): False heads read a zero state, without a cleaned copy.
    ``longest``: a static bound on the spans' lengths (None: TT)."""
    if isinstance(A, tuple):
        return tuple(_matvec_vjp(jnp.stack(A), Y, spans, ok, narrow, longest))
    return _matvec_vjp(A[None], Y, spans, ok, narrow, longest)[0]


def outer(U, X, spans: Spans, N: int, narrow: int = WIDE, longest: Optional[int] = None):
    """``S [N, HV, K, V]``: ``sum_t U_t^T X_t`` over span n (``U [HV, TT, K]``, ``X [HV, TT, V]``)."""
    return _outer_vjp(U[None], X[None], spans, N, narrow, longest)
