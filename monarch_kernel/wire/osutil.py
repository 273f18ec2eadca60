"""Small OS helpers shared by the host agent and ranks (Linux-specific bits are optional)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    If ``expected_parent`` is given and the parent is already gone (we were re-parented
    before the prctl), exit at once: nothing may outlive its controller.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - non-glibc
            pass
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(3)


def describe_exit(code: int | None, sig: int | None) -> str:
    """``exit code 1`` / ``killed by SIGKILL``."""
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exit code {code}"


def tail_lines(path: str, n: int = 20, max_bytes: int = 16384) -> list[str]:
    """The last ``n`` lines of a text file (empty list if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if not _noise(line)]
    return lines[-n:]


def _noise(line: str) -> bool:
    """Frames of our own runtime and faulthandler's module list, in a crash dump."""
    stripped = line.strip()
    return stripped.startswith("Extension modules:") or (
        stripped.startswith("File ") and ("/monarch_kernel/" in line or "<frozen runpy>" in line)
    )
