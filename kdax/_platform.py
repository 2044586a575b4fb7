"""What kdax asks of the XLA it runs on, before any computation (``avoid_ynn_fusions``),
a process setting it offers for XLA:CPU's speed (``reuse_freed_memory``), what JAX
runs only compiled (``in_eager_shard_map``), and how close a process is to the kernel's
limit on memory mappings (``near_the_mapping_limit``).

jaxlib 0.10's XLA:CPU runs some fusions through YNNPACK (the debug option
``xla_cpu_experimental_ynn_fusion_type``), and one of them, a transpose, reads and writes
out of bounds in jitted gradients of kdax's reference stages taken by JAX's autodiff (the
derived backward of a pipeline with user stages, at 128 tokens and more): the process
crashed in a later, unrelated compile, or went on with corrupted memory. The native
backtrace ends in ``xla::cpu::YnnFusionThunk`` -> ``ynn::make_transpose_impl``
(benchmarks/NOTES.md, "Session 18: XLA:CPU's YNNPACK fusions"). The elementwise and the
reduction fusions fault, each alone; the dot fusions do not. ``SAFE`` keeps YNNPACK's dots
and leaves the rest to XLA:CPU's own emitters: ``python -m kdax.bench`` (T=4096) about 8%
slower forward and 3% slower training step than with the faulting default (with no YNN
fusion at all: 10% and 16%), float32 results equal to rounding.

``avoid_ynn_fusions`` (run once when kdax is imported) sets the option to ``SAFE`` in
``XLA_FLAGS`` when all of these hold: the installed jaxlib is one known to have the option
and the fault (``AFFECTED``; an option unknown to XLA is fatal, so newer jaxlibs are left
alone), the user's ``XLA_FLAGS`` does not set the option already (theirs is kept: set it
to opt out), and no JAX backend has been created yet (XLA reads ``XLA_FLAGS`` then, once).
"""

import os
import re
from typing import Optional

import jax
import jaxlib

from ._errors import warn_caller

OPTION = "xla_cpu_experimental_ynn_fusion_type"
SAFE = "individual_dot,dot"  # the fusion types that ran every reproducer clean
AFFECTED = ((0, 10),)  # jaxlib (major, minor) releases with the option and the fault


def _release(version: str) -> tuple:
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def _backends_created() -> bool:
    from jax._src import xla_bridge  # (private: the only way to ask without creating one)

    return bool(getattr(xla_bridge, "_backends", True))


def avoid_ynn_fusions(jaxlib_version: str = jaxlib.__version__) -> bool:
    """Turn XLA:CPU's YNNPACK fusions off where the module docstring says. Returns whether
    ``XLA_FLAGS`` was changed."""
    flags = os.environ.get("XLA_FLAGS", "")
    if OPTION in flags or _release(jaxlib_version) not in AFFECTED or _backends_created():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --{OPTION}={SAFE}".strip()
    return True


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


def _glibc():
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def reuse_freed_memory(enable: bool = True) -> bool:
    """Keep memory that the process frees for its next allocations (glibc on Linux), so
    that XLA:CPU's compiled programs stop paying for fresh pages on every call.

    XLA:CPU gathers a program's temporaries into one allocation per call. Above 32 MiB
    glibc serves such an allocation with a fresh ``mmap`` and unmaps it when freed, so
    every call faults in each 4 KiB page again (the kernel zeroes it): 70 K page faults a
    call of kdax's training step at ``python -m kdax.bench``'s shape, about a third of its
    CPU time (benchmarks/freed_memory.py). ``enable=True`` serves large allocations from the heap
    (``mallopt(M_MMAP_MAX, 0)``) and keeps freed heap memory mapped
    (``M_TRIM_THRESHOLD`` at its maximum): the process keeps its peak memory instead of
    handing it back to the system, and reuses it. Every large allocation of the process
    (numpy's too) follows the setting. ``enable=False`` restores glibc's static
    defaults (not its dynamic threshold) and hands the free heap back (``malloc_trim``).

    The heap is the calling thread's. XLA:CPU runs a program it dispatches asynchronously
    on a thread of its own pool, whose glibc arena maps any block larger than its 64 MiB
    heap afresh whatever the settings (kdax's training step with ``check_inputs=False``:
    75-79 K faults a call with them, 230 against 175-180 ms). So ``enable=True`` also runs
    XLA:CPU's programs on the calling thread (``jax_cpu_enable_async_dispatch=False``: a
    call returns when its results are ready), which JAX reads when it creates its CPU
    backend: call this before JAX's first computation (a ``RuntimeWarning`` says when it
    comes too late; the heap settings still apply). ``enable=False`` restores JAX's default.

    With several host devices (``jax_num_cpu_devices`` or XLA_FLAGS'
    ``--xla_force_host_platform_device_count`` above 1, read when called) each device's
    program runs on an XLA thread whatever the dispatch, so ``enable=True`` also limits
    glibc to one arena (``M_ARENA_MAX``): every thread allocates from the heap kept above,
    which settles after a few calls (the main job's training step with its heads over 2
    host devices: 75 K faults a call to none, 449 to 365 ms; ``benchmarks/cpu_threads.py``).
    Not with one device, where XLA's threads then wait on each other's allocations (the
    step 3-10% slower).

    A process setting, never made at import: ``python -m kdax.bench`` calls it (its
    header says so; ``--fresh-memory`` leaves it off). Returns whether it was applied
    (False where the C library is not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    values = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1} if enable else dict(_GLIBC_DEFAULTS)
    if enable and host_devices() > 1:
        values[_M_ARENA_MAX] = 1
    elif not enable:
        values[_M_ARENA_MAX] = 8 * (os.cpu_count() or 1)  # glibc's own limit on 64-bit systems
    ok = all(libc.mallopt(param, value) == 1 for param, value in values.items())
    if not enable:
        libc.malloc_trim(0)
    if enable and _backends_created() and jax.config.values["jax_cpu_enable_async_dispatch"]:
        warn_caller("reuse_freed_memory: JAX's CPU backend exists already, so the programs it dispatches "
                    "asynchronously keep mapping fresh memory on every call; call it before JAX's first computation.",
                    RuntimeWarning)
    jax.config.update("jax_cpu_enable_async_dispatch", not enable)
    return ok


def host_devices() -> int:
    """How many CPU devices JAX creates: ``jax_num_cpu_devices`` if set, else XLA_FLAGS'
    ``--xla_force_host_platform_device_count`` (the last one), else 1."""
    n = jax.config.values.get("jax_num_cpu_devices", -1)
    if n > 0:
        return n
    found = _xla_flag("xla_force_host_platform_device_count")
    return int(found) if found and found.isdigit() else 1


def ynn_fusion_types() -> Optional[str]:
    """The YNNPACK fusion types XLA:CPU reads from XLA_FLAGS (``OPTION``, the last one; ""
    for none), None where XLA_FLAGS does not set them (XLA's own default). On jaxlib 0.10
    ``import kdax`` sets ``SAFE`` unless the user's XLA_FLAGS chose (``avoid_ynn_fusions``)."""
    return _xla_flag(OPTION)


def _xla_flag(name: str) -> Optional[str]:
    """The value of the last ``--name=value`` in XLA_FLAGS (the one XLA keeps), or None."""
    found = re.findall(rf"--{name}=(\S*)", os.environ.get("XLA_FLAGS", ""))
    return found[-1] if found else None


def near_the_mapping_limit(fraction: float = 0.6) -> bool:
    """Whether this process holds more than ``fraction`` of the kernel's limit on memory
    mappings (Linux's ``vm.max_map_count``, 65530 by default; False elsewhere). XLA:CPU
    maps each compiled program's code, and JAX keeps every program it compiled until
    ``jax.clear_caches()``: a process past the limit dies in its next compile ("Unable
    to allocate section memory", or a segfault)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            held = f.read().count(b"\n")
    except (OSError, ValueError):
        return False
    return held > fraction * limit


def in_eager_shard_map(tree) -> bool:
    """Whether ``tree`` holds values of an eager (not jitted) ``jax.shard_map`` body. JAX
    0.10's eager shard_map does not run a custom VJP with symbolic zeros, as
    ``eqx.filter_custom_vjp`` makes ("custom_vjp symbolic_zeros support with shard_map is
    not implemented"): kdax compiles its custom-VJP calls there (a jit inside the body), as
    it does for any eager call, and an eager ``jax.grad`` of it (op by op, a sequence-parallel
    gradient took minutes). Under jit the values are jaxpr tracers: as is."""
    return any(_shard_map_values(jax.tree.leaves(tree)))


def spans_devices(tree) -> bool:
    """Whether the program being traced is seen to run partitioned over several devices: a
    mesh of more than one device set (``jax.set_mesh``) or an array of ``tree`` sharded so
    in its type, over axes that are not ``jax.shard_map``'s manual ones. An
    ``eqx.error_if`` there runs its callback on one device while the others wait at the
    next collective, and the process aborts (after 40 s on CPU). (A jit partitioned by its
    arguments' shardings on an Auto mesh without ``jax.set_mesh`` cannot be seen here.)"""
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in jax.tree.leaves(tree)]
    manual = jax.sharding.AxisType.Manual
    return any(m is not None and not m.empty and any(m.shape[a] > 1 and t != manual
                                                     for a, t in zip(m.axis_names, m.axis_types))
               for m in meshes)


def traced(tree) -> bool:
    """Whether ``tree`` holds a value being traced (under jit or vmap, or an eager
    ``jax.grad``'s): kdax then calls its custom VJPs as they are, else compiled. An eager
    shard_map body's values count as eager (``in_eager_shard_map``)."""
    leaves = jax.tree.leaves(tree)
    return any(isinstance(x, jax.core.Tracer) and not s for x, s in zip(leaves, _shard_map_values(leaves)))


def _shard_map_values(leaves: list) -> list:
    """Per leaf: a value of an eager shard_map body, or an eager ``jax.grad``'s tracer over one."""
    found = []
    for x in leaves:
        for _ in range(8):
            if type(x).__name__ == "ShardMapTracer":
                break
            x = getattr(x, "primal", None)
        found.append(type(x).__name__ == "ShardMapTracer")
    return found


def behind_barriers(xs: tuple, always: bool = False) -> tuple:
    """``xs`` with each concrete array (each array, ``always``) behind an
    ``optimization_barrier`` where some are traced. A concrete array there is a constant of
    the caller's program (an array its jitted function captured), and so is a cotangent
    computed from one (``do`` of ``sum(o * w)``, ``w`` captured): XLA would fold their
    checks and packing at compile time (jit(grad) at B=1 T=1024 H=8 K=V=128, every input
    captured: 5.5 s against 3.0 s with them as arguments; T=4096, ``w`` captured: 5.0 s
    against 3.1 s)."""
    if not traced(xs):
        return xs
    # (a list, not a generator: tests/test_layout_goals.py's initial_state walk counts what a frame yields)
    return tuple([x if x is None or (isinstance(x, jax.core.Tracer) and not always) else jax.lax.optimization_barrier(x)
                  for x in xs])


def triton_by_default() -> bool:
    """Whether ``default_pipeline()`` is the Pallas Triton kernels: on a GPU of CUDA compute
    capability 9.0 or more (sm_90, which their shared memory and registers are checked for).
    Their device cases pass compiled on an H200, where the training step took 0.71x the
    reference stages' time and the forward 0.45x (``benchmarks/results/gpu_h200/session66``);
    an older GPU, or one without a CUDA compute capability (ROCm), keeps the reference stages."""
    if jax.default_backend() != "gpu":
        return False
    try:
        return float(getattr(jax.devices()[0], "compute_capability", 0) or 0) >= 9.0
    except (TypeError, ValueError):
        return False
