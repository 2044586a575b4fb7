"""kdax's benchmark harness and main job: ``python -m kdax.bench``.

Runs chunk_kda on a realistic shape, checks it against the float64 reference, and times
it against baselines run in the same process:

* ``scan``: the ``lax.scan`` recurrence (``kdax.ref.naive_recurrent_kda``), forward and
  ``jax.grad``;
* ``plain_scan``: the fastest plain ``lax.scan`` recurrence a careful user would write
  (``plain_scan_kda``: the decay folded into k and q, the state read once for both
  products, no checks), forward and ``jax.grad``: the honest baseline (the ``/plain``
  column; 2.5x faster since session 59, so earlier ``/plain`` ratios read lower);
* ``autodiff``: ``jax.grad`` through the same chunked forward by XLA autodiff (the stages'
  jnp code differentiated by JAX instead of the six-stage backward);
* ``fused_recurrent``: ``kdax.fused_recurrent_kda``.

Every path is compiled once (``jit(...).lower().compile()``: its compile time, XLA's
peak memory figure and the executable that is timed). Times are medians of ``--reps``
device-synchronised runs after a warm-up; the light paths (chunk_kda, the scan forward,
fused_recurrent) are timed in rounds, every path once per round, so that the machine's
drift reaches them alike; the heavy baselines (the plain scan's and autodiff's
gradients, GBs of memory, seconds a call) one at a time after them, at ``--heavy-reps``
runs (1 by default; the table's ``reps`` column says which). The readable oracle's
gradient (8 s a call, 6 GB at T=4096) runs only with ``--slow-baselines``. Every ratio
compares numbers from this one run. GFLOP/s use the FLOP model
(``flops_per_token_head``) and are set against a large float32 matmul timed in the same
run. Peak memory is XLA's own figure for the compiled program (``memory_analysis()``:
temporaries + outputs), deterministic.

The float64 reference (outputs and gradients, for the max-error column) runs in a thread
beside the baselines' compiles, after kdax's own compiles (whose times are reported
alone) and before anything is timed. Progress lines (what runs, seconds since the start)
go to stderr as it compiles and times. Results (JSON, CSV) and plots (PNG, with
matplotlib: ``pip install -e ".[test]"`` installs it) are written to ``--out`` (default
``bench-results/`` in the working directory). ``--sweep`` runs T over 512..16384 (H=8,
K=V=128). ``--stages`` times each stage alone; ``--profile`` sums the forward's and the
training step's operations by kind (dots, exponentials, the chunk loops' slices and
updates, copies, ...) from a ``jax.profiler`` trace. ``--host-devices N`` runs every path
(chunk_kda and the baselines alike) on N host devices, each on its own heads
(``jax.shard_map``): XLA:CPU runs a program's batched dots on one core, so on a multi-core
CPU this is how a user gives kdax the other cores (README, "Cores").
"""

from ._baselines import (
    _TrainStep as _TrainStep,  # (private: the tests and benchmarks/bench_ab.py build training steps)
    baseline_paths as baseline_paths,
    pipelines as pipelines,
    plain_scan_kda as plain_scan_kda,
)
from ._main import main as main
from ._results import write_results as write_results
from ._run import bench_shape as bench_shape
from ._shape import (
    Shape as Shape,
    cotangent as cotangent,
    flops_per_token_head as flops_per_token_head,
    make_inputs as make_inputs,
)
from ._stages import STAGES as STAGES, bench_glue as bench_glue, bench_stages as bench_stages
from ._tables import (
    STAGE_HEAD as STAGE_HEAD,
    format_stage_row as format_stage_row,
    format_stage_table as format_stage_table,
    format_table as format_table,
    with_ratios as with_ratios,
)
from ._timing import (
    Log as Log,
    chunk_dot_gflops as chunk_dot_gflops,
    machine as machine,
    matmul_gflops as matmul_gflops,
    time_fn as time_fn,
    time_rounds as time_rounds,
)
