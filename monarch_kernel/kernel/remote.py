"""Running a cell on a mesh's ranks: the machinery behind ``%%remote``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.actor import ProcMesh, ValueMesh
from monarch_kernel.controller.errors import ActorError, actor_error
from monarch_kernel.controller.future import Future
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Message, dumps, loads
from monarch_kernel.wire import kinds as K

#: For --bg jobs: how long after the last result their output block is closed (output of
#: threads the cell left running may still come in). Foreground cells close at once:
#: ranks send all of a cell's output before its result.
OUTPUT_GRACE = 0.05
INTERRUPT_WAIT = 3.0


class RemoteCellError(ActorError):
    """A ``%%remote`` cell failed on one or more ranks (grouped, root cause first)."""


class RemoteJob:
    """One ``%%remote`` execution. ``--bg`` returns it at once.

    ``wait()``/``result()`` give the ValueMesh of the cell's last expression (or raise
    the grouped error), ``done()`` tells whether all ranks finished, ``cancel()``
    interrupts the ranks still running it.
    """

    def __init__(
        self,
        procs: ProcMesh,
        code: str,
        cell: str,
        output: CellOutput | None,
        ranks: list[int] | None = None,
        shape: Shape | None = None,
        on_finished: Callable[[RemoteJob], None] | None = None,
        header: list[str] | None = None,
    ):
        self.procs = procs
        self.code = code
        self.cell = cell
        self.output = output
        self.ranks = ranks if ranks is not None else procs.ranks()
        self.shape = shape or procs.shape
        self.on_finished = on_finished
        self.header = header or []
        self.started = time.time()
        self.finished: float | None = None
        self.request_id: str | None = None
        self._replies: dict[int, Message] = {}
        self._lock = threading.Lock()
        self.future: Future[ValueMesh] = Future(self._finish)

    def start(self) -> RemoteJob:
        spec = {"code": self.code, "cell": self.cell, "header": self.header}
        payload, buffers = dumps(spec, "cell")
        self.request_id = self.procs.runtime.request(
            self.ranks,
            {"k": K.EXEC},
            payload,
            buffers,
            self._on_reply,
            self._on_death,
            sink=self._sink,
        )
        return self

    # -- I/O thread callbacks ----------------------------------------------------------
    def _sink(self, rank: int, name: str, text: str) -> None:
        if self.output is not None:
            self.output.feed(rank, name, text)

    def _on_reply(self, rank: int, msg: Message) -> None:
        with self._lock:
            self._replies[rank] = msg
            complete = len(self._replies) == len(self.ranks)
        if complete:
            self._complete(None)

    def _on_death(self, rank: int, error: BaseException) -> None:
        self._complete(error)

    def _complete(self, error: BaseException | None) -> None:
        if self.future.done():
            return
        self.finished = time.time()
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)
        # Never sleep here (this is the controller's I/O thread): close the output and
        # report after a short grace on a timer thread.
        threading.Timer(OUTPUT_GRACE, self._after_finish).start()

    def _after_finish(self) -> None:
        if self.output is not None:
            self.output.close()
        if self.on_finished is not None:
            self.on_finished(self)

    def _finish(self, _: Any) -> ValueMesh:
        values, failures = [], []
        for r in self.ranks:
            msg = self._replies[r]
            if msg.header.get("ok"):
                values.append(loads(msg.payload, msg.buffers, f"cell value from rank {r}"))
                continue
            import pickle

            report = pickle.loads(msg.payload)
            report["rank"] = r
            failures.append(report)
            values.append(None)
        if failures:
            err = actor_error(failures, len(self.ranks))
            raise RemoteCellError(str(err), err.failures, err.exception)
        return ValueMesh(self.shape, values)

    # -- user side -----------------------------------------------------------------
    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> ValueMesh:
        """Block until every rank finished; Ctrl-C / the stop button interrupts the ranks."""
        try:
            try:
                return self.future.get(timeout)
            finally:
                if self.future.done() and self.output is not None:
                    self.output.close()
        except KeyboardInterrupt:
            self.cancel()
            try:
                self.future.get(INTERRUPT_WAIT)
            except BaseException:  # noqa: BLE001 - the interrupt is what we report
                pass
            raise

    result = wait

    def cancel(self) -> None:
        """Raise KeyboardInterrupt in the ranks still running this cell."""
        if self.done():
            return
        rt = self.procs.runtime
        with self._lock:
            running = [r for r in self.ranks if r not in self._replies and rt.ranks[r].alive]
        for r in running:  # interrupts it if running, skips it if not started yet
            rt.send_control(r, {"k": K.CANCEL, "c": self.request_id})

    @property
    def state(self) -> str:
        if not self.done():
            return "running"
        return "failed" if self.future.exception() is not None else "done"

    def __repr__(self) -> str:
        took = f" in {self.finished - self.started:.1f}s" if self.finished else ""
        return (
            f"<RemoteJob cell {self.cell} on {self.procs.name} ranks "
            f"{self.ranks}: {self.state}{took}>"
        )
