"""Interpret-mode Pallas pipelines inside ``jax.shard_map``: which pipelines need
``check_vma=False``, and a clear error where a caller's ``shard_map`` checks."""

from .._numerics.arrays import varying_axes
from .._runner.contracts import STAGES
from ..pallas import PallasTarget
from ..pipeline import default_pipeline


def interprets(pipeline) -> bool:
    """Whether ``pipeline`` (None: the default) runs a Pallas stage in interpret mode.
    JAX's interpreter of ``pallas_call`` (``hlo_interpreter``) evaluates the kernel on
    values typed with their varying mesh axes but constants typed without, which
    ``jax.shard_map``'s type check (``check_vma=True``) refuses while lowering: such a
    pipeline runs in a ``shard_map`` with ``check_vma=False``."""
    pipeline = default_pipeline() if pipeline is None else pipeline
    return any(isinstance(s, PallasTarget) and s.run_interpreted
               for s in (getattr(pipeline, name, None) for name in STAGES))


def check_interpret_in_shard_map(pipeline, *arrays):
    """A clear error for an interpret-mode Pallas pipeline inside a ``jax.shard_map`` that
    checks varying axes (any of ``arrays`` varies over a manual mesh axis), before JAX's
    obscure one at lowering."""
    axes = set()
    for a in arrays:
        if a is not None and hasattr(a, "dtype"):
            axes |= varying_axes(a)
    if axes and interprets(pipeline):
        raise ValueError(
            "pipeline: a Pallas pipeline in interpret mode runs inside jax.shard_map only with "
            f"check_vma=False (the inputs vary over mesh axes {sorted(axes)}): JAX's pallas_call "
            "interpreter is not typed for varying manual axes. Pass check_vma=False to jax.shard_map, "
            "or use kdax.parallel.chunk_kda / sharded inputs on an Explicit mesh, which do."
        )
