"""A cost model of kdax's Pallas Triton kernels on an H100/H200, from their sm_90 compiles,
without a GPU: every kernel of a training step (``jax.grad`` of ``chunk_kda``, bf16 inputs,
K = V = 128, chunk 64, Kimi Linear's options: ``gpu_vs_fla.py``'s configuration) lowered for
CUDA and compiled by Triton's passes and the ptxas of the triton wheel
(``triton_resources.py``), then per kernel:

- bytes: every operand of its ``pallas_call`` read (inputs) or written (outputs) once, the
  blocks its grid visits (each block's index map evaluated over the grid: a block several
  programs read counts once; the rest, ``reread``, are L2 traffic); HBM time at the H200's
  measured copy bandwidth (4.3 TB/s read + write), the datasheet's 4.8 TB/s beside it;
- instructions: the SASS (``cuobjdump -sass``) executed by one warp of one program, each
  instruction weighted by the trip counts of the loops around it (loops read from the
  TTGIR Triton hands to LLVM, matched to the SASS's backward branches; loops LLVM unrolled
  are found by the matching); ``steps``: loop iterations one program runs in sequence;
- occupancy: resident CTAs per SM from registers (65536 per SM, allocated per warp in
  units of 256), warps (64 per SM) and shared memory (228 KiB per SM, 1 KiB reserved per
  CTA); waves = ceil(programs / (132 SMs x CTAs per SM));
- issue time = instructions per warp x waves / r, r = min(R, 4 schedulers x 1.98 GHz /
  resident warps): R is the model's one fitted constant, an effective instruction rate
  per warp (latency, dependences, barriers, memory stalls in one number), fitted once by
  least squares on log(predicted / measured) over the measured kernels;
- tensor-core time: the dynamic HGMMA/HMMA products at the datasheet's dense peaks;
- a kernel's prediction: HBM + issue + tensor-core time, no overlap (at one resident CTA
  per SM, most of these kernels, a program's loads and its arithmetic run in turn; the
  results file also gives the fit with max(HBM, issue, tensor-core), the full-overlap
  bound, which fits worse); a step's: the sum.

Calibration: the per-kernel times measured on an H200, two runs. Issue36's
(``results/gpu_h200/issue36/profile.txt``: the all-Triton candidate ``CANDIDATE`` at the
goal shape, its intermediates stored float32), beside the kernels that profile timed:
lowered by a checkout of ``PROFILE_COMMIT``, compiled and analysed by this checkout's code,
their figures frozen in ``PROFILED_KERNELS`` (``--freeze-profiled`` regenerates them).
Session 29's (``RUN``, ``RUNS``: this checkout's candidate, Aqk, Akk, w, u, qg, kg, h,
v_new and dh stored bf16 under the ``"fast"`` policy and G without its low part as FLA
does, and ``BEST``, F2 and B4 at 16 warps and the state kernels at 32 value columns a
program, at the goal shape; the candidate at 1x4096x16), beside the kernels the run timed,
compiled once and frozen in ``RUN_KERNELS`` (``--freeze-run``; ``calibration_set``; the
results say whether their sums are the ones predicted before the run and whether the
checkout still compiles the same figures). The older profiles (``results/gpu_h200/profile_before.txt``,
``profile_after.txt``) measured kernels the current code no longer builds (``OLD_PROFILES``).

Out of sample (issue 53): session 29's kernels against the model as fitted before the run
(on issue36's kernels alone; ``BEFORE``: what the results file then predicted), kernel by
kernel, and the steps the run timed without a per-kernel profile (``UNPROFILED``: the
default tuning, the candidate at 4x4096x32) against the refit. What that run says about
where the model is wrong: the results file's first lines. In short: kernels that loop over
dependent steps at one resident CTA per SM (F2, F4, B2, B3, B4) ran 1.6-1.8x slower than
their instruction count priced, B5 1.75x slower than its bytes, the 16-warp F2 and B4
slower than at 8 warps (the per-warp rate credited them with twice the issue slots), and
the step's launches outside the kernels were under-counted (93 events, not 36); one rate
cannot fit issue36's float32 kernels and the run's together.

Honesty (issue 53): the fit is reported beside its leave-one-out form (each measured
kernel predicted with the rate fitted on the other distinct kernels, ``leave_one_out``;
a kernel timed twice, the same compile, left out with its twin), and beside a per-SM
issue-rate variant (``Kernel.issue_s(per_sm=True)``: twice the warps at half the
instructions a warp gain nothing there, where the per-warp model credits the 16-warp
tunings with twice the issue slots), and beside a two-rate variant (``fit_rate_bw``: the
rate and an effective HBM bandwidth fitted together; the kernels' strided block loads do
not reach the copy's bandwidth); the headline leave-one-out line and the step with glue
take the model with the smaller leave-one-out factor. The step adds the glue: the XLA ops
of the lowered CUDA program outside the kernels and the bytes they move (``count_glue``),
their launches and the run's idle time per launch (``profile_gaps``; session 29's since
the run, issue36's before), checked against the profiled steps' own. The prediction is a
range over the three issue models and the glue fused or not; the results' last line says
whether the default tuning (``KDAPipeline.pallas("triton")``) compiles without spills
under every precision, dense and packed (``default_spills``).

    python benchmarks/gpu_cost_model.py                       # candidate, goal shape
    python benchmarks/gpu_cost_model.py --pipes pallas+fast --shape 1,4096,16
    python benchmarks/gpu_cost_model.py --out benchmarks/results/gpu_cost_model.txt
    python benchmarks/gpu_cost_model.py --freeze-profiled      # the profiled kernels' figures again
    python benchmarks/gpu_cost_model.py --freeze-profiled-glue # the profiled step's glue alone, recounted
    python benchmarks/gpu_cost_model.py --no-spill-check       # without the default tuning's spill sweep

Needs ``triton`` (the ``test`` extra); exits with the reason where JAX cannot lower a
Pallas Triton kernel without a GPU (``tests/pallas/_triton.py``, ``skip_reason``)."""

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
import warnings
from pathlib import Path

# The CUDA programs lowered here are traced on a CPU host: with one CPU device kdax orders
# its isolation tests for XLA:CPU's memory (kdax._numerics.isolation._flags), which a GPU
# host does not. Two host devices (set before JAX starts; the test suite has eight) keep
# the programs as a GPU traces them.
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CANDIDATE = "pallas+warps=8+f32dot=tf32x3+fast+stages=2+block_k=64"
BEST = CANDIDATE + "+warps.intra=16+warps.intra_bwd=16+block_v=32"  # gpu_candidate_run.py's CANDIDATE_BEST
DEFAULT = "triton"  # KDAPipeline.pallas("triton"): the default tuning (gpu_vs_fla.py's path name)
GOAL = (1, 16384, 16)  # B, T, H
MEASURED = ROOT / "benchmarks/results/gpu_h200/issue36/profile.txt"  # CANDIDATE at GOAL, H200
# Session 29's run: the checkout's candidates compiled on an H200 (its README), the first
# measurement of the kernels this script predicts. RUN_COMMIT: the checkout it built (the
# parent of ef305cf, which committed the results; kdax unchanged between them).
RUN = ROOT / "benchmarks/results/gpu_h200/triton_candidates"
RUN_COMMIT = "1cae317abc051646a29d6e23493784d859b0aa2f"
SMALL_RUN = (1, 4096, 16)
# The figures of every kernel session 29 timed (RUNS, UNPROFILED), compiled and analysed
# once and frozen, so that the run's kernels stay the ones it timed as kdax moves on and the
# script compiles only the checkout's (``--freeze-run`` regenerates them).
RUN_KERNELS = RUN / "compiled_kernels.json"
# The run's per-kernel profiles, calibration kernels since (label, path, shape, profile);
# the run's labels name the kernels in the calibration set ("s29:kdax_PallasIntra_kernel").
RUNS = (("s29", CANDIDATE, GOAL, RUN / "profile_1x16384x16.txt"),
        ("s29-best", BEST, GOAL, RUN / "profile_1x16384x16.txt"),
        ("s29-4096", CANDIDATE, SMALL_RUN, RUN / "profile_1x4096x16.txt"))
# Steps the run timed with no per-kernel profile: the refit model's out-of-sample test.
UNPROFILED = ((DEFAULT, GOAL), (DEFAULT, SMALL_RUN), (CANDIDATE, (4, 4096, 32)))
# What this script predicted before the run (benchmarks/results/gpu_cost_model.txt at
# c41b6a7, the two-rate model fitted on issue36's 12 kernels, its headline then): kernels'
# sums (ms), the central time outside the kernels, BEST's step with it, the worst
# leave-one-out factor. Frozen: the out-of-sample test is of these numbers.
BEFORE = dict(commit="c41b6a7", candidate=8.82, best=7.27, outside=0.27, best_step=7.54, loo=1.62)
# The kernels the profile timed, as this script compiles them: lowered by the checkout of
# PROFILE_COMMIT (its kernels are those of aaaae2c, which ran the profile; 893f711 added
# this script), compiled and analysed by this checkout's code, frozen in PROFILED_KERNELS
# (``--freeze-profiled`` regenerates it). The calibration fits on these, whatever the
# checkout's kernels have become since.
PROFILE_COMMIT = "893f7118170d4f7832e6d776b5883a9d16657d3b"
PROFILED_KERNELS = ROOT / "benchmarks/results/gpu_h200/issue36/profiled_kernels.json"
OLD_PROFILES = (
    "results/gpu_h200/profile_before.txt and profile_after.txt: not used; their Pallas kernels "
    "(paths mixed*, pallas, reference+pallas_state+...) were rewritten after those runs (the state "
    "kernels as FLA's 64-row bf16 tiles, the gate without spills, the chunk kernels' feature "
    "blocks; 29 commits to kdax/pallas after 1d85936, which committed them), so no kernel built from "
    "this checkout is the kernel they timed")

# H100 / H200 SXM (sm_90)
SMS = 132
REGS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024  # per CTA
MAX_WARPS = 64
MAX_CTAS = 32
CLOCK_HZ = 1.98e9
SCHEDULERS = 4
HBM_MEASURED = 4.3e12  # B/s, the H200's measured read + write copy bandwidth
HBM_DATASHEET = 4.8e12
TC_PEAK = {"bf16": 989e12, "tf32": 494e12}  # dense FLOP/s, datasheet


@dataclasses.dataclass
class Kernel:
    """One ``pallas_call`` of the lowered step, compiled."""

    name: str  # as the profile names it (kdax_<stage>_kernel, a second instance __1)
    grid: tuple
    warps: int
    stages: int
    read: int  # bytes: unique blocks of the inputs
    written: int
    reread: int  # bytes the grid reads again (blocks of an input several programs read)
    registers: int = 0
    local: int = 0
    shared: int = 0
    instructions: float = 0.0  # SASS executed by one warp of one program
    steps: int = 0  # loop iterations one program runs in sequence
    loops: str = ""  # loop trip counts as matched, e.g. "4x[64]"
    tc_flops: float = 0.0  # per program
    tc_kind: str = "bf16"
    notes: str = ""

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def ctas_per_sm(self) -> int:
        per_warp = math.ceil(max(self.registers, 1) * 32 / 256) * 256
        by_regs = REGS_PER_SM // (per_warp * self.warps)
        by_shared = SHARED_PER_SM // (self.shared + SHARED_RESERVED)
        return max(0, min(by_regs, by_shared, MAX_WARPS // self.warps, MAX_CTAS))

    @property
    def waves(self) -> int:
        return math.ceil(self.programs / (SMS * max(self.ctas_per_sm, 1)))

    def hbm_s(self, bw: float = HBM_MEASURED) -> float:
        return (self.read + self.written) / bw

    def issue_s(self, rate: float, per_sm: bool = False) -> float:
        """``rate``: the fitted instructions per second of one warp, capped by the SM's
        schedulers shared among the resident warps. ``per_sm`` (the variant): ``rate`` is
        the instructions per second of one SM, whatever its warps: the busiest SM's
        programs (``ceil(programs / SMs)``) x warps x instructions a warp, so a tuning with
        twice the warps and half the instructions a warp gains nothing (the per-warp model
        credits it with twice the issue slots: the 16-warp tunings' gain)."""
        if per_sm:
            return self.instructions * self.warps * math.ceil(self.programs / SMS) / rate
        cap = SCHEDULERS * CLOCK_HZ / (self.ctas_per_sm * self.warps)
        return self.instructions * self.waves / min(rate, cap)

    def tc_s(self) -> float:
        return self.tc_flops * self.programs / TC_PEAK[self.tc_kind]

    def predict_s(self, rate: float, overlap: bool = False, per_sm: bool = False, bw: float = HBM_MEASURED) -> float:
        """HBM + issue + tensor-core time (``overlap``: the largest); ``bw``: the bytes'
        bandwidth (the measured copy's, or the two-rate model's fitted one)."""
        parts = (self.hbm_s(bw), self.issue_s(rate, per_sm), self.tc_s())
        return max(parts) if overlap else sum(parts)

    def bound(self, rate: float) -> str:
        t = {"HBM": self.hbm_s(), "issue": self.issue_s(rate), "tensor": self.tc_s()}
        return max(t, key=t.get)



class _Fixed(Kernel):
    """A kernel with its grid and occupancy figures computed once: a fit evaluates each
    kernel's prediction some 10^5 to 10^6 times, its fields unchanged."""

    programs = functools.cached_property(Kernel.programs.fget)
    ctas_per_sm = functools.cached_property(Kernel.ctas_per_sm.fget)
    waves = functools.cached_property(Kernel.waves.fget)


def _fixed(ks: list) -> list:
    return [_Fixed(**{f.name: getattr(k, f.name) for f in dataclasses.fields(Kernel)}) for k in ks]

# -- lowering ---------------------------------------------------------------------------------
def _index_rows(bm, grid) -> int:
    """How many distinct blocks the grid visits: the index map evaluated at every point."""
    import jax
    import numpy as np
    from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

    if not grid:
        return 1
    j = bm.index_map_jaxpr
    closed = j if hasattr(j, "jaxpr") else ClosedJaxpr(j, getattr(j, "consts", ()))
    ids = np.indices(grid).reshape(len(grid), -1).astype(np.int32)
    out = jax.vmap(jaxpr_as_fun(closed))(*ids)
    out = np.stack([np.broadcast_to(np.asarray(o), (ids.shape[1],)) for o in out], axis=1)
    return len(np.unique(out, axis=0))


def _operand_bytes(bm, grid) -> tuple:
    """(unique bytes, bytes the grid reads in all) of one operand."""
    item = bm.array_aval.dtype.itemsize
    array = math.prod(bm.array_aval.shape) * item
    block = math.prod(bm.transformed_block_aval.shape) * item
    if block >= array:  # the whole array: a kernel that indexes it itself (pl.ds)
        return array, array
    unique = min(_index_rows(bm, grid) * block, array)
    return unique, block * math.prod(grid)


def _calls(hlo: str) -> list:
    """``[(name, num_warps, num_stages)]`` of the Triton custom calls of a lowered module,
    in order (the backend configs XLA compiles them with)."""
    out = []
    for cfg in hlo.split("__gpu$xla.gpu.triton(")[1:]:  # (the config follows its serialised TTIR)
        get = lambda k: re.search(rf'\b{k} = "?([\w.]+)', cfg).group(1)  # noqa: E731
        out.append((get("name"), int(get("num_warps")), int(get("num_stages"))))
    return out


GLUE = {}  # (path, shape) -> Glue of the step ``lower`` lowered last


def lower(path: str, shape: tuple) -> list:
    """``[(Kernel without compile figures, TTIR)]`` of the training step along ``path``."""
    import jax
    from triton_resources import training_step

    from tests.pallas._triton import captured

    B, T, H = shape
    fn, args, _ = training_step(path, B, T, H)
    records = []
    with captured(records):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    GLUE[(path, tuple(shape))] = count_glue(text)
    calls = _calls(text)
    assert len(calls) == len(records), (len(calls), len(records))
    out, seen = [], {}
    for (jaxpr, gm, ttir), (name, warps, stages) in zip(records, calls):
        grid = tuple(int(g) for g in gm.grid)
        read = written = reread = 0
        for i, bm in enumerate(gm.block_mappings):
            unique, total = _operand_bytes(bm, grid)
            if i < gm.num_inputs:
                read, reread = read + unique, reread + total - unique
            else:
                written += unique
        n = seen[name] = seen.get(name, -1) + 1
        out.append((Kernel(name + (f"__{n}" if n else ""), grid, warps, stages, read, written, reread), ttir))
    return out


# -- glue: the XLA ops outside the kernels -----------------------------------------------
# Ops that move no data of their own: shape changes XLA makes bitcasts, constants, plumbing.
FREE_OPS = frozenset({"reshape", "constant", "get_tuple_element", "tuple", "return", "bitcast_convert",
                      "optimization_barrier"})
MIN_LAUNCH_S = 3e-6  # the smallest XLA fusions the H200 profile timed: 3-6 us each
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "ui32": 4, "i64": 8, "i1": 1, "i8": 1, "ui8": 1,
                "i16": 2}
_TENSOR = re.compile(r"tensor<([^>]*)>")
_FUNC = re.compile(r"^\s*func\.func (?:public|private) @(\w+)\((.*?)\) ->")
_OP = re.compile(r"^\s*(%[\w#]+)(?::(\d+))? = (?:\"?)(stablehlo\.\w+|call @\w+)")


def tensor_bytes(t: str) -> int:
    """Bytes of ``tensor<1x512x2x128xbf16>`` (the text inside the brackets)."""
    *dims, dt = t.split("x")
    return math.prod(int(d) for d in dims) * _DTYPE_BYTES.get(dt, 4)


@dataclasses.dataclass
class Glue:
    """The XLA ops of a lowered program outside its Triton kernels (its StableHLO, before
    XLA fuses it): ``ops`` per kind, the private functions' ops (JAX's ``where``) counted
    at each call; a ``broadcast_in_dim`` that only adds unit axes (as many elements out as
    in) is a reshape (XLA makes it a bitcast) and counts as none; ``bytes_fused``: what
    they move if XLA fuses every run of them into one kernel (the values they read from
    the caller's arrays and the kernels' outputs, each once, an array only sliced by what
    its slices take, and the values they hand to a kernel or return, each written once:
    reshapes of one value are that value, however many kernels take which of them);
    ``bytes_unfused``: each op reading its operands and writing its result;
    ``launches_fused``: the values they hand on (one fusion each, at least),
    ``launches_unfused``: the ops that touch more than one element."""

    ops: dict
    kernels: int
    bytes_fused: int
    bytes_unfused: int
    launches_fused: int
    launches_unfused: int
    # what the fused bytes are: ``(bytes, the glue op kinds that made it, its takers)`` per
    # value handed on, ``(bytes, where from)`` per array read (an argument, a kernel's output)
    handed: tuple = ()
    read_from: tuple = ()

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def seconds(self, gap_s: float, fused: bool = True, bw: float = HBM_MEASURED) -> float:
        """The time outside the kernels: the glue's bytes at HBM speed, each of its
        launches at least ``MIN_LAUNCH_S``, and ``gap_s`` between every two launches
        (kernels and glue: the profile's idle time per launch)."""
        n = self.launches_fused if fused else self.launches_unfused
        moved = (self.bytes_fused if fused else self.bytes_unfused) / bw
        return max(moved, n * MIN_LAUNCH_S) + (n + self.kernels) * gap_s


def count_glue(text: str) -> Glue:
    """``Glue`` of a lowered module's StableHLO text (``Lowered.as_text()``)."""
    funcs, order, cur = {}, [], None
    for line in text.splitlines():
        if m := _FUNC.match(line):
            cur = m.group(1)
            args = [(a, t) for a, t in re.findall(r"(%arg\d+): tensor<([^>]*)>", m.group(2))]
            funcs[cur] = dict(args=args, lines=[])
            order.append(cur)
        elif cur is not None:
            funcs[cur]["lines"].append(line)
    main = "main" if "main" in funcs else order[0]

    def parse(line):
        """(results [(name, bytes)], kind, operands, callee) of one op line, or None."""
        m = _OP.match(line)
        if not m:
            if line.strip().startswith("return "):
                return [], "return", re.findall(r"%[\w#]+", line.split(":")[0]), None
            return None
        name, n, op = m.group(1), int(m.group(2) or 1), m.group(3)
        kind = op.split(".")[-1] if op.startswith("stablehlo") else "call"
        callee = op.split("@")[1] if kind == "call" else None
        rest = line[m.end():]
        if kind == "custom_call":
            operands = re.findall(r"%[\w#]+", rest[:rest.index(")")]) if ")" in rest else []
            kind = "kernel" if "xla.gpu.triton" in line else "custom_call"
        else:
            operands = re.findall(r"%[\w#]+", rest.split(" : ")[0])
        sig = rest.rsplit(" : ", 1)[-1] if " : " in rest else ""
        types = _TENSOR.findall(sig.split("->")[-1]) if sig else []
        names = [name] if n == 1 else [f"{name}#{i}" for i in range(n)]
        sizes = [tensor_bytes(t) for t in types[-n:]] if types else [0] * n
        return list(zip(names, sizes)), kind, operands, callee

    ops, sizes, origin = {}, {}, {}  # origin: "source" (argument / kernel output), "glue", "const"
    root = {}  # a reshape's result -> the value it reshapes (the same bytes)
    for a, t in funcs[main]["args"]:
        sizes[a], origin[a] = tensor_bytes(t), "source"
    reads, writes, unfused, launches_unfused, kernels = set(), set(), 0, 0, 0
    made, made_by, takers = {}, {}, {}  # glue value -> its op kinds; source -> "argument" / "kernel N"
    sliced = {}  # source -> bytes its slices read (a source read whole is charged whole)
    for a, _ in funcs[main]["args"]:
        made_by[a] = "argument"
    for line in funcs[main]["lines"]:
        p = parse(line)
        if p is None:
            continue
        results, kind, operands, callee = p
        base = lambda v: root.get(v, v) if v in origin else v.split("#")[0]  # noqa: E731
        if kind == "kernel" or kind == "return":
            kernels += kind == "kernel"
            for v in operands:
                if origin.get(base(v)) == "glue":
                    writes.add(base(v))
                    takers.setdefault(base(v), []).append(f"kernel {kernels}" if kind == "kernel" else "returned")
            for r, b in results:
                sizes[r], origin[r], made_by[r] = b, "source", f"kernel {kernels}"
            continue
        # a broadcast that only adds unit axes: a reshape (XLA: a bitcast)
        free = kind in FREE_OPS or (kind == "broadcast_in_dim" and len(operands) == 1 and len(results) == 1
                                    and sizes.get(base(operands[0])) == results[0][1])
        if kind == "call":  # JAX's where and friends: their ops, one elementwise fusion
            for cl in funcs[callee]["lines"]:
                if (q := parse(cl)) and q[1] not in FREE_OPS:
                    ops[q[1]] = ops.get(q[1], 0) + 1
        elif not free:
            ops[kind] = ops.get(kind, 0) + 1
        srcs = [origin.get(base(v)) for v in operands]
        if free:  # a reshape of a source is a source; of glue, glue
            o = "source" if "source" in srcs else ("glue" if "glue" in srcs else "const")
            if kind in ("reshape", "broadcast_in_dim") and len(operands) == 1 and base(operands[0]) in origin:
                for r, _ in results:
                    root[r] = base(operands[0])
        else:
            o = "glue"
            own = set() if kind == "call" else {kind}
            if kind == "call":
                own |= {q[1] for cl in funcs[callee]["lines"] if (q := parse(cl)) and q[1] not in FREE_OPS}
            for v in operands:
                own |= made.get(base(v), set())
                if origin.get(base(v)) == "source" and kind == "slice":  # reads the slice alone
                    sliced[base(v)] = sliced.get(base(v), 0) + sum(b for _, b in results)
                elif origin.get(base(v)) == "source":
                    reads.add(base(v))
            for r, _ in results:
                made[r] = own
            out_bytes = sum(b for _, b in results)
            unfused += out_bytes + sum(sizes.get(base(v), 0) for v in operands)
            launches_unfused += out_bytes > 8
        for r, b in results:
            sizes[r], origin[r] = b, o
    sliced = {v: min(b, sizes[v]) for v, b in sliced.items() if v not in reads}
    fused = sum(sizes[v] for v in reads) + sum(sliced.values()) + sum(sizes[v] for v in writes)
    handed = tuple(sorted(((sizes[v], "+".join(sorted(made.get(v, ()))), ", ".join(dict.fromkeys(takers[v])))
                           for v in writes), key=lambda t: (-t[0], t[2], t[1])))
    read_from = tuple(sorted([(sizes[v], made_by.get(v, "?")) for v in reads]
                             + [(b, made_by.get(v, "?") + " (slices)") for v, b in sliced.items()],
                             key=lambda t: (-t[0], t[1])))
    return Glue(dict(sorted(ops.items(), key=lambda kv: -kv[1])), kernels, fused, unfused, len(writes),
                launches_unfused, handed, read_from)


def profile_gaps(profile: Path = MEASURED, path: str = CANDIDATE, pass_: str = "train") -> dict:
    """What the profile measured around the kernels in a section: ``wall`` (median ms a
    call), ``stream`` (ms of device events a call), ``events`` (launches a call),
    ``kernels`` (ms in kdax's kernels); ``glue`` = stream - kernels (XLA's own kernels),
    ``gap_s`` = (wall - stream) / events (idle time per launch)."""
    text = profile.read_text()
    sec = text.split(f"--- {path} {pass_}:")[1].split("\n--- ")[0]
    wall = float(re.search(r"wall median ([\d.]+) ms", sec).group(1))
    events, stream = re.search(r"(\d+) events, ([\d.]+) ms per call", sec).groups()
    kernels = sum(measured(profile, path, pass_).values())
    events, stream = int(events), float(stream)
    return dict(wall=wall, stream=stream, events=events, kernels=kernels, glue=stream - kernels,
                gap_s=(wall - stream) * 1e-3 / events)


# -- loops --------------------------------------------------------------------------------
_FOR = re.compile(r"scf\.for %(\w+) = (%[\w#]+) to (%[\w#]+) step (%[\w#]+)")
_DEF = re.compile(r"^\s*(%[\w#]+) = (arith\.\w+) (.*?)(?: : | loc|$)")


@dataclasses.dataclass
class Loop:
    iv: str
    lb: str
    ub: str
    step: str
    depth: int
    parent: int | None
    count: int = 0  # body executions per program
    constant: bool = True
    bounds: tuple | None = None  # (upper bound, step) where every run of the loop has the same


def ttgir_loops(ttgir: str) -> list:
    """The ``scf.for`` loops of a TTGIR module in text order (preorder), each with the
    number of times its body runs per program (bounds: constants, enclosing induction
    variables and integer arithmetic on them)."""
    defs, loops, stack = {}, [], []
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if stack and line.strip().startswith("}") and indent <= loops[stack[-1]][1]:
            stack.pop()  # the loop's closing brace
            continue
        if m := _FOR.search(line):
            parent = stack[-1] if stack else None
            loops.append((Loop(*m.groups(), len(stack), parent), indent))
            stack.append(len(loops) - 1)
        elif m := _DEF.match(line):
            defs[m.group(1)] = (m.group(2), m.group(3))
    loops = [lp for lp, _ in loops]

    def value(name, env):
        if name in env:
            return env[name]
        op, rest = defs.get(name, (None, ""))
        if op == "arith.constant":
            return int(re.match(r"(-?\d+)", rest.strip()).group(1)) if re.match(r"-?\d+", rest.strip()) else None
        args = [value(a, env) for a in re.findall(r"%[\w#]+", rest)[:2]]
        if None in args or len(args) < 2:
            return None
        a, b = args
        return {"arith.addi": a + b, "arith.subi": a - b, "arith.muli": a * b, "arith.maxsi": max(a, b),
                "arith.minsi": min(a, b), "arith.divsi": a // b if b else None}.get(op)

    def run(i, env):
        lp = loops[i]
        lb, ub, st = (value(x, env) for x in (lp.lb, lp.ub, lp.step))
        if None in (lb, ub, st) or st <= 0:
            lp.constant = False
            lb, ub, st = 0, 1, 1  # unknown bounds: counted once (noted)
        if any(v.startswith("%arg") for v in (lp.lb, lp.ub)):
            lp.constant = False
        lp.bounds = (ub, st) if lp.bounds in (None, (ub, st)) and lp.constant else ()
        for it in range(lb, ub, st):
            lp.count += 1
            for j, ch in enumerate(loops):
                if ch.parent == i:
                    run(j, {**env, "%" + lp.iv: it})

    for i, lp in enumerate(loops):
        if lp.parent is None:
            run(i, {})
    return loops


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")


def sass_instructions(sass: str) -> list:
    """``[(address, opcode, operands)]`` of the kernel's SASS, NOPs left out; a predicated
    instruction's operands start with its guard (``"@P0 "``)."""
    return [(int(a, 16), op, (guard or "") + rest) for a, guard, op, rest in _SASS.findall(sass) if op != "NOP"]


def unroll_factor(ins: list, rng: tuple, lp: "Loop") -> int:
    """How many of ``lp``'s iterations one pass of the SASS loop ``rng`` runs: LLVM unrolls
    some loops partly (B4's 16-step offset loop at 16 warps: 4 copies of the body, the
    counter stepped by 4), so the SASS loop's instructions run ``count / u`` times, not
    ``count``. Read from the loop's exit test: the backward branch's predicate set by a
    compare of a register with the TTGIR loop's upper bound, that register stepped by
    ``u x step`` inside the loop; 1 where the pattern is not there (bounds not constant,
    a counter LLVM rescaled)."""
    body = [(a, op, rest) for a, op, rest in ins if rng[0] <= a <= rng[1]]
    guard = re.match(r"@(P\d)", body[-1][2].strip()) if body else None
    if not guard or lp is None or not lp.constant or not lp.bounds:
        return 1
    ub, step = lp.bounds
    counter = None
    for _, op, rest in reversed(body[:-1]):
        args = [a.strip() for a in rest.split(",")]
        if op.startswith("ISETP") and args[0].split()[-1] == guard.group(1) and len(args) > 3:
            if re.fullmatch(r"0x[0-9a-f]+", args[3]) and int(args[3], 16) == ub:
                counter = args[2]
            break
    if counter is None:
        return 1
    for _, op, rest in body:
        args = [a.strip() for a in rest.split(",")]
        if op in ("VIADD", "IADD3") and args[0] == counter and counter in args[1:3]:
            imm = [a for a in args[1:] if re.fullmatch(r"0x[0-9a-f]+", a)]
            if len(imm) == 1:
                k = int(imm[0], 16)
                if k % step == 0 and k // step > 1 and lp.count % (k // step) == 0:
                    return k // step
            return 1
    return 1


def sass_loops(ins: list) -> list:
    """``[(start, end)]`` address ranges of the SASS loops (backward branches), by start."""
    out = []
    for addr, op, rest in ins:
        if op.startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", rest)):
            target = int(m.group(1), 16)
            if target < addr:
                out.append((target, addr))
    return sorted(out, key=lambda r: (r[0], -r[1]))


def _depths(ranges) -> list:
    return [sum(1 for o in ranges if o != r and o[0] <= r[0] and r[1] <= o[1]) for r in ranges]


def match_loops(loops: list, ranges: list) -> tuple:
    """``(counts, note, loops)``: each SASS loop's body executions per program, from the TTGIR loop
    it is (text order; loops LLVM unrolled fully are constant-trip leaves that left no
    branch: the fewest such removed that make the nesting agree)."""
    import itertools

    want = _depths(ranges)
    extra = len(loops) - len(ranges)
    if extra < 0:
        return [1] * len(ranges), f"{-extra} SASS loops without a TTGIR loop (counted once)", [None] * len(ranges)
    leaves = [i for i, lp in enumerate(loops) if lp.constant and not any(c.parent == i for c in loops)]
    for drop in itertools.combinations(sorted(leaves, key=lambda i: (-loops[i].depth, i)), extra):
        kept = [lp for i, lp in enumerate(loops) if i not in drop]
        depth = [sum(1 for a in _ancestors(loops, lp) if a in kept) for lp in kept]
        if depth == want:
            note = f"{extra} loop(s) unrolled by LLVM" if extra else ""
            return [lp.count for lp in kept], note, kept
    return [1] * len(ranges), "loops unmatched (SASS loops counted once)", [None] * len(ranges)


def _ancestors(loops, lp):
    while lp.parent is not None:
        lp = loops[lp.parent]
        yield lp


_HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.F32\.(\w+)")
_HMMA = {"HMMA.1688.F32.TF32": (16 * 8 * 8, "tf32"), "HMMA.16816.F32.BF16": (16 * 8 * 16, "bf16"),
         "HMMA.16816.F32": (16 * 8 * 16, "bf16"), "HMMA.1684.F32.TF32": (16 * 8 * 4, "tf32")}


def analyse(k: Kernel, keep: dict) -> None:
    """Fill ``k``'s instruction, step and tensor-core figures from its compile."""
    loops = ttgir_loops(keep["ttgir"])
    ins = sass_instructions(keep["sass"])
    ranges = sass_loops(ins)
    steps, note, kept = match_loops(loops, ranges)
    unrolled = [unroll_factor(ins, r, lp) for r, lp in zip(ranges, kept)]
    counts = [c // u for c, u in zip(steps, unrolled)]  # (passes of each SASS loop)
    if any(u > 1 for u in unrolled):
        note = "; ".join(x for x in (note, "partly unrolled by LLVM: " + " ".join(f"x{u}" for u in unrolled)) if x)
    if any(not lp.constant for lp in loops):
        note = "; ".join(x for x in (note, "bounds from outer loops") if x)
    k.notes = note
    k.steps = sum(steps)
    k.loops = " ".join(str(c) for c in steps) or "-"
    total = flops = 0.0
    kinds = set()
    for addr, op, _ in ins:
        inside = [(r[1] - r[0], c) for r, c in zip(ranges, counts) if r[0] <= addr <= r[1]]
        n = min(inside)[1] if inside else 1  # the innermost loop's count
        total += n
        if m := _HGMMA.match(op):  # one warpgroup's product: every warp of it issues it
            flops += 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * n / 4
            kinds.add("tf32" if m.group(4) == "TF32" else "bf16")
        elif op in _HMMA:
            macs, kind = _HMMA[op]
            flops += 2 * macs * n
            kinds.add(kind)
    k.instructions = total
    k.tc_flops = flops * k.warps
    k.tc_kind = "tf32" if "tf32" in kinds else "bf16"


_COMPILED = {}


def compile_kernel(k: Kernel, ttir: str) -> None:
    from tests.pallas._triton import resources

    key = (ttir, k.warps, k.stages)
    if key not in _COMPILED:
        keep = {}
        r = resources(ttir, k.warps, k.stages, keep)
        _COMPILED[key] = (r, keep)
    r, keep = _COMPILED[key]
    k.registers, k.local, k.shared = r.registers, r.local, r.shared
    analyse(k, keep)


def kernels(path: str, shape: tuple) -> list:
    out = []
    for k, ttir in lower(path, shape):
        compile_kernel(k, ttir)
        print(f"  {k.name}: {k.registers} regs, {k.instructions:.0f} instr/warp, {k.steps} steps", file=sys.stderr, flush=True)
        out.append(k)
    return out


# -- calibration -----------------------------------------------------------------------------
def measured(profile: Path = MEASURED, path: str = CANDIDATE, pass_: str = "train") -> dict:
    """``{kernel: ms}`` of the Pallas kernels in a ``gpu_profile.py`` report's section."""
    out, on = {}, False
    for line in profile.read_text().splitlines():
        if line.startswith("--- "):
            on = line.startswith(f"--- {path} {pass_}:")
        elif on and (m := re.match(r"\s+(kdax_\w+)\s+([\d.]+) ms\s+x(\d+)", line)):
            out[m.group(1)] = float(m.group(2))  # per step (all its calls)
    return out


def run_steps(results: Path = RUN / "results.txt") -> dict:
    """``{(path, (B, T, H), pass): ms}`` of a ``gpu_vs_fla.py`` results table (medians of
    synchronised calls, wall); FLA's rows under the path ``"fla"``."""
    out = {}
    for line in results.read_text().splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+(\d+) (fla|kdax\[(\S+)\])\s+(fwd|train)\s+\d+\s+([\d.]+)", line)
        if m:
            out[(m.group(5) or "fla", tuple(int(x) for x in m.group(1, 2, 3)), m.group(6))] = float(m.group(7))
    return out


def labelled(label: str, ks: list, meas: dict) -> tuple:
    """``(kernels, {name: ms})`` named ``label:kernel``: a run's kernels in one calibration
    set beside other runs' kernels of the same names."""
    return ([dataclasses.replace(k, name=f"{label}:{k.name}") for k in ks],
            {f"{label}:{n}": t for n, t in meas.items()})


def freeze_run(out: Path = RUN_KERNELS) -> dict:
    """Compile and analyse here every ``(path, shape)`` of ``RUNS`` and ``UNPROFILED`` and
    write their figures to ``out`` with this checkout's commit and whether kdax differs from
    ``RUN_COMMIT``'s (the out-of-sample sums recomputed to the numbers predicted before the
    run are the check that the kernels are the ones it timed). Returns ``run_kernels``'s dict."""
    import json
    import subprocess

    sets = {}
    for path, at in [(p, at) for _, p, at, _ in RUNS] + list(UNPROFILED):
        if (path, at) not in sets:
            print(f"{path} at {at} (frozen)", file=sys.stderr, flush=True)
            sets[(path, at)] = kernels(path, at)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = [dict(path=p, shape=list(at), kernels=[dict(dataclasses.asdict(k), grid=list(k.grid)) for k in ks])
            for (p, at), ks in sets.items()]
    out.write_text(json.dumps({"commit": head, "kdax_changed_since_run": kdax_changed_since(), "sets": rows},
                              indent=1) + "\n")
    return sets


def run_kernels(path: Path = RUN_KERNELS) -> dict:
    """``{(path, (B, T, H)): kernels}``: the frozen figures of the kernels session 29 timed
    (``freeze_run``)."""
    import json

    data = json.loads(path.read_text())
    return {(d["path"], tuple(d["shape"])): [Kernel(**dict(k, grid=tuple(k["grid"]))) for k in d["kernels"]]
            for d in data["sets"]}


def calibration_set(compiled: dict) -> tuple:
    """``(kernels, {name: ms})``: issue36's profiled kernels (frozen, float32
    intermediates) and every kernel of ``RUNS`` (``compiled``: ``{(path, shape): kernels}``,
    ``run_kernels``), each beside its measured time. A run's profile must time every
    kernel of its step and no other."""
    ks, meas = profiled_kernels(), measured()
    for label, path, shape, profile in RUNS:
        t = measured(profile, path)
        names = [k.name for k in compiled[(path, shape)]]
        assert set(t) == set(names), (label, sorted(t), names)
        more, tm = labelled(label, compiled[(path, shape)], t)
        ks, meas = ks + more, {**meas, **tm}
    return ks, meas


def kdax_changed_since(commit: str = RUN_COMMIT):
    """Whether ``kdax/`` differs from ``commit``'s (True / False), None where the commit is
    not in this clone (a shallow one) or git is missing."""
    import subprocess

    try:
        r = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", commit, "--", "kdax"], capture_output=True)
    except OSError:
        return None
    return {0: False, 1: True}.get(r.returncode)


_DUMP = """
import json, sys
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import jax
import gpu_cost_model as m
from triton_resources import training_step
from tests.pallas._triton import captured
Path(sys.argv[1]).write_text(json.dumps([dict(name=k.name, grid=list(k.grid), warps=k.warps, stages=k.stages,
    read=k.read, written=k.written, reread=k.reread, ttir=ttir) for k, ttir in m.lower(m.CANDIDATE, m.GOAL)]))
fn, args, _ = training_step(m.CANDIDATE, *m.GOAL)
with captured():
    Path(sys.argv[2]).write_text(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
"""


def freeze_profiled(commit: str = PROFILE_COMMIT, out: Path = PROFILED_KERNELS) -> list:
    """Lower the candidate's step at the goal shape in a checkout of ``commit`` (a git
    worktree, removed after; that checkout's own ``lower``), compile and analyse each
    kernel here, count the step's glue here (``count_glue``), and write their figures to
    ``out``. Returns the kernels."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tree, dump, text = Path(tmp) / "tree", Path(tmp) / "ttir.json", Path(tmp) / "step.mlir"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
        try:
            subprocess.run([sys.executable, "-c", _DUMP, str(dump), str(text)], cwd=tree, check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
        lowered = json.loads(dump.read_text())
        glue = count_glue(text.read_text())
    ks = []
    for d in lowered:
        k = Kernel(d["name"], tuple(d["grid"]), d["warps"], d["stages"], d["read"], d["written"], d["reread"])
        compile_kernel(k, d["ttir"])
        ks.append(k)
    rows = [dict(dataclasses.asdict(k), grid=list(k.grid)) for k in ks]
    out.write_text(json.dumps({"commit": commit, "path": CANDIDATE, "shape": list(GOAL), "kernels": rows,
                               "glue": dataclasses.asdict(glue)}, indent=1) + "\n")
    return ks


_DUMP_TEXT = """
import sys
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import jax
import gpu_cost_model as m
from triton_resources import training_step
from tests.pallas._triton import captured
fn, args, _ = training_step(m.CANDIDATE, *m.GOAL)
with captured():
    Path(sys.argv[1]).write_text(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
"""


def freeze_profiled_glue(commit: str = PROFILE_COMMIT, out: Path = PROFILED_KERNELS) -> "Glue":
    """``freeze_profiled``'s glue alone: the candidate's step lowered at the goal shape in a
    checkout of ``commit`` (a git worktree, removed after), its glue counted by this
    checkout's ``count_glue`` and written to ``out``'s ``"glue"`` (the kernels' figures
    kept), so that the profiled step's glue and the checkout's are counted alike."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tree, text = Path(tmp) / "tree", Path(tmp) / "step.mlir"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
        try:
            subprocess.run([sys.executable, "-c", _DUMP_TEXT, str(text)], cwd=tree, check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
        glue = count_glue(text.read_text())
    data = json.loads(out.read_text())
    data["glue"] = dataclasses.asdict(glue)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return glue


def profiled_glue(path: Path = PROFILED_KERNELS) -> "Glue":
    """The profiled step's glue (``count_glue`` of the program ``freeze_profiled`` lowered)."""
    import json

    return Glue(**json.loads(path.read_text())["glue"])


def profiled_kernels(path: Path = PROFILED_KERNELS) -> list:
    """The profiled kernels' frozen figures (``freeze_profiled``)."""
    import json

    data = json.loads(path.read_text())
    return [Kernel(**dict(d, grid=tuple(d["grid"]))) for d in data["kernels"]]


def fit_rate(ks: list, meas: dict, overlap: bool = False, per_sm: bool = False) -> float:
    """The instruction rate (per warp; ``per_sm``: per SM) minimising
    sum(log(predicted / measured)^2) over the kernels of ``ks`` that ``meas`` times."""
    pairs = [(k, meas[k.name] * 1e-3) for k in _fixed(ks) if k.name in meas]

    def loss(logr):
        return sum(math.log(k.predict_s(math.exp(logr), overlap, per_sm) / t) ** 2 for k, t in pairs)

    grid = [math.log(1e6) + i * (math.log(1e14) - math.log(1e6)) / 2400 for i in range(2401)]
    best = min(grid, key=loss)
    lo, hi = best - 0.01, best + 0.01  # golden-section refinement
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return math.exp((lo + hi) / 2)


def fit_rate_bw(ks: list, meas: dict) -> tuple:
    """The two-rate model: ``(rate, bandwidth)`` minimising sum(log(predicted /
    measured)^2) together, the bandwidth an effective one for the kernels' block loads
    (strided ``[C, D]`` blocks of many arrays, not a streaming copy: the measured copy's
    4.3 TB/s is an upper bound), searched from 1 to 6 TB/s; the rate as ``fit_rate``'s
    at each bandwidth."""
    pairs = [(k, meas[k.name] * 1e-3) for k in _fixed(ks) if k.name in meas]

    def rate_at(bw):
        def loss(logr):
            return sum(math.log(k.predict_s(math.exp(logr), bw=bw) / t) ** 2 for k, t in pairs)
        lo, hi = math.log(1e7), math.log(1e12)
        g = (math.sqrt(5) - 1) / 2
        for _ in range(80):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
        r = math.exp((lo + hi) / 2)
        return loss(math.log(r)), r

    lo, hi = math.log(1e12), math.log(6e12)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(50):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if rate_at(math.exp(a))[0] < rate_at(math.exp(b))[0] else (a, hi)
    bw = math.exp((lo + hi) / 2)
    return rate_at(bw)[1], bw


def leave_one_out_bw(ks: list, meas: dict) -> list:
    """``leave_one_out`` for the two-rate model: ``[(kernel, (rate, bandwidth) fitted
    without it, predicted s, factor)]``."""
    out = []
    for group in twins([k for k in ks if k.name in meas]):
        names = {k.name for k in group}
        rate, bw = fit_rate_bw([k for k in ks if k.name not in names], meas)
        for k in group:
            p = k.predict_s(rate, bw=bw)
            out.append((k, (rate, bw), p, factor(p, meas[k.name])))
    return out


# -- terms tried for the leave-one-out goal and not kept (issue 53) --------------------------
def occupancy_bw(k: Kernel, per_warp: float) -> float:
    """Little's law: the bytes a kernel has in flight grow with its resident warps, so its
    bandwidth is ``per_warp`` x the resident warps of its busy SMs, at most the copy's
    (one CTA of 8 warps per SM, most kernels here; 32 of 132 SMs, the state kernels)."""
    active = min(SMS, k.programs)
    warps = min(k.ctas_per_sm, math.ceil(k.programs / active)) * k.warps
    return min(HBM_MEASURED, active * warps * per_warp)


# Each: the prediction with one physical term beside the per-warp rate, the term's search
# range (``fit_with``). "occupancy": ``occupancy_bw``'s per-warp bandwidth (B/s, log-searched);
# "steps": a latency per dependent step (s), paid steps x waves times: a loop iteration in
# sequence that waits on a barrier or a memory round trip that one resident CTA cannot hide.
TERMS = {
    "occupancy": (lambda k, rate, x: k.hbm_s(occupancy_bw(k, math.exp(x))) + k.issue_s(rate) + k.tc_s(),
                  (math.log(1e8), math.log(1e12))),
    "steps": (lambda k, rate, x: k.predict_s(rate) + k.waves * k.steps * x, (0.0, 5e-6)),
}


def fit_with(ks: list, meas: dict, term: str) -> tuple:
    """``(rate, x)`` minimising sum(log(predicted / measured)^2) for ``TERMS[term]``: the
    term's ``x`` by golden section over its range, the rate as ``fit_rate``'s at each."""
    pred, (lo, hi) = TERMS[term]
    pairs = [(k, meas[k.name] * 1e-3) for k in _fixed(ks) if k.name in meas]
    g = (math.sqrt(5) - 1) / 2

    def golden(f, a, b, n):
        for _ in range(n):
            c, d = b - g * (b - a), a + g * (b - a)
            a, b = (a, d) if f(c) < f(d) else (c, b)
        return (a + b) / 2

    def at(x):
        loss = lambda lr: sum(math.log(pred(k, math.exp(lr), x) / t) ** 2 for k, t in pairs)  # noqa: E731
        lr = golden(loss, math.log(1e7), math.log(1e12), 80)
        return loss(lr), math.exp(lr)

    x = golden(lambda x: at(x)[0], lo, hi, 50)
    return at(x)[1], x


def term_calibration(ks: list, meas: dict, term: str) -> tuple:
    """``(x fitted on all, in-sample worst factor, leave-one-out worst factor)`` of the
    model with ``TERMS[term]`` (left out as ``leave_one_out``: a kernel with its twin)."""
    pred = TERMS[term][0]
    rate, x = fit_with(ks, meas, term)
    both = [k for k in ks if k.name in meas]
    fit = max(factor(pred(k, rate, x), meas[k.name]) for k in both)
    loo = 1.0
    for group in twins(both):
        names = {k.name for k in group}
        r, y = fit_with([k for k in ks if k.name not in names], meas, term)
        loo = max([loo] + [factor(pred(k, r, y), meas[k.name]) for k in group])
    return x, fit, loo


def factor(pred_s: float, meas_ms: float) -> float:
    """How far a prediction is off, either way: max(pred / meas, meas / pred) >= 1."""
    r = pred_s * 1e3 / meas_ms
    return max(r, 1 / r)


def twins(ks: list) -> list:
    """The kernels grouped by identical compiled figures (a kernel the step calls twice,
    ``kdax_PallasWY_kernel`` and ``__1``: one kernel, timed twice), in order."""
    groups = {}
    for k in ks:
        key = dataclasses.astuple(dataclasses.replace(k, name=""))
        groups.setdefault(key, []).append(k)
    return list(groups.values())


def leave_one_out(ks: list, meas: dict, per_sm: bool = False) -> list:
    """``[(kernel, rate fitted without it, predicted s, factor)]``: each measured kernel
    predicted with the rate fitted on the other distinct kernels (its twin, the same
    compiled kernel timed again, left out with it: else the fit has seen it)."""
    out = []
    for group in twins([k for k in ks if k.name in meas]):
        names = {k.name for k in group}
        rate = fit_rate([k for k in ks if k.name not in names], meas, per_sm=per_sm)
        for k in group:
            p = k.predict_s(rate, per_sm=per_sm)
            out.append((k, rate, p, factor(p, meas[k.name])))
    return out


def table(title: str, ks: list, rate: float, meas: dict | None = None) -> str:
    hdr = (f"{'kernel':<34} {'grid':>9} {'w':>2} {'s':>1} {'regs':>4} {'smem KiB':>8} {'CTA/SM':>6} {'waves':>5} "
           f"{'read MiB':>8} {'write MiB':>9} {'reread':>7} {'instr/warp':>10} {'steps':>5} "
           f"{'HBM ms':>7} {'@4.8':>6} {'issue ms':>8} {'TC ms':>6} {'pred ms':>7}")
    if meas is not None:
        hdr += f" {'meas ms':>7} {'factor':>7}"
    out = [title, hdr]
    for k in ks:
        line = (f"{k.name:<34} {'x'.join(map(str, k.grid)):>9} {k.warps:>2} {k.stages:>1} {k.registers:>4} "
                f"{k.shared / 1024:>8.1f} {k.ctas_per_sm:>6} {k.waves:>5} {k.read / 2**20:>8.1f} {k.written / 2**20:>9.1f} "
                f"{k.reread / 2**20:>7.1f} {k.instructions:>10.0f} {k.steps:>5} {k.hbm_s() * 1e3:>7.3f} "
                f"{k.hbm_s(HBM_DATASHEET) * 1e3:>6.3f} {k.issue_s(rate) * 1e3:>8.3f} {k.tc_s() * 1e3:>6.3f} "
                f"{k.predict_s(rate) * 1e3:>7.3f}")
        if meas is not None:
            t = meas.get(k.name)
            line += f" {t:>7.3f} {k.predict_s(rate) * 1e3 / t:>7.2f}" if t else f" {'-':>7} {'-':>7}"
        out.append(line + f"  {k.bound(rate)}" + (f"; {k.notes}" if k.notes else "") + (f"; loops {k.loops}" if k.loops != "-" else ""))
    tot = sum(k.predict_s(rate) for k in ks) * 1e3
    gib = sum(k.read + k.written for k in ks) / 2**30
    out.append(f"{'sum':<34} predicted {tot:.3f} ms; HBM floor {sum(k.hbm_s() for k in ks) * 1e3:.3f} ms "
               f"({gib:.2f} GiB at 4.3 TB/s; {sum(k.hbm_s(HBM_DATASHEET) for k in ks) * 1e3:.3f} ms at 4.8)"
               + (f"; measured {sum(meas.get(k.name, 0) for k in ks):.3f} ms" if meas else ""))
    return "\n".join(out)


def default_spills() -> list:
    """``["kernel under policy (inputs), layout: N B", ...]``: the default tuning's Triton
    kernels of a training step (``KDAPipeline.pallas("triton")``) compiled for sm_90 at
    every precision (``STEP_CASES``: ``"auto"`` with float32 and bf16 inputs, every policy
    by name), dense and packed, that use thread-local memory; [] when none does
    (``tests/pallas/_triton.py``'s ``step_resources``)."""
    from kdax import KDAPipeline
    from tests.pallas._triton import STEP_CASES, step_resources

    pipe = KDAPipeline.pallas("triton", interpret=False)
    out = []
    for policy, dtype in STEP_CASES:
        for packed in (False, True):
            where = f"{policy} ({dtype} inputs), {'packed' if packed else 'dense'}"
            print(f"  default tuning, {where}", file=sys.stderr, flush=True)
            for (name, _, _), r in step_resources(pipe, policy, packed, dtype=dtype).items():
                if r.local:
                    out.append(f"{name} under {where}: {r.local} B")
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipes", default=CANDIDATE, help="gpu_vs_fla.py path names, comma separated")
    ap.add_argument("--shape", default=",".join(map(str, GOAL)), help="B,T,H of the bf16 inputs (K = V = 128, chunk 64)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--freeze-profiled", action="store_true",
                    help=f"regenerate {PROFILED_KERNELS.relative_to(ROOT)} from a checkout of {PROFILE_COMMIT[:7]} first")
    ap.add_argument("--freeze-profiled-glue", action="store_true",
                    help=f"recount the profiled step's glue (lowered in a checkout of {PROFILE_COMMIT[:7]}) first")
    ap.add_argument("--freeze-run", action="store_true",
                    help=f"regenerate {RUN_KERNELS.relative_to(ROOT)} (session 29's kernels, compiled here) first")
    ap.add_argument("--no-spill-check", action="store_true",
                    help="leave out the default tuning's sm_90 compiles under every precision, dense and packed "
                         "(default_spills, ~3 minutes) and the results' last line")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", module="triton")
    from triton_resources import parse_shape

    from tests.pallas._triton import skip_reason

    if reason := skip_reason():
        sys.exit(f"gpu_cost_model: {reason}")
    import jax
    import triton

    shape = parse_shape(a.shape)
    if a.freeze_profiled:
        print(f"freezing the profiled kernels: lowered at {PROFILE_COMMIT[:7]}", file=sys.stderr, flush=True)
        freeze_profiled()
    elif a.freeze_profiled_glue:
        print(f"recounting the profiled step's glue: lowered at {PROFILE_COMMIT[:7]}", file=sys.stderr, flush=True)
        freeze_profiled_glue()
    cal_old, meas_old = profiled_kernels(), measured()
    compiled = freeze_run() if a.freeze_run else run_kernels()  # the kernels the run timed
    for key in compiled:  # their steps' glue, as this checkout lowers them (no compile)
        if key not in GLUE:
            lower(*key)
    checkout = {}
    for p in (CANDIDATE, BEST, DEFAULT):
        print(f"{p} at {GOAL}", file=sys.stderr, flush=True)
        checkout[p] = kernels(p, GOAL)
    now, best, default = (checkout[p] for p in (CANDIDATE, BEST, DEFAULT))
    spills = None if a.no_spill_check else default_spills()
    cal, meas = calibration_set(compiled)
    run_meas = {(p, at): measured(prof, p) for _, p, at, prof in RUNS}  # by the profile's names
    steps_run = run_steps()
    B, T, H = GOAL
    shape_name = lambda at: "x".join(map(str, at))  # noqa: E731

    # -- before the run: the fits on issue36's kernels alone ------------------------------------
    rate_b, rate_sm_b = fit_rate(cal_old, meas_old), fit_rate(cal_old, meas_old, per_sm=True)
    rate_2b, bw_2b = fit_rate_bw(cal_old, meas_old)
    before = lambda ks: sum(k.predict_s(rate_2b, bw=bw_2b) for k in ks) * 1e3  # noqa: E731 (its headline)
    oos = [f"{'run':<9} {'kernel':<32} {'before ms':>9} {'meas ms':>7} {'factor':>6}   {'per-warp':>8} {'factor':>6} "
           f"{'per-SM':>7} {'factor':>6}"]
    oos_worst, oos_sums = [], []
    for label, path, at, _ in RUNS:
        t = run_meas[(path, at)]
        for k in compiled[(path, at)]:
            p2, p1, ps = (k.predict_s(rate_2b, bw=bw_2b), k.predict_s(rate_b), k.predict_s(rate_sm_b, per_sm=True))
            oos.append(f"{label:<9} {k.name:<32} {p2 * 1e3:>9.3f} {t[k.name]:>7.3f} {p2 * 1e3 / t[k.name]:>6.2f}   "
                       f"{p1 * 1e3:>8.3f} {p1 * 1e3 / t[k.name]:>6.2f} {ps * 1e3:>7.3f} {ps * 1e3 / t[k.name]:>6.2f}")
            oos_worst.append((factor(p2, t[k.name]), label, k.name))
        gp_run = profile_gaps(RUNS[[r[0] for r in RUNS].index(label)][3], path)
        oos_sums.append((label, path, at, before(compiled[(path, at)]), sum(t.values()), gp_run["stream"]))
        oos.append(f"{label:<9} {'sum':<32} {oos_sums[-1][3]:>9.3f} {oos_sums[-1][4]:>7.3f} "
                   f"{oos_sums[-1][3] / oos_sums[-1][4]:>6.2f}   "
                   f"{sum(k.predict_s(rate_b) for k in compiled[(path, at)]) * 1e3:>8.3f} {'':>6} "
                   f"{sum(k.predict_s(rate_sm_b, per_sm=True) for k in compiled[(path, at)]) * 1e3:>7.3f}")
    new_kernels = [f for f, *_ in oos_worst]

    # -- the refit: every measured kernel ------------------------------------------------------
    rate = fit_rate(cal, meas)
    both = [k for k in cal if k.name in meas]

    def worst(r, overlap=False):
        return max(factor(k.predict_s(r, overlap), meas[k.name]) for k in both)

    rate_max = fit_rate(cal, meas, overlap=True)
    worst_max = worst(rate_max, True)
    parts = [
        f"Cost model of kdax's Pallas Triton kernels on an H200 (sm_90), from their compiles without a GPU "
        f"(jax {jax.__version__}, triton {triton.__version__}): bf16 inputs, K=V=128, chunk 64, Kimi Linear's options, "
        f"training step (jax.grad of chunk_kda). Per kernel: grid, warps (w), pipeline stages (s), registers, shared "
        f"memory, resident CTAs per SM, waves over {SMS} SMs; bytes read and written once (unique blocks; reread: "
        f"blocks read again by other programs, L2); SASS instructions one warp executes (loop trip counts from the "
        f"TTGIR, a loop LLVM unrolled partly counted by its passes), steps (loop iterations in sequence per program); "
        f"HBM time at {HBM_MEASURED / 1e12:.1f} TB/s "
        f"(measured copy) and at {HBM_DATASHEET / 1e12:.1f} (datasheet); issue time = instr/warp x waves / "
        f"min(R, {SCHEDULERS} x {CLOCK_HZ / 1e9:.2f} GHz / resident warps); tensor-core time at the dense datasheet "
        f"peaks; predicted = HBM + issue + TC (no overlap); the largest of the three after the kernel's row.",
        f"One fitted constant: R = {rate / 1e9:.4f} instructions per ns per warp (least squares on log(pred/meas) "
        f"over the {len(both)} measured kernels: issue36's 12 and session 29's {len(both) - len(cal_old)}; no "
        f"per-kernel tuning; {rate_b / 1e9:.4f} fitted on issue36's alone, before the run). With max(HBM, issue, TC) "
        f"instead of the sum (full overlap) the fit gives R = {rate_max / 1e9:.4f} and a worst factor of "
        f"{worst_max:.2f}.",
        "",
        table(f"Calibration: the kernels the profile timed ({CANDIDATE} at B={B} T={T} H={H}, intermediates "
              f"stored float32), lowered by the checkout of {PROFILE_COMMIT[:7]} (the kernels of aaaae2c, which "
              f"ran the profile) and compiled and analysed by this one, frozen in "
              f"{PROFILED_KERNELS.relative_to(ROOT)}; predicted beside measured on an H200 "
              f"({MEASURED.relative_to(ROOT)}, train pass; factor = predicted / measured)", cal_old, rate, meas_old),
        f"Older profiles: {OLD_PROFILES}.",
        "",
        table(f"Prediction: {CANDIDATE} at B={B} T={T} H={H} as the checkout builds it: Aqk, Akk, w, u, qg, kg, h, "
              f"v_new, dh stored bf16 and G without G_lo under \"fast\" (kdax._numerics.precision; FLA's storage), "
              f"float32 accumulation; measured: session 29 ({RUNS[0][3].relative_to(ROOT)}), in the calibration since",
              now, rate, run_meas[(CANDIDATE, GOAL)]),
        "",
        table(f"Prediction: {BEST} at B={B} T={T} H={H} (F2 and B4 at 16 warps: kdax.pallas._intra_levels, no "
              f"spills; F4 and B2 at 32 value columns a program; the other kernels as above); measured: session 29",
              best, rate, run_meas[(BEST, GOAL)]),
        "",
        table(f"Calibration (session 29): {CANDIDATE} at B={SMALL_RUN[0]} T={SMALL_RUN[1]} H={SMALL_RUN[2]}, "
              f"measured: {RUNS[2][3].relative_to(ROOT)}", compiled[(CANDIDATE, SMALL_RUN)], rate,
              run_meas[(CANDIDATE, SMALL_RUN)]),
    ]
    if not (a.pipes == CANDIDATE and shape == GOAL):
        for path in a.pipes.split(","):
            print(f"{path} at {shape}:", file=sys.stderr, flush=True)
            ks = compiled.get((path, tuple(shape))) or kernels(path, shape)
            parts += ["", table(f"Prediction: {path} at B={shape[0]} T={shape[1]} H={shape[2]}", ks, rate)]
    step = sum(k.predict_s(rate) for k in cal_old) * 1e3
    step_now = sum(k.predict_s(rate) for k in now) * 1e3
    step_best = sum(k.predict_s(rate) for k in best) * 1e3
    step_default = sum(k.predict_s(rate) for k in default) * 1e3
    gib = lambda ks: sum(k.read + k.written for k in ks) / 2**30  # noqa: E731
    parts += ["", table(f"Prediction: {DEFAULT} at B={B} T={T} H={H}: the default tuning "
                        f"(KDAPipeline.pallas(\"triton\"), kdax.pallas.TUNINGS[\"default\"]), precision auto "
                        f"(bfloat16 for these inputs); no per-kernel profile (its step: below)", default, rate)]
    # the kernels the run timed: frozen (RUN_KERNELS), checked against the sums predicted then
    ran_now, ran_best = compiled[(CANDIDATE, GOAL)], compiled[(BEST, GOAL)]
    again = (round(before(ran_now), 2), round(before(ran_best), 2)) == (BEFORE["candidate"], BEFORE["best"])
    fig = lambda ks: [(k.name, k.registers, round(k.instructions), k.read, k.written) for k in ks]  # noqa: E731
    moved = fig(now) != fig(ran_now) or fig(best) != fig(ran_best)
    same = (f"frozen in {RUN_KERNELS.relative_to(ROOT)}, "
            + ("their sums the ones predicted then" if again else "their sums NOT the ones predicted then: "
               "they may not be the kernels the run timed")
            + ("; the checkout's kernels differ from them" if moved else "; the checkout compiles the same figures"))
    parts += ["", f"Out of sample (issue 53): the model as fitted before the run (on issue36's 12 kernels: two-rate "
                  f"R = {rate_2b / 1e9:.4f}, {bw_2b / 1e12:.2f} TB/s, the headline then; per-warp R = {rate_b / 1e9:.4f}; "
                  f"per-SM {rate_sm_b / 1e9:.2f} instructions per ns) against session 29's per-kernel times on an H200 "
                  f"({RUN.relative_to(ROOT)}: the checkout's kernels, {RUN_COMMIT[:7]}; {same}). factor = predicted / "
                  f"measured. Predicted before the run (gpu_cost_model.txt at {BEFORE['commit']}): kernels "
                  f"{BEFORE['candidate']:.2f} ms {CANDIDATE}, {BEFORE['best']:.2f} ms {BEST} (recomputed here: "
                  f"{before(ran_now):.2f}, {before(ran_best):.2f}).", *oos]

    # -- leave-one-out, the per-SM and two-rate variants ---------------------------------------
    loo = leave_one_out(cal, meas)
    rate_sm = fit_rate(cal, meas, per_sm=True)
    loo_sm = leave_one_out(cal, meas, per_sm=True)
    print("two-rate model: fit and leave-one-out", file=sys.stderr, flush=True)
    rate_2, bw_2 = fit_rate_bw(cal, meas)
    loo_2 = leave_one_out_bw(cal, meas)
    distinct = len(twins(both))
    worst_loo, worst_loo_sm, worst_loo_2 = (max(f for *_, f in x) for x in (loo, loo_sm, loo_2))
    who = lambda x: max(x, key=lambda r: r[-1])[0].name  # noqa: E731 (the worst kernel out of sample)
    rows = [f"{'kernel':<41} {'meas ms':>7} {'fit ms':>7} {'factor':>6} {'LOO R':>7} {'LOO ms':>7} {'factor':>6}   "
            f"{'SM fit':>7} {'factor':>6} {'LOO ms':>7} {'factor':>6}   {'2R fit':>7} {'factor':>6} {'LOO BW':>6} "
            f"{'LOO ms':>7} {'factor':>6}"]
    for (k, r, p, f), (_, r_sm, p_sm, f_sm), (_, (_, b2), p2, f2) in zip(loo, loo_sm, loo_2):
        fit_p, fit_sm, fit_2 = k.predict_s(rate), k.predict_s(rate_sm, per_sm=True), k.predict_s(rate_2, bw=bw_2)
        rows.append(f"{k.name:<41} {meas[k.name]:>7.3f} {fit_p * 1e3:>7.3f} {factor(fit_p, meas[k.name]):>6.2f} "
                    f"{r / 1e9:>7.4f} {p * 1e3:>7.3f} {f:>6.2f}   {fit_sm * 1e3:>7.3f} "
                    f"{factor(fit_sm, meas[k.name]):>6.2f} {p_sm * 1e3:>7.3f} {f_sm:>6.2f}   {fit_2 * 1e3:>7.3f} "
                    f"{factor(fit_2, meas[k.name]):>6.2f} {b2 / 1e12:>6.2f} {p2 * 1e3:>7.3f} {f2:>6.2f}")
    worst_sm = max(factor(k.predict_s(rate_sm, per_sm=True), meas[k.name]) for k in both)
    worst_2 = max(factor(k.predict_s(rate_2, bw=bw_2), meas[k.name]) for k in both)
    parts += ["", f"Calibration, leave-one-out: each of the {len(both)} measured kernels (issue36's, unprefixed; "
                  f"session 29's, prefixed by run) predicted with the rate fitted on the other {distinct - 1} distinct "
                  f"kernels (a kernel timed more than once, the same compile: WY and State twice a step, a kernel "
                  f"{BEST} shares with {CANDIDATE}, left out with its twins); beside the in-sample fit (factor = "
                  f"max(pred/meas, meas/pred)). Per-warp model (R instructions per ns per warp, capped by the "
                  f"schedulers): in-sample worst {worst(rate):.2f}, leave-one-out worst {worst_loo:.2f} "
                  f"({who(loo)}). Per-SM variant (one rate per SM, {rate_sm / 1e9:.2f} instructions per ns: the "
                  f"busiest SM's programs x warps x instructions a warp, so twice the warps at half the instructions "
                  f"a warp gain nothing): in-sample worst {worst_sm:.2f}, leave-one-out worst {worst_loo_sm:.2f} "
                  f"({who(loo_sm)}). Two-rate variant (2R: the per-warp rate and an effective HBM bandwidth fitted "
                  f"together, R = {rate_2 / 1e9:.4f}, {bw_2 / 1e12:.2f} TB/s against the copy's 4.3): in-sample worst "
                  f"{worst_2:.2f}, leave-one-out worst {worst_loo_2:.2f} ({who(loo_2)}; LOO BW: the bandwidth "
                  f"fitted without the kernel). Before the run: leave-one-out worst {BEFORE['loo']:.2f} over 10 "
                  f"kernels (two-rate), out of sample on the run's kernels {max(new_kernels):.2f}.", *rows]
    # the run's kernels alone: the kernels this checkout builds, without issue36's float32 ones
    run_ks = [k for k in cal if ":" in k.name]
    rate_run = fit_rate(run_ks, meas)
    loo_run = leave_one_out(run_ks, meas)
    parts.append(f"Fitted on session 29's {len(run_ks)} kernels alone ({len(twins(run_ks))} distinct; the kernels "
                 f"this checkout builds, per-warp model): R = {rate_run / 1e9:.4f}, in-sample worst "
                 f"{max(factor(k.predict_s(rate_run), meas[k.name]) for k in run_ks):.2f}, leave-one-out worst "
                 f"{max(f for *_, f in loo_run):.2f} ({who(loo_run)}); {CANDIDATE}'s kernels "
                 f"{sum(k.predict_s(rate_run) for k in now) * 1e3:.2f} ms, {BEST}'s "
                 f"{sum(k.predict_s(rate_run) for k in best) * 1e3:.2f} ms (measured "
                 f"{sum(run_meas[(CANDIDATE, GOAL)].values()):.2f}, {sum(run_meas[(BEST, GOAL)].values()):.2f}); "
                 f"issue36's kernels predicted with it: worst factor "
                 f"{max(factor(k.predict_s(rate_run), meas_old[k.name]) for k in cal_old):.2f}.")
    print("terms tried: fit and leave-one-out", file=sys.stderr, flush=True)
    (b_occ, fit_occ, loo_occ), (l_st, fit_st, loo_st) = (term_calibration(cal, meas, t) for t in ("occupancy", "steps"))
    parts += [f"Terms tried for a leave-one-out factor <= 1.5 and not kept, each one physical term fitted with the "
              f"per-warp rate over the same kernels: occupancy-limited bandwidth (Little's law: bytes in flight grow "
              f"with the resident warps, so one CTA of 8 warps per SM, or 32 busy SMs, cannot reach the copy's 4.3 "
              f"TB/s; occupancy_bw): the bandwidth a resident warp pulls fitted at {math.exp(b_occ) / 1e9:.0f} GB/s, "
              f"in-sample worst {fit_occ:.2f}, leave-one-out worst {loo_occ:.2f}; a latency per dependent step "
              f"(steps x waves x L: a loop iteration in sequence waiting on a barrier or a memory round trip that one "
              f"resident CTA cannot hide): L = {l_st * 1e6:.4f} us fitted, in-sample worst {fit_st:.2f}, "
              f"leave-one-out worst {loo_st:.2f} (the per-warp rate alone: {worst(rate):.2f}, {worst_loo:.2f}). "
              f"Earlier variants, not kept either (on issue36's kernels): a per-SM rate with a fitted bandwidth "
              f"(leave-one-out worst 2.25), an overlap model of bytes and instructions (2.26)."]
    sm = lambda ks: sum(k.predict_s(rate_sm, per_sm=True) for k in ks) * 1e3  # noqa: E731
    two = lambda ks: sum(k.predict_s(rate_2, bw=bw_2) for k in ks) * 1e3  # noqa: E731
    per_warp = lambda ks: sum(k.predict_s(rate) for k in ks) * 1e3  # noqa: E731
    # The headline model: the one with the smaller worst leave-one-out factor.
    head, head_loo, head_sum = (("two-rate", worst_loo_2, two) if worst_loo_2 < worst_loo
                                else ("per-warp", worst_loo, per_warp))
    parts += [f"kernels' sums, per-warp / per-SM model: profiled {step:.2f} / {sm(cal_old):.2f} ms (measured "
              f"{sum(meas_old.values()):.2f}), {CANDIDATE} {step_now:.2f} / {sm(now):.2f} ms (measured "
              f"{sum(run_meas[(CANDIDATE, GOAL)].values()):.2f}), {BEST} {step_best:.2f} / {sm(best):.2f} ms (measured "
              f"{sum(run_meas[(BEST, GOAL)].values()):.2f}), {DEFAULT} {step_default:.2f} / {sm(default):.2f} ms; "
              f"two-rate model: profiled {two(cal_old):.2f}, {CANDIDATE} {two(now):.2f}, {BEST} {two(best):.2f}, "
              f"{DEFAULT} {two(default):.2f} ms"]

    # -- glue ---------------------------------------------------------------------------------
    gp_old = profile_gaps()
    old = profiled_glue()
    ratio_old = (gp_old["events"] - old.kernels) / old.launches_fused  # issue36's glue launches per fused value
    gp = profile_gaps(RUNS[0][3], CANDIDATE)  # session 29's candidate: the refit's idle time and launches
    g_now = GLUE[(CANDIDATE, GOAL)]
    ratio = (gp["events"] - g_now.kernels) / g_now.launches_fused
    glue_best = GLUE[(BEST, GOAL)]

    def outside(g, gap_s=gp["gap_s"], r=ratio):
        """(low, central, high) seconds outside the kernels: fused; fused bytes with the
        launches the profiled step had per fused value; unfused."""
        central = dataclasses.replace(g, launches_fused=round(g.launches_fused * r))
        return g.seconds(gap_s, True), central.seconds(gap_s, True), g.seconds(gap_s, False)

    def glue_line(label, g):
        lo, mid, hi = (x * 1e3 for x in outside(g))
        kinds = ", ".join(f"{n} {k}" for k, n in g.ops.items())
        return (f"{label}: {g.total_ops} XLA ops outside its {g.kernels} kernels ({kinds}); they move "
                f"{g.bytes_fused / 2**30:.2f} GiB fused ({g.launches_fused} values handed on), "
                f"{g.bytes_unfused / 2**30:.2f} GiB unfused ({g.launches_unfused} ops); outside the kernels "
                f"{lo:.2f} ms fused, {mid:.2f} central, {hi:.2f} unfused")

    before_glue = [x * 1e3 for x in outside(g_now, gp_old["gap_s"], ratio_old)]
    # XLA's own kernels as predicted before the run: the fused bytes or the launches' minimum
    xla_before = max(g_now.bytes_fused / HBM_MEASURED, round(g_now.launches_fused * ratio_old) * MIN_LAUNCH_S) * 1e3
    gp4 = profile_gaps(RUNS[2][3], CANDIDATE)
    glue4 = outside(GLUE[(CANDIDATE, SMALL_RUN)])[1] * 1e3
    wall = steps_run[(CANDIDATE, GOAL, "train")]
    parts += ["",
              "Glue: the XLA ops of the lowered CUDA program outside the Triton kernels (StableHLO before XLA fuses it: "
              "kdax.chunk_kda's NaN masks, casts, transposes, partial sums, the loss's own ops), counted by "
              "count_glue; their time = max(bytes at 4.3 TB/s, launches x "
              f"{MIN_LAUNCH_S * 1e6:.0f} us) + (launches + kernels) x {gp['gap_s'] * 1e6:.2f} us, session 29's idle "
              f"time per launch ((wall {gp['wall']:.2f} - device {gp['stream']:.3f} ms) / {gp['events']} launches, "
              f"{CANDIDATE} at {shape_name(GOAL)}; before the run: issue36's, {gp_old['gap_s'] * 1e6:.2f} us). Fused: "
              f"XLA fuses every run of glue into one kernel; central: fused bytes, launches x {ratio:.2f} (session "
              f"29's non-kdax events, {gp['events'] - g_now.kernels}, per fused value, {g_now.launches_fused}; "
              f"before the run issue36's {ratio_old:.2f}); unfused: every op its own kernel.",
              glue_line(f"the profiled step ({CANDIDATE} at {PROFILE_COMMIT[:7]})", old)
              + f"; measured (issue36): XLA's kernels {gp_old['glue']:.2f} ms, outside the kernels "
                f"{gp_old['wall'] - gp_old['kernels']:.2f} ms",
              glue_line(f"{CANDIDATE} (the checkout)", g_now)
              + f"; measured (session 29): XLA's kernels {gp['glue']:.2f} ms, idle between launches "
                f"{gp['wall'] - gp['stream']:.2f} ms, outside the kernels {gp['wall'] - gp['kernels']:.2f} ms (the "
                f"profile's wall; {wall - gp['kernels']:.2f} ms from results.txt's {wall:.2f})",
              glue_line(f"{BEST} (the checkout)", glue_best)]
    if (DEFAULT, GOAL) in GLUE:
        parts.append(glue_line(f"{DEFAULT} (the checkout)", GLUE[(DEFAULT, GOAL)]))
    parts += [f"Glue, predicted before the run against session 29: {CANDIDATE} outside the kernels "
              f"{before_glue[0]:.2f} ms fused, {before_glue[1]:.2f} central (issue36's idle time and launches per "
              f"value); measured {gp['wall'] - gp['kernels']:.2f} ms, {gp['events']} "
              f"launches a step against the {round(g_now.launches_fused * ratio_old) + g_now.kernels} the central "
              f"count gave: the launches, not the bytes, were under-counted (XLA's own kernels "
              f"{gp['glue']:.2f} ms against {xla_before:.2f} "
              f"predicted). Refit (session 29's idle time and launches per value, in sample at "
              f"{shape_name(GOAL)}): {CANDIDATE} at {shape_name(SMALL_RUN)} {glue4:.2f} ms predicted outside the "
              f"kernels, {gp4['wall'] - gp4['kernels']:.2f} measured (its profile: wall {gp4['wall']:.2f}, kernels "
              f"{gp4['kernels']:.2f} ms)."]
    parts.append(f"{BEST}'s glue, fused, value by value (the op kinds that made each, from the arrays it reads):")
    parts += [f"  handed on {b / 2**20:8.2f} MiB to {to}: {kinds}" for b, kinds, to in glue_best.handed]
    parts += [f"  read      {b / 2**20:8.2f} MiB from {src}" for b, src in glue_best.read_from]

    # -- steps: the refit against the run ---------------------------------------------------------
    def with_glue(path, at, model=head_sum):
        return model(compiled[(path, at)]) + outside(GLUE[(path, at)])[1] * 1e3

    step_rows = [f"{'path':<92} {'shape':>10} {'before':>7} {'refit':>7} {'meas':>7} {'factor':>6}  in the fit"]
    for path, at in ((CANDIDATE, GOAL), (BEST, GOAL), (CANDIDATE, SMALL_RUN)) + UNPROFILED:
        b = before(compiled[(path, at)]) + outside(GLUE[(path, at)], gp_old["gap_s"], ratio_old)[1] * 1e3
        p, t = with_glue(path, at), steps_run[(path, at, "train")]
        fit = "kernels" if any(r[1:3] == (path, at) for r in RUNS) else "no (out of sample)"
        step_rows.append(f"{path:<92} {shape_name(at):>10} {b:>7.2f} {p:>7.2f} {t:>7.2f} {p / t:>6.2f}  {fit}")
    parts += ["", f"Training steps, ms: predicted before the run (two-rate on issue36's kernels, issue36's glue "
                  f"figures) and by the refit ({head} model, session 29's glue figures) against the run's wall "
                  f"medians (results.txt); factor = refit / measured.", *step_rows]
    lo, mid, hi = (x * 1e3 for x in outside(g_now))
    k_lo, k_hi = min(step_now, sm(now), two(now)), max(step_now, sm(now), two(now))
    k_head = head_sum(now)
    dev = gp["stream"]
    parts += [f"bytes a step's kernels move (unique blocks read + written): {gib(cal_old):.2f} GiB with float32 "
              f"intermediates (as profiled), {gib(now):.2f} GiB with bf16 Aqk, Akk, w, u, qg, kg, h, v_new, dh "
              f"and no G_lo (the checkout); "
              f"FLA ~8 GiB (docs: shared DESIGN.md section 6)",
              f"steps predicted: {step:.2f} ms the kernels profiled (measured {sum(meas_old.values()):.2f}), "
              f"{step_now:.2f} ms {CANDIDATE} (the checkout), {step_best:.2f} ms {BEST} (16 warps)",
              f"calibration (in-sample): worst factor {worst(rate):.2f} over {len(both)} kernels",
              f"candidate step range: {k_lo + lo:.2f} to {k_hi + max(mid, hi):.2f} ms (kernels {step_now:.2f} ms "
              f"per-warp model, {sm(now):.2f} ms per-SM, {two(now):.2f} ms two-rate; outside the kernels {lo:.2f} "
              f"fused to {max(mid, hi):.2f}); each kernel off by up to {max(worst_loo, worst_loo_sm, worst_loo_2):.2f}x "
              f"out of sample",
              f"candidate step measured: {wall:.2f} ms (device busy {dev:.2f} ms, kdax's kernels "
              f"{gp['kernels']:.2f} ms; {CANDIDATE}, session 29); predicted before the run "
              f"{BEFORE['candidate'] + BEFORE['outside']:.2f} ms (kernels {BEFORE['candidate']:.2f} ms, outside the "
              f"kernels {BEFORE['outside']:.2f} ms); the headline then, {BEST}: {BEFORE['best_step']:.2f} ms "
              f"predicted, {steps_run[(BEST, GOAL, 'train')]:.2f} ms measured",
              f"headline model: {head} (the smaller worst leave-one-out factor; in-sample worst "
              f"{worst_2 if head == 'two-rate' else worst(rate):.2f})",
              f"calibration (leave-one-out): worst factor {head_loo:.2f} over {distinct} kernels",
              f"candidate step with glue: predicted {k_head + mid:.2f} ms (kernels {k_head:.2f} ms, outside the "
              f"kernels {mid:.2f} ms); FLA measured {steps_run[('fla', GOAL, 'train')]:.2f} ms"]
    if spills is not None:
        parts.append("default triton tuning: no spills" if not spills else
                     f"default triton tuning: spills in {', '.join(spills)}")
    # -- what the run says (the results' first lines) ----------------------------------------------
    short = lambda n: n.replace("kdax_Pallas", "").replace("_kernel", "").replace("__1", "")  # noqa: E731
    ratio_s29 = {n: run_meas[(CANDIDATE, GOAL)][n] / before([k for k in now if k.name == n])
                 for n in run_meas[(CANDIDATE, GOAL)]}  # measured / predicted before, CANDIDATE at GOAL
    under = sorted({short(n) for n, r in ratio_s29.items() if r > 1.4})
    near = sorted({short(n) for n, r in ratio_s29.items() if r <= 1.4})
    mb = run_meas[(BEST, GOAL)]
    mc = run_meas[(CANDIDATE, GOAL)]
    pb = {k.name: k.predict_s(rate_2b, bw=bw_2b) * 1e3 for k in best}
    summary = [
        f"What session 29's H200 run ({RUN.relative_to(ROOT)}) says about this model (issue 53):",
        f"- Out of sample, the model fitted before the run (two-rate, on issue36's 12 kernels) put {CANDIDATE}'s "
        f"kernels at {BEFORE['candidate']:.2f} ms and the 16-warp BEST's at {BEFORE['best']:.2f} (BEST's step with "
        f"glue {BEFORE['best_step']:.2f}); measured {sum(mc.values()):.2f} and {sum(mb.values()):.2f} ms of kernels "
        f"(steps {wall:.2f} and {steps_run[(BEST, GOAL, 'train')]:.2f} ms, FLA "
        f"{steps_run[('fla', GOAL, 'train')]:.2f}): {sum(mc.values()) / BEFORE['candidate']:.2f}x and "
        f"{sum(mb.values()) / BEFORE['best']:.2f}x the prediction; per kernel off by up to {max(new_kernels):.2f}x.",
        f"- Under-predicted by {min(r for r in ratio_s29.values() if r > 1.4):.1f}-{max(ratio_s29.values()):.1f}x: "
        f"{', '.join(under)} (the long ones: issue-bound in the model at one resident CTA of 8 warps per SM; "
        f"GateBackward HBM-bound in the model). Within {max(max(r, 1 / r) for n, r in ratio_s29.items() if short(n) in near):.2f}x: "
        f"{', '.join(near)} (the short, HBM-bound ones, or at 3 CTAs per SM).",
        "- Likely why: one instruction rate over a trip-weighted SASS count prices every instruction alike; the "
        "under-predicted kernels are loops of dependent steps (tensor-core waits, barriers, shared-memory round trips) "
        "run by one CTA per SM, which cannot hide their latency, while issue36's float32 kernels (F2's 121k "
        "instructions a warp of per-token masked reductions) issued faster a warp: the count misses the "
        "latency-bound loops, and the bytes term misses GateBackward's poor bandwidth (its blocks of many small rows).",
        f"- 16 warps: the per-warp model gave BEST's F2 and B4 twice the issue slots ({pb['kdax_PallasIntra_kernel']:.2f} "
        f"and {pb['kdax_PallasIntraBackward_kernel']:.2f} ms predicted); measured they are slower than at 8 warps "
        f"({mb['kdax_PallasIntra_kernel']:.2f} against {mc['kdax_PallasIntra_kernel']:.2f}, "
        f"{mb['kdax_PallasIntraBackward_kernel']:.2f} against {mc['kdax_PallasIntraBackward_kernel']:.2f} ms): "
        f"what limits them is per CTA (its dependent steps), not per warp.",
        f"- Refit on all {len(both)} measured kernels ({distinct} distinct): R {rate_b / 1e9:.4f} -> "
        f"{rate / 1e9:.4f} instructions per ns per warp; headline ({head}) in-sample worst "
        f"{worst_2 if head == 'two-rate' else worst(rate):.2f}, leave-one-out worst {head_loo:.2f} (before the run "
        f"{BEFORE['loo']:.2f} over 10): no one rate fits issue36's kernels and the run's together.",
        f"- Glue: predicted {before_glue[1]:.2f} ms outside the kernels ({before_glue[0]:.2f} fused); measured "
        f"{gp['wall'] - gp['kernels']:.2f} (XLA's kernels {gp['glue']:.2f}, idle between {gp['events']} launches "
        f"{gp['wall'] - gp['stream']:.2f}): the launches were under-counted, not the bytes.",
    ]
    text = "\n".join(summary + [""] + parts)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return text

if __name__ == "__main__":
    main()
