"""``%mesh profile`` on the rank: ``torch.profiler`` over the next steps of its loop.

The controller's ``profile`` control message (served while the loop runs) arms a
:class:`ProfileRun`; the loop's thread starts the profiler at its next step boundary,
stops it after the asked number of steps and replies with the trace
(:class:`RankTrace`). The trace's timestamps are torch's own clock; an anchor event
recorded at a known ``time.time()`` lets the controller put every rank on one axis.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from monarch_kernel.wire.steps import ProfileOrder, RankTrace, StepRecord

log = logging.getLogger("monarch_kernel.rank")

#: The name of the anchor event each rank's trace starts with.
ANCHOR = "monarch_kernel.profile_anchor"
#: Ops per rank kept for the summary.
TOP_OPS = 12


Reply = Callable[[RankTrace], None]


class ProfileRun:
    """One armed ``%mesh profile`` on this rank (the loop's thread drives it)."""

    def __init__(self, order: ProfileOrder, rank: int, reply: Reply):
        self.order = order
        self.rank = rank
        self._reply = reply
        self._prof: Any = None
        self._left = order.steps
        self._anchor_epoch = 0.0
        self._first_step = 0
        self._comm = 0.0  # seconds blocked in collectives over the profiled steps

    def on_step(self, record: StepRecord) -> bool:
        """A step ended: start at the first, stop after ``steps``; True once done."""
        if self._prof is None:
            order = self.order
            if order.start_step:  # the step before the first profiled one just ended
                due = record.step >= order.start_step - 1
            else:
                due = time.time() >= order.start_after
            if due:
                self._first_step = record.step + 1
                self._start()
            return False
        self._comm += record.comm
        self._left -= 1
        if self._left > 0:
            return False
        self._finish()
        return True

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        with record_function(ANCHOR):
            self._anchor_epoch = time.time() * 1e6

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        hostname = socket.gethostname()
        try:
            prof.__exit__(None, None, None)
            fd, path = tempfile.mkstemp(prefix="mk-trace-", suffix=".json")
            os.close(fd)
            try:
                prof.export_chrome_trace(path)
                with open(path, "rb") as f:
                    raw = f.read()
            finally:
                os.unlink(path)
            anchor_ts = _anchor_ts(raw)
            top = sorted(
                (
                    (e.key, float(e.self_cpu_time_total), int(e.count))
                    for e in prof.key_averages()
                    if e.key != ANCHOR
                ),
                key=lambda row: -row[1],
            )[:TOP_OPS]
            trace = RankTrace(
                self.rank, hostname, self.order.steps, zlib.compress(raw, 3),
                self._anchor_epoch, anchor_ts, top, time.time(),
                comm_per_step=self._comm / max(1, self.order.steps),
                first_step=self._first_step,
            )  # fmt: skip
        except Exception as exc:
            trace = RankTrace(self.rank, hostname, 0, b"", 0.0, 0.0, error=repr(exc))
        self._reply(trace)


def _anchor_ts(raw: bytes) -> float:
    for event in json.loads(raw).get("traceEvents", ()):
        if event.get("name") == ANCHOR:
            return float(event["ts"])
    raise RuntimeError("the profiler's trace has no anchor event")


class Profiling:
    """The armed run of this rank, if any (set from the control thread, driven by
    the loop's thread at each step's end)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.run: ProfileRun | None = None

    def arm(self, run: ProfileRun) -> ProfileRun | None:
        """Arm ``run``; returns the one it replaced (its caller is told it was)."""
        with self._lock:
            old, self.run = self.run, run
        return old

    def arm_none(self) -> None:
        """Disarm (``%mesh profile`` gave up)."""
        with self._lock:
            self.run = None

    def on_step(self, record: StepRecord) -> None:
        run = self.run
        if run is not None and run.on_step(record):
            with self._lock:
                if self.run is run:
                    self.run = None
