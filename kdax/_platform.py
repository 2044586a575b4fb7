"""What kdax asks of the XLA it runs on, before any computation.

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

import jaxlib

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
