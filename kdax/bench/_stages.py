"""Each stage alone (``--stages``): per pipeline, on the arguments the reference pipeline
gives it."""

from typing import Callable, Optional

import equinox as eqx

from .._declared.capabilities import capabilities
from .._runner.runner import stage_inputs
from ..pipeline import KDAPipeline
from ._shape import Shape, make_inputs
from ._timing import error_line, time_fn

STAGES = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")


def bench_stages(s: Shape, reps: int, pipes: dict, on_row: Optional[Callable] = None) -> list:
    """Each stage alone, per pipeline, on the arguments the reference pipeline gives it in
    one forward and backward at shape ``s``: rows of (stage, pipeline, time or error).
    A stage that fails (a kernel the backend cannot compile) gives a row with its error.
    ``on_row(row)`` is called as each row is done (long compiles: results as they come)."""
    args = make_inputs(s)
    ref = KDAPipeline.reference()
    taps = stage_inputs(ref, *args, chunk_size=s.chunk_size)
    rows = []
    for name in STAGES:
        for pname, pipe in pipes.items():
            stage = getattr(pipe, name)
            row = dict(T=s.T, stage=name, pipeline=pname, impl=type(stage).__name__, time_s=None, error=None)
            # G_lo (kdax._numerics.hilo), the last of the reference's arguments: only for stages that take it
            cut = capabilities(type(getattr(ref, name))).G_lo and not capabilities(type(stage)).G_lo
            try:
                row["time_s"] = time_fn(eqx.filter_jit(stage), taps[name][:-1] if cut else taps[name], reps)
            except Exception as e:
                row["error"] = error_line(e)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows
