"""The exceptions and warnings kdax raises about stages and inputs."""

import functools
import os
import sys
import warnings

# Frames of these packages sit between a user's call and kdax's checks (the typecheck and
# routing wrappers, jit): a warning points at the first frame outside them.
_INSIDE = tuple(os.sep + p + os.sep for p in ("kdax", "jaxtyping", "beartype", "equinox", "jax"))


def warn_caller(message: str, category: type) -> None:
    """``warnings.warn`` attributed to the user's line that called into kdax."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and any(p in frame.f_code.co_filename for p in _INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class UnsupportedCase(NotImplementedError):
    """Raised by a stage for inputs or options its implementation cannot run (a Pallas
    state kernel on packed varlen input, a Triton kernel beyond its shared memory, ...).

    It is the only exception on which ``KDAPipeline(fallback=True)`` runs the reference
    stage of the same family instead; any other exception, ``NotImplementedError``
    included, propagates. Raise it before any kernel is built, with a message that says
    what is unsupported (the fallback warning and ``KDAPipeline.plan`` show it)."""


class StageContractError(TypeError):
    """A stage was called with arguments its ``__call__`` does not take, or returned
    something other than its abstract class promises (container, shapes, dtypes). The
    message names the pipeline field and the implementation class."""


class FallbackWarning(UserWarning):
    """A stage raised ``UnsupportedCase`` and the pipeline ran the reference stage instead
    (issued once per stage field, implementation and reason)."""


class StageGradientError(ValueError):
    """A differentiated function reaches an array held by a forward stage whose gradient
    kdax cannot give exactly (see ``kdax._runner.stage_grads``: F1 and F5 arrays get exact
    gradients, the backward stages' arrays an exact zero). The message names the pipeline
    field, the array's path and the stage's class."""


class DerivedBackwardError(TypeError):
    """A pipeline's backward stages are not the transposes of its forward stages
    (``kdax._runner.routes``), and the gradient cannot be derived from the forward stages either:
    JAX cannot differentiate one of them (a Pallas kernel of custom math, say), or the
    caller runs the hand-written backward directly (``KDAPipeline.backward``,
    ``kdax.parallel``). The message names the stages and what to pass."""


class ForwardModeError(TypeError):
    """Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, or
    ``jax.jvp`` of a ``jax.grad``) reached ``chunk_kda``, whose derivative is its
    hand-written backward, a custom VJP, which JAX can only run in reverse. The message
    says what to use instead."""


def reverse_mode_only(fn):
    """``fn`` (a custom VJP's call) with JAX's refusal of forward mode raised as a
    ``ForwardModeError`` that names what works."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            if "forward-mode autodiff" not in str(e):
                raise
            raise ForwardModeError(
                "chunk_kda: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, jax.jvp of jax.grad) "
                "is not available: its derivative is the hand-written six-stage backward, a custom VJP, which JAX "
                "runs in reverse only. For a Hessian-vector product differentiate in reverse twice (jax.grad of a "
                "jax.grad: exact, dense or packed); for forward mode use kdax.fused_recurrent_kda (plain JAX)."
            ) from e

    return call


class HeadFirstLayoutWarning(UserWarning):
    """``chunk_kda``'s q has fewer tokens than heads (``q.shape[1] < q.shape[2]``), which is
    what FLA's old head-first layout ``[B, H, T, K]`` looks like when passed as kdax's (and
    FLA's current) ``[B, T, H, K]``: the call would run with T and H swapped. Transpose
    with ``jnp.swapaxes(x, 1, 2)``; a genuine short input (a prompt shorter than the head
    count) can ignore it (``warnings.filterwarnings("ignore", category=...)``) or use
    ``fused_recurrent_kda``."""


class Float64Warning(UserWarning):
    """A float64 input while JAX's 64-bit mode is off: JAX converts it to float32, so the
    call computes in float32, not float64. Enable ``jax.config.update("jax_enable_x64", True)``
    before creating arrays to compute in float64."""


class UnstableDeltaRuleWarning(UserWarning):
    """Keys and write strengths with ``beta * |k|^2 > 2`` (without
    ``use_qk_l2norm_in_kernel``): the delta rule's update ``I - beta k k^T`` then has an
    eigenvalue below -1 and the state can grow without bound (NaN outputs follow). Checked on
    eager calls (concrete values); normalise the keys (``use_qk_l2norm_in_kernel=True``, as
    Kimi Linear does) or scale beta."""
