"""The repository is self-contained: a clone in an empty folder (no ``../shared``) runs the
golden tests with its own ``kdax``."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_golden_tests_pass_in_a_fresh_clone(tmp_path):
    clone = tmp_path / "kdax-clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kdax-clone"]  # nothing beside it: no ../shared
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    # python -m puts the clone's root first on sys.path: its kdax is the one imported.
    where = subprocess.run([sys.executable, "-c", "import kdax; print(kdax.__file__)"], cwd=clone, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert pathlib.Path(where).resolve().is_relative_to(clone.resolve()), where
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "tests/test_recurrent.py", "-k",
         "golden"],
        cwd=clone, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
