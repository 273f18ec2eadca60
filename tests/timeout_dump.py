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
would kill the others): a rank's stacks file (``wire.stacks.stacks_path``) is open in
it.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import TextIO

import psutil

from monarch_kernel.host.stacks import dump_stacks
from monarch_kernel.wire.lane import _HEAD, _TAIL, _U64
from monarch_kernel.wire.stacks import stacks_path

#: Seconds before the test's limit when the ranks are asked for their stacks.
AHEAD_S = 10.0
#: Longest wait for the ranks' dumps to be written.
DUMP_WAIT_S = 3.0
#: Lines of each rank's log printed with its stack.
LOG_LINES = 30


def _ranks() -> dict[int, str]:
    """pid -> log path of every rank under this process: those that hold their stacks
    file (``stacks_path(log, pid)``) open."""
    found: dict[int, str] = {}
    for proc in psutil.Process().children(recursive=True):
        suffix = stacks_path("", proc.pid)
        try:
            files = proc.open_files()
        except psutil.Error:  # gone meanwhile
            continue
        for f in files:
            if f.path.endswith(suffix):
                found[proc.pid] = f.path[: -len(suffix)]
    return found


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"(its log cannot be read: {exc})\n"


def dump_ranks(out: TextIO | None = None) -> int:
    """Print the main-thread stack and the log's end of every rank under this process
    (``host.stacks.dump_stacks``, as a host agent does for ``%mesh stacks``); the number
    of ranks asked."""
    write = (out or sys.stdout).write
    logs = _ranks()
    dumped = dict(dump_stacks({pid: pid for pid in logs}, logs, DUMP_WAIT_S))
    for pid, log in sorted(logs.items()):
        write(f"~~~~~~~~ rank pid {pid}: main thread ~~~~~~~~\n")
        threads = dumped.get(pid)
        if not threads:
            write("(no dump within the wait: stuck where signals are not handled?)\n")
        for thread in threads or ():
            for frame in reversed(thread.frames):  # innermost first, as faulthandler
                write(f'  File "{frame.filename}", line {frame.lineno} in {frame.function}\n')
        write(f"~~~~~~~~ rank pid {pid}: the end of {log} ~~~~~~~~\n{_tail(log, LOG_LINES)}")
    return len(logs)


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
