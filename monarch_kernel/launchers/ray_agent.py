"""The Ray actor that runs one host agent on its node (:class:`AgentRunner`), and the
release of a detachable mesh's host placement group by name (:func:`release_detached`).

For a ``--detachable`` mesh each host's placement group and agent actor are *detached*
(``lifetime="detached"``, named, in our namespace): they outlive the kernel, the Ray
driver. Nothing else then frees them, so each actor keeps watch itself (its *keeper*
thread): once its agent has ended (the mesh's ``--keep`` ran out, a ``%mesh stop`` from
any kernel, a shrink that dropped its host) and so have those of the other actors it was
told of (none, as every host has a group of its own), it removes its placement group,
which ends the actor, and exits. The kernel holding the mesh releases the groups on stop
as for any mesh; a kernel that attached (or stops it unattached) does it by name with
what the attach file records (:mod:`.reservation`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

#: Seconds between a keeper's looks at the other bundles' agents.
KEEPER_INTERVAL = 1.0
#: How much of the end of the agent's output a failure quotes (bytes read).
LOG_TAIL = 16384


class AgentRunner:
    """The body of the Ray actor that runs one host agent on its node."""

    def __init__(self) -> None:
        self.proc: Any = None
        #: The agent's output: a file removed as soon as the agent has it open, so that
        #: nothing is left on the node however this actor ends (Ray kills it outright
        #: when its placement group goes); read through this descriptor.
        self.log_fd = -1

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        keeper: dict[str, Any] | None = None,
    ) -> tuple[str, str, int]:
        """Start the agent; return (node address, hostname, pid). ``keeper`` (a
        detachable mesh: ``group``, ``namespace``, ``actors``) starts the keeper thread
        (see the module docstring)."""
        import socket
        import subprocess
        import tempfile

        import ray

        full = {**os.environ, **env, "MONARCH_KERNEL_PARENT_PID": str(os.getpid())}
        fd, path = tempfile.mkstemp(prefix="mk-ray-agent-", suffix=".log")
        # A new session: Ray's signals to the worker's group do not reach it, but it
        # still dies with this actor (parent-death signal set by the agent itself; a
        # detachable mesh's agent drops it once configured, and outlives us).
        self.proc = subprocess.Popen(
            argv, env=full, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True
        )
        os.unlink(path)
        self.log_fd = fd
        if keeper is not None:
            threading.Thread(
                target=self._keep, args=(keeper,), name="mk-ray-keeper", daemon=True
            ).start()
        return ray.util.get_node_ip_address(), socket.gethostname(), int(self.proc.pid)

    def poll(self) -> tuple[int | None, str]:
        """The agent's exit code (None while it runs) and, once it ended, its last lines."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return None, ""
        try:
            size = os.fstat(self.log_fd).st_size
            tail = os.pread(self.log_fd, LOG_TAIL, max(0, size - LOG_TAIL))
        except OSError:
            return code, ""
        return code, "".join(tail.decode(errors="replace").splitlines(True)[-20:])

    def stop(self, timeout: float = 3.0) -> None:
        """Terminate the agent (its ranks die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except Exception:
                self.proc.kill()

    def _keep(self, keeper: dict[str, Any]) -> None:
        """The keeper thread: once its agent and those of ``keeper["actors"]`` ended,
        remove the group (the actors in it end with it) and exit."""
        import ray

        self.proc.wait()
        namespace = str(keeper["namespace"])
        me = ray.get_runtime_context().get_actor_name()
        others = [str(n) for n in keeper["actors"] if n != me]
        while others:
            others = [n for n in others if _agent_runs(ray, n, namespace)]
            if others:
                time.sleep(KEEPER_INTERVAL)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(ray.util.get_placement_group(str(keeper["group"])))
        time.sleep(5.0)  # removing the group ends this actor; if it did not:
        os._exit(0)


def _agent_runs(ray: Any, name: str, namespace: str) -> bool:
    """Whether the agent of actor ``name`` still runs (a dead or missing actor's does
    not: its agent died with it, or is its own keeper's to wait for)."""
    try:
        code, _ = ray.get(ray.get_actor(name, namespace=namespace).poll.remote(), timeout=10)
    except Exception:
        return False
    return code is None


def release_detached(address: str, namespace: str, group: str, actors: list[str]) -> None:
    """Stop the agents of ``actors``, kill those actors and remove placement group
    ``group`` (a detachable mesh's, by the names its attach file records); connects
    this process to the Ray cluster at ``address`` if it is not yet."""
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
    handles: list[Any] = []
    for name in actors:
        try:
            handles.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            continue  # gone already (its keeper removed the group)
    # Their agents were told to stop already: make sure, all at once, then let go.
    stops: list[Any] = [a.stop.remote() for a in handles]
    with contextlib.suppress(Exception):
        ray.wait(stops, num_returns=len(stops), timeout=5)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(ray.util.get_placement_group(group))
    for actor in handles:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
