"""kdax._platform: XLA:CPU's YNNPACK fusions turned off before any computation where the
installed jaxlib has the fault, the user's own choice kept, nothing done once a backend
exists. The fault itself is shown in a fresh process: a jitted autodiff gradient of the
reference forward (the derived backward's path) and then any scan gradient, which crashed
in XLA:CPU with jaxlib 0.10.2 before kdax turned the fusions off."""

import os
import subprocess
import sys
import types
from pathlib import Path

import jaxlib
import pytest

from kdax import _platform

from ._util import one_device_env

ROOT = Path(__file__).resolve().parents[1]

_SCENARIO = """
import os, sys
import kdax
import jax, jax.numpy as jnp
from kdax._validate import prepare_options
from tests._util import make_inputs
print("XLA_FLAGS=" + os.environ.get("XLA_FLAGS", ""), flush=True)
x = make_inputs(seed=4, B=1, T=128, H=2, K=16, V=16, dtype=jnp.float32)
pipe = kdax.KDAPipeline.reference().untiled()
config, args, _ = prepare_options(x["q"], x["k"], x["v"], x["g"], x["beta"], kdax.KDAOptions(chunk_size=32))
loss = lambda q: pipe.run_forward(config, q, *args[1:])[0].sum()
jax.block_until_ready(jax.jit(jax.grad(loss))(args[0]))
f = lambda x: jax.lax.scan(lambda c, y: (c * y + jnp.sin(c), c), x[0], x)[0].sum()
print("scan gradient", [float(v) for v in jax.grad(f)(jnp.arange(5.0))], flush=True)
"""


def _run(flags: str):
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _SCENARIO], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def _without_option(flags: str) -> str:
    return " ".join(f for f in flags.split() if _platform.OPTION not in f)


@pytest.mark.skipif(_platform._release(jaxlib.__version__) not in _platform.AFFECTED,
                    reason="kdax leaves XLA's options alone on this jaxlib")
def test_import_turns_the_fusions_off_and_the_process_stays_sound():
    out = _run(_without_option(os.environ.get("XLA_FLAGS", "")))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"--{_platform.OPTION}={_platform.SAFE}" in out.stdout.splitlines()[0]
    assert "scan gradient [120.0, 0.0, 0.0, 0.0, 0.0]" in out.stdout


def test_the_users_choice_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--{_platform.OPTION}=individual_dot,eltwise")
    monkeypatch.setattr(_platform, "_backends_created", lambda: False)
    assert not _platform.avoid_ynn_fusions("0.10.2")
    assert os.environ["XLA_FLAGS"] == f"--{_platform.OPTION}=individual_dot,eltwise"


def test_other_jaxlibs_and_created_backends_are_left_alone(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    monkeypatch.setattr(_platform, "_backends_created", lambda: False)
    assert not _platform.avoid_ynn_fusions("0.11.2")  # an option XLA may not know is fatal
    monkeypatch.setattr(_platform, "_backends_created", lambda: True)
    assert not _platform.avoid_ynn_fusions("0.10.2")  # XLA has read its options already
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=false"
    monkeypatch.setattr(_platform, "_backends_created", lambda: False)
    assert _platform.avoid_ynn_fusions("0.10.2")
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_use_fusion_emitters=false --{_platform.OPTION}={_platform.SAFE}"


_FAULTS = """
import resource, sys, warnings
import jax, kdax
from kdax.bench._shape import Shape, make_inputs, cotangent
applied = kdax.reuse_freed_memory() if sys.argv[1] == "reused" else None  # (before any computation)
s = Shape(B=1, T=2048, H=4, HV=4, K=128, V=128, chunk_size=64)
args, w = make_inputs(s), cotangent(s)

def faults(check):  # minor page faults a call of a training step
    step = jax.jit(jax.grad(lambda *a: (kdax.chunk_kda(*a, check_inputs=check)[0] * w).sum(), argnums=(0, 1, 2, 3, 4)))
    for _ in range(2):
        jax.block_until_ready(step(*args))
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        jax.block_until_ready(step(*args))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 3

counts = [faults(True), faults(False)]
with warnings.catch_warnings(record=True) as late:
    warnings.simplefilter("always")
    kdax.reuse_freed_memory()  # the backend exists now: too late for the dispatch, if not set before
print(applied, *counts, sum("before JAX's first computation" in str(x.message) for x in late),
      kdax.reuse_freed_memory(False), jax.config.values["jax_cpu_enable_async_dispatch"])
"""


def _faults(mode: str) -> list:
    run = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=one_device_env(PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout.split()


@pytest.mark.skipif(_platform._glibc() is None, reason="glibc's mallopt only")
def test_reuse_freed_memory_ends_the_page_faults():
    """A training step whose temporaries exceed glibc's mmap threshold (T=2048 H=4
    K=V=128: about 65 MiB a call) faults its pages in afresh on every call with malloc as
    it is; after ``kdax.reuse_freed_memory()`` it reuses the memory it freed, whichever
    thread XLA:CPU would run it on (the step without the in-program check was dispatched
    to XLA's own pool, whose arena kept mapping fresh blocks: ~40 K faults a call with
    the heap settings alone). Counted in fresh processes (the setting is the process's),
    as minor page faults a call; a call after JAX's first computation warns."""
    _, checked, unchecked, late, _, _ = _faults("as-is")
    applied, checked_after, unchecked_after, again, off, dispatch = _faults("reused")
    assert applied == off == "True"  # (glibc takes both settings)
    # ~18 K faults a call (4 KiB pages) as it is; none once freed memory is reused.
    for before, after in ((checked, checked_after), (unchecked, unchecked_after)):
        assert float(before) > 10_000, before
        assert float(after) < 0.01 * float(before), (before, after)
    # warned when late (not once in effect); enable=False restored JAX's default
    assert (late, again, dispatch) == ("1", "0", "True")



_DEVICES = """
import ctypes, os, resource, sys
import jax, jax.numpy as jnp
import kdax
from jax.sharding import NamedSharding, PartitionSpec as P
from kdax._platform import host_devices
applied = kdax.reuse_freed_memory()
if sys.argv[1] == "arenas":  # an arena per thread again (glibc's own limit), as before
    ctypes.CDLL("libc.so.6").mallopt(-8, 8 * os.cpu_count())
mesh = jax.make_mesh((2,), ("d",))
# A temporary of 80 MiB per device (exp(x) read whole by the dot): above the 64 MiB heap of
# a thread's own glibc arena, so such an arena maps it afresh on every call.
x = jax.device_put(jnp.ones((2 * 4096, 5120), jnp.float32) * -1e-3, NamedSharding(mesh, P("d")))
w = jax.device_put(jnp.ones((5120, 8), jnp.float32), NamedSharding(mesh, P()))
f = jax.jit(lambda x, w: jnp.exp(x) @ w)
faults = []  # each call's minor page faults
for _ in range(20):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x, w))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
# The median of the calls after the first eight: two threads on one heap grow it now and
# then (the order of their allocations varies) until it holds every arrangement, mostly
# within 8 calls (30-call runs, quiet: 1-5 of the first 8 faulted, 0-2 of the 22 after).
print(applied, host_devices(), len(jax.devices()), sorted(faults[8:])[6], kdax.reuse_freed_memory(False))
"""


@pytest.mark.slow  # (two processes; the setting's effect on a training step stays in the core)
@pytest.mark.skipif(_platform._glibc() is None, reason="glibc's mallopt only")
def test_reuse_freed_memory_with_several_host_devices():
    """With two host devices each device's program runs on an XLA thread, whose own glibc
    arena maps a temporary over its 64 MiB heap afresh on every call whatever the heap
    settings; ``reuse_freed_memory`` limits glibc to one arena then, the main heap it keeps:
    no faults in most calls once the heap has grown to hold both threads' blocks. The
    contrast (an arena per thread restored after the call) shows the program faulted."""
    env = one_device_env(PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=2".strip()
    env.pop("MALLOC_ARENA_MAX", None)  # (glibc's own: the process's arenas as the call finds them)
    out = {}
    for mode in ("as set", "arenas"):
        run = subprocess.run([sys.executable, "-c", _DEVICES, mode], env=env, capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-4000:]
        out[mode] = run.stdout.split()
    applied, devices, made, faults, off = out["as set"]
    assert (applied, devices, made, off) == ("True", "2", "2", "True")
    # 80 MiB a device: ~40 K faults a call (4 KiB pages) with an arena per thread, none with one (median call).
    assert float(out["arenas"][3]) > 10_000, out["arenas"]
    assert float(faults) < 0.01 * float(out["arenas"][3]), (faults, out["arenas"])


def test_host_devices(monkeypatch):
    """``host_devices``: JAX's ``jax_num_cpu_devices`` when set, else the last
    ``--xla_force_host_platform_device_count`` of XLA_FLAGS, else one."""
    config = {"jax_num_cpu_devices": -1}
    monkeypatch.setattr(_platform, "jax", types.SimpleNamespace(config=types.SimpleNamespace(values=config)))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    assert _platform.host_devices() == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_force_host_platform_device_count=3")
    assert _platform.host_devices() == 3
    config["jax_num_cpu_devices"] = 4
    assert _platform.host_devices() == 4


def test_ynn_fusion_types(monkeypatch):
    """The fusion types XLA:CPU reads: the last setting in XLA_FLAGS, "" for none, None unset."""
    monkeypatch.setenv("XLA_FLAGS", f"--{_platform.OPTION}=individual_dot,dot --xla_cpu_use_fusion_emitters=false "
                                    f"--{_platform.OPTION}=dot")
    assert _platform.ynn_fusion_types() == "dot"
    monkeypatch.setenv("XLA_FLAGS", f"--{_platform.OPTION}=")
    assert _platform.ynn_fusion_types() == ""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert _platform.ynn_fusion_types() is None
