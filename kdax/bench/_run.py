"""One shape: every pipeline's chunk_kda and the baselines compiled, checked against the
float64 recurrence and timed; rows of results."""

import threading
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._chunk_kda import chunk_kda
from ..ref import naive_recurrent_kda
from ._baselines import _TrainStep, baseline_paths, plain_scan_kda
from ._shape import Shape, cotangent, flops_per_token_head, make_inputs, over_heads, per_device
from ._timing import compiled, error_line, quiet, time_fn, time_rounds


class _Path(NamedTuple):
    """A compiled path to time: ``flops`` per token-head (None: no GFLOP/s), ``err`` the
    max error against float64 (None: not checked), ``alone``: a heavy baseline."""

    name: str
    kind: str
    run: Callable
    flops: Optional[float]
    err: Optional[float]
    alone: bool
    compile_s: float
    peak: Optional[int]


def kdax_paths(s: Shape, pipe, w, check_inputs: bool = True, devices: int = 1) -> tuple:
    """``(forward, training step)``: ``chunk_kda`` with ``pipe`` at shape ``s`` as the main
    table times it (the output alone; ``sum(o * w)`` and every input gradient), on each
    of ``devices`` host devices for its heads (``per_device``)."""
    opts = dict(chunk_size=s.chunk_size, pipeline=pipe, check_inputs=check_inputs)
    fn = per_device(lambda *a: chunk_kda(*a, **opts), devices)
    return jax.jit(lambda *a: fn(*a)[0]), _TrainStep(fn, w)


def bench_shape(s: Shape, reps: int, pipes: dict, baselines: bool, check: bool, log: Callable = quiet,
                slow_baselines: bool = False, heavy_reps: int = 1, devices: int = 1) -> list:
    """Rows of results for one shape: each pipeline's forward and forward+backward, and
    the baselines (the scan's gradient only with ``slow_baselines``; the heavy baselines
    timed ``heavy_reps`` times), the inputs' heads split over ``devices``. ``log(line)``
    hears what runs."""
    args, w = make_inputs(s), cotangent(s)
    if devices > 1:
        split = over_heads((*args, w), devices)
        args, w = split[:5], split[5]
    at = f"T={s.T}"

    def compile_path(name, kind, f, flops=None, alone=False):
        log(f"{at} compiling {name} {kind}")
        run, secs, peak = compiled(f, args)
        return _Path(name, kind, run, flops, None, alone, secs, peak)

    todo, checked, rows = _compile_pipelines(s, args, w, pipes, compile_path, log, devices)
    # The float64 reference in a thread of its own, beside the baselines' compiles (kdax's
    # compiles above ran alone: their times are reported).
    reference = _Float64Reference(s, args, w, log) if check and checked else None
    if baselines:
        todo += [compile_path(name, kind, f, alone=alone)
                 for name, kind, f, alone in baseline_paths(s, w, slow_baselines, devices)]
    if reference is not None:
        reference.check(todo, checked, args)
    times, n_reps = _time_paths(todo, args, reps, heavy_reps, log, at)
    tokens = s.B * s.T * s.HV
    for i, p in enumerate(todo):
        t = times[i]
        rows.append(dict(T=s.T, name=p.name, kind=p.kind, time_s=t, peak_bytes=p.peak, reps=n_reps[i],
                         gflops=None if p.flops is None else p.flops * tokens / t / 1e9, max_err=p.err,
                         compile_s=p.compile_s if p.kind == "fwd+bwd" else None))
    return rows


def _compile_pipelines(s: Shape, args, w, pipes: dict, compile_path: Callable, log: Callable, devices: int = 1):
    """``(paths, checked, failed rows)``: each pipeline's forward and training step compiled
    and run once; ``checked`` holds ``(index in paths, forward, training step)`` of each
    pipeline that compiled; one that fails gives a row with its error."""
    ff = flops_per_token_head(s.chunk_size, s.K, s.V)
    todo, checked, rows = [], [], []
    # The reference pipeline once more without the in-program check of g and beta
    # (check_inputs=False): the check's cost is the difference of the two rows.
    variants = [(pname, pipe, True) for pname, pipe in pipes.items()]
    variants += [(f"{pname}, check_inputs=False", pipe, False) for pname, pipe in pipes.items() if pname == "reference"]
    for pname, pipe, check_inputs in variants:
        fwd, grad = kdax_paths(s, pipe, w, check_inputs, devices)
        n = len(todo)
        try:
            todo.append(compile_path(f"chunk_kda[{pname}]", "fwd", fwd, ff["forward"]))
            todo.append(compile_path(f"chunk_kda[{pname}]", "fwd+bwd", grad, ff["forward"] + ff["backward"]))
            f, g = todo[n].run, todo[n + 1].run
            jax.block_until_ready((f(*args), g(*args)))  # run once before anything is timed
            checked.append((n, f, g))
        except Exception as e:  # a kernel the backend cannot compile: report it, go on with the rest
            del todo[n:]
            rows.append(dict(T=s.T, name=f"chunk_kda[{pname}]", kind="failed", time_s=None, peak_bytes=None,
                             gflops=None, max_err=None, error=error_line(e)))
            log(f"T={s.T} chunk_kda[{pname}] failed: {rows[-1]['error']}")
    return todo, checked, rows


class _Float64Reference:
    """The float64 recurrence's outputs and gradients, computed in a thread started at
    construction; ``check`` waits for it and sets each checked pipeline's max errors."""

    def __init__(self, s: Shape, args, w, log: Callable):
        # The plain scan (checked against kdax.ref's oracle in the tests) when it applies: its
        # gradient takes about half the oracle's time.
        ref_fn = plain_scan_kda if s.H == s.HV else naive_recurrent_kda
        self.ref, self.log, self.at = {}, log, f"T={s.T}"

        def reference():
            # jax.enable_x64 is thread-local: every timed path runs with JAX's default 32-bit types.
            try:
                with jax.enable_x64(True):
                    a64 = tuple(a.astype(jnp.float64) for a in args)
                    self.ref["o"] = np.asarray(jax.jit(lambda *a: ref_fn(*a)[0])(*a64))
                    self.ref["g"] = jax.tree.map(np.asarray, _TrainStep(ref_fn, w.astype(jnp.float64))(*a64)[1])
            except BaseException as e:  # raised again in the main thread
                self.ref["error"] = e

        log(f"{self.at} float64 reference (the recurrence, {ref_fn.__name__}: outputs and gradients), "
            "in the background")
        self.thread = threading.Thread(target=reference, daemon=True)
        self.thread.start()

    def check(self, todo: list, checked: list, args) -> None:
        """Wait for the reference; ``todo[n]``, ``todo[n + 1]`` get the forward's and the
        training step's max errors for each ``(n, forward, step)`` of ``checked``."""
        if self.thread.is_alive():
            self.log(f"{self.at} waiting for the float64 reference")
        self.thread.join()
        if "error" in self.ref:
            raise self.ref["error"]
        for n, f, g in checked:
            e_o = _max_abs(f(*args), self.ref["o"])
            e_g = max(_max_abs(a, b) for a, b in zip(g(*args)[1], self.ref["g"]))
            todo[n] = todo[n]._replace(err=e_o)
            todo[n + 1] = todo[n + 1]._replace(err=e_g)


def _max_abs(x, ref) -> float:
    """Max-abs error against a float64 numpy reference, on the host in float64."""
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


def _time_paths(todo: list, args, reps: int, heavy_reps: int, log: Callable, at: str):
    """``(seconds, reps)`` by index in ``todo``. The light paths in rounds (every path once
    per round), so that the machine's drift reaches them alike and their ratios hold; the
    heavy baselines (GBs of memory that would slow whatever runs next) one at a time after
    them."""
    together = [i for i, p in enumerate(todo) if not p.alone]
    log(f"{at} timing {len(together)} paths in {reps} rounds: " + ", ".join(f"{todo[i].name} {todo[i].kind}"
                                                                           for i in together))
    times = dict(zip(together, time_rounds([todo[i].run for i in together], args, reps)))
    n_reps = {i: reps for i in together}
    for i, p in enumerate(todo):
        if p.alone:
            log(f"{at} timing {p.name} {p.kind} ({heavy_reps} run{'s' if heavy_reps > 1 else ''} after a warm-up)")
            times[i], n_reps[i] = time_fn(p.run, args, heavy_reps), heavy_reps
    return times, n_reps
