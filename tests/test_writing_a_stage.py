"""docs/writing_a_stage.md (issue 52 item 6): every ```python block runs as written, top to
bottom in one fresh Python process, as a reader would paste them (JAX's defaults: the page
turns x64 on itself; one CPU device; an empty working directory); the page lists at most
fifteen concepts, and each section names only concepts of that list."""

import re
from pathlib import Path

from ._util import python_blocks, run_python_blocks

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "writing_a_stage.md"


def concepts(text: str) -> list[str]:
    """The numbered entries of the section "What you need to know"."""
    section = re.search(r"^## What you need to know\n(.*?)^## ", text, flags=re.S | re.M)
    assert section, "no section '## What you need to know' followed by another section"
    return re.findall(r"^(\d+)\. ", section.group(1), flags=re.M)


def test_at_most_fifteen_concepts():
    text = PAGE.read_text()
    numbers = concepts(text)
    assert 1 <= len(numbers) <= 15, numbers
    assert numbers == [str(i) for i in range(1, len(numbers) + 1)], numbers
    # "Concepts 3-6, 8-11." at a section's start: only numbers of the list
    for line in re.findall(r"^Concepts? ([\d, -]+)\.", text, flags=re.M):
        for part in line.split(","):
            for n in part.strip().split("-"):
                assert 1 <= int(n) <= len(numbers), line


def test_blocks_found():
    text = PAGE.read_text()
    blocks = python_blocks(text)
    # set-up, the F1 and its check, its plan, the F5 and its check, check_pipeline, the
    # training step, the check against the recurrence
    assert len(blocks) >= 8
    for b in blocks:
        compile(b, "writing_a_stage.md", "exec")
    assert "kdax.testing.check_stage(TemperedGate" in text and "kdax.testing.check_stage(FormulaOutput" in text
    assert "jax.value_and_grad(loss)" in text


def test_page_blocks_run_as_written(tmp_path):
    print(run_python_blocks(python_blocks(PAGE.read_text()), "writing_a_stage.md", tmp_path))
