"""Running a cell on a mesh's ranks: the machinery behind ``%%remote``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from monarch_kernel.actor import ProcMesh, ValueMesh
from monarch_kernel.actor.gather import Gather
from monarch_kernel.controller.errors import ActorError
from monarch_kernel.controller.future import Future
from monarch_kernel.controller.mesh import new_request_id
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.shape import Shape
from monarch_kernel.wire import dumps
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

    The cell is one request: its replies are gathered by the actor API's
    :class:`~monarch_kernel.actor.gather.Gather`, and its output is routed (by request
    id) to this job's :class:`CellOutput` through the mesh's stream router.
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
        self.request_id = new_request_id()
        # Not a waiter: the I/O thread receives cell replies (a cell's output must keep
        # flowing while the notebook's main thread blocks in wait()).
        self._gather = Gather(
            self.ranks, self.shape, None, error_class=RemoteCellError, value_name="cell value"
        )
        self.future: Future[ValueMesh[object]] = self._gather.future
        self._closing = threading.Lock()  # held for good once the output is closed

    def start(self) -> RemoteJob:
        spec = {"code": self.code, "cell": self.cell, "header": self.header}
        payload, buffers = dumps(spec, "cell")
        rt = self.procs.runtime
        if self.output is not None:
            rt.output.route(self.request_id, self.output.feed)
        self.future.add_done_callback(self._on_done)
        try:
            rt.request(
                self.ranks,
                {"k": K.EXEC},
                payload,
                buffers,
                self._gather,
                what=f"cell {self.cell}",
                request_id=self.request_id,
            )
        except BaseException:
            rt.output.unroute(self.request_id)
            raise
        return self

    def _on_done(self, _: Future[ValueMesh[object]]) -> None:
        """Every rank answered or one was lost (a controller thread: never sleep here)."""
        self.finished = time.time()
        # Close the output and report after a short grace, on a timer thread.
        threading.Timer(OUTPUT_GRACE, self._after_finish).start()

    def _after_finish(self) -> None:
        self._close_output()
        if self.on_finished is not None:
            self.on_finished(self)

    def _close_output(self) -> None:
        if not self._closing.acquire(blocking=False):
            return  # closed already (wait() and the timer both get here)
        self.procs.runtime.output.unroute(self.request_id)
        if self.output is not None:
            self.output.close()

    # -- user side -----------------------------------------------------------------
    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float | None = None) -> ValueMesh:
        """Block until every rank finished; Ctrl-C / the stop button interrupts the ranks."""
        try:
            try:
                return self.future.get(timeout)
            finally:
                if self.future.done():
                    self._close_output()
        except KeyboardInterrupt:
            self.cancel()
            try:
                self.future.get(INTERRUPT_WAIT)
            except BaseException:  # the interrupt is what we report
                pass
            raise

    result = wait

    def cancel(self) -> None:
        """Raise KeyboardInterrupt in the ranks still running this cell."""
        if self.done():
            return
        rt = self.procs.runtime
        running = [r for r in self.ranks if not self._gather.answered(r) and rt.ranks[r].alive]
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
