"""``benchmarks/gpu_cost_model.py``'s glue count (``count_glue``): the XLA ops of a lowered
CUDA program outside its Triton kernels and the bytes they move, on a program whose
answer is known by hand and on the candidate's training step at a small shape. Skipped
where Pallas Triton kernels cannot be lowered without a GPU (``tests/pallas/_triton.py``)."""

import re

import pytest

from ._load import load_benchmark


@pytest.fixture(scope="module")
def m():
    from tests.pallas._triton import skip_reason

    if reason := skip_reason():
        pytest.skip(reason)
    return load_benchmark("gpu_cost_model")


def test_glue_by_hand(m):
    """x [64, 128] f32 -> transpose -> a Triton kernel (x + 1) -> convert to bf16: one
    kernel, two glue ops; fused, the glue reads x (32 KiB) and the kernel's output (32 KiB)
    once and writes the transposed x (32 KiB, handed to the kernel) and the bf16 result
    (16 KiB, returned); unfused, each op reads its operand and writes its result."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    from tests.pallas._triton import captured

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    add = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 64), jnp.float32),
                         compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))

    def f(x):
        return add(x.T).astype(jnp.bfloat16)

    with captured():
        text = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 128), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    g = m.count_glue(text)
    kib = 1024
    assert g.kernels == 1 and g.ops == {"transpose": 1, "convert": 1}, g
    assert g.bytes_fused == 32 * kib + 32 * kib + 32 * kib + 16 * kib, g
    assert g.bytes_unfused == (32 + 32) * kib + (32 + 16) * kib, g
    assert (g.launches_fused, g.launches_unfused) == (2, 2), g
    gap = 5e-6  # the time of two launches at the floor, and three gaps (two glue launches, one kernel)
    assert g.seconds(gap) == pytest.approx(2 * m.MIN_LAUNCH_S + 3 * gap)


def test_candidate_step_glue(m):
    """The candidate's training step at B=1 T=256 H=2, lowered for CUDA: its 12 kernels,
    and the ops outside them as the StableHLO text has them (every op kind ``count_glue``
    reports appears that often in the text, JAX's ``where`` functions' ops at each call):
    the NaN masks (compare, select), the casts (convert) and the partial sums (reduce)
    among them (no transposes since B3 and B5 write the call's gradients); fused bytes at
    most the unfused."""
    from triton_resources import training_step

    from tests.pallas._triton import lower_step

    fn, args, _ = training_step(m.CANDIDATE, 1, 256, 2)
    lowered, records = lower_step(fn, args)
    text = lowered.as_text()
    g = m.count_glue(text)
    assert g.kernels == len(records) == 12, (g.kernels, len(records))
    assert {"convert", "select", "compare", "reduce"} <= set(g.ops) and "transpose" not in g.ops, g.ops
    main = text.split("func.func private")[0]
    calls = re.findall(r"call @(\w+)\(", main)
    bodies = {name: body for name, body in re.findall(r"func\.func private @(\w+)\(.*?\n(.*?)\n  \}", text, re.S)}
    # in the main function, a broadcast that only adds unit axes is a reshape (not counted)
    unit = sum(m.tensor_bytes(a) == m.tensor_bytes(b) for a, b in re.findall(
        r"= stablehlo\.broadcast_in_dim [^:]*: \(tensor<([^>]*)>\) -> tensor<([^>]*)>", main))
    assert unit > 0
    for kind, n in g.ops.items():
        direct = len(re.findall(rf"= stablehlo\.{kind}\b", main)) - (unit if kind == "broadcast_in_dim" else 0)
        called = sum(len(re.findall(rf"= stablehlo\.{kind}\b", bodies[c])) for c in calls)
        assert n == direct + called, (kind, n, direct, called)
    assert 0 < g.bytes_fused <= g.bytes_unfused and 0 < g.launches_fused <= g.launches_unfused, g
    # The glue does not grow back (issue 53 item 2): at most the level counted once B3 and B5
    # wrote the call's gradients (75 ops, 5 values, 0.89 MiB fused; 119 ops, 14 values, 2.42
    # MiB before the folds, 134 and 16 before the dense state kernels dropped the boundaries)
    assert g.total_ops <= 75 and g.launches_fused <= 5 and g.bytes_fused <= 934912, g
    # the inputs' bytes (4 bf16 [1, 256, 2, 128] and beta) are read at least once
    assert g.bytes_fused >= 4 * 256 * 2 * 128 * 2, g


def test_glue_reshapes_are_one_value(m):
    """A broadcast that only adds a unit axis (``x[..., None]``: XLA makes it a bitcast)
    is no op and no value; one glue value handed to two kernels through two reshapes is
    written once: x [64, 128] f32 -> x * x -> (as [64, 128, 1], and as [8192]) into two
    kernels: one glue op (multiply), reading x (32 KiB) and writing its result once (32 KiB)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    from tests.pallas._triton import captured

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    params = pltr.CompilerParams(num_warps=4, num_stages=1)
    add3 = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 128, 1), jnp.float32), compiler_params=params)
    add1 = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8192,), jnp.float32), compiler_params=params)

    def f(x):
        y = x * x
        return add3(y[..., None]), add1(y.reshape(-1))

    with captured():
        text = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 128), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "broadcast_in_dim" in text or "reshape" in text
    g = m.count_glue(text)
    kib = 1024
    assert g.kernels == 2 and g.ops == {"multiply": 1}, g
    assert g.bytes_fused == 32 * kib + 32 * kib and g.launches_fused == 1, g


@pytest.mark.slow
def test_profiled_glue_recounted(m, tmp_path):
    """The profiled step's glue as committed is this ``count_glue``'s count of the program
    that step's commit lowers (``--freeze-profiled-glue``; needs the commit in this
    clone's history: skipped in a shallow one), so the profiled step and the checkout's
    are counted alike (the central estimate's launches per value)."""
    import shutil
    import subprocess

    have = subprocess.run(["git", "-C", str(m.ROOT), "cat-file", "-e", m.PROFILE_COMMIT + "^{commit}"],
                          capture_output=True)
    if have.returncode:
        pytest.skip(f"{m.PROFILE_COMMIT[:7]} is not in this clone's history")
    out = tmp_path / "profiled.json"
    shutil.copy(m.PROFILED_KERNELS, out)
    got, kept = m.freeze_profiled_glue(out=out), m.profiled_glue()
    fields = ("ops", "kernels", "bytes_fused", "bytes_unfused", "launches_fused", "launches_unfused")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(kept, f) for f in fields}


def test_glue_slice_reads_what_it_takes(m):
    """A slice of a kernel's output reads the slice alone: x [64, 128] f32 -> a kernel ->
    its first 16 columns -> a kernel: one glue op, reading 4 KiB and writing 4 KiB."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    from tests.pallas._triton import captured

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    params = pltr.CompilerParams(num_warps=4, num_stages=1)
    whole = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32), compiler_params=params)
    part = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 16), jnp.float32), compiler_params=params)

    with captured():
        text = jax.jit(lambda x: part(whole(x)[:, :16])).trace(jax.ShapeDtypeStruct((64, 128), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    g = m.count_glue(text)
    assert g.kernels == 2 and g.ops == {"slice": 1}, g
    assert g.bytes_fused == 4096 + 4096 and g.launches_fused == 1, g
