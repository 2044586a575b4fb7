"""Each stage alone (``--stages``): per pipeline, on the arguments the reference pipeline
gives it, with the FLOPs and bytes XLA counts in its compiled program; and the glue, the
whole forward and training step less the stages they run."""

import inspect
from typing import Callable, Optional

import equinox as eqx
import jax

from .._stage_protocol.capabilities import capabilities
from .._chunk_kda import chunk_kda
from .._runner.runner import stage_inputs
from ..pipeline import KDAPipeline
from ._shape import Shape, cotangent, flops_per_token_head, make_inputs
from ._timing import error_line, time_fn

STAGES = ("gate", "intra", "wy", "state", "output", "recompute", "dav", "dhu", "wy_dqkg", "intra_bwd", "gate_bwd")

# The FLOP model's entry (``flops_per_token_head``) of each stage that is matmul work: the
# same count as the main table's. XLA's cost analysis counts a while loop's body once, not
# once per iteration, so its count for a stage in chunk-group loops or a chunk recurrence is
# a fraction of the work (F1's chunk cumsum alone: 1.07 GFLOP at the main shape; XLA: 0.06).
MODEL = dict(intra="F2_intra", wy="F3_wy", state="F4_state", output="F5_output", recompute="B0_recompute",
             dav="B1_dAv", dhu="B2_dhu", wy_dqkg="B3_wy_dqkg", intra_bwd="B4_intra")


def model_flops(s: Shape, stage: str):
    """The FLOP model's multiply-add FLOPs of ``stage`` at shape ``s``; None for F1 and B5."""
    if stage not in MODEL:
        return None
    return flops_per_token_head(s.chunk_size, s.K, s.V)[MODEL[stage]] * s.B * s.T * s.HV


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
            row = dict(T=s.T, stage=name, pipeline=pname, impl=type(stage).__name__, time_s=None, error=None,
                       model_flops=model_flops(s, name))
            # G_lo (kdax._numerics.hilo), the last of the reference's arguments: only for stages that take it
            cut = capabilities(type(getattr(ref, name))).G_lo and not capabilities(type(stage)).G_lo
            a = (taps[name][:-1] if cut else taps[name])[:_positional(stage)]  # (an optional reset it does not take)
            try:
                compiled = eqx.filter_jit(stage).lower(*a).compile()
                row.update(_cost(compiled))
                row["time_s"] = time_fn(compiled, a, reps)
            except Exception as e:
                row["error"] = error_line(e)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def _positional(stage) -> int:
    """How many positional arguments ``stage`` takes."""
    return sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(stage).parameters.values())


def _cost(compiled) -> dict:
    """``flops`` and ``bytes`` (accessed) of a compiled program, as XLA's cost analysis
    counts them (every operation, elementwise ones included); None where not reported."""
    ca = compiled.compiled.cost_analysis() if hasattr(compiled, "compiled") else compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    return dict(flops=ca.get("flops"), bytes=ca.get("bytes accessed"))


FORWARD = STAGES[:5]
BACKWARD = STAGES[5:]


def bench_glue(s: Shape, reps: int, rows: list, pipeline: str = "reference") -> list:
    """Rows for the work between the stages (``pipeline``'s rows of ``rows``): the whole
    forward (``chunk_kda``) less F1-F5 alone, and the training step (``jax.grad``) less the
    forward and B0-B5 alone; the remainder is the layout's packing and unpacking, casts,
    masks and what XLA does differently when the stages share one program."""
    args, w = make_inputs(s), cotangent(s)
    alone = {r["stage"]: r["time_s"] for r in rows if r["pipeline"] == pipeline and r["time_s"] is not None}
    pipe = KDAPipeline.reference()
    fwd = jax.jit(lambda *a: chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe)[0])
    step = jax.jit(jax.grad(lambda *a: (chunk_kda(*a, chunk_size=s.chunk_size, pipeline=pipe)[0] * w).sum(),
                            argnums=(0, 1, 2, 3, 4)))
    t_fwd, t_step = time_fn(fwd, args, reps), time_fn(step, args, reps)
    f_sum = sum(alone.get(n, 0.0) for n in FORWARD)
    b_sum = sum(alone.get(n, 0.0) for n in BACKWARD)
    return [
        dict(T=s.T, stage="glue fwd", pipeline=pipeline, impl=f"forward {1e3 * t_fwd:.1f} - F1-F5", time_s=t_fwd - f_sum,
             error=None, flops=None, bytes=None),
        dict(T=s.T, stage="glue bwd", pipeline=pipeline, impl=f"step {1e3 * t_step:.1f} - fwd - B0-B5",
             time_s=t_step - t_fwd - b_sum, error=None, flops=None, bytes=None),
    ]
