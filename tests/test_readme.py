"""Every ```python block of README.md runs as written (issue 39 item 7).

The blocks run top to bottom in one Python session, as a reader would paste them, eagerly
where the README is eager, in a fresh process as a new user has it: JAX's defaults (no x64
mode, which the suite's conftest turns on; one CPU device: the suite's simulated devices
are taken out of XLA_FLAGS, and the sequence-parallel block runs on the devices it finds),
an empty working directory, nothing written for it beforehand (the layer block writes the
checkpoint it loads)."""

from pathlib import Path

from ._util import python_blocks, run_python_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_blocks_found():
    blocks = python_blocks(README.read_text())
    # Use, the stage swap, sequence parallel, the layer (a README block that no longer
    # parses as a fence would be skipped silently: count them)
    assert len(blocks) >= 4
    for b in blocks:
        compile(b, "README.md", "exec")


def test_readme_blocks_run_as_written(tmp_path):
    print(run_python_blocks(python_blocks(README.read_text()), "README.md", tmp_path))
