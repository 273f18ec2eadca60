"""Small OS helpers shared by the host agent and ranks (Linux-specific bits are optional)."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import CodeType, FrameType

_PR_SET_PDEATHSIG = 1


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


class IdleCores:
    """How many of the CPUs this process may run on were idle, on average, between two
    calls of :meth:`since_last` (the first: since it was made), from ``/proc/stat``
    (each CPU's idle and iowait time against its whole time), and no more than its
    control group's CPU quota leaves unused (a container limited to 2 CPUs on a
    64-CPU machine sees 60 idle ones in ``/proc/stat``)."""

    def __init__(self, quota: CpuQuota | None) -> None:
        """``quota``: the control group's CPU quota to respect (this process's:
        :func:`cpu_quota`), or None."""
        self._quota = quota
        self._last = _cpu_times()
        self._last_used = self._used()

    def _used(self) -> tuple[float, float] | None:
        if self._quota is None:
            return None
        used = self._quota.used_seconds()
        return None if used is None else (time.monotonic(), used)

    def since_last(self) -> float | None:
        """Idle CPUs (0 to the number allowed) since the last call; None where it cannot
        be told (no ``/proc/stat``: not Linux; no time passed)."""
        now, last = _cpu_times(), self._last
        self._last = now
        common = [cpu for cpu in now if cpu in last]
        idle = sum(now[c][0] - last[c][0] for c in common)
        total = sum(now[c][1] - last[c][1] for c in common)
        spare = len(common) * idle / total if common and total > 0 else None
        used, last_used = self._used(), self._last_used
        self._last_used = used
        if self._quota is not None and used is not None and last_used is not None:
            elapsed = used[0] - last_used[0]
            if elapsed > 0:
                left = max(0.0, self._quota.cores - (used[1] - last_used[1]) / elapsed)
                spare = left if spare is None else min(spare, left)
        return spare


@dataclass(frozen=True)
class CpuQuota:
    """A control group's CPU limit: ``cores`` CPUs' worth of time, and where the group's
    CPU time used so far is read (``scale``: seconds per unit of that file)."""

    cores: float
    usage_file: str
    scale: float

    def used_seconds(self) -> float | None:
        try:
            with open(self.usage_file) as f:
                text = f.read()
        except OSError:
            return None
        for line in text.splitlines():  # cgroup v2 cpu.stat: "usage_usec N"; v1: "N"
            parts = line.split()
            if len(parts) == 1 or (len(parts) == 2 and parts[0] == "usage_usec"):
                try:
                    return int(parts[-1]) * self.scale
                except ValueError:
                    return None
        return None


def cpu_quota(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> CpuQuota | None:
    """The tightest CPU quota of this process's control group and its ancestors (cgroup
    v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``), or None: no limit, or none readable."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[CpuQuota] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        parts = [p for p in path.split("/") if p]
        groups = [parts[:depth] for depth in range(len(parts), -1, -1)]  # it, then ancestors
        if controllers == "":  # v2 (unified): mounted at root, or at root/unified (hybrid)
            base = root if os.path.exists(f"{root}/cgroup.controllers") else f"{root}/unified"
            found += [q for g in groups if (q := _v2_limit(os.path.join(base, *g)))]
        elif "cpu" in controllers.split(","):  # v1: its CPU time is cpuacct's
            found += [q for g in groups if (q := _v1_limit(root, controllers, g))]
    return min(found, key=lambda q: q.cores, default=None)


def _v2_limit(folder: str) -> CpuQuota | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = (f.read().split() + ["", ""])[:2]
        cores = int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):  # "max": no limit here
        return None
    return CpuQuota(cores, os.path.join(folder, "cpu.stat"), 1e-6)


def _v1_limit(root: str, controllers: str, group: list[str]) -> CpuQuota | None:
    folder = os.path.join(root, controllers, *group)
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1: no limit
        return None
    usage = os.path.join(root, "cpuacct", *group, "cpuacct.usage")  # (its own hierarchy)
    if not os.path.exists(usage):  # or mounted together with cpu ("cpu,cpuacct")
        usage = os.path.join(folder, "cpuacct.usage")
    return CpuQuota(quota / period, usage, 1e-9)


def _cpu_times() -> dict[int, tuple[int, int]]:
    """CPU number -> (idle + iowait, all) clock ticks, for the CPUs this process may run
    on; empty where ``/proc/stat`` cannot be read."""
    try:
        allowed: Collection[int] | None = os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - macOS
        allowed = None
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        cpu = int(name[3:])
        if allowed is not None and cpu not in allowed:
            continue
        ticks = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        if len(ticks) >= 5:
            out[cpu] = (ticks[3] + ticks[4], sum(ticks))
    return out


def proc_state(stat_path: str) -> str:
    """The state letter (``R``, ``S``, ``T``, ``Z`` ...) in a Linux ``stat`` file
    (``/proc/PID/stat`` or a thread's ``/proc/PID/task/TID/stat``); '' when it cannot be
    read (the process or thread is gone, or this is not Linux)."""
    try:
        with open(stat_path) as f:
            stat = f.read()
    except OSError:
        return ""
    # The command name, in parentheses, may itself hold spaces and ')': the state is
    # the first field after the last ')'.
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    return fields[0] if paren and fields else ""


def pid_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine is gone: no such process, or a zombie
    (dead, not yet reaped) or dead one. A pid reused by another process reads as alive;
    the holders of a pid check what else they know of it where that matters."""
    return proc_state(f"/proc/{pid}/stat") in ("", "Z", "X")


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


def runs_in(frame: FrameType | None, codes: Collection[CodeType]) -> bool:
    """Whether ``frame`` (where a signal handler found its thread) or one of its callers
    runs one of ``codes``: a handler defers what it would raise there."""
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (its thread id is its pid), not
    to whichever of its threads the kernel picks, as :func:`os.kill` would. Uses Linux's
    ``tgkill``; elsewhere (or without glibc's wrapper) falls back to :func:`os.kill`.
    Raises :class:`OSError` like :func:`os.kill` (``ProcessLookupError`` when gone)."""
    tgkill = _tgkill()
    if tgkill is None:
        os.kill(pid, sig)
        return
    if tgkill(pid, pid, sig) != 0:
        err = ctypes.get_errno()
        raise (ProcessLookupError if err == errno.ESRCH else OSError)(err, os.strerror(err))


@functools.cache
def _tgkill() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Callable[[int, int, int], int] = ctypes.CDLL(None, use_errno=True).tgkill
    except (OSError, AttributeError):  # pragma: no cover - glibc < 2.30, musl
        return None
    return fn


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_exit(code: int | None, sig: int | None) -> str:
    """``exit code 1`` / ``killed by SIGKILL``."""
    if sig:
        return f"killed by {signal_name(sig)}"
    return f"exit code {code}"


def tail_lines(path: str, n: int = 20, max_bytes: int = 16384) -> list[str]:
    """The last ``n`` lines of a text file (empty list if it does not exist)."""
    return _read_tail(path, max_bytes)[0][-n:]


def _read_tail(path: str, max_bytes: int) -> tuple[list[str], bool]:
    """The lines in the last ``max_bytes`` of a text file (crash-dump noise left out),
    and whether they reach back to its start (if not, the first, likely cut, line is
    dropped, unless it is the only one). ``([], True)`` if the file does not exist."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return [], True
    lines = data.decode("utf-8", "replace").splitlines()
    if start > 0 and len(lines) > 1:
        lines = lines[1:]
    return [line for line in lines if not _noise(line)], start == 0


#: The first window :func:`request_tail` reads.
TAIL_WINDOW = 16384
#: Written by a rank to its log when it starts and ends serving a request, so that the
#: output of a rank that died can be cut to what it printed in the request it died in.
#: (\x02 starts them: unlike \x1c-\x1e it is no line break for str.splitlines.)
REQUEST_START = "\x02mk-request-start"
REQUEST_END = "\x02mk-request-end"
#: Written by a rank of a detachable mesh when its controller goes away and when one is
#: connected again, so that the next controller shows what it printed meanwhile.
DETACHED_MARK = "\x02mk-detached"
ATTACHED_MARK = "\x02mk-attached"


def request_tail(path: str, n: int = 20, max_bytes: int = 1 << 20) -> list[str]:
    """A dead rank's last output lines, from its log: if it died serving a request,
    only what it printed since that request started (possibly nothing); if it died
    idle, its last lines. Markers are never shown.

    The log is read from its end in growing windows (16 KiB, then 4x more each time, up
    to ``max_bytes``) until the window holds ``n`` lines of output or the file's start:
    every request writes two markers, so after a few hundred silent calls a rank's last
    lines of output lie far behind its last 16 KiB."""
    window = min(TAIL_WINDOW, max_bytes)
    while True:
        lines, whole = _read_tail(path, window)
        for i in range(len(lines) - 1, -1, -1):
            if lines[i] == REQUEST_START:
                lines = lines[i + 1 :]  # what the request it died in printed (all of it)
                whole = True
                break
            if lines[i] == REQUEST_END:
                break
        shown = [line for line in lines if line not in (REQUEST_START, REQUEST_END)]
        if len(shown) >= n or whole or window >= max_bytes:
            return shown[-n:]
        window = min(window * 4, max_bytes)


def printed_since_detached(path: str, n: int = 20, max_bytes: int = 1 << 20) -> list[str]:
    """A rank's last ``n`` output lines printed since its controller last went away
    (from its log; empty if it never did, or printed nothing since)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    at = text.rfind(DETACHED_MARK)
    if at < 0:
        return []
    after = text[at + len(DETACHED_MARK) :].split(ATTACHED_MARK)[0]
    marks = (REQUEST_START, REQUEST_END)
    lines = [ln for ln in after.splitlines() if ln and ln not in marks and not _noise(ln)]
    return lines[-n:]


def _noise(line: str) -> bool:
    """Frames of our own runtime and faulthandler's module list, in a crash dump."""
    stripped = line.strip()
    if stripped in (DETACHED_MARK, ATTACHED_MARK):
        return True
    return stripped.startswith("Extension modules:") or (
        stripped.startswith("File ") and ("/monarch_kernel/" in line or "<frozen runpy>" in line)
    )
