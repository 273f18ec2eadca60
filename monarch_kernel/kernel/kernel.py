"""``MonarchKernel``: ipykernel's IPython kernel with the mesh magics loaded.

At start-up it pre-warms one local host agent in the background (so torch is already
imported when the first ``%mesh`` runs); on shutdown or restart it stops every rank and
host agent of every mesh, but detachable meshes, which it lets go of (they run on).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from ipykernel.ipkernel import IPythonKernel

from monarch_kernel import __version__

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
        # The controller's threads (receiving rank output, the dashboard) share the GIL
        # with the cell the user runs; with Python's default 5 ms switch interval each
        # hand-over of the GIL to the shell costs up to 5 ms, and answering a request
        # takes a dozen. 1 ms keeps the notebook responsive while ranks flood output.
        sys.setswitchinterval(SWITCH_INTERVAL)
        if os.environ.get("MONARCH_KERNEL_PREWARM", "1") != "0":
            threading.Thread(target=self._prewarm, name="mk-prewarm", daemon=True).start()

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
        if LocalLauncher._shared is not None:
            LocalLauncher._shared.shutdown()
        return super().do_shutdown(restart)
