"""``benchmarks/compile_size.py --llvm``: XLA:CPU's per-kernel LLVM times read from its log
and attributed to kdax's stages by the compiled HLO's metadata. Times are never asserted."""

import os
import subprocess
import sys

import pytest

from ._load import BENCH, load_benchmark

HLO = """HloModule jit_f, entry_computation_layout={()}

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p), metadata={op_name="jit(f)/kdax_intra/while/body/exp"}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %exponential_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/transpose(jvp(kdax_recompute))/kdax_wy/mul"}
  ROOT %add_fusion.2 = f32[4]{0} fusion(%exponential_fusion), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/add"}
}
"""

LOG = """I1202 17:00:00.1   1 ir_compiler.cc:293] Compiled LLVM module: __compute_module_exponential_fusion_kernel_module time: 12.5 ms (12500 us) (cumulative: 1 s)
I1202 17:00:00.2   1 ir_compiler.cc:293] Compiled LLVM module: __compute_module_add_fusion.2_kernel_module time: 900 us (900 us) (cumulative: 1 s)
I1202 17:00:00.3   1 ir_compiler.cc:293] Compiled LLVM module: __compute_module_dot.7_elemental_kernel_module time: 1.5 s (1500000 us) (cumulative: 2 s)
"""


@pytest.fixture(scope="module")
def cs():
    return load_benchmark("compile_size")


def test_kernels_are_timed_and_given_their_innermost_stage(cs):
    rows = cs.llvm_by_kernel(LOG, HLO)
    assert rows == [(1500.0, "dot.7_elemental", "?", ""),
                    (12.5, "exponential_fusion", "wy", "f32[4]{0}"),
                    (0.9, "add_fusion.2", "glue", "f32[4]{0}")]


def test_a_real_compile_logs_its_kernels(cs, tmp_path):
    """The log lines the parser reads are the ones this jaxlib writes (a small jitted program
    in a child process, as ``llvm_report`` runs the gradient; without the suite's XLA flags,
    whose one codegen part a program compiles every kernel as one LLVM module)."""
    code = ("import jax, jax.numpy as jnp; f = jax.jit(lambda x: jnp.exp(x) * 2 + jnp.sin(x)); "
            "c = f.lower(jnp.ones((64, 64))).compile(); open(__import__('sys').argv[1], 'w').write(c.as_text())")
    out = tmp_path / "hlo.txt"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="ir_compiler=1", XLA_FLAGS="")
    run = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True,
                         check=True, cwd=BENCH)
    rows = cs.llvm_by_kernel(run.stderr, out.read_text())
    assert rows, f"no 'Compiled LLVM module' line in the log:\n{run.stderr[-2000:]}"
    assert all(ms >= 0 for ms, *_ in rows)
    assert ("glue", "f32[64,64]{1,0}") in [(stage, shape) for _, _, stage, shape in rows], rows  # the fusion, named
