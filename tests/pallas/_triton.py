"""Compiling kdax's Pallas Triton kernels for Hopper (sm_90) on a machine without a GPU,
with the ``triton`` package (the ``test`` extra on Linux x86_64): the TTIR JAX lowers
each kernel to (``captured``), Triton's own passes down to LLVM IR (``shared_bytes``) or
to a cubin through the ``ptxas`` its wheel ships (``resources``)."""

import contextlib
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

HOPPER_SHARED_BYTES = 232448  # 227 KiB: the per-block opt-in limit of sm_90
HOPPER_REGISTERS = 255  # per thread


HOPPER_KIND = "NVIDIA H100 80GB HBM3"  # a device kind JAX's Triton lowering maps to sm_90


def hopper_target():
    """A context in which JAX lowers Pallas Triton kernels for sm_90 on a machine without a
    GPU. JAX 0.10 falls back to sm_90 by itself; from 0.11 the lowering asks
    ``jax._src.pallas.triton.gpu_info`` for the device and raises "No supported GPU devices
    found" unless an abstract GPU device is in scope (``jax.sharding.use_abstract_mesh``
    with an ``AbstractDevice``, as JAX's own GPU interpret tests do)."""
    try:
        from jax._src.pallas.triton import gpu_info  # noqa: F401  (JAX >= 0.11)
    except ImportError:
        return contextlib.nullcontext()
    import jax

    dev = jax.sharding.AbstractDevice(device_kind=HOPPER_KIND, platform="gpu", num_cores=132)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev))


@contextlib.contextmanager
def captured(records: list | None = None):
    """``{kernel source: TTIR text}`` of every Pallas Triton kernel lowered inside, under
    ``hopper_target``. ``records``: also every lowering in order, as
    ``(jaxpr, grid_mapping, TTIR text)`` (a kernel called twice appears twice)."""
    from jax._src.pallas.triton import lowering

    mods, orig = {}, lowering.lower_jaxpr_to_triton_module

    def keep(jaxpr, *a, **kw):
        res = orig(jaxpr, *a, **kw)
        text = res.module.operation.get_asm(enable_debug_info=False)
        mods.setdefault(jaxpr.debug_info.func_src_info, text)
        if records is not None:
            records.append((jaxpr, a[0] if a else kw["grid_mapping"], text))
        return res

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        with hopper_target():
            yield mods
    finally:
        lowering.lower_jaxpr_to_triton_module = orig


def skip_reason():
    """Why Pallas Triton kernels cannot be lowered for CUDA and compiled for sm_90 here
    (None: they can): no ``triton`` package, or a JAX whose lowering refuses without a GPU
    even under ``hopper_target``. A one-kernel probe."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs the triton package (the test extra, Linux x86_64)"
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr  # registers the Triton lowering

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                       compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))
    try:
        with captured():
            jax.jit(f).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001  (the reason is the message)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"JAX {jax.__version__} cannot lower a Pallas Triton kernel without a GPU here: {msg}"
    return None


def _compile(ttir: str, tmp_path: Path, num_warps: int, num_stages: int, to_cubin: bool, keep: dict | None = None):
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))  # as kdax.pallas compiles them
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    path = tmp_path / "kernel.ttir"
    path.write_text(ttir)
    mod = ir.parse_mlir_module(str(path), ctx)
    mod.context = ctx
    meta = {}
    mod = backend.make_ttir(mod, meta, options, 90)
    mod = backend.make_ttgir(mod, meta, options, 90)
    if keep is not None:
        keep["ttgir"] = str(mod)
    llir = backend.make_llir(mod, meta, options, 90)
    if not to_cubin:
        return meta, None, None
    ptx = backend.make_ptx(llir, meta, options, 90)
    return meta, ptx, backend.make_cubin(ptx, meta, options, 90)


def shared_bytes(ttir: str, tmp_path: Path, num_warps: int = 4, num_stages: int = 1) -> int:
    """The shared memory one program of the kernel asks for on sm_90 (Triton's figure)."""
    return _compile(ttir, tmp_path, num_warps, num_stages, False)[0]["shared"]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one program of a kernel compiled for sm_90 holds: ``registers`` per thread,
    ``local`` bytes of thread-local memory (the stack frame, where ptxas spills
    registers, and local arrays: off chip),
    ``shared`` bytes, and the tensor-core instructions in its PTX (``mma``)."""

    registers: int
    local: int
    shared: int
    mma: frozenset


def resources(ttir: str, num_warps: int = 4, num_stages: int = 1, keep: dict | None = None) -> Resources:
    """The kernel compiled to a cubin by Triton's passes and ptxas, as Triton would on an
    H100; the figures read back with the ``cuobjdump`` of the same wheel. ``keep``: also
    the compile's ``ttgir``, ``ptx`` and ``sass`` (disassembly) texts stored there."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        meta, ptx, cubin = _compile(ttir, tmp, num_warps, num_stages, True, keep)
        binary = tmp / "kernel.cubin"
        binary.write_bytes(cubin)
        cuobjdump = Path(get_ptxas(90).path).with_name("cuobjdump")
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(binary)], check=True,
                               capture_output=True, text=True).stdout
        if keep is not None:
            keep["ptx"] = ptx
            keep["sass"] = subprocess.run([str(cuobjdump), "-sass", str(binary)], check=True,
                                          capture_output=True, text=True).stdout
    reg, stack, local = (int(re.search(rf"\b{name}:(\d+)", usage).group(1)) for name in ("REG", "STACK", "LOCAL"))
    mma = frozenset(re.findall(r"\b(wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.\w+\.\w+|mma\.sync\.aligned[.\w]*)", ptx))
    return Resources(reg, stack + local, meta["shared"], mma)


def state_kernels(policy: str, tuning: dict, layout: str, tokens: bool = False, start: bool = False) -> dict:
    """``captured`` TTIR of the Triton state kernels F4 and B2 alone (B0's F4 is F4) at
    K = V = 128, chunk 64, traced under precision ``policy`` with Triton ``tuning``
    (``PallasState`` / ``PallasDhu`` fields, ``round_in_kernel`` too), on the ``"dense"``
    layout or a ``"packed"`` varlen one (per-chunk resets). ``tokens`` (dense): B2 reads
    ``do`` as a ``kdax._layouts.tokens.Tokens`` view of a bf16 ``[B, T, HV, V]`` array. The
    stored intermediates (w, u, kg) in the policy's storage dtype, as the pipeline passes
    them (bf16 under ``"fast"``: ``kdax._numerics.precision.storage``). ``start``: B2 is given
    ``dh_start`` (float32 ``[R, HV, NC, K, V]``), as for a loss on packed final states."""
    import jax
    import jax.numpy as jnp

    from kdax._numerics import precision as _precision
    from kdax._layouts.layout import make_layout
    from kdax._layouts.tokens import Tokens
    from kdax.pallas import PallasDhu, PallasState

    R, HV, NC, C, K = 1, 2, 8, 64, 128
    kw = dict(target="triton", interpret=False, **tuning)
    T = NC * C if layout == "dense" else NC * C - 2 * C
    lay = make_layout(R, T, C) if layout == "dense" else make_layout(R, T, C, jnp.asarray([0, 100, 300, T]))

    def f4(w, u, kg, G, h0):
        return PallasState(**kw)(w, u, kg, G, h0, lay, precision=policy)

    def b2(qg, kg, w, G, do, dv, dht, *dh_start):
        do = Tokens(do, HV, C, jnp.dtype(jnp.float32)) if tokens else do
        return PallasDhu(**kw)(0.1, qg, kg, w, G, do, dv, dht, lay, precision=policy,
                               **({"dh_start": dh_start[0]} if start else {}))

    seq = jax.ShapeDtypeStruct((lay.empty.shape[0], HV, K, K), jnp.float32)
    ck = jax.ShapeDtypeStruct((R, HV, lay.num_chunks, C, K), jnp.float32)
    st = jax.ShapeDtypeStruct(ck.shape, _precision.storage(jnp.float32, policy))
    do = jax.ShapeDtypeStruct((R, T, HV, K), jnp.bfloat16) if tokens else ck
    with captured() as mods:
        jax.jit(f4).trace(st, st, st, ck, seq).lower(lowering_platforms=("cuda",))
        jax.jit(b2).trace(ck, st, st, ck, do, ck, seq, *[jax.ShapeDtypeStruct((R, HV, lay.num_chunks, K, K), jnp.float32)] * start).lower(
            lowering_platforms=("cuda",))
    assert len(mods) == 2, list(mods)
    return mods


def gate_kernels(tuning: dict, tokens: bool = False, reset: bool = False) -> dict:
    """``captured`` TTIR of the Triton gate kernels F1 and B5 alone at K = 128, chunk 64,
    with Kimi Linear's options (l2norm, the softplus gate with A_log and dt_bias, beta
    sigmoid) and Triton ``tuning`` (``PallasGate`` / ``PallasGateBackward`` fields).
    ``tokens``: F1's q, k, g, beta and B5's g as ``kdax._layouts.tokens.Tokens`` views of bf16
    ``[B, T, H, K]`` inputs, cleaned as ``chunk_kda`` cleans them (the pipeline's dense
    path), instead of chunked float32 arrays. ``reset``: shared chunks' reset table
    (sequences starting inside chunks: ``kdax.pallas._gate._segment_sums`` in B5)."""
    import jax
    import jax.numpy as jnp

    from kdax import KDAConfig
    from kdax._numerics import isolation as _isolation
    from kdax._layouts.tokens import token_inputs
    from kdax.pallas import PallasGate, PallasGateBackward
    from kdax.stages import Activated

    R, HV, NC, C, K = 1, 2, 4, 64, 128
    s = jax.ShapeDtypeStruct
    ck, cs, c1 = s((R, HV, NC, C, K), jnp.float32), s((R, HV, NC, C), jnp.float32), s((R, HV, NC, C, 1), jnp.float32)
    tk, ts = s((R, NC * C, HV, K), jnp.bfloat16), s((R, NC * C, HV), jnp.bfloat16)
    cfg = KDAConfig(scale=0.1, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    kw = dict(target="triton", interpret=False, **tuning)
    A_log, dt_bias, valid = jnp.zeros(HV, jnp.float32), jnp.zeros(HV * K, jnp.float32), jnp.ones((R, NC, C), bool)
    kinds = _isolation.input_kinds(True, True)
    rs = {"reset": jnp.zeros((R, NC, C), bool).at[:, :, 0].set(True).at[:, 1, 17].set(True)} if reset else {}

    def views(q, k, g, b):
        if not tokens:
            return q, k, g, b
        q, k, _, g, b = token_inputs((q, k, None, g, b), HV, C, jnp.float32, kinds)
        return q, k, g, b

    def f1(q, k, g, b):
        return PallasGate(**kw)(cfg, *views(q, k, g, b), A_log, dt_bias, valid, **rs)

    def b5(q, k, g, b, G, qr, kr, dq, dk, db, dG):
        act = Activated(q, k, b, G, qr, kr, None)
        g = views(None, None, g, None)[2] if tokens else g
        return PallasGateBackward(**kw)(cfg, act, g, A_log, dt_bias, valid, dq, dk, db, dG, **rs)

    raw = (tk, tk, tk, ts) if tokens else (ck, ck, ck, cs)
    with captured() as mods:
        jax.jit(f1).trace(*raw).lower(lowering_platforms=("cuda",))
        jax.jit(b5).trace(ck, ck, raw[2], cs, ck, c1, c1, ck, ck, cs, ck).lower(lowering_platforms=("cuda",))
    assert len(mods) == 2, list(mods)
    return mods


def chunk_kernels(policy: str, tuning: dict, tokens: bool = False, only: tuple = ("intra", "wy", "wy_dqkg", "intra_bwd"),
                  packed: bool = False) -> dict:
    """``captured`` TTIR of the chunk-parallel Triton kernels F2, F3, B3 and B4 alone at
    K = V = 128, chunk 64, with G's low part where the policy keeps it (``kdax._numerics.hilo``,
    ``precision.keeps_low_part``: all but ``"fast"``), each traced under precision
    ``policy`` (its stage's products) with Triton
    ``tuning`` (``PallasTarget`` fields). ``tokens``: F3 and B3 read ``v`` (cleaned as
    ``chunk_kda`` cleans it) and B3 ``do`` as ``kdax._layouts.tokens.Tokens`` views of bf16
    ``[B, T, HV, V]`` arrays. ``only``: these stages' kernels. ``packed``: F2, F3, B3 and B4 take
    shared chunks' resets (``kdax._layouts.resets``). The stored
    intermediates (Akk, qg, kg, h, v_new, dh) in the policy's storage dtype, as the pipeline
    passes them (bf16 under ``"fast"``: ``kdax._numerics.precision.storage``)."""
    import jax
    import jax.numpy as jnp

    from kdax._numerics import precision as _precision
    from kdax._layouts.tokens import Tokens
    from kdax.pallas import PallasIntra, PallasIntraBackward, PallasWY, PallasWYDqkg
    from kdax.stages import ChunkGrads

    R, HV, NC, C, K = 1, 2, 4, 64, 128
    s = jax.ShapeDtypeStruct
    ck, cs = s((R, HV, NC, C, K), jnp.float32), s((R, HV, NC, C), jnp.float32)
    cm, ch = s((R, HV, NC, C, C), jnp.float32), s((R, HV, NC, K, K), jnp.float32)
    stored = lambda x: s(x.shape, _precision.storage(x.dtype, policy))
    sk, sm, sh = stored(ck), stored(cm), stored(ch)
    lo = ck if _precision.keeps_low_part(policy) else None
    kw = dict(target="triton", interpret=False, **tuning)
    tv = s((R, NC * C, HV, K), jnp.bfloat16) if tokens else ck
    view = (lambda d, kind=None: Tokens(d, HV, C, jnp.dtype(jnp.float32), kind)) if tokens else (lambda d, kind=None: d)

    rs = (s((R, NC, C), jnp.bool_),) if packed else ()
    calls = [
        (lambda q, k, b, G, lo, *r: PallasIntra(**kw)(0.1, q, k, b, G, lo, *r, precision=policy), (ck, ck, cs, ck, lo, *rs)),
        (lambda q, k, v, b, G, A, lo, *r: PallasWY(**kw)(q, k, view(v, "any"), b, G, A, lo, *r, precision=policy),
         (ck, ck, tv, cs, ck, sm, lo, *rs)),
        (lambda *a: PallasWYDqkg(**kw)(0.1, *a[:2], view(a[2], "any"), *a[3:11], view(a[11]), *a[12:], precision=policy),
         (ck, ck, tv, cs, ck, sm, sk, sk, sh, sh, sk, tv, ck, lo, *rs)),
        (lambda q, k, b, G, dA, dL, dq, dk, db, dG, lo, *r: PallasIntraBackward(**kw)(
            0.1, q, k, b, G, dA, ChunkGrads(dq, dk, None, db, dG, dL), lo, *r, precision=policy), (ck, ck, cs, ck, cm, cm, ck, ck, cs, ck, lo, *rs)),
    ]
    with captured() as mods:
        for name, (fn, args) in zip(("intra", "wy", "wy_dqkg", "intra_bwd"), calls):
            if name in only:
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(mods) == len(only), list(mods)
    return mods


# -- a whole training step ------------------------------------------------------------------
STEP_POLICIES = ("highest", "bfloat16", "float16", "fast")  # every resolved precision policy
# Every precision a training step can run at: (policy, input dtype name); "auto" with float32
# inputs resolves to "highest", with bf16 to "bfloat16" (kdax._numerics.precision.resolve),
# but its kernels read float32 or bf16 views of the inputs.
STEP_CASES = (("auto", "float32"), ("auto", "bfloat16"), ("highest", "bfloat16"), ("bfloat16", "bfloat16"),
              ("float16", "bfloat16"), ("fast", "bfloat16"))
PACKED_CU = (0, 100, 300, 512)  # three sequences over T = 512: starts inside chunks (shared chunks)

# The kernel names a step's Triton custom calls carry (``kdax_<stage class>_kernel``), by
# pipeline field. B0 runs the pipeline's own F3 and F4 (``PallasRecompute``): their kernels.
KERNEL_STAGES = {
    "PallasGate": "gate", "PallasIntra": "intra", "PallasWY": "wy", "PallasState": "state",
    "PallasOutput": "output", "PallasDAv": "dav", "PallasDhu": "dhu", "PallasWYDqkg": "wy_dqkg",
    "PallasIntraBackward": "intra_bwd", "PallasGateBackward": "gate_bwd",
}


def kernel_stage(name: str) -> str:
    """The pipeline field whose stage built the kernel ``kdax_<class>_kernel[__n]``."""
    cls = re.match(r"kdax_(\w+?)_kernel", name).group(1)
    return KERNEL_STAGES[cls]


def triton_calls(hlo: str) -> list:
    """``[(kernel name, num_warps, num_stages)]`` of the Triton custom calls of a lowered
    module, in order: the configs XLA compiles them with."""
    out = []
    for cfg in hlo.split("__gpu$xla.gpu.triton(")[1:]:  # (the config follows its serialised TTIR)
        get = lambda k: re.search(rf'\b{k} = "?([\w.]+)', cfg).group(1)  # noqa: E731
        out.append((get("name"), int(get("num_warps")), int(get("num_stages"))))
    return out


def step_function(pipe, B: int = 1, T: int = 512, H: int = 2, K: int = 128, C: int = 64, cu_seqlens=None,
                  dtype: str = "bfloat16"):
    """``(fn, args)``: ``jax.grad`` of a loss on ``chunk_kda`` with ``pipe`` (inputs
    ``[B, T, H, K]`` of ``dtype``, bf16 by default, Kimi Linear's options,
    ``output_final_state``), optionally packed (``cu_seqlens``, a tuple of ints, B = 1),
    ready to lower for CUDA."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kdax

    s = jax.ShapeDtypeStruct
    args = (s((B, T, H, K), jnp.dtype(dtype)),) * 4 + (s((B, T, H), jnp.dtype(dtype)),)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if cu_seqlens is not None:
        opts["cu_seqlens"] = np.asarray(cu_seqlens, np.int32)

    def loss(*a):
        o, ht = kdax.chunk_kda(*a, pipeline=pipe, chunk_size=C, output_final_state=True, A_log=jnp.zeros(H, jnp.float32),
                               dt_bias=jnp.zeros(H * K, jnp.float32), **opts)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args


def lower_step(fn, args):
    """``(lowered, records)``: ``fn`` lowered for CUDA under ``captured``. The input checks'
    runtime errors (``eqx.error_if``: a host callback, which a CUDA lowering on a machine
    without a GPU cannot place) are switched off while tracing: they add no kernel."""
    from unittest import mock

    import equinox._errors as eqx_errors
    import jax

    records = []
    with captured(records), mock.patch.object(eqx_errors, "EQX_ON_ERROR", "off"):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered, records


def step_resources(pipe, policy: str, packed: bool, T: int = 512, H: int = 2, dtype: str = "bfloat16") -> dict:
    """``{(kernel name, num_warps, num_stages): Resources}`` of every Triton kernel of the
    training step with ``pipe`` under precision ``policy`` (inputs of ``dtype``), dense
    (B = 1, T) or packed (``PACKED_CU``), each compiled for sm_90 as XLA would (its custom
    call's warps and stages). Kernels lowered alike are compiled once."""
    fn, args = step_function(pipe.with_precision(policy), T=T, H=H, cu_seqlens=PACKED_CU if packed else None,
                             dtype=dtype)
    lowered, records = lower_step(fn, args)
    calls = triton_calls(lowered.as_text())
    assert len(calls) == len(records), (len(calls), len(records))
    out, done = {}, {}
    for (_, _, ttir), (name, warps, stages) in zip(records, calls):
        key = (ttir, warps, stages)
        if key not in done:
            done[key] = resources(ttir, warps, stages)
        out.setdefault((name, warps, stages), done[key])
        if out[(name, warps, stages)] != done[key]:  # two lowerings of one name: keep the worse
            out[(name, warps, stages)] = max(out[(name, warps, stages)], done[key], key=lambda r: r.local)
    return out
