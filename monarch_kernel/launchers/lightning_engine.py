"""The ``lightning`` backend: a multi-machine Lightning.ai job runs the join command.

``%mesh big --backend lightning --hosts 2 --machine H100_X_8`` submits one job::

    Job.run(name="mk-big-...", machine=Machine.H100_X_8, num_machines=2,
            command="python -m monarch_kernel.host --join tcp://ADDR:PORT",
            studio=Studio(create_ok=False), env={"MONARCH_KERNEL_JOIN_TOKEN": ...},
            interruptible=False)

Every machine of the job runs the same command in the Studio's environment (hence plain
``python``) with one *group* token in its environment (never on the command line); each
takes the next host slot not joined yet. Until a machine joins, the dashboard shows what
the SDK says about it ("Pending", "Running at 10.0.0.7"), read by a background thread, so
the dashboard never waits on the cloud. The job is stopped on ``%mesh stop``, kernel
shutdown and interpreter exit (:class:`~.engine.EngineLauncher`).

Inside a Studio, ``%mesh NAME --gpus 8`` needs none of this: the Studio's own GPUs are the
local backend's.

``lightning-sdk`` is an optional extra (``pip install monarch-kernel[lightning]``). Its
import checks PyPI for a newer version unless ``LIGHTNING_DISABLE_VERSION_CHECK=1``, which
this module sets first: a kernel must not call the internet to start a mesh. Its import
also sets ``TQDM_POSITION=-1`` and ``TQDM_MININTERVAL=1`` in the environment when stderr
is no terminal (a kernel's never is); every rank started later would inherit them and
draw its progress bars once a second, a row below the cursor. :func:`import_sdk` puts
those variables back as they were.

The machines connect to the controller at ``advertise`` (default: this Studio's address
on its default route); where the job's machines cannot reach it, pass ``--advertise``.
Host slot ``i`` shows machine ``i``'s status until some machine joins it (with a group
token a machine takes whichever slot is free, so the two may differ).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import secrets
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from monarch_kernel.launchers.base import HostConfig
from monarch_kernel.launchers.engine import Allocation, EngineLauncher, JoinCommand

log = logging.getLogger("monarch_kernel.launchers")

#: Set inside a Lightning Studio (the SDK then authenticates by itself).
STUDIO_ENV = "LIGHTNING_CLOUD_SPACE_ID"

#: Job states after which a job runs nothing (the values of ``lightning_sdk.Status``).
ENDED = ("Stopped", "Completed", "Failed")

IDLE_SLEEP_NOTICE = (
    "Lightning job {job} runs this mesh on {n}x {machine}. An idle Studio goes to sleep, "
    "and that ends the live mesh: keep this Studio active (or raise its idle timeout) "
    "while the mesh is in use."
)


class LightningSDK(Protocol):
    """The three names of ``lightning_sdk`` this backend uses (the module itself, or a
    stand-in with the same interface in tests)."""

    #: ``Job.run(name=, machine=, num_machines=, command=, studio=, env=,
    #: interruptible=)`` returns a job with ``status``, ``machines`` (rank-ordered, each
    #: with ``status`` and ``private_ip_address``), ``link`` and ``stop()``.
    Job: Any
    #: Machine types are its class attributes that are instances of it.
    Machine: Any
    #: ``Studio(create_ok=False)``: the current Studio (or the configured default one).
    Studio: Any


#: What ``lightning_sdk``'s import sets in the environment (for tqdm in log files).
SDK_SETS = ("TQDM_POSITION", "TQDM_MININTERVAL")


def import_sdk() -> LightningSDK:
    """The installed ``lightning_sdk``, imported without its internet version check and
    without changing the environment ranks inherit (see the module's doc)."""
    os.environ["LIGHTNING_DISABLE_VERSION_CHECK"] = "1"
    before = {name: os.environ.get(name) for name in SDK_SETS}
    try:
        return _import_sdk()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import_sdk() -> LightningSDK:
    stderr = sys.stderr
    try:
        stderr.fileno()
    except (AttributeError, OSError, ValueError):
        # Its import asks ``os.isatty(sys.stderr.fileno())`` (to quiet tqdm), which fails
        # where a kernel's stderr is a stream without a file descriptor: show it the
        # process's own stderr for that moment.
        sys.stderr = sys.__stderr__ or open(os.devnull, "w")  # noqa: SIM115 (put back below)
    try:
        module: Any = importlib.import_module("lightning_sdk")
    except ImportError:
        raise ValueError(
            "the lightning backend needs lightning-sdk: pip install 'monarch-kernel[lightning]'"
        ) from None
    finally:
        if sys.stderr is not stderr:
            if sys.stderr is not sys.__stderr__:
                sys.stderr.close()
            sys.stderr = stderr
    sdk: LightningSDK = module
    return sdk


def in_studio(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Lightning.ai Studio."""
    return bool((os.environ if environ is None else environ).get(STUDIO_ENV))


def find_credentials(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the SDK would take Lightning credentials from, or None when it has none.

    The order is the SDK's own: a Studio authenticates by itself; else an API key or an
    auth token in the environment; else the file ``lightning login`` writes
    (``$LIGHTNING_CREDENTIAL_PATH``, default ``~/.lightning/credentials.json``)."""
    env = os.environ if environ is None else environ
    if env.get(STUDIO_ENV):
        return "this Studio"
    if env.get("LIGHTNING_API_KEY") or env.get("LIGHTNING_AUTH_TOKEN"):
        return "the environment"
    path = Path(env.get("LIGHTNING_CREDENTIAL_PATH") or Path.home() / ".lightning/credentials.json")
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(saved, dict) and (saved.get("api_key") or saved.get("auth_token")):
        return str(path)
    return None


def machine_types(sdk: LightningSDK) -> dict[str, object]:
    """The machine types the installed SDK knows, by name (``H100_X_8`` ...)."""
    cls = sdk.Machine
    return {k: v for k, v in vars(cls).items() if isinstance(v, cls)}


def _job_name(mesh: str) -> str:
    """A job name unique in the teamspace: the SDK wants one per run."""
    slug = re.sub(r"[^a-z0-9]+", "-", mesh.lower()).strip("-")[:40] or "mesh"
    return f"mk-{slug}-{secrets.token_hex(3)}"


def _state(value: object) -> str:
    """A status as the SDK's enum prints it (``Status.Running`` -> ``Running``)."""
    return str(getattr(value, "value", value))


class LightningJob(Allocation):
    """One multi-machine job serving the hosts of one mesh start.

    A daemon thread reads the job's and its machines' statuses every ``interval`` s (less
    often once all run): :meth:`status` and :meth:`failure` only read what it saw last."""

    def __init__(self, job: Any, name: str, machine: str, n: int, interval: float):
        self.job = job
        self.name = name
        self.machine = machine
        self.n = n
        self.interval = interval
        self._lock = threading.Lock()
        self._state = "Pending"
        self._machines: list[str] = []
        self._released = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"mk-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> bool:
        """One look at the job (SDK calls, off the dashboard's thread); True once all
        machines run or the job ended."""
        state = _state(self.job.status)
        seen = []
        for m in list(self.job.machines)[: self.n]:
            s, ip = _state(m.status), m.private_ip_address
            seen.append(f"{s} at {ip}" if ip and s == "Running" else s)
        with self._lock:
            self._state, self._machines = state, seen
        return state in ENDED or (
            len(seen) == self.n and all(s.startswith("Running") for s in seen)
        )

    def _poll(self) -> None:
        while not self._stop.is_set():
            settled = False
            try:
                settled = self._read()
            except Exception as exc:  # the API hiccups: keep the last statuses, try again
                log.debug("reading Lightning job %s: %s", self.name, exc)
            if self._state in ENDED:
                return  # nothing changes any more
            # Once every machine runs only an end of the job matters: ask less often.
            self._stop.wait(self.interval * (6 if settled else 1))

    def status(self, i: int) -> str:
        with self._lock:
            s = self._machines[i] if i < len(self._machines) else self._state
        return f"Lightning {self.machine} machine {i}: {s} (job {self.name})"

    def notice(self) -> str | None:
        return IDLE_SLEEP_NOTICE.format(job=self.name, n=self.n, machine=self.machine)

    def failure(self) -> str | None:
        with self._lock:
            state, released = self._state, self._released
        if state in ENDED and not released:
            link = getattr(self.job, "link", "") if state == "Failed" else ""
            return f"Lightning job {self.name} is {state}" + (f"; its logs: {link}" if link else "")
        return None

    def release(self) -> None:
        """Stop the job (a no-op once it ended or was stopped); idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._stop.set()
        try:
            self.job.stop()
        except BaseException:
            with self._lock:
                self._released = False  # a later release (kernel exit) tries again
            raise
        self._thread.join(2)


@dataclass(eq=False)  # hashable, like its base (see engine.py)
class LightningLauncher(EngineLauncher):
    """Runs the join command on ``N`` machines of one Lightning.ai job per mesh start.

    ``machine``: a ``lightning_sdk.Machine`` name (``H100_X_8`` ...). ``sdk``: the SDK
    (default: the installed ``lightning_sdk``; tests pass a stand-in). ``poll_interval``:
    seconds between status reads while machines come up."""

    machine: str | None = None
    sdk: LightningSDK | None = None
    poll_interval: float = 5.0
    name: str = "lightning"
    per_host_tokens: bool = False
    _machine: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Nothing is bound or imported for a mesh that cannot start: credentials first.
        if find_credentials() is None:
            raise ValueError(
                "no Lightning credentials: run this notebook inside a Lightning.ai Studio, "
                "or set LIGHTNING_USER_ID and LIGHTNING_API_KEY (lightning.ai, Global "
                "settings > Keys), or run `lightning login` once on this machine"
            )
        if self.sdk is None:
            self.sdk = import_sdk()
        known = machine_types(self.sdk)
        choices = ", ".join(sorted(known))
        if not self.machine:
            raise ValueError(f"the lightning backend needs --machine TYPE; one of: {choices}")
        key = self.machine.upper()
        if key not in known:
            raise ValueError(f"unknown Lightning machine type {self.machine!r}; one of: {choices}")
        self.machine, self._machine = key, known[key]
        super().__post_init__()

    def python(self) -> str:
        """The job runs in the Studio's environment: its ``python``."""
        return "python"

    def allocate(self, command: JoinCommand, configs: list[HostConfig]) -> Allocation:
        sdk = self.sdk
        assert sdk is not None  # set in __post_init__
        count = getattr(self._machine, "accelerator_count", None)
        family = str(getattr(self._machine, "family", ""))
        wanted = max(c.ranks for c in configs)
        if count and family not in ("CPU", "DATA-PREP") and wanted > count:
            raise ValueError(
                f"{wanted} ranks per host but a {self.machine} machine has {count} GPUs; "
                "use --gpus <= that, or a larger --machine"
            )
        name = _job_name(command.mesh)
        try:
            job = sdk.Job.run(
                name=name,
                machine=self._machine,
                num_machines=len(configs),
                command=command.line,
                # create_ok=False: never create a Studio as a side effect (outside a
                # Studio this takes the configured default one, else fails clearly).
                studio=sdk.Studio(create_ok=False),
                env=command.env(0),
                interruptible=False,
            )
        except Exception as exc:
            raise ValueError(f"Lightning could not start job {name}: {exc}") from exc
        log.info("Lightning job %s: %d x %s", name, len(configs), self.machine)
        return LightningJob(job, name, str(self.machine), len(configs), self.poll_interval)


__all__: Sequence[str] = (
    "LightningJob",
    "LightningLauncher",
    "LightningSDK",
    "find_credentials",
    "import_sdk",
    "in_studio",
    "machine_types",
)
