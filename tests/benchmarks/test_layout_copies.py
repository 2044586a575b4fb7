"""``benchmarks/layout_copies.py``: the transposes XLA makes around the Pallas kernels."""

import pytest

from ._load import load_benchmark


@pytest.fixture(scope="module")
def lc():
    return load_benchmark("layout_copies")


def test_no_layout_copies_of_the_inputs(lc):
    """Lowered for a GPU, the all-Triton pipeline's forward and training step on dense bf16
    input (T a multiple of the chunk size) transpose no input and not ``do``: the only
    transpose of input size left is o's unpacking in the forward; the training step has
    none (its gradient does not read o, and B3 and B5 write dq, dk, dv, dg, dbeta in the
    caller's layout themselves: the ``"final_grads"`` capability). With
    ``read_views=False`` (``+noviews``: the chunked copies, as before ``kdax._layouts.tokens``)
    the 5 and 9 of before come back. At the benchmark's shape: 641 -> 128 MiB written by
    transposes in the forward, 1154 -> 513 MiB a training step (benchmarks/NOTES.md,
    session 15)."""
    B, T, H, K = 1, 256, 2, 32
    at_least = 2 * B * T * H * K  # an input-sized array in bf16 (beta's are smaller)
    counts = {}
    for path in ("pallas", "pallas+noviews"):
        text = lc.lowered(path, B=B, T=T, H=H, K=K, C=64)
        counts[path] = tuple(len(lc.transposes(text[n], at_least)) for n in ("forward", "training step"))
    assert counts["pallas"] == (1, 0), counts
    # (each stage then copies the view it is given: XLA merges the equal copies)
    assert counts["pallas+noviews"][0] == 5 and counts["pallas+noviews"][1] >= 9, counts
