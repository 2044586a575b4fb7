"""Where a kdax pipeline's GPU time goes: JAX's profiler over a few forward and training
steps at gpu_vs_fla's configuration (bf16 inputs, K = V = 128, chunk 64, Kimi options),
summarised per stage (the ``kdax_<stage>`` named scope each stage is traced under) and per
kernel, with the device's busy time set against the wall time (the gap is launch and loop
overhead: XLA's while loops, one per chunk recurrence).

    python benchmarks/gpu_profile.py --shape 1x16384x16 --pipes mixed,reference+group=none

(``--pipes``: gpu_vs_fla's pipeline names, with its ``+option`` variants.)
"""

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_vs_fla import GRAD_NAMES, kdax_fns, kdax_pipeline, make_inputs, median_time, parse_shape  # noqa: E402

from kdax._runner.contracts import STAGES  # noqa: E402
import kdax.pallas  # noqa: E402

# A stage's named scope (``kdax_<field>``, kdax._runner.runner), the longest field first so
# that ``kdax_intra_bwd`` is not read as ``intra``; a name that only starts like one
# (``kdax_intra_chunk_kernel``, a kernel function) is none.
_SCOPE = re.compile(r"kdax_(" + "|".join(sorted(STAGES, key=len, reverse=True)) + r")(?![A-Za-z_])")
# A Pallas kernel's name: ``kdax_<stage class>_...`` (kdax.pallas._common.kernel_name)
_KERNEL = re.compile(r"kdax_([A-Z][A-Za-z0-9]*)_")

_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name="([^"]*)"', re.M)


def kernel_stage(name: str):
    """The stage field whose family the Pallas stage class in a kernel's name implements
    (``kdax_PallasIntraBackward_kernel`` -> ``intra_bwd``), or None. (B0's F4 runs the
    ``state`` family's kernel again: its events count as ``state``.)"""
    m = _KERNEL.match(name)
    cls = getattr(kdax.pallas, m.group(1), None) if m else None
    if not isinstance(cls, type):
        return None
    return next((field for field, info in STAGES.items() if issubclass(cls, info.family)), None)


def _event_name(name: str) -> str:
    """An HLO instruction's name as its GPU kernel is named (``loop_slice_fusion.2`` runs as
    ``loop_slice_fusion_2``)."""
    return re.sub(r"[.\-]", "_", name)


def hlo_scopes(compiled_text: str) -> dict:
    """HLO instruction name -> kdax stage, from the compiled module's op_name metadata
    (a kernel event is named after its instruction, a fusion after its root's), under
    both the HLO's spelling and the kernel's (``_event_name``)."""
    out = {}
    for name, op in _INSTR.findall(compiled_text):
        m = _SCOPE.search(op)
        out[name] = out[_event_name(name)] = m.group(1) if m else "(outside stages)"
    return out


def _scope_of(event, scopes: dict) -> str:
    """The stage of a trace event: a stage scope in its name or stats, its Pallas kernel's
    stage class, or its HLO instruction's scope (``hlo_scopes``)."""
    values = [event.name] + [v for _, v in event.stats if isinstance(v, str)]
    for v in values:
        m = _SCOPE.search(v)
        if m:
            return m.group(1)
    stage = kernel_stage(event.name)
    if stage is not None:
        return stage
    return next((scopes[v] for v in values if v in scopes), "(unmapped)")


def summarise(trace_dir: str, calls: int, scopes: dict) -> str:
    from jax.profiler import ProfileData

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return "no trace written"
    pd = ProfileData.from_file(paths[-1])
    lines = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            events = list(line.events)
            if not events:
                continue
            by_name = collections.Counter()
            count = collections.Counter()
            by_scope = collections.Counter()
            for ev in events:
                by_name[ev.name] += ev.duration_ns
                count[ev.name] += 1
                by_scope[_scope_of(ev, scopes)] += ev.duration_ns
            total = sum(by_name.values())
            lines.append(f"-- {plane.name} / {line.name}: {len(events)} events, {total / 1e6 / calls:.3f} ms per call")
            if line.name.lower() in ("xla modules", "steps"):
                continue
            for s, ns in by_scope.most_common():
                lines.append(f"   stage {s:<18} {ns / 1e6 / calls:9.3f} ms  {100 * ns / max(total, 1):5.1f}%")
            for n, ns in by_name.most_common(14):
                lines.append(f"   {n[:70]:<70} {ns / 1e6 / calls:9.3f} ms  x{count[n] // calls}")
    return "\n".join(lines)


def profile(name: str, x: dict, chunk: int, reps: int) -> str:
    fwd, step = kdax_fns(kdax_pipeline(name), chunk)
    args = tuple(jnp.asarray(x[n], jnp.bfloat16 if n not in ("A_log", "dt_bias") else jnp.float32) for n in GRAD_NAMES)
    w = jnp.asarray(x["w"])
    out = [f"== {name}"]
    for label, f, a in (("fwd", fwd, args), ("train", step, args + (w,))):
        t = median_time(lambda: f(*a), jax.block_until_ready, reps)
        d = tempfile.mkdtemp(prefix=f"trace_{name}_{label}_")
        calls = 3
        jax.profiler.start_trace(d)
        for _ in range(calls):
            jax.block_until_ready(f(*a))
        jax.profiler.stop_trace()
        out.append(f"--- {name} {label}: wall median {1e3 * t:.2f} ms (of {reps})")
        try:
            scopes = hlo_scopes(f.lower(*a).compile().as_text())
        except Exception as e:
            print("no HLO scopes:", e)
            scopes = {}
        out.append(summarise(d, calls, scopes))
        print("\n".join(out[-2:]), flush=True)
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1x16384x16")
    ap.add_argument("--pipes", default="mixed")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the summaries to this file (appended per path)")
    a = ap.parse_args(argv)
    B, T, H = parse_shape(a.shape)
    x = make_inputs(B, T, H, 128, 128)
    print(jax.devices(), flush=True)
    for name in a.pipes.split(","):
        try:
            text = profile(name, x, a.chunk, a.reps)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(f"{text}\n")
        except Exception as e:  # one pipeline failing leaves the others their run
            print(f"== {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
