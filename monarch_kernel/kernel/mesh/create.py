"""``%mesh NAME --gpus N ...``: create a mesh (or keep the one of that name running).

The steps, in order: :meth:`MeshRequest.parse` checks the line (every usage error
before anything starts); a running mesh of the same shape and environment is kept
(:func:`_keep_running`); otherwise the hosts are reserved (:func:`_reserve_hosts`, which
checks capacity while an older mesh of the name still runs), that older mesh is stopped,
and the ranks are started (:func:`_spawn`) with the dashboard showing them start.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.actor import ProcMesh
from monarch_kernel.actor.hosts import HostMesh, host_mesh
from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.lifecycle.startup import StartProgress
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.kernel.args import ENGINE_OPTIONS, mesh_parser
from monarch_kernel.kernel.mesh.detach import check_detached_name, detachable_note
from monarch_kernel.kernel.mesh.names import check_identifier, check_mesh_name
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.remote import InputRouter
from monarch_kernel.kernel.remote_cell import run_on
from monarch_kernel.shape import Shape
from monarch_kernel.wire.desk import parse_duration

#: What ``%mesh --dist`` runs on every rank once the mesh is up.
INIT_DIST = "import torch.distributed as _mk_dist\n_mk_dist.init_process_group()\n"


@dataclass(frozen=True)
class MeshRequest:
    """A checked ``%mesh NAME ...`` line."""

    name: str
    gpus: int  #: ranks per host
    hosts: int
    backend: str
    env: dict[str, str]  #: ``--env K=V``: the ranks' extra environment
    #: the backend's own options that were given (``--partition``, ``--machine`` ...)
    engine_options: dict[str, str]
    timeout: float
    on_failure: str
    grace: float
    dist: bool
    detachable: bool = False
    keep: str | None = None  #: ``--keep``, as written (checked by ``spawn_procs``)

    @classmethod
    def parse(cls, args: list[str], notebook: Notebook) -> MeshRequest:
        """The request of ``%mesh`` with (split) ``args``; a one-line UsageError for a
        bad name, a missing or bad size, or a bad ``--env``."""
        opts = mesh_parser().parse_args(args)
        name = opts.name
        check_identifier(name)
        check_mesh_name(name, opts.force, notebook.user_ns, notebook.hidden)
        if opts.gpus is None:
            raise UsageError(f"how many ranks? e.g. %mesh {name} --gpus 4")
        if opts.gpus < 1 or opts.hosts < 1:
            raise UsageError("--gpus and --hosts must be at least 1")
        _check_keep(name, opts.detachable, opts.keep)
        return cls(
            name=name,
            gpus=opts.gpus,
            hosts=opts.hosts,
            backend=opts.backend,
            env=_env_option(opts.env),
            engine_options={k: v for k in ENGINE_OPTIONS if (v := getattr(opts, k))},
            timeout=opts.timeout,
            on_failure=opts.on_failure,
            grace=opts.grace,
            dist=opts.dist,
            detachable=opts.detachable,
            keep=opts.keep,
        )

    @property
    def extent(self) -> dict[str, int]:
        """The mesh's dims: ``gpus``, and ``hosts`` before it when there are several."""
        return ({"hosts": self.hosts} if self.hosts > 1 else {}) | {"gpus": self.gpus}

    def matches(self, mesh: ProcMesh) -> bool:
        """Whether the running ``mesh`` is what this request asks for (same shape, same
        environment): then ``%mesh`` keeps it instead of starting another."""
        return mesh.extent == Shape.from_extent(self.extent).extent and mesh.runtime.env == self.env


def _check_keep(name: str, detachable: bool, keep: str | None) -> None:
    """``--keep`` goes with ``--detachable`` and is a duration (``30m``, ``2h`` ...)."""
    if keep is None:
        return
    if not detachable:
        raise UsageError(
            f"--keep is for detachable meshes: %mesh {name} ... --detachable --keep {keep}"
        )
    try:
        parse_duration(keep)
    except ValueError as exc:
        raise UsageError(f"--keep: {exc}") from None


def _env_option(items: list[str]) -> dict[str, str]:
    """``--env K=V`` (given any number of times) as a dict."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def create_mesh(notebook: Notebook, args: list[str]) -> None:
    """``%mesh NAME --gpus N ...`` (``args``: the split line): start the mesh, bind it to
    ``NAME`` in the notebook and say how long it took."""
    req = MeshRequest.parse(args, notebook)
    old_runtime = registry.get(req.name)
    old = ProcMesh(old_runtime) if old_runtime is not None else None
    if old is not None and not old.stopped and req.matches(old):
        _keep_running(notebook, req.name, old)
        return
    if req.detachable:
        check_detached_name(req.name)
    hosts = _reserve_hosts(req, replacing=old_runtime)
    if old is not None:
        old.stop()  # the same name with another shape: this one replaces it
    procs, took = _spawn(hosts, req)
    notebook.user_ns[req.name] = procs
    InputRouter.of(procs.runtime)  # parks breakpoints of endpoints for %debug_remote
    print(f"mesh {req.name!r}: {procs.shape.describe()} ({req.backend}) ready in {took:.2f}s")
    if req.detachable:
        print(detachable_note(procs))
    if req.backend == "local" and os.environ.get("LIGHTNING_CLOUD_SPACE_ID"):
        print(
            f"mesh {req.name!r} runs on this Lightning Studio's own machine; an idle Studio "
            "goes to sleep and that ends the mesh (keep it active while you use it)"
        )
    if req.dist:
        run_on(notebook, procs, INIT_DIST)
        print(f"mesh {req.name!r}: torch.distributed process group initialised")


def _keep_running(notebook: Notebook, name: str, mesh: ProcMesh) -> None:
    """``%mesh`` again for the mesh ``name`` that runs as asked: bind it (the notebook
    variable may have been reassigned meanwhile) and show it, rather than restart it."""
    print(f"mesh {name!r} is already running (%mesh restart {name} to restart it)")
    notebook.user_ns[name] = mesh
    from monarch_kernel.widgets import show  # ipywidgets: imported late

    show(mesh)


def _reserve_hosts(req: MeshRequest, replacing: MeshRuntime | None) -> HostMesh:
    """The request's hosts. The capacity check counts the mesh it replaces as gone, but
    runs before that mesh is stopped: a refused request leaves it running."""
    try:
        # join: the one-line command per host and "2/4 hosts joined" print here
        hosts = host_mesh(hosts=req.hosts, backend=req.backend, **req.engine_options)
        _check_capacity(hosts, req.hosts * req.gpus, replacing=replacing)
    except ValueError as exc:
        raise UsageError(f"%mesh {req.name}: {exc}") from None
    return hosts


def _check_capacity(hosts: HostMesh, ranks: int, replacing: MeshRuntime | None) -> None:
    """``hosts.launcher.check_capacity`` for a new mesh of ``ranks`` ranks that replaces
    ``replacing`` (whose ranks will be gone by then); as ``spawn_procs`` checks it."""
    running = sum(
        m.world for m in registry.live() if m.launcher is hosts.launcher and m is not replacing
    )
    hosts.launcher.check_capacity(ranks, running)


def _spawn(hosts: HostMesh, req: MeshRequest) -> tuple[ProcMesh, float]:
    """Start the ranks, shown on the dashboard as they start (or fail to); the mesh and
    the seconds its start took. The stop button stops what was started."""
    from monarch_kernel.widgets import refresh, show  # ipywidgets: imported late

    shown: list[ProcMesh] = []
    line = _ProgressLine(req.name)

    def show_while_starting(procs: ProcMesh) -> None:
        show(procs)  # the dashboard shows the ranks start (or fail to)
        shown.append(procs)
        if procs.runtime.world >= PROGRESS_MIN_RANKS:
            procs.runtime.starter.progress = line

    t0 = time.monotonic()
    try:
        with _interrupt_once():
            procs = hosts.spawn_procs(
                {"gpus": req.gpus},
                name=req.name,
                env=req.env,
                timeout=req.timeout,
                on_starting=show_while_starting,
                on_failure=req.on_failure,
                grace=req.grace,
                detachable=req.detachable,
                keep=req.keep,
            )
    except ValueError as exc:  # bad options, or another thread took the name meanwhile
        raise UsageError(f"%mesh {req.name}: {exc}") from None
    except KeyboardInterrupt:  # the stop button: spawn_procs stopped what it started
        for p in shown:
            p.stop()  # idempotent; in case the interrupt came before spawn_procs' own
        raise MeshStartError(
            f"mesh {req.name!r}: start interrupted; the ranks and host agents it had "
            "started are stopped"
        ) from None
    finally:
        line.end()
        for p in shown:
            refresh(p)
    return procs, time.monotonic() - t0


#: A mesh of at least this many ranks shows a progress line while it starts.
PROGRESS_MIN_RANKS = 32


class _ProgressLine:
    """One line under the ``%mesh`` cell that a big mesh's start keeps rewriting
    (``\\r``: the front end shows the latest), ended by a newline."""

    def __init__(self, name: str):
        self._name = name
        self._open = False

    def __call__(self, progress: StartProgress) -> None:
        sys.stdout.write(f"\rmesh {self._name!r}: {progress.line()}")
        sys.stdout.flush()
        self._open = True

    def end(self) -> None:
        if self._open:
            sys.stdout.write("\n")
            self._open = False


@contextmanager
def _interrupt_once() -> Iterator[None]:
    """The first Ctrl-C (the notebook's stop button) raises KeyboardInterrupt as usual;
    further ones are ignored until the block ends, so that pressing stop again while an
    interrupted mesh start stops what it started cannot leave half of it running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
