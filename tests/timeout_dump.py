"""What a test that runs out of time shows of its ranks, not only of the pytest process.

pytest-timeout prints the stacks of the pytest process's threads when a test passes its
limit. A hang is mostly in a rank (a collective, a gate, a lost message), and those
stacks say nothing of it. So, a few seconds before the limit, every rank that descends
from this process (in-process meshes' ranks, and those of the kernels a test started)
dumps its main thread's stack with the rank's own ``faulthandler`` handler
(``monarch_kernel.rank.forked``: the signal ``%mesh stacks`` uses when a rank cannot
answer), and the dump and the end of the rank's log are printed into the test's
captured output, where the failure report shows them.

Only ranks that registered the handler are signalled (the signal's default action
would kill the others): a rank's stacks file is open in it under the name
``<log>.<pid>.stacks``.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from monarch_kernel.wire.lane import _HEAD, _TAIL, _U64
from monarch_kernel.wire.osutil import signal_main_thread
from monarch_kernel.wire.stacks import DUMP_HEADER, STACKS_SIGNAL

#: Seconds before the test's limit when the ranks are asked for their stacks.
AHEAD_S = 10.0
#: Longest wait for the ranks' dumps to be written.
DUMP_WAIT_S = 3.0
#: Lines of each rank's log printed with its stack.
LOG_LINES = 30

_SUFFIX = ".stacks"


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process now (from ``/proc``)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        out.setdefault(int(fields[1]), []).append(int(name))
    return out


def _descendants(root: int) -> Iterator[int]:
    children = _children()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        yield pid
        todo.extend(children.get(pid, ()))


def _stacks_file(pid: int) -> str | None:
    """The stacks file rank ``pid`` has open, None if it is not a rank (or is gone)."""
    suffix = f".{pid}{_SUFFIX}"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith(suffix):
            return target
    return None


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"(its log cannot be read: {exc})\n"


def dump_ranks(out: TextIO | None = None) -> int:
    """Print the main-thread stack and the log's end of every rank under this process;
    the number of ranks asked."""
    write = (out or sys.stdout).write
    paths: dict[int, str] = {}
    for pid in _descendants(os.getpid()):
        path = _stacks_file(pid)
        if path is None:
            continue
        try:
            os.truncate(path, 0)
            signal_main_thread(pid, STACKS_SIGNAL)
        except OSError:
            continue
        paths[pid] = path
    files = dict(paths)
    deadline = time.monotonic() + DUMP_WAIT_S
    texts: dict[int, str] = {}
    while files and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid, path in list(files.items()):
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            if DUMP_HEADER in text and text.endswith("\n"):
                texts[pid] = text
                del files[pid]
    for pid in files:
        texts[pid] = "(no dump within the wait: stuck where signals are not handled?)\n"
    for pid, text in sorted(texts.items()):
        log = paths[pid][: -len(f".{pid}{_SUFFIX}")]
        write(f"~~~~~~~~ rank pid {pid}: main thread ~~~~~~~~\n{text}")
        write(f"~~~~~~~~ rank pid {pid}: the end of {log} ~~~~~~~~\n{_tail(log, LOG_LINES)}")
    return len(texts)


def dump_lanes(out: TextIO | None = None) -> int:
    """Print where each same-machine lane of this process's meshes stands (ring
    positions both ways, the messages read and not handled): a message that sits in a
    ring nobody reads is a lost wake-up. The number of lane sets found."""
    write = (out or sys.stdout).write
    module = sys.modules.get("monarch_kernel.controller.messaging.lanes")
    if module is None:
        return 0
    found = [o for o in gc.get_objects() if isinstance(o, module.Lanes)]
    for lanes in found:
        if lanes.closed:
            continue
        write(
            f"~~~~~~~~ lanes {id(lanes):#x}: sent {lanes.sent}, fell back {lanes.fallbacks}, "
            f"received {lanes.received}, read and not handled {len(lanes._ready)}, "
            f"to look at {sorted(lanes._look)}, doorbell rang {lanes._bell_poll.poll(0)!r}\n"
        )
        for slot, lane in sorted(lanes._lanes.items()):
            rings = []
            for name, ring in (("down", lane.file.down), ("up", lane.file.up)):
                try:
                    head, tail = (
                        _U64.unpack_from(lane.file.mem, ring._base + at)[0] for at in (_HEAD, _TAIL)
                    )
                except ValueError:
                    rings.append(f"{name} closed")
                    continue
                rings.append(f"{name} head {head} tail {tail}")
            write(f"  slot {slot}: active {lane.active}; " + "; ".join(rings) + "\n")
    return len(found)


class RankDumpTimer:
    """Calls :func:`dump_ranks` ``AHEAD_S`` before a test's limit, unless cancelled."""

    def __init__(self, limit: float) -> None:
        self._timer = threading.Timer(max(limit - AHEAD_S, limit * 0.8), self._fire)
        self._timer.name = "rank-stacks-before-timeout"
        self._timer.daemon = True

    def _fire(self) -> None:
        sys.stdout.write("++++++++ the test is near its limit: its ranks' stacks ++++++++\n")
        try:
            n = dump_ranks()
            dump_lanes()
        except Exception as exc:  # a report that failed must not hide the timeout
            sys.stdout.write(f"(the ranks' stacks could not be taken: {exc!r})\n")
            return
        sys.stdout.write(f"++++++++ {n} rank(s) dumped ++++++++\n")
        sys.stdout.flush()

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()
