"""The host agent's handle on its warm template process (:mod:`monarch_kernel.host.template`):
commands down one pipe, events up another, one JSON line each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, TypedDict

#: Seconds ranks get to exit cleanly when ``stop`` does not say (its ``grace``).
DEFAULT_GRACE = 3.0

#: Sent to the template after the ``exit`` command: one importing its late modules
#: (``torch._dynamo``: seconds on a loaded machine, during which it reads no command)
#: stops importing and reads it; one that is not importing ignores it. One still in its
#: first imports (before its loop, so before any fork) is ended by it, the signal's
#: default action: it has no rank to stop. A real-time signal, as the ranks' stack dumps
#: use: SIGUSR1/SIGUSR2 are Slurm's pre-emption notices.
#: (Without real-time signals, SIGUSR2: the ranks' stack dumps fall back to it too,
#: but those go to ranks, and this to templates.)
CUT_IMPORT_SIGNAL: int = int(getattr(signal, "SIGRTMIN", signal.SIGUSR2)) + (
    5 if hasattr(signal, "SIGRTMIN") else 0
)
#: Seconds between two :data:`CUT_IMPORT_SIGNAL` while a stop waits for the template.
CUT_AGAIN = 0.5


class TemplateEvent(TypedDict, total=False):
    """One JSON line from the template: ``e`` is ``template_ready``, ``forked``, ``exit``
    or ``template_exit``; the other keys are those of its kind."""

    e: str
    pid: int
    rank: int
    code: int | None
    signal: int | None


class TemplateCommand(TypedDict, total=False):
    """One JSON line to the template: ``op`` is ``fork`` (with the rank's ``cfg``),
    ``stop`` (with a ``grace``) or ``exit``."""

    op: str
    cfg: dict[str, object]
    grace: float


#: The host agent's own variables: its template (so its ranks) never sees them (a
#: rank that starts a mesh of its own must not take its agent's directory).
AGENT_ONLY_ENV = frozenset(
    ["MONARCH_KERNEL_HOST_DIR", "MONARCH_KERNEL_HOST_CONFIG", "MONARCH_KERNEL_JOIN_TOKEN"]
)


class Template:
    """Handle on the warm template process (see :mod:`monarch_kernel.host.template`)."""

    def __init__(self) -> None:
        """Start the template; its imports (torch: about a second) begin at once."""
        cmd_r, self.cmd_w = os.pipe()
        self.event_r, ev_w = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monarch_kernel.host.template",
                str(cmd_r),
                str(ev_w),
                str(os.getpid()),
            ],
            pass_fds=(cmd_r, ev_w),
            stdin=subprocess.DEVNULL,
            cwd=os.getcwd(),
            env={k: v for k, v in os.environ.items() if k not in AGENT_ONLY_ENV},
        )
        os.close(cmd_r)
        os.close(ev_w)
        # Commands are written without blocking: the template reads them only between
        # imports (torch at its start, torch._dynamo once idle: seconds under load), and
        # 64 fork commands (about 1 KiB each) fill a pipe's 64 KiB, which blocked the
        # agent's loop (its heartbeats: "host agent 0 lost" while starting 64 ranks).
        # What does not fit waits in ``pending``; the loop calls :meth:`flush`.
        os.set_blocking(self.cmd_w, False)
        self.pending = bytearray()
        self.buf = b""
        #: It said ``template_ready`` (its imports are done), or was asked to fork a rank:
        #: until either, a stop has nothing of its own to end gracefully.
        self.engaged = False

    def command(self, **cmd: Any) -> None:
        if cmd.get("op") == "fork":
            self.engaged = True
        self.pending += (json.dumps(cmd) + "\n").encode()
        self.flush()

    def flush(self) -> None:
        """Write what the pipe takes of the pending commands (never blocks)."""
        pending = self.pending
        while pending:
            try:
                n = os.write(self.cmd_w, pending)
            except BlockingIOError:
                return
            except BrokenPipeError:  # it exited: its end of the event pipe says so
                pending.clear()
                return
            del pending[:n]

    def events(self) -> list[TemplateEvent]:
        data = os.read(self.event_r, 65536)
        if not data:
            return [{"e": "template_exit", "code": self.proc.wait()}]
        self.buf += data
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            event: TemplateEvent = json.loads(line)
            if event.get("e") == "template_ready":
                self.engaged = True
            out.append(event)
        return out

    def stop(self, grace: float = DEFAULT_GRACE) -> None:
        """Ask the template to stop its ranks (SIGTERM, then SIGKILL after ``grace``
        seconds) and exit; kill it if it has not exited a while after that. One still
        importing (a pre-warmed agent stopped early) is killed at once: it would read
        the command only once torch is imported, seconds later, and has no rank yet.
        One importing its late modules is told to stop that (:data:`CUT_IMPORT_SIGNAL`):
        its ranks would otherwise outlive a dead controller by as long as the import."""
        if not self.engaged:
            self.proc.kill()
            self.proc.wait()
            return
        try:
            self.command(op="exit", grace=grace)
        except OSError:
            pass
        # Before the blocking flush: a template in its late import reads no command,
        # and a full pipe would hold us until the import ended.
        self.cut_import()
        try:
            os.set_blocking(self.cmd_w, True)  # stopping: the rest waits for it
            self.flush()
        except OSError:
            pass
        deadline = time.monotonic() + grace + 5.0
        while True:
            try:
                self.proc.wait(max(0.0, min(CUT_AGAIN, deadline - time.monotonic())))
                return
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    break
                self.cut_import()  # one that landed where it could not cut
        self.proc.kill()
        self.proc.wait()

    def cut_import(self) -> None:
        """Send :data:`CUT_IMPORT_SIGNAL` (nothing once the template was reaped: its
        pid may be another process's by then)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(CUT_IMPORT_SIGNAL)
