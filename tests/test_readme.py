"""Every ```python block of README.md runs as written (issue 39 item 7).

The blocks run top to bottom in one Python session, as a reader would paste them, eagerly
where the README is eager, in a fresh process as a new user has it: JAX's defaults (no x64
mode, which the suite's conftest turns on; one CPU device: the suite's simulated devices
are taken out of XLA_FLAGS, and the sequence-parallel block runs on the devices it finds),
an empty working directory, nothing written for it beforehand (the layer block writes the
checkpoint it loads)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    """The contents of every ```python fence, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_blocks_found():
    blocks = python_blocks(README.read_text())
    # Use, the stage swap, sequence parallel, the layer (a README block that no longer
    # parses as a fence would be skipped silently: count them)
    assert len(blocks) >= 4
    for b in blocks:
        compile(b, "README.md", "exec")


RUNNER = textwrap.dedent('''
    import sys, time, traceback
    blocks = {blocks!r}
    ns = {{"__name__": "__main__"}}
    for i, src in enumerate(blocks):
        t = time.perf_counter()
        try:
            exec(compile(src, f"README.md block {{i}}", "exec"), ns)
        except BaseException:
            print(f"README block {{i}} failed:\\n{{src}}", flush=True)
            traceback.print_exc()
            sys.exit(1)
        print(f"README block {{i}} ran in {{time.perf_counter() - t:.1f}} s", flush=True)
''')


def test_readme_blocks_run_as_written(tmp_path):
    blocks = python_blocks(README.read_text())
    script = tmp_path / "readme_blocks.py"
    script.write_text(RUNNER.format(blocks=blocks))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_ENABLE_X64", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert run.stdout.count("ran in") == len(blocks), run.stdout
    print(run.stdout)
