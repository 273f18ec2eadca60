"""The attach file of a ``--detachable`` mesh: all that another kernel of the same user
needs to take the mesh over, and nothing on a command line.

Like a kernel's connection file it lives in Jupyter's runtime directory
(``jupyter --runtime-dir``, ``$JUPYTER_RUNTIME_DIR``), is readable by its user only
(0600) and holds a secret: the mesh's signing key. It also holds the controller's socket
addresses, each host agent's desk (where an attach is asked) and log, each rank's pid
and peer address, and what a restart re-creates (the failure policy, the ``--setup``
cells, the ranks' common configuration). The controller holding the mesh rewrites it
when any of that changes (atomically: a reader never sees half a file); the agents
remove it when they stop with no controller.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from monarch_kernel.controller.messaging.sockets import CurveKeys, Endpoints
from monarch_kernel.wire.desk import ControllerId

#: Version of the file's layout (a kernel refuses a file of another version). 2: the
#: package's modules moved (its agents and ranks pickle other class paths) and the
#: ranks' common part names the ``listener_key``. 3: protocol 14, whose signatures
#: (keyed BLAKE2b) the agents of a version-2 mesh would drop as forged.
FILE_VERSION = 3
PREFIX = "monarch-mesh-"
#: Names a detachable mesh may have (they become part of a file name).
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


class AttachFileError(ValueError):
    """An attach file is missing, unreadable or not one this version reads."""


def runtime_dir() -> str:
    """Jupyter's runtime directory (made, 0700, if missing)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        path = jupyter_runtime_dir()
    except ImportError:  # pragma: no cover - jupyter_core comes with ipykernel
        path = os.path.join(tempfile.gettempdir(), f"jupyter-runtime-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def file_for(name: str) -> str:
    """Where the attach file of mesh ``name`` is (ValueError for a name that cannot be
    part of a file name)."""
    if not NAME_RE.match(name):
        raise ValueError(
            f"a detachable mesh's name is letters, digits, '_', '.' and '-' (at most 100), "
            f"got {name!r}"
        )
    return os.path.join(runtime_dir(), f"{PREFIX}{name}.json")


@dataclass(frozen=True)
class MeshIdentity:
    """What a controller that attaches takes over from the file: the mesh's key and
    run, and where its controller listens."""

    key: bytes
    run_id: str
    started_at: float
    endpoints: Endpoints


@dataclass
class HostEntry:
    """One host agent of the mesh."""

    index: int
    pid: int
    hostname: str
    addr: str
    port: int
    desk: str  #: its attach desk (``ipc://DIR/desk``, or ``tcp://ADDR:PORT`` on a tcp mesh)
    dir: str = ""  #: its private directory (default: the desk's, on unix sockets)
    #: On a tcp mesh: the agent's CURVE public key (z85), which its desk serves with.
    curve_public: str = ""
    #: The engine reservation it runs in (ray, slurm: ``launchers.reservation``), which
    #: the kernel that stops the mesh releases; None on the other backends.
    reservation: dict[str, Any] | None = None
    #: Its wire id (``controller.state.records.Slots``); -1: its index.
    slot: int = -1

    @property
    def private_dir(self) -> str:
        """The agent's private directory (its ranks' logs, its own log), on the
        agent's machine."""
        return self.dir or os.path.dirname(self.desk.removeprefix("ipc://"))

    def rank_log(self, rank: int) -> str:
        """The log file rank ``rank`` of this host writes (everything it prints)."""
        return os.path.join(self.private_dir, f"rank{rank}.log")

    @property
    def log(self) -> str:
        return os.path.join(self.private_dir, "agent.log")


@dataclass
class RankEntry:
    """One rank of the mesh, as of its last start."""

    rank: int
    host: int
    pid: int
    hostname: str
    device: str
    peer: list[str]  #: its peer address (``PeerAddress.encode()``)
    peer_secret: str
    restarts: int
    #: Its wire id, which its host agent knows it by (``controller.state.records.Slots``);
    #: -1: its rank.
    slot: int = -1


@dataclass
class JobRecord:
    """A request the holder started that was still running when the file was written
    (a ``%%remote`` cell: its handle comes back at attach)."""

    request: str  #: the request id (the ranks answer it, whoever holds the mesh)
    ranks: list[int]
    kind: str  #: ``cell``, ``call`` ... (``controller.state.events.RequestKind``)
    what: str  #: ``cell 7``
    started: float  #: time.time()

    @property
    def cell(self) -> str:
        """The cell's label (``7`` of ``cell 7``)."""
        return self.what.removeprefix("cell ")


@dataclass
class ActorRecord:
    """An actor mesh spawned on the mesh: re-created on restarted ranks, and its handle
    comes back at attach. ``payload``/``buffers``: the spawn's, base64."""

    name: str
    payload: str
    buffers: list[str]
    ranks: list[int]
    owner: dict[str, Any] | None = None  #: the owner actor's ``oa``/``ox``/``on``


@dataclass
class AttachFile:
    """The content of an attach file (see the module docstring)."""

    name: str
    run_id: str
    key: str  #: the mesh's signing key, hex
    created: float  #: time.time() the mesh started
    keep: float  #: seconds it runs on without a controller
    backend: str
    per_host: dict[str, int]
    n_hosts: int
    controller: ControllerId  #: the controller holding it (or that held it last)
    send: str
    recv: str
    ipc_dir: str | None
    env: dict[str, str]
    on_failure: str
    grace: float
    common: dict[str, Any]  #: the ranks' common configuration (``spawn_ranks``)
    setup_cells: list[dict[str, Any]] = field(default_factory=list)
    hosts: list[HostEntry] = field(default_factory=list)
    ranks: list[RankEntry] = field(default_factory=list)
    #: What ran on the mesh when the file was last written.
    jobs: list[JobRecord] = field(default_factory=list)
    actors: list[ActorRecord] = field(default_factory=list)
    #: A tcp mesh's CURVE keys (``transport.CurveKeys`` as JSON); None on unix sockets.
    curve: dict[str, Any] | None = None
    written: float = field(default_factory=time.time)
    version: int = FILE_VERSION

    @property
    def path(self) -> str:
        return file_for(self.name)

    @property
    def running(self) -> list[str]:
        """What ran on the mesh (``cell 7`` ...), once each."""
        return list(dict.fromkeys(j.what for j in self.jobs))

    def identity(self) -> MeshIdentity:
        """The key, run and addresses a controller that attaches takes over."""
        return MeshIdentity(
            bytes.fromhex(self.key),
            self.run_id,
            self.created,
            Endpoints(self.send, self.recv, self.ipc_dir, self.curve_keys()),
        )

    def curve_keys(self) -> CurveKeys | None:
        """The tcp mesh's CURVE keys (None on unix sockets)."""
        raw = self.curve
        if raw is None:
            return None
        hosts = {int(h): (str(v[0]), str(v[1])) for h, v in dict(raw["hosts"]).items()}
        return CurveKeys(str(raw["public"]), str(raw["secret"]), hosts)

    def write(self) -> None:
        """Write atomically, readable by this user only."""
        self.written = time.time()
        body = asdict(self)
        folder = os.path.dirname(self.path)
        fd, tmp = tempfile.mkstemp(prefix=".mk-attach-", dir=folder)  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            _unlink(tmp)
            raise

    def remove(self) -> None:
        """Remove the file if it still describes this run of the mesh."""
        try:
            current = read(self.path)
        except AttachFileError:
            return
        if current.run_id == self.run_id:
            _unlink(self.path)


def curve_json(keys: CurveKeys | None) -> dict[str, Any] | None:
    """``keys`` as the file holds them."""
    if keys is None:
        return None
    hosts = {str(h): list(v) for h, v in keys.hosts.items()}
    return {"public": keys.public, "secret": keys.secret, "hosts": hosts}


def read(path: str) -> AttachFile:
    """The attach file at ``path`` (AttachFileError saying why it cannot be used)."""
    try:
        with open(path) as f:
            why = _not_private(path, os.fstat(f.fileno()))
            raw = None if why else json.load(f)
    except FileNotFoundError:
        raise AttachFileError(f"no attach file at {path}") from None
    except (OSError, ValueError) as exc:
        raise AttachFileError(f"cannot read the attach file {path}: {exc}") from None
    if why:
        raise AttachFileError(why)
    if not isinstance(raw, dict) or raw.get("version") != FILE_VERSION:
        version = raw.get("version") if isinstance(raw, dict) else None
        raise AttachFileError(
            f"{path} is an attach file of version {version!r}; this monarch_kernel reads "
            f"version {FILE_VERSION}: attach from a kernel of the version that made it"
        )
    try:
        names = {f.name for f in fields(AttachFile)}
        values = {k: v for k, v in raw.items() if k in names}
        values["controller"] = ControllerId.from_json(raw["controller"])
        values["hosts"] = [HostEntry(**h) for h in raw["hosts"]]
        values["ranks"] = [RankEntry(**r) for r in raw["ranks"]]
        values["jobs"] = [JobRecord(**j) for j in raw.get("jobs", ())]
        values["actors"] = [ActorRecord(**a) for a in raw.get("actors", ())]
        return AttachFile(**values)
    except (KeyError, TypeError, ValueError) as exc:
        raise AttachFileError(f"the attach file {path} is damaged: {exc!r}") from None


def _not_private(path: str, st: os.stat_result) -> str:
    """Why a file someone else could have written or read is refused ("" if it is
    not): it holds the mesh's key, and a forged one could point this kernel at someone
    else's sockets."""
    if st.st_uid != os.getuid():
        return (
            f"the attach file {path} belongs to another user (uid {st.st_uid}); attach only "
            "from your own files"
        )
    if st.st_mode & 0o077:
        return (
            f"the attach file {path} is readable or writable by others "
            f"(mode {st.st_mode & 0o777:o}); it holds the mesh's key: copy it with its mode "
            f"kept (scp -p) or chmod 600 it, then attach again"
        )
    return ""


def all_files() -> list[str]:
    """Every attach file in the runtime directory, oldest first."""
    folder = runtime_dir()
    paths = [
        os.path.join(folder, n)
        for n in os.listdir(folder)
        if n.startswith(PREFIX) and n.endswith(".json")
    ]
    return sorted(paths, key=_mtime)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
