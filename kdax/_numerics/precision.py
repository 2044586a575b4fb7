"""Precision policy of the matrix products: which stages may feed half-precision operands
to the products (tensor cores, float32 accumulation) and which keep float32 operands.

Policies (``KDAPipeline.precision``):

* ``"highest"``: every product at float32 (float64 for float64 inputs) HIGHEST precision;
* ``"bfloat16"`` / ``"float16"``: the products of the stage families in ``FAST_FAMILIES`` round their
  operands to that dtype and accumulate in float32 (what FLA's Triton kernels do); every
  other product stays at HIGHEST;
* ``"fast"`` (opt-in by name): ``"bfloat16"`` plus the chunk recurrences (F4, B2, and F4
  inside B0) with bf16 operands and float32 accumulation, as FLA's
  ``chunk_gated_delta_rule_fwd_h`` / ``bwd_dhu`` run them: the state itself is carried in
  float32 across chunks (only its copy fed to each chunk's product is rounded), ``h`` (the
  state at each chunk's start) and ``v_new`` are stored rounded to bf16 (FLA stores them
  as bf16 tensors), and the final states stay float32. The intermediates FLA stores in
  bf16 (``STORED``: ``Aqk``, ``Akk``, ``w``, ``u``, ``qg``, ``kg``, ``h``, ``v_new`` and
  B2's ``dh``, the state gradient at each chunk's end) are stored as bf16 arrays, every
  sum behind them accumulated in float32 (``storage``: the bytes a training step moves,
  about 11.4 GiB against FLA's 8 at the GPU benchmark's shape with them in float32;
  the dh carried across chunks stays float32, as the state does). The gate's cumsum
  ``G`` is float32 alone, as FLA's, without the low part ``G_lo`` the other policies
  carry (``keeps_low_part``). Float64 inputs still get ``"highest"``;
* ``"auto"`` (default): ``"bfloat16"`` / ``"float16"`` when q, k and v are bfloat16 /
  float16 (``policy_dtype``), else ``"highest"``. Whether ``"fast"`` can become the default for bf16 inputs on a GPU is to
  be decided there (benchmarks/NOTES.md): its CPU errors (``tests/test_precision.py``)
  are within FLA's tolerances.

What must stay float32, and why:

* the gate's chunk cumsum (F1, and its reverse in B5): ``G`` sits in every exponent, and a
  bf16 rounding of the per-step gates (relative 4e-3) grows with the cumsum;
* ``(I + L)^-1`` (in F2): a triangular solve, whose rounding errors compound down the
  rows (the reference stage's block products and the Triton kernel's doubling products
  run under ``float32_products``; the TPU kernel substitutes row by row without products);
* the state recurrence (F4, B2, and F4 inside B0), except under ``"fast"``: the state is
  carried across all chunks, so each chunk's rounding could add up over the sequence.
  Under ``"fast"`` the carried state stays float32 and only the products' operands are
  rounded, each chunk's rounding error then decays with the state like any other input
  (FLA's choice; measured within FLA's tolerances on the CPU, gates down to -1e4);
* B4 (the intra-chunk gradients): its dG is a difference of products that cancel
  (``q * dq - k * dk`` and the like), so operand rounding relative to the products
  becomes large relative to dG. With B4 rounded, dg's error was 1.7e-2 (H100, bf16,
  1x16384x16, K=V=128) and dA_log's 6e-2; on a CPU with XLA:GPU's rounding emulated (T=1024,
  H=2, K=V=64) dg 2.6e-2 and dA_log 1.45, against 3.3e-3 and 6.8e-3 with B4 exact.
* row sums written as products (``kdax._numerics.arrays.rowsum``): sums, not products.

Everything else (the scores of F2, F3's ``w``/``u``, F5's output, B1, B3 and B0's F3)
takes half-precision operands as FLA's kernels do, with errors of the order of the
inputs' own rounding.

Mechanism: the policy is an argument. The stage runner (``kdax._runner.runner``) passes
the pipeline's resolved policy as ``precision=`` to every stage that declares the capability
``"precision"`` (``kdax._stage_protocol.capabilities``): kdax's own stages (the final classes,
``kdax._stage_protocol.final``, which declare it) trace their ``__call__`` under JAX's default
matmul precision for their family (``matmul_precision``: the reference stages' jnp products;
on GPUs XLA then rounds the operands and runs bf16 tensor-core products; XLA:CPU ignores
the algorithm and computes in float32), and ``kdax.pallas``'s in-kernel ``dot`` rounds its
operands to the dtype its ``Products`` carry (``operand``, on every backend, interpret mode
included). A user's stage that composes a kdax stage passes its own ``precision`` on (it
declares the capability to be told it); one that does not runs the composed stage at
``"highest"``, and its own products keep the caller's precision. The tests emulate
XLA:GPU's rounding on a CPU (``tests/_gpu_products.py``).

Storage (``"fast"`` only): the stage runner casts the ``STORED`` fields of F2's, F3's,
F4's, B0's and B2's outputs to ``storage(dtype, policy)`` (a no-op for a stage that wrote them so: the
Pallas kernels write bf16 themselves), and hands them in that dtype only to a stage that
declares the capability ``"half_stored"`` (``kdax._stage_protocol.capabilities``); any other stage gets
float32 copies (exact), so every stage, a user's too, runs unchanged.
"""

import contextlib
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp


POLICIES = ("auto", "highest", "bfloat16", "float16", "fast")

# The stage families whose products may take half-precision operands (see the module
# docstring), by their abstract classes' names.
FAST_FAMILIES = frozenset({"AbstractIntra", "AbstractWY", "AbstractOutput", "AbstractDAv", "AbstractWYDqkg"})

# The intermediates that "fast" stores in bf16, as FLA does (stage outputs and stage
# arguments go by these names: F2's Aqk, Akk; F3's w, u, qg, kg; F4's h, v_new; B2's dh).
# G and every gradient a stage returns to the pipeline's caller stay float32.
STORED = frozenset({"Aqk", "Akk", "w", "u", "qg", "kg", "h", "v_new", "dh"})

# The chunk recurrences (F4 and B2; B0's F4 is an F4 stage), whose products take bf16
# operands under "fast" only.
RECURRENCE_FAMILIES = frozenset({"AbstractState", "AbstractDhu"})

# JAX's dot algorithm for each half dtype: operands rounded to it, float32 accumulation.
_ALGORITHM = {"bfloat16": "BF16_BF16_F32", "float16": "F16_F16_F32"}


def _algorithm(policy: str) -> str:
    """The jnp products' precision under a half policy. XLA:CPU rejects F16_F16_F32 (and
    computes BF16_BF16_F32 products in float32 anyway): float16 asks for it on GPUs only."""
    if policy == "float16" and jax.default_backend() != "gpu":
        return "highest"
    return _ALGORITHM[policy]


def _half(policy: str) -> Optional[str]:
    """The operand dtype's name of a half policy ("fast" rounds to bf16), else None."""
    return "bfloat16" if policy == "fast" else (policy if policy in _ALGORITHM else None)


def family_of(stage: type) -> str:
    """The name of the abstract family class stage class ``stage`` implements."""
    return next((b.__name__ for b in stage.__mro__ if b.__name__.startswith("Abstract")), stage.__name__)


def operand(policy: str, stage: type) -> Optional[jnp.dtype]:
    """The dtype the products of a kdax stage of class ``stage`` round their operands to
    under ``policy`` (resolved), or None (full precision): the half dtype for the families
    of ``FAST_FAMILIES``, and under ``"fast"`` for the recurrences too."""
    half = _half(policy)
    family = family_of(stage)
    if half is None or not (family in FAST_FAMILIES or (policy == "fast" and family in RECURRENCE_FAMILIES)):
        return None
    return jnp.dtype(half)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"precision: expected one of {POLICIES}, got {policy!r}.")
    return policy


def policy_dtype(*dtypes):
    """The dtype a call's policy resolves for, from its inputs' dtypes (q's, k's and v's
    first, then g's, beta's, the initial state's; arrays stand for their dtypes, None for
    an absent input): float64 when any is
    (the compute dtype, ``kdax.ref.compute_dtype``), else the promotion of q's, k's and v's,
    the products' operands, so half precision only when all three are half."""
    given = [jnp.dtype(getattr(d, "dtype", d)) for d in dtypes if d is not None]
    if any(d == jnp.float64 for d in given):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.result_type(*given[:3]))


def resolve(policy: str, *dtypes) -> str:
    """The policy for a call whose inputs have ``dtypes`` (``policy_dtype``; q's alone will
    do where all are alike): ``"auto"`` becomes ``"bfloat16"`` or ``"float16"`` for
    half-precision inputs and ``"highest"`` otherwise; float64 inputs always get
    ``"highest"``, whatever the policy."""
    check_policy(policy)
    dtype = policy_dtype(*dtypes)
    if dtype == jnp.float64:
        return "highest"
    if policy == "auto":
        return {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}.get(dtype, "highest")
    return policy


def float32_products():
    """Products traced inside run at HIGHEST whatever the stage's policy (the solve; B4;
    row sums): JAX's own context. A Pallas kernel's products say it with ``Products``'
    ``operand=None``."""
    return jax.default_matmul_precision("highest")


def glue_at_highest(fn):
    """``fn`` traced under HIGHEST matmul precision whatever JAX's default, which is TF32 on
    a GPU: for products between the stages (``kdax._layouts``' entering and final states,
    which otherwise put a float32 golden case of packed sequences 7.5e-5 off on an H200),
    where no stage's policy applies (a custom VJP's rule too: traced after any scope)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with float32_products():
            return fn(*args, **kwargs)

    return wrapped


def captured():
    """JAX's default matmul precision where this is traced, for ``restored`` to trace a
    custom VJP's backward under (traced after the forward's context has exited)."""
    return jax.config.jax_default_matmul_precision


def restored(matmul):
    """Trace the block under JAX's default matmul precision ``matmul`` (``captured``)."""
    return jax.default_matmul_precision(matmul) if matmul is not None else contextlib.nullcontext()


def keeps_low_part(policy: str) -> bool:
    """Whether F1 gives a float32 ``G`` as the exact sum ``G + G_lo``
    (``kdax._numerics.hilo``) under ``policy``: under every policy but ``"fast"``, which keeps ``G`` alone, FLA's float32
    cumsum: a relative error of about ``eps |G|`` in each decay (``|G| <= 128 C``, the
    float32 floor: at most 4.9e-4 at C = 64 with every gate at the floor, ~2e-5 with Kimi
    Linear's gates), below the bf16 rounding of that policy's operands (4e-3), and no
    ``G_lo`` for F2 to B4 to read and add."""
    return policy != "fast"


def storage(dtype, policy: str):
    """The dtype an intermediate of ``STORED`` computed in ``dtype`` is stored in under
    ``policy``: bf16 for float32 under ``"fast"`` (FLA's storage), else ``dtype``."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.bfloat16) if policy == "fast" and dtype == jnp.float32 else dtype


def stored(x, policy: str):
    """``x`` (an intermediate of ``STORED``) in its storage dtype under ``policy``."""
    return x.astype(storage(x.dtype, policy))


def store_outputs(out, policy: str):
    """A stage output (a container, or a tuple of them: B0's) with its ``STORED`` fields
    in their storage dtype under ``policy``: the one cast, applied by the stage runner
    (no-op for a field already so, and for every field outside ``"fast"``)."""
    if isinstance(out, tuple):
        return tuple(store_outputs(x, policy) for x in out)
    fix = {}
    for n in sorted(STORED):
        x = getattr(out, n, None)
        if x is not None and storage(x.dtype, policy) != x.dtype:
            fix[n] = x.astype(storage(x.dtype, policy))
    return dataclasses.replace(out, **fix) if fix else out


def widened(kwargs: dict) -> dict:
    """``kwargs`` with any ``STORED`` argument held in a half dtype as a float32 copy
    (exact): what a stage that does not declare ``"half_stored"`` is given."""
    half = lambda x: getattr(x, "dtype", None) in (jnp.bfloat16, jnp.float16)
    if not any(n in STORED and half(x) for n, x in kwargs.items()):
        return kwargs
    return {n: x.astype(jnp.float32) if n in STORED and half(x) else x for n, x in kwargs.items()}


def matmul_precision(policy: str, stage: type) -> str:
    """The ``jax.default_matmul_precision`` value for the products of a kdax stage of class
    ``stage`` under ``policy``."""
    half = operand(policy, stage)
    return "highest" if half is None else _algorithm(half.name)


def keep_float32(fn):
    """Decorator: ``fn``'s products under ``float32_products``."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with float32_products():
            return fn(*args, **kwargs)

    return wrapped
