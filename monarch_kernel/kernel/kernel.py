"""``MonarchKernel``: ipykernel's IPython kernel with the mesh magics loaded.

At start-up it pre-warms one local host agent in the background (so torch is already
imported when the first ``%mesh`` runs); on shutdown or restart it stops every rank and
host agent of every mesh, but detachable meshes, which it lets go of (they run on).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from typing import Any

from ipykernel.ipkernel import IPythonKernel

from monarch_kernel import __version__
from monarch_kernel.kernel.debug.requests import RemoteDebugger

#: The kernel process's GIL switch interval (seconds); see ``MonarchKernel.__init__``.
SWITCH_INTERVAL = 0.001


class MonarchKernel(IPythonKernel):
    implementation = "monarch_kernel"
    implementation_version = __version__
    banner = "Monarch kernel: %mesh NAME --gpus N, then %%remote NAME"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        from monarch_kernel.kernel.magics import load_ipython_extension

        self._magics = load_ipython_extension(self.shell)
        self._remote_debugger = self._make_remote_debugger()
        # The controller's threads (receiving rank output, the dashboard) share the GIL
        # with the cell the user runs; with Python's default 5 ms switch interval each
        # hand-over of the GIL to the shell costs up to 5 ms, and answering a request
        # takes a dozen. 1 ms keeps the notebook responsive while ranks flood output.
        sys.setswitchinterval(SWITCH_INTERVAL)
        if os.environ.get("MONARCH_KERNEL_PREWARM", "1") != "0":
            threading.Thread(target=self._prewarm, name="mk-prewarm", daemon=True).start()

    def _make_remote_debugger(self) -> RemoteDebugger:
        from ipykernel.compiler import get_file_name

        def started() -> bool:
            debugger = getattr(self, "debugger", None)
            return bool(debugger is not None and debugger.is_started)

        def kernel_stopped() -> bool:
            debugger = getattr(self, "debugger", None)
            return bool(debugger is not None and debugger.stopped_threads)

        user_ns = self.shell.user_ns if self.shell is not None else None
        return RemoteDebugger(
            self._publish_debug_event, started, get_file_name, user_ns, kernel_stopped
        )

    async def do_debug_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The visual debugger: requests about ranks are answered by the remote
        debugger (:mod:`monarch_kernel.kernel.debug.requests`), the others by ipykernel's (this
        process)."""
        remote = self._remote_debugger
        # (off the event loop: a query waits for a rank's answer, and the loop of the
        # control channel must keep serving meanwhile)
        reply = await asyncio.to_thread(remote.handle, msg)
        if reply is None:
            reply = await super().do_debug_request(msg)
        deferred = remote.take_deferred()
        if deferred is not None:  # after ipykernel sent this reply (no await in between)
            loop = asyncio.get_running_loop()
            loop.call_soon(lambda: loop.run_in_executor(None, deferred))
        return remote.after(msg, reply)

    async def do_execute(self, code: str, *args: Any, **kwargs: Any) -> Any:
        # the source as the front end has it: a %%remote cell's gutter breakpoints are
        # keyed by the dumped file of exactly this text
        remote = self._remote_debugger
        remote.current_code = code
        if remote.endpoints.table:  # a mesh made since the breakpoints were set gets them
            await asyncio.to_thread(remote.endpoints.sync)
        return await super().do_execute(code, *args, **kwargs)

    def post_handler_hook(self) -> None:
        """Between cells ipykernel ignores SIGINT (the stop button); we use it to stop
        running ``--bg`` cells instead, so the button always does something."""
        super().post_handler_hook()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._interrupt_while_idle)

    def _interrupt_while_idle(self, signum: int, frame: Any) -> None:
        self._magics.cancel_background_jobs("the stop button was pressed while no cell ran")

    @staticmethod
    def _prewarm() -> None:
        from monarch_kernel.launchers.local import LocalLauncher

        try:
            LocalLauncher.shared().prewarm(1)
            import ipywidgets  # noqa: F401 - the first %mesh shows a dashboard
        except Exception:  # pragma: no cover - a cold start still works
            pass

    def do_shutdown(self, restart: bool) -> Any:
        from monarch_kernel.kernel.magics import stop_all_meshes
        from monarch_kernel.launchers.local import LocalLauncher

        self._magics.shutting_down = True  # a pending stop of --bg cells does not happen
        stop_all_meshes()
        _retire_dashboards()  # after: their snapshots show the meshes let go or stopped
        if LocalLauncher._shared is not None:
            LocalLauncher._shared.shutdown()
        return super().do_shutdown(restart)


def _retire_dashboards() -> None:
    """Leave a static snapshot in place of every dashboard shown (``widgets.retire``);
    only if the widgets were ever loaded."""
    if "monarch_kernel.widgets.dashboard" not in sys.modules:
        return
    from monarch_kernel.widgets.retire import retire_all

    retire_all()
