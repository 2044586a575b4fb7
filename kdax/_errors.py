"""The exceptions and warnings kdax raises about stages."""


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
    (``kdax._runner.derived``), and the gradient cannot be derived from the forward stages either:
    JAX cannot differentiate one of them (a Pallas kernel of custom math, say), or the
    caller runs the hand-written backward directly (``KDAPipeline.backward``,
    ``kdax.parallel``). The message names the stages and what to pass."""
