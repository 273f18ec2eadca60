"""Small helpers shared by the tests: waiting for an observable event instead of sleeping."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from monarch_kernel.wire.osutil import proc_state

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """``wait_until`` gave up: the condition was still false when the time ran out."""


def wait_until(
    cond: Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
    detail: Callable[[], Any] | None = None,
) -> T:
    """Call ``cond()`` every ``interval`` seconds until it returns something true; return it.

    Raises :class:`WaitTimeout` (an AssertionError, so a test fails) naming ``what`` and
    the timeout if ``cond`` is still false after ``timeout`` seconds; ``detail()``, when
    given, describes the state at that moment (e.g. which processes are still alive).
    ``cond`` is always called at least once, and once more at the deadline.
    """
    if timeout < 0 or interval < 0:
        raise ValueError(f"timeout and interval must be >= 0, got {timeout} and {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            message = f"timed out after {timeout:g}s waiting for {what or _name(cond)}"
            if detail is not None:
                message += f"; {detail()}"
            raise WaitTimeout(message)
        time.sleep(min(interval, left))


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and wait until every one of its threads has stopped.

    ``kill`` returns before the stop takes effect: each thread stops only once it is
    scheduled again, and on a loaded machine its libzmq I/O thread may meanwhile still
    take a connection and a message (a request sent "to a stopped agent" was then served
    as soon as it ran again)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return False
        states = (proc_state(f"/proc/{pid}/task/{tid}/stat") for tid in tids)
        return all(state in ("", "T", "t") for state in states)  # '': a thread that ended

    wait_until(stopped, timeout=timeout, interval=0.005, what=f"every thread of {pid} to stop")


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"the condition {name}"


def wait_for_rank_line(procs: Any, rank: int, text: str, timeout: float = 15.0) -> None:
    """Wait until ``rank`` of mesh ``procs`` has printed a line containing ``text``.

    Uses the lines the controller keeps for each rank (``procs.runtime.ranks[r].tail``):
    a printed line is proof that the rank has started the code that printed it.
    """

    def lines() -> list[str]:
        return list(procs.runtime.ranks[rank].tail)

    wait_until(
        lambda: any(text in line for line in lines()),
        timeout=timeout,
        what=f"rank {rank} to print {text!r}",
        detail=lambda: f"its last lines: {lines()[-5:]}",
    )


@contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment; put back what was there after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kill(pid: int | None, sig: int) -> None:
    """``os.kill`` for a pid the controller records (``None`` until the process is up)."""
    assert pid is not None, "the process has no pid yet"
    os.kill(pid, sig)


def pythonpath_with(first: str) -> str:
    """``$PYTHONPATH`` with ``first`` in front (processes started from it import there)."""
    path = os.environ.get("PYTHONPATH", "")
    return first + (os.pathsep + path if path else "")


def controller_bytes(runtime: Any) -> int:
    """Bytes the controller has sent to the ranks of the mesh ``runtime`` runs (a
    rank-to-rank call never adds to it)."""
    return sum(info.bytes_out for info in runtime.ranks)


def ranks_showing(out: str, line: str) -> set[int]:
    """The ranks whose output has ``line`` (the kernel writes ``[0-2] text`` for lines
    that several ranks printed alike, ``[3] text`` for one rank's)."""
    import re

    ranks: set[int] = set()
    for row in out.splitlines():
        m = re.match(r"^\[([0-9,\- ]+)\] ?(.*)$", row)
        if m is None or m.group(2) != line:
            continue
        for part in m.group(1).split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    return ranks


#: The checkout the tests run from (put first on a program's path by :func:`program_env`).
REPO = Path(__file__).resolve().parent.parent


def program_env(tag: str) -> dict[str, str]:
    """The environment of a user's program that a test runs: this checkout first on the
    path (its ranks inherit it), and ``MK_EXAMPLE_TAG=tag``, inherited by every process
    the program starts, to find any it leaves behind (:func:`tagged_processes`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["MK_EXAMPLE_TAG"] = tag
    return env


def tagged_processes(tag: str) -> list[psutil.Process]:
    """The live (not zombie) processes whose environment has ``MK_EXAMPLE_TAG=tag``."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MK_EXAMPLE_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def run_program(
    argv: list[str], cwd: Path | str, limit: float, grace: float = 15.0
) -> subprocess.CompletedProcess[str]:
    """Run a user's program (``argv``, in ``cwd``, with :func:`program_env`) to its end,
    at most ``limit`` seconds; then wait up to ``grace`` seconds for every process it
    started to end. Those left are killed (never left to other tests) and the test
    fails naming them."""
    tag = uuid.uuid4().hex
    try:
        return subprocess.run(
            argv, cwd=cwd, env=program_env(tag), capture_output=True, text=True, timeout=limit
        )
    finally:
        try:
            wait_until(
                lambda: not tagged_processes(tag), timeout=grace, what="the program's processes"
            )
        except WaitTimeout:
            left = tagged_processes(tag)
            for p in left:
                p.kill()
            pytest.fail("processes left behind: " + ", ".join(str(p.pid) for p in left))


def assert_in_order(text: str, markers: list[str], shown: str = "") -> None:
    """Each of ``markers`` occurs in ``text``, in that order (``shown``: what the
    failure prints besides the end of ``text``)."""
    at = 0
    for marker in markers:
        found = text.find(marker, at)
        assert found >= 0, f"{marker!r} missing (after offset {at}):\n{text[-4000:]}\n{shown}"
        at = found + len(marker)
