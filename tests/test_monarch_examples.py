"""Monarch's own example programs, ported by changing the import line (and CUDA to CPU),
run as a Monarch user runs them: scripts with this environment's Python, notebooks with
a plain ``python3`` kernel. Each must exit 0, print its last line and leave no process.

The programs live in ``../shared/monarch_examples/`` (its README says what each must
print); without that directory these tests skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_program

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO.parent / "shared" / "monarch_examples"
#: Seconds one program may take (they take 5-15 s here).
LIMIT = 240

#: program -> the lines it must print (the last one last among the controller's lines)
SCRIPTS = {
    "ping_pong.py": ["Example completed successfully!"],
    "grpo_yield.py": ["[controller] training complete at step 20"],
    "getting_started_actors.py": ["It didn't say hello", "inferred with:"],
    "ddp/spmd_ddp.py": ["DDP example completed successfully!"],
}
NOTEBOOKS = {
    "slurm_allreduce.ipynb": ['"rank_3": 4'],
    "slurm_ddp.ipynb": ["DDP example completed successfully!"],
}


def _run(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    if not EXAMPLES.is_dir():
        pytest.skip(f"{EXAMPLES} is absent (Monarch's ported examples live in ../shared/)")
    t0 = time.monotonic()
    proc = run_program(argv, cwd, LIMIT, grace=10)
    return proc, time.monotonic() - t0


def _controller_lines(stdout: str) -> list[str]:
    """What the program itself printed (rank output is ``[rank N] ...``)."""
    return [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("[rank ")]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_monarch_example_script_runs(script):
    proc, elapsed = _run([sys.executable, str(EXAMPLES / script)], EXAMPLES)
    out = proc.stdout
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    )
    for line in SCRIPTS[script]:
        assert line in out, f"{script} did not print {line!r}:\n{out[-3000:]}"
    last = _controller_lines(out)[-1]
    assert SCRIPTS[script][-1] in last, f"{script} ended with {last!r}"
    print(f"{script}: {elapsed:.1f} s")


def _notebook_text(path: Path) -> str:
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                parts.append("".join(out["text"]))
            elif out["output_type"] == "error":
                parts.append("\n".join(out["traceback"]))
    return "".join(parts)


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS))
def test_monarch_example_notebook_runs_in_a_plain_kernel(notebook, tmp_path):
    executed = tmp_path / notebook
    jupyter_execute = Path(sys.executable).with_name("jupyter-execute")
    argv = [
        str(jupyter_execute),
        "--kernel_name=python3",
        f"--output={executed.with_suffix('')}",
        str(EXAMPLES / notebook),
    ]
    proc, elapsed = _run(argv, EXAMPLES)
    assert proc.returncode == 0, f"{notebook} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    text = _notebook_text(executed)
    for line in NOTEBOOKS[notebook]:
        assert line in text, f"{notebook} did not print {line!r}:\n{text[-3000:]}"
    print(f"{notebook}: {elapsed:.1f} s")
