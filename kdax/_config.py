"""The options of ``chunk_kda`` / ``fused_recurrent_kda`` (``KDAOptions``) and the static
configuration the stages receive (``KDAConfig``). A new option: a field in
``KDAOptions`` (and, for the stages, one of the same name in ``KDAConfig``, which
``KDAOptions.config`` copies) and its keyword in ``chunk_kda`` (a test checks that they agree)."""

import dataclasses
from typing import Any

import equinox as eqx

from ._errors import warn_caller


class KDAConfig(eqx.Module):
    """The static options of one call, as every stage receives them (``scale`` resolved)."""

    scale: float = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True, default=64)
    use_qk_l2norm_in_kernel: bool = eqx.field(static=True, default=False)
    use_gate_in_kernel: bool = eqx.field(static=True, default=False)
    lower_bound: Any = None  # (as scale: a float once validated)
    use_beta_sigmoid_in_kernel: bool = eqx.field(static=True, default=False)
    allow_neg_eigval: bool = eqx.field(static=True, default=False)
    safe_gate: bool = eqx.field(static=True, default=False)
    output_final_state: bool = eqx.field(static=True, default=False)
    disable_recompute: bool = eqx.field(static=True, default=False)


# KDAConfig's fields that KDAOptions.config copies as they are.
_COPIED = tuple(f.name for f in dataclasses.fields(KDAConfig) if f.name not in ("scale", "lower_bound"))


class KDAOptions(eqx.Module):
    """Every option of ``chunk_kda`` with FLA's names and defaults (``fused_recurrent_kda``:
    all but ``safe_gate``, ``chunk_size``, ``disable_recompute``). Arrays and ``scale`` are
    pytree leaves, the rest static. ``from_kwargs`` also takes FLA's deprecated
    ``transpose_state_layout``; ``kdax._validate.validate`` normalises the options."""

    # A number (Python, numpy, or a concrete 0-d JAX array: hence not a static field).
    scale: Any = None
    initial_state: Any = None
    output_final_state: bool = eqx.field(static=True, default=False)
    use_qk_l2norm_in_kernel: bool = eqx.field(static=True, default=False)
    use_gate_in_kernel: bool = eqx.field(static=True, default=False)
    A_log: Any = None
    dt_bias: Any = None
    lower_bound: Any = None  # (as scale: a float once validated)
    use_beta_sigmoid_in_kernel: bool = eqx.field(static=True, default=False)
    allow_neg_eigval: bool = eqx.field(static=True, default=False)
    safe_gate: bool = eqx.field(static=True, default=False)
    cu_seqlens: Any = None
    chunk_size: int = eqx.field(static=True, default=64)
    disable_recompute: bool = eqx.field(static=True, default=False)
    state_v_first: bool = eqx.field(static=True, default=False)
    # kdax's own (not FLA's): check g and beta's domain inside the compiled program too
    # (``kdax._validate.checked_domain``); eager calls are always checked.
    check_inputs: bool = eqx.field(static=True, default=True)

    @classmethod
    def names(cls) -> tuple:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "KDAOptions":
        """Options from keywords (``transpose_state_layout``: the deprecated alias of
        ``state_v_first``); an unknown keyword raises ``TypeError`` naming it."""
        kwargs = resolve_deprecated(kwargs)
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise TypeError(f"{', '.join(unknown)}: not a kdax option; the options are {', '.join(cls.names())}.")
        return cls(**kwargs)

    def config(self, scale: float) -> KDAConfig:
        """The stages' static configuration (``scale`` resolved)."""
        # Without the in-kernel gate, lower_bound is only safe_gate's promise about g.
        lb = None if self.lower_bound is None or not self.use_gate_in_kernel else float(self.lower_bound)
        return KDAConfig(scale=scale, lower_bound=lb, **{n: getattr(self, n) for n in _COPIED})


def state_v_first_of(state_v_first: bool, transpose_state_layout) -> bool:
    """``state_v_first``, or its deprecated alias ``transpose_state_layout`` when given."""
    given = dict(state_v_first=state_v_first, transpose_state_layout=transpose_state_layout)
    return state_v_first if transpose_state_layout is None else resolve_deprecated(given)["state_v_first"]


def resolve_deprecated(kwargs: dict) -> dict:
    """FLA's deprecated ``transpose_state_layout`` -> ``state_v_first`` (with a warning)."""
    if "transpose_state_layout" not in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    value = kwargs.pop("transpose_state_layout")
    if kwargs.get("state_v_first", False):
        raise ValueError("transpose_state_layout: cannot be given together with state_v_first (its new name).")
    warn_caller("transpose_state_layout is deprecated (as in FLA); use state_v_first.", DeprecationWarning)
    kwargs["state_v_first"] = bool(value)
    return kwargs
