"""Kernel input that must never hurt the notebook: mesh names that would replace IPython's
own names or the user's variables, more ranks than the machine holds, the stop button
during a slow start, and cell labels that match the prompt numbers the user sees."""

from __future__ import annotations

import re

import pytest
from conftest import pid_alive
from helpers import wait_until
from kernel_client import Kernel

from monarch_kernel.launchers import local
from monarch_kernel.launchers.local import MAX_RANKS_ENV, LocalLauncher, rank_limit

GiB = 1 << 30


@pytest.fixture(scope="module")
def kernel():
    """A kernel whose local meshes may run 4 ranks at once, with a 2-rank mesh ``m``
    created with ``--dist`` (its set-up cell runs on the ranks from the %mesh prompt)."""
    k = Kernel(env={MAX_RANKS_ENV: "4"})
    r = k.run("%mesh m --gpus 2 --dist")
    assert "process group initialised" in r.stdout, r.stderr + r.error_text
    yield k
    k.shutdown_and_check()


def usage_error(r) -> str:
    assert r.reply["status"] == "error" and r.reply["ename"] == "UsageError", r
    return r.stderr.strip()


# -- names ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["get_ipython", "In", "Out", "exit", "display", "_", "_ih"])
def test_ipython_names_are_always_refused(kernel, name):
    for force in ("", " --force"):
        text = usage_error(kernel.run(f"%mesh {name} --gpus 1{force}"))
        assert text == (
            f"UsageError: %mesh {name}: {name!r} is one of IPython's own names; a mesh bound "
            "to it would break the notebook. Pick another mesh name"
        )
    r = kernel.run("%mesh")  # magics (get_ipython().run_line_magic) still work
    assert not r.errors and "gpus=2" in r.text
    r = kernel.run("type(get_ipython()).__name__, type(In).__name__")
    assert r.text == "('ZMQInteractiveShell', 'list')"


def test_user_variable_is_kept_unless_forced(kernel):
    kernel.run("model = [1, 2]")
    text = usage_error(kernel.run("%mesh model --gpus 1"))
    assert text == (
        "UsageError: %mesh model: 'model' already holds a list in the notebook; pick another "
        "mesh name, or add --force to replace it"
    )
    assert kernel.run("model").text == "[1, 2]"
    assert "is a Python builtin" in usage_error(kernel.run("%mesh print --gpus 1"))
    r = kernel.run("%mesh model --gpus 1 --force")
    assert "ready" in r.stdout, r.stderr + r.error_text
    assert kernel.run("type(model).__name__, model.name").text == "('ProcMesh', 'model')"
    r = kernel.run("%mesh model --gpus 1")  # a name that holds a mesh: as before
    assert "already running" in r.stdout, r.stderr + r.error_text
    kernel.run("%mesh stop model")
    r = kernel.run("%mesh model --gpus 1")  # ... running or stopped
    assert "ready" in r.stdout, r.stderr + r.error_text
    kernel.run("%mesh stop model")


# -- how many ranks ------------------------------------------------------------------
def test_too_many_ranks_are_refused_before_anything_starts(kernel):
    before = kernel.pids()
    text = usage_error(kernel.run("%mesh big --gpus 3"))  # with m's 2 ranks: 5 > 4
    assert text == (
        "UsageError: %mesh big: 3 ranks are more than the local backend allows: local meshes "
        f"may run at most 4 ranks at once on this machine (set by {MAX_RANKS_ENV}); 2 already "
        "run in other meshes. Use fewer ranks, or set the environment variable "
        f"{MAX_RANKS_ENV}=N to change the limit"
    )
    assert "6 ranks are more" in usage_error(kernel.run("%mesh big --gpus 1 --hosts 6"))
    # without the variable, the machine's own limit (the stop button could not halt
    # 10,000 forks)
    kernel.run(f"import os; _limit = os.environ.pop({MAX_RANKS_ENV!r})")
    try:
        text = usage_error(kernel.run("%mesh big --gpus 10000"))
        assert re.search(r"at most \d+ ranks at once on this machine \(\d+ CPUs, ", text), text
        assert f"{MAX_RANKS_ENV}=N" in text
    finally:
        kernel.run(f"os.environ[{MAX_RANKS_ENV!r}] = _limit")
    assert kernel.pids() == before
    assert "big" not in kernel.run("%mesh").text


def test_the_environment_variable_raises_the_limit(kernel):
    assert "at most 4 ranks" in usage_error(kernel.run("%mesh big --gpus 3"))
    kernel.run(f"%env {MAX_RANKS_ENV}=5")
    try:
        r = kernel.run("%mesh big --gpus 3")
        assert "ready" in r.stdout, r.stderr + r.error_text
        kernel.run("%mesh stop big")
    finally:
        kernel.run(f"%env {MAX_RANKS_ENV}=4")


@pytest.mark.unit
def test_rank_limit_formula():
    assert rank_limit(2, 24 * GiB) == 64  # this CI machine: at least 64 by CPU
    assert rank_limit(16, 64 * GiB) == 16 * 32
    assert rank_limit(64, 10 * GiB) == 80  # memory bound: 128 MiB a rank
    assert rank_limit(8, 0) == 1


@pytest.mark.unit
def test_check_capacity_limit_and_override(monkeypatch):
    launcher = LocalLauncher.shared()
    monkeypatch.delenv(MAX_RANKS_ENV, raising=False)
    monkeypatch.setattr(local, "cpu_count", lambda: 2)
    monkeypatch.setattr(local, "available_memory", lambda: 24 * GiB)
    launcher.check_capacity(60, running=4)
    with pytest.raises(ValueError, match=r"at most 64 ranks .*\(2 CPUs, 24.0 GiB of memory"):
        launcher.check_capacity(61, running=4)
    monkeypatch.setenv(MAX_RANKS_ENV, "100000")
    launcher.check_capacity(10000)
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(MAX_RANKS_ENV, bad)
        with pytest.raises(ValueError, match=f"{MAX_RANKS_ENV}='{bad}' is not a positive"):
            launcher.check_capacity(1)


@pytest.mark.unit
def test_available_memory_is_positive():
    assert local.available_memory() > 0


# -- prompt numbers ------------------------------------------------------------------
def test_remote_cell_label_is_the_prompt_number(kernel):
    kernel.run("a = 1")
    kernel.run("%%remote m\nb = 2")
    r = kernel.run("%%remote m\nb\n1 / 0")
    assert r.reply["status"] == "error"
    labels = set(re.findall(r"<remote cell ([^>]*)>", r.error_text))
    assert labels == {str(r.reply["execution_count"])}, (labels, r.reply["execution_count"])
    # a second run on ranks from the same prompt: N.2
    r = kernel.run("%remote m b\n%remote m 1 / 0")
    labels = set(re.findall(r"<remote cell ([^>]*)>", r.error_text))
    assert labels == {f"{r.reply['execution_count']}.2"}, labels


# -- the stop button during a slow start ---------------------------------------------
SLOW_TEMPLATE = """\
import os, sys, time
if "monarch_kernel.host.template" in sys.orig_argv:  # the host agent's warm template
    time.sleep(float(os.environ["MK_TEST_SLOW_TEMPLATE"]))
"""


def test_interrupt_during_a_slow_start_stops_everything(tmp_path):
    """The stop button while ``%mesh`` waits for its ranks (here: a template that takes 3 s
    to start) ends the cell with one line, and leaves no host agent or rank behind, even
    when pressed twice."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_TEMPLATE)
    import os

    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {"MONARCH_KERNEL_PREWARM": "0", "PYTHONPATH": path, "MK_TEST_SLOW_TEMPLATE": "3"}
    k = Kernel(env=env)
    try:
        kernel_pid = k.pids()[0]
        msg_id = k.submit("%mesh slow --gpus 8")
        wait_until(lambda: len(k.pids()) >= 3, timeout=20, what="host agent and template")
        started = k.pids()[1:]
        k.km.interrupt_kernel()
        k.km.interrupt_kernel()  # pressed again while the start stops what it started
        r = k.collect(msg_id, timeout=30)
        assert r.reply["status"] == "error"
        assert r.error_text == (
            "MeshStartError: mesh 'slow': start interrupted; the ranks and host agents it "
            "had started are stopped"
        )
        assert not any(pid_alive(p) for p in started)
        assert k.pids() == [kernel_pid]
        assert re.search(r"slow\s+gpus=8\s+local\s+0/8\s+stopped", k.run("%mesh").text)
    finally:
        k.shutdown_and_check()
