"""Issue 18 item 2: float32 chunk_kda's error against the float64 oracle, as a multiple of
the float32 recurrence's (fused_recurrent_kda) on the same inputs, per output/gradient and
chunk size (the inputs of tests/test_hardening.py: B=1, T=256, H=2, K=V=16; "none": the
same inputs without extreme gates).

    python benchmarks/extreme_gates.py [patterns] [chunk sizes]    # from the repository root
    python benchmarks/extreme_gates.py one_token,scattered,none 16,32,64,128
"""

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.getcwd())

import jax.numpy as jnp  # noqa: E402

import kdax  # noqa: E402
from tests._util import make_inputs  # noqa: E402
from tests.test_hardening import _chunked, _errors, _extreme  # noqa: E402


def main(patterns, chunk_sizes):
    for pattern in patterns:
        x64 = make_inputs(seed=4, B=1, T=256, H=2, K=16, V=16) if pattern == "none" else _extreme(pattern)
        x32 = {n: a.astype(jnp.float32) for n, a in x64.items()}
        rec = _errors(kdax.fused_recurrent_kda, x32, x64, {})
        print(pattern, "recurrence:", " ".join(f"{n} {v:.2e}" for n, v in rec.items()), flush=True)
        for C in chunk_sizes:
            got = _errors(_chunked(kdax.KDAPipeline.reference(), C), x32, x64, {})
            ratios = {n: got[n] / rec[n] for n in got}
            print(f"  C={C:4d}: " + "  ".join(f"{n} {r:.1f}x" for n, r in ratios.items()),
                  f"| max {max(ratios.values()):.1f}x", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["one_token", "scattered", "none"],
         [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 32, 64, 128])
