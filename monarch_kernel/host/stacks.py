"""Stacks of ranks stuck where their control thread cannot answer (C code holding the
GIL): the host agent makes each one's main thread dump its own stack with
``faulthandler``.

Only the main thread, signalled directly (``tgkill``): a thread that dumps *other*
threads from a signal handler reads their frames while they may run, and a rank
whose threads start and end meanwhile dies of SIGSEGV (reproduced: within a few
hundred dumps). A thread dumping itself is interrupted while it does, so its frames
hold still. The main thread is the one that runs cells and endpoints: the one that
is stuck.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping

from monarch_kernel.wire.osutil import signal_main_thread
from monarch_kernel.wire.stacks import (
    DUMP_HEADER,
    STACKS_SIGNAL,
    ThreadStack,
    parse_faulthandler,
    stacks_path,
)


def dump_stacks(
    pids: Mapping[int, int], logs: Mapping[int, str], wait: float
) -> Iterator[tuple[int, tuple[ThreadStack, ...]]]:
    """Signal the main thread of each rank of ``logs`` (rank -> its log path) that runs
    (``pids``: rank -> pid) to dump its stack, and yield ``(rank, threads)`` for each
    dump as it is complete.

    Complete: each rank is signalled twice. The signal is blocked while its handler
    runs and a real-time one is queued, so the second dump starts only once the first
    is written; its header in the file says the first is whole. (A file that merely
    stopped growing could be a dump whose writer was preempted halfway, on a loaded
    machine.) Waits at most ``wait`` seconds in all (the dumps take microseconds, so
    the agent's heartbeats never suffer); by then a rank's dump is taken as it is, and
    a rank that wrote nothing yields nothing.
    """
    files: dict[int, str] = {}
    for r, log in logs.items():
        pid = pids.get(r)
        if not pid:
            continue
        path = stacks_path(log, pid)
        try:  # absent until the rank registered its handler: never signal it before
            os.truncate(path, 0)
            signal_main_thread(pid, STACKS_SIGNAL)
            signal_main_thread(pid, STACKS_SIGNAL)
        except OSError:
            continue
        files[r] = path
    deadline = time.monotonic() + wait
    while files:
        time.sleep(0.01)
        last = time.monotonic() >= deadline
        for r, path in list(files.items()):
            try:
                with open(path, errors="replace") as f:
                    text = f.read()
            except OSError:
                del files[r]
                continue
            if text.count(DUMP_HEADER) >= 2 or (last and text):
                del files[r]
                yield r, parse_faulthandler(text)
        if last:
            break
