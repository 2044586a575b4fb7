"""What a change inside one sequence reaches within it, for ``check_stage``: which sequence
each element belongs to (``_owners``); ``nan-reach`` (a NaN reaches each token row the
reference stage's reaches: ``_rows_missed``); ``overflow`` (B3: a ``dw`` row overflowing
from finite operands, ``_dw_overflow``); ``causal`` (a change at one token leaves every
entry the reference stage's leaves, to the bit: ``_causal``)."""

import jax.numpy as jnp
import numpy as np

from ._cases import Case, _device, tolerance
from ._compare import _leaves, _named, _rel
from ._runs import _jit_run


def _owners(shape, case: Case, R: int, NC: int, N: int):
    """The sequence each element of an argument or output of ``shape`` belongs to, as an
    int array that broadcasts to ``shape`` (None: not indexed by sequence). The chunks past
    the last sequence's in the per-sequence layout belong to none (-1: never read). Shared
    chunks: each token's (``[1, HV, NC, C, ...]``; the cases' K and V are not C), and none
    for a chunk's own arrays (its states: the sequences sharing it read them)."""
    if case.share:
        if len(shape) < 4 or shape[0] != R or shape[2] != NC or shape[3] != case.chunk:
            return None
        t = np.arange(NC * case.chunk)
        owner = np.where(t < case.cu[-1], np.searchsorted(np.asarray(case.cu), t, side="right") - 1, -1)
        return owner.reshape((1, 1, NC, case.chunk) + (1,) * (len(shape) - 4))
    if len(shape) >= 3 and shape[0] == R and shape[2] == NC:
        if not case.packed:
            return np.arange(R).reshape((R,) + (1,) * (len(shape) - 1))
        # per-sequence layout: sequence n occupies chunks [start_n, start_n + ceil(len_n / C))
        owner = np.full(NC, -1)
        c = 0
        for n in range(len(case.cu) - 1):
            m = -(-(case.cu[n + 1] - case.cu[n]) // case.chunk)
            owner[c:c + m] = n
            c += m
        return owner.reshape((1, 1, NC) + (1,) * (len(shape) - 3))
    if len(shape) == 4 and shape[0] == N:
        return np.arange(N).reshape((N, 1, 1, 1))
    return None


def _tokens_of(case: Case, R: int, NC: int):
    """``(owner [R, NC, C], N)``: each token's sequence (``_owners``), and how many there are."""
    N = len(case.cu) - 1 if case.packed else case.B
    C = case.chunk
    return np.broadcast_to(_owners((R, 1, NC, C), case, R, NC, N), (R, 1, NC, C))[:, 0], N


def _kept(y, y0):
    """Where ``y`` is ``y0`` (NaN where it was NaN counts)."""
    return (y == y0) | (np.isnan(y) & np.isnan(y0))


def _dw_overflow(col, pipe, kw, clean, reference, case: Case):
    """``overflow`` (B3): in a chunk whose start state its sequence reads, that state and one
    token's ``dv_new`` at ``1e4 sqrt(max)`` (finite) make row j of ``dw = -dv_new h^T``
    overflow (by 1e8, whatever the order of the products; float16 by 256); the stage's outputs in
    the rows it reaches (``Akk^T dw``: rows i <= j) are non-finite wherever the reference
    stage's are (a non-finite ``dw`` row read as zero fails), the sequence's finite entries
    close to the reference's, and every other sequence's as without it."""
    R, NC, C = kw["q"].shape[0], kw["q"].shape[2], case.chunk
    owner, N = _tokens_of(case, R, NC)
    r, c = next((r, c) for r in range(R) for c in range(1, NC) if owner[r, c, 0] == owner[r, c - 1, -1] >= 0)
    seq = owner[r, c, 0]
    rows = np.flatnonzero(owner[r, c] == seq)
    j = int(rows[len(rows) // 2])  # (the rows after it: not reached)
    root = float(jnp.finfo(kw["q"].dtype).max) ** 0.5
    big = root * min(1e4, root / 16)  # (float16: 4096)
    h, dv = np.array(kw["h"]), np.array(kw["dv_new"])
    h[r, :, c], dv[r, :, c, j] = big, big
    change = dict(h=_device(h, kw["h"].dtype), dv_new=_device(dv, kw["dv_new"].dtype))
    got, want = _jit_run(pipe, "wy_dqkg", dict(kw, **change)), _jit_run(reference[0], "wy_dqkg",
                                                                         dict(reference[1], **change))
    at = np.zeros((R, 1, NC, C), bool)
    at[r, :, c, :j + 1] = True
    others, missed, worst = [], [], 0.0
    for (path, a), (_, b), (_, a0) in zip(_leaves(got), _leaves(want), _leaves(clean)):
        shape = lambda m: np.broadcast_to(m.reshape(m.shape + (1,) * (a.ndim - 4)), a.shape)
        mine, reached = shape(owner[:, None] == seq), shape(at & (owner[:, None] == seq))
        if not np.array_equal(a[~mine], a0[~mine], equal_nan=True):
            others.append(path)
        n = int((~np.isfinite(b) & np.isfinite(a) & reached).sum())
        if n:
            missed.append(f"{_named(path)} at {n} of {int((~np.isfinite(b) & reached).sum())} places")
        both = mine & np.isfinite(a) & np.isfinite(b)
        top = np.max(np.abs(b[both]), initial=0.0) or 1.0  # (scaled: their squares overflow)
        e = _rel(np.where(both, a, 0.0) / top, np.where(both, b, 0.0) / top)
        worst = e if not e <= worst else worst
    tol = tolerance(case.dtype)
    ok = not (others or missed) and worst <= tol
    said = [f"finite where the reference stage's are not ({', '.join(missed)}: a non-finite dw row read as "
            "numbers)"] * bool(missed) + [f"other sequences' {', '.join(others)} changed"] * bool(others)
    col.add("overflow", case.name, ok, f"sequence {seq}'s dw row {j} of chunk {c} overflows from finite operands "
            f"(±{big:.0e}): " + ("; ".join(said + [f"rel-RMS {worst:.1e} from the reference stage"] * (
                not worst <= tol)) if not ok else f"non-finite where the reference stage's are in rows <= {j}, "
                                                   f"rel-RMS {worst:.1e} elsewhere"))


def _token_rows(out, case: Case, R: int, NC: int, N: int, seq: int):
    """Per token row ``[R, HV, NC, C]`` of sequence ``seq``: whether some output is non-finite
    there (the outputs indexed by token), and the rows of ``seq``; None: no such output."""
    bad = None
    for _, y in _leaves(out):
        if y.ndim >= 4 and y.shape[0] == R and y.shape[2] == NC and y.shape[3] == case.chunk:
            b = ~np.isfinite(y.reshape(y.shape[:4] + (-1,))).all(axis=-1)
            bad = b if bad is None else bad | b
    if bad is None:
        return None
    owner = _owners(bad.shape + (1,), case, R, NC, N)
    return bad, np.broadcast_to(owner == seq, bad.shape + (1,))[..., 0]


def _rows_missed(out, want, case: Case, R: int, NC: int, N: int, seq: int) -> str:
    """``nan-reach``: the token rows of sequence ``seq`` where ``want`` (the reference
    stage's outputs) has a non-finite entry and ``out`` none, said; empty: none. By row, not
    by entry: stages may carry a NaN through other columns (the reference NaNs whole rows)."""
    got, ref = _token_rows(out, case, R, NC, N, seq), _token_rows(want, case, R, NC, N, seq)
    if got is None or ref is None:
        return ""
    missed = ref[0] & ~got[0] & ref[1]
    return f"{int(missed.sum())} of {int((ref[0] & ref[1]).sum())} token rows" if missed.any() else ""


def _middles(case: Case, R: int, NC: int, shift: int = 0):
    """``[(sequence, [R, NC, C] bool: its tokens from its middle one on)]`` (``shift`` tokens
    after it), for each sequence of two tokens (``shift + 2``) or more."""
    owner, N = _tokens_of(case, R, NC)
    got = []
    for seq in range(N):
        at = np.argwhere(owner == seq)
        if len(at) >= 2 + shift:
            later = np.zeros(owner.shape, bool)
            for r, c, i in at[len(at) // 2 + shift:]:
                later[r, c, i] = True
            got.append((seq, later))
    return got


def _causal(col, pipe, field, kw, clean, reference, case: Case):
    """``causal``: each sequence's tokens from its middle one on, less one in every per-token
    argument (a log decay less one there is another decay), leave every output entry of
    that sequence that the reference stage's leaves as it was (``reference`` None, a forward
    stage of other math: every entry of a token before the change and every chunk-start
    state no later than it), to the bit (docs/DESIGN.md §2: outputs and gradients causal to the bit; a stage whose earlier
    rows read later tokens, as an anchor of the exponents chosen over the whole chunk does
    through its rounding, fails). A NaN there is not this row's change: a plain product
    against a triangular mask (``tril(Aqk) @ v_new``) carries it to earlier rows
    (``0 * NaN``), which the reference stages avoid (``lower_matmul``) and this row does
    not ask of a user's stage (benchmarks/NOTES.md; the shipped Pallas F2 and B4:
    tests/pallas/test_stages.py::test_nan_in_later_tokens_reaches_no_earlier_row)."""
    x0 = next(x for x in kw.values() if hasattr(x, "ndim") and x.ndim >= 4)
    R, NC, C = x0.shape[0], x0.shape[2], case.chunk
    N = len(case.cu) - 1 if case.packed else case.B
    # (other math, a second cut a token later: a mix inside chunks escapes a cut on a chunk boundary)
    tokens = _middles(case, R, NC) + (_middles(case, R, NC, 1) if reference is None else [])
    names = [n for n, x in kw.items() if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
             and x.ndim >= 4 and x.shape[0] == R and x.shape[2] == NC and x.shape[3] == C]
    ref0 = None if reference is None else _jit_run(reference[0], field, reference[1])
    keeps = "the reference stage's keeps" if reference is not None else "before the first changed token"
    reached = []
    for seq, later in tokens:
        moved = {n: _device(np.where(later.reshape(R, 1, NC, C, *(1,) * (kw[n].ndim - 4)), np.asarray(kw[n]) - 1,
                                     np.asarray(kw[n])), kw[n].dtype) for n in names}
        got = _jit_run(pipe, field, dict(kw, **moved))
        want = clean if reference is None else _jit_run(reference[0], field, dict(reference[1], **moved))
        for (path, a), (_, a0), (_, b), (_, b0) in zip(_leaves(got), _leaves(clean), _leaves(want),
                                                       _leaves(clean if reference is None else ref0)):
            mine = _owners(a.shape, case, R, NC, N)
            if mine is None or a.shape != b.shape:
                continue
            # (a stage of other math: the entries of the tokens and chunk-start states before the change)
            must = _kept(b, b0) if reference is not None else _before(a.shape, later, C)
            bad = np.broadcast_to(mine == seq, a.shape) & must & ~_kept(a, a0)
            if bad.any():
                reached.append(f"sequence {seq}'s later tokens changed {_named(path)} at {int(bad.sum())} "
                               f"places {keeps}")
    col.add("causal", case.name, not reached, "; ".join(reached[:3]) if reached else
            f"{', '.join(names)} less one from each sequence's middle token on: every entry {keeps} kept, to the bit")


def _before(shape, later, C: int):
    """Where an output of ``shape`` holds a token before the first of ``later [R, NC, C]`` in
    its row (``[R, HV, NC, C, ...]``) or a chunk-start state no later than it (``[R, HV, NC,
    ...]``, the cases' K and V not C); elsewhere False."""
    R, NC = later.shape[:2]
    pos = np.arange(NC * C).reshape(1, NC, C)
    first = np.where(later.any(axis=(1, 2)), np.where(later, pos, NC * C).min(axis=(1, 2)), NC * C)[:, None, None]
    if len(shape) < 3 or shape[0] != R or shape[2] != NC:
        return np.zeros(shape, bool)
    if len(shape) >= 4 and shape[3] == C:
        return np.broadcast_to((pos < first).reshape(R, 1, NC, C, *(1,) * (len(shape) - 4)), shape)
    return np.broadcast_to((pos[..., 0] <= first[..., 0]).reshape(R, 1, NC, *(1,) * (len(shape) - 3)), shape)
