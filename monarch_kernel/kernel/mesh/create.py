"""``%mesh NAME --gpus N ...``: create a mesh (or keep the one of that name running).

The steps, in order: :meth:`MeshRequest.parse` checks the line (every usage error
before anything starts); a running mesh of that name is kept when it was asked for as
this line asks (:func:`_keep_running`: a notebook's Run All keeps its meshes), and a
line that asks for something else is refused, naming what differs
(:meth:`MeshRequest.differences`), unless ``--replace`` says to stop it and start anew;
then the hosts are reserved (:func:`_reserve_hosts`, which checks capacity while an
older mesh of the name still runs), more ranks than this machine has cores or GPUs is
said (:mod:`.oversubscribed`), that older mesh is stopped, and the ranks are started
(:func:`_spawn`) with the dashboard showing them start.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.actor import ProcMesh
from monarch_kernel.actor.hosts import HostMesh, host_mesh
from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.lifecycle.startup import StartProgress
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.controller.state.records import parse_policy
from monarch_kernel.kernel.args import ENGINE_OPTIONS, mesh_parser
from monarch_kernel.kernel.mesh.detach import check_detached_name, detachable_note
from monarch_kernel.kernel.mesh.names import check_identifier, check_mesh_name
from monarch_kernel.kernel.mesh.oversubscribed import oversubscription
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.remote import InputRouter
from monarch_kernel.kernel.remote_cell import run_on
from monarch_kernel.shape import Shape
from monarch_kernel.wire.desk import parse_duration

#: What ``%mesh --dist`` runs on every rank once the mesh is up.
INIT_DIST = (
    "import torch.distributed as _mk_dist\n_mk_dist.init_process_group()\n"
    "str(_mk_dist.get_backend())"
)
#: The backends the rank-side ``init_process_group`` picks, and what runs inside them.
REFORMABLE_KINDS = {"mkgloo": "gloo", "mknccl": "NCCL, with gloo for CPU tensors"}


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
    replace: bool = False  #: ``--replace``: stop a running mesh of the name, start anew

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
            replace=opts.replace,
        )

    @property
    def extent(self) -> dict[str, int]:
        """The mesh's dims: ``gpus``, and ``hosts`` before it when there are several."""
        return ({"hosts": self.hosts} if self.hosts > 1 else {}) | {"gpus": self.gpus}

    def matches(self, mesh: ProcMesh) -> bool:
        """Whether the running ``mesh`` is what this request asks for (see
        :meth:`differences`): then ``%mesh`` keeps it instead of starting another."""
        return not self.differences(mesh.runtime)

    def differences(self, runtime: MeshRuntime) -> list[str]:
        """What this request asks for that the running mesh ``runtime`` is not, one
        ``--gpus 3 vs the live --gpus 2`` each: its size now (after any grow or shrink),
        environment, backend and failure policy, whether it is detachable, and, for a
        mesh an earlier ``%mesh`` line started, that line's other lasting options
        (``--dist``, ``--keep``, the backend's options). ``--timeout`` and ``--force``
        are not the mesh's: they never differ."""
        out = []
        if not _hosts_by_gpus(runtime):
            out.append(
                f"{Shape.from_extent(self.extent).describe()} vs the live "
                f"{runtime.shape.describe()}"
            )
        else:
            if self.hosts != runtime.n_hosts:
                out.append(_vs("--hosts", str(self.hosts), str(runtime.n_hosts)))
            if self.gpus != runtime.per_host:
                out.append(_vs("--gpus", str(self.gpus), str(runtime.per_host)))
        if self.env != runtime.env:
            out.append(_vs("--env", _env_text(self.env), _env_text(runtime.env)))
        if self.backend != runtime.backend:
            out.append(_vs("--backend", self.backend, runtime.backend))
        policy, minimum = parse_policy(self.on_failure)
        live_policy = _policy_text(runtime.on_failure, runtime.shrink_min)
        if _policy_text(policy.value, minimum) != live_policy:
            out.append(_vs("--on-failure", self.on_failure, live_policy))
        if self.grace != runtime.failures.grace:
            out.append(_vs("--grace", f"{self.grace:g}", f"{runtime.failures.grace:g}"))
        if self.detachable != (runtime.detach_keep > 0):
            flag = "" if self.detachable else None
            out.append(_vs("--detachable", flag, None if self.detachable else ""))
        started = _started_by.get(runtime)
        if started is not None:
            if self.dist != started.dist:
                out.append(_vs("--dist", "" if self.dist else None, "" if started.dist else None))
            if self.detachable and started.detachable and _keep(self) != _keep(started):
                out.append(_vs("--keep", self.keep, started.keep))
            for key in ENGINE_OPTIONS:
                asked, live = self.engine_options.get(key), started.engine_options.get(key)
                if asked != live:
                    out.append(_vs(f"--{key}", asked, live))
        return out

    def refusal(self, runtime: MeshRuntime, differences: list[str]) -> str:
        """The UsageError of this request for the name of the running mesh ``runtime``,
        which it ``differences`` from: what differs and the choices."""
        name = self.name
        text = (
            f"%mesh {name}: mesh {name!r} is already running with another spec: "
            f"{'; '.join(differences)}."
        )
        resize = self._resize_command(runtime, len(differences))
        if resize:
            text += f" To resize it and keep its ranks' state: {resize}."
        return (
            f"{text} To start it anew, which loses its ranks' state (their namespaces): "
            f"%mesh stop {name} first, or add --replace"
        )

    def _resize_command(self, runtime: MeshRuntime, differences: int) -> str:
        """``%mesh grow NAME --gpus +1`` (or ``shrink``) when this request differs from
        the running mesh only in a size a resize can change ('' otherwise): ranks on a
        one-host mesh, or whole hosts."""
        if differences != 1 or not _hosts_by_gpus(runtime):
            return ""
        if self.hosts == runtime.n_hosts == 1 and self.gpus != runtime.per_host:
            option, asked, live = "--gpus", self.gpus, runtime.per_host
        elif self.gpus == runtime.per_host and self.hosts != runtime.n_hosts:
            option, asked, live = "--hosts", self.hosts, runtime.n_hosts
        else:
            return ""
        if asked > live:
            return f"%mesh grow {self.name} {option} +{asked - live}"
        return f"%mesh shrink {self.name} {option} {asked}"


#: The request each mesh a ``%mesh`` line started was started by (what
#: :meth:`MeshRequest.differences` compares a later line's lasting options with).
_started_by: weakref.WeakKeyDictionary[MeshRuntime, MeshRequest] = weakref.WeakKeyDictionary()


def _hosts_by_gpus(runtime: MeshRuntime) -> bool:
    """Whether the running mesh has ``%mesh``'s dims (``gpus``, or ``hosts`` and
    ``gpus``), not others ``spawn_procs(per_host=...)`` gave it."""
    return tuple(runtime.shape.labels) in (("gpus",), ("hosts", "gpus"))


def _vs(option: str, asked: str | None, live: str | None) -> str:
    """``--gpus 3 vs the live --gpus 2``; ``None``: the option was not given (``no
    --dist``, ``the live mesh without --dist``), ``""``: a flag that was."""
    mine = f"{option} {asked}".rstrip() if asked is not None else f"no {option}"
    theirs = f"the live {option} {live}" if live is not None else f"the live mesh without {option}"
    theirs = theirs.rstrip()
    return f"{mine} vs {theirs}"


def _keep(req: MeshRequest) -> float | None:
    """``--keep`` in seconds (None: not given)."""
    return None if req.keep is None else parse_duration(req.keep)


def _env_text(env: Mapping[str, str]) -> str | None:
    """``A=1 B=2`` (None: no ``--env``)."""
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or None


def _policy_text(policy: str, minimum: int) -> str:
    """``restart``, ``shrink``, ``shrink:2``: a failure policy as ``--on-failure`` takes it."""
    return f"{policy}:{minimum}" if minimum > 1 else policy


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
    ``NAME`` in the notebook and say how long it took. A mesh of that name that runs is
    kept when asked for as it runs, else refused (a UsageError naming what differs),
    unless ``--replace``."""
    req = MeshRequest.parse(args, notebook)
    old_runtime = registry.get(req.name)
    old = ProcMesh(old_runtime) if old_runtime is not None else None
    if old_runtime is not None and old is not None and not old.stopped and not req.replace:
        differences = req.differences(old_runtime)
        if differences:
            raise UsageError(req.refusal(old_runtime, differences))
        _keep_running(notebook, req.name, old)
        return
    if req.detachable:
        check_detached_name(req.name)
    hosts = _reserve_hosts(req, replacing=old_runtime)
    if old_runtime is not None and old is not None:
        was_live = not old.stopped
        about = _about(old_runtime)
        old.stop()  # --replace (or a stopped mesh of the name): this one replaces it
        if was_live:
            print(
                f"mesh {req.name!r} ({about}) stopped for --replace; its ranks' state is "
                "gone, a new mesh starts"
            )
    note = oversubscription(req, hosts, replacing=old_runtime)
    if note:
        print(note)
    procs, took = _spawn(hosts, req)
    _started_by[procs.runtime] = req
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
        backends = set(run_on(notebook, procs, INIT_DIST).values())
        print(f"mesh {req.name!r}: torch.distributed process group initialised{_kind(backends)}")


def _kind(backends: set[str]) -> str:
    """`` (mkgloo: gloo in a worker the mesh can abort and re-form in place)``."""
    if len(backends) != 1:
        return f" ({', '.join(sorted(map(str, backends)))})"
    (backend,) = backends
    inside = REFORMABLE_KINDS.get(backend)
    if inside is None:
        return f" ({backend})"
    return (
        f" ({backend}: {inside} in a worker process the mesh can abort and re-form in place; "
        f"dist.get_backend() says {backend})"
    )


def _keep_running(notebook: Notebook, name: str, mesh: ProcMesh) -> None:
    """``%mesh`` again for the mesh ``name`` that runs as asked: bind it (the notebook
    variable may have been reassigned meanwhile) and show it, rather than restart it."""
    print(
        f"mesh {name!r} is already running with this spec ({_about(mesh.runtime)}): kept; "
        f"%mesh stop {name} first, or add --replace, to start it anew"
    )
    notebook.user_ns[name] = mesh
    from monarch_kernel.widgets import show  # ipywidgets: imported late

    show(mesh)


def _about(runtime: MeshRuntime) -> str:
    """``4 ranks, up 3m``: a running mesh in a few words."""
    ranks = f"{runtime.world} rank{'s' if runtime.world != 1 else ''}"
    return f"{ranks}, up {_age(time.time() - runtime.started_at)}"


def _age(seconds: float) -> str:
    """``12s``, ``3m``, ``2h 05m``."""
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


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
