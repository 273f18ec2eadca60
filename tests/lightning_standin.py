"""A stand-in for the cloud half of ``lightning_sdk`` (``Job``, ``Studio``): Lightning.ai
cannot be reached from the test machines.

``Job.run`` does what a Studio job does with its ``command``: it runs it with ``bash``
(``set -e``, as the SDK documents for Studio jobs), in the Studio's environment (its
``python`` first on ``PATH``, as the Studio's conda env is) plus ``env``, on
``num_machines`` machines: here network-namespace hosts (``tests/netns.py``), machine ``i``
on the ``i``-th host no running job of the stand-in is on (a cloud gives each job fresh
machines; when too few are free, host ``i``). Each machine stays ``Pending`` for
``startup`` seconds (provisioning), then is ``Running`` with its host's address as
``private_ip_address`` and starts the command ``boot`` seconds later (its environment
boots); it ends ``Completed`` or ``Failed`` by the command's exit code, or ``Stopped``
after :meth:`Job.stop`, which kills the machine's whole process group (as stopping a
cloud machine ends everything on it).

``Machine`` and ``Status`` *are* the installed SDK's (plain data, no network), and the
public signatures of ``Job`` and ``Studio`` are checked against the installed SDK by
``tests/test_lightning.py`` so the two cannot drift apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any, ClassVar, cast

from netns import NetHosts

os.environ["LIGHTNING_DISABLE_VERSION_CHECK"] = "1"  # before the SDK's import: no internet

from lightning_sdk import Machine
from lightning_sdk.status import Status

#: The project's root: a Studio has the project installed; here its checkout is imported.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The system part of a machine's PATH (``ip``/``unshare`` of the namespace wrapper too).
SYSTEM_PATH = ("/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

ENDED = (Status.Stopped, Status.Completed, Status.Failed)


class Studio:
    """The Studio whose environment jobs run in (same constructor as the SDK's)."""

    def __init__(
        self,
        name: str | None = None,
        teamspace: Any = None,
        org: Any = None,
        user: Any = None,
        cloud: Any = None,
        create_ok: bool = True,
        source: str | None = None,
        disable_secrets: bool = False,
        studio_type: str | None = None,
    ) -> None:
        current = os.environ.get("LIGHTNING_CLOUD_SPACE_ID")
        if name is None and not current and not create_ok:
            raise ValueError(
                "Cannot autodetect Studio. Either use the SDK from within a Studio or pass a name!"
            )
        self.name = name or current or "new-studio"


class Job:
    """A job on ``hosts`` (set by :func:`make_sdk` on a subclass); the public methods and
    properties the backend uses have the SDK's signatures."""

    hosts: ClassVar[NetHosts | None] = None
    #: Seconds every machine stays Pending before its command starts.
    startup: ClassVar[float] = 1.0
    #: Seconds a machine is Running before its command starts (its environment boots).
    boot: ClassVar[float] = 0.5
    #: Where the logs of the machines go (removed by ``close``).
    log_dir: ClassVar[str] = ""
    #: Overrides of the Studio's environment (e.g. a ``PATH`` without its ``python``).
    studio_env: ClassVar[dict[str, str]] = {}
    #: Every job started, in order (for the tests to inspect).
    started: ClassVar[list[Job]]

    def __init__(
        self,
        name: str,
        teamspace: Any = None,
        org: Any = None,
        user: Any = None,
        *,
        _fetch_job: bool = True,
        _num_machines: int = 1,
    ) -> None:
        if _num_machines < 1:
            raise ValueError("A job needs to run on at least one machine")
        self._name = name
        self._num_machines = _num_machines
        self._lock = threading.Lock()
        self._state = Status.Pending
        self._rank: int | None = None
        self._host = 0  #: the index of the namespace host this machine runs on
        self._ip: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._subjobs: list[Job] = []
        self._stopping = False
        #: What ``run`` was given (the tests check it).
        self.spec: dict[str, Any] = {}
        #: How many times ``stop`` was called (the tests check it).
        self.stop_calls = 0

    # -- what a multi-machine Job.run does ----------------------------------------
    @classmethod
    def run(
        cls,
        name: str,
        machine: Machine | str,
        cloud: Any = None,
        command: str | None = None,
        studio: Studio | str | None = None,
        image: str | None = None,
        teamspace: Any = None,
        org: Any = None,
        user: Any = None,
        env: dict[str, str] | None = None,
        interruptible: bool = False,
        image_credentials: str | None = None,
        cloud_account_auth: bool = False,
        entrypoint: str | None = None,
        path_mappings: dict[str, str] | None = None,
        max_runtime: int | None = None,
        max_run_attempts: int | None = None,
        reuse_snapshot: bool = True,
        scratch_disks: dict[str, int] | None = None,
        placement_group_id: str | None = None,
        num_machines: int = 1,
        tags: list[str] | None = None,
        keep_minutes: int | None = None,
    ) -> Job:
        if cls.hosts is None:
            raise RuntimeError("the stand-in has no hosts: build it with make_sdk(net)")
        if not isinstance(machine, Machine):
            machine = Machine.from_str(machine)
        if studio is not None and image is not None:
            raise ValueError("studio and image are mutually exclusive")
        if studio is not None and not command:
            raise ValueError("a Studio job needs a command")
        if num_machines > len(cls.hosts.hosts):
            raise ValueError(f"the stand-in has {len(cls.hosts.hosts)} hosts, not {num_machines}")
        busy = {m._host for j in cls.started if j.status not in ENDED for m in j.machines}
        free = [i for i in range(len(cls.hosts.hosts)) if i not in busy]
        places = free if len(free) >= num_machines else list(range(num_machines))
        job = cls(name, _fetch_job=False, _num_machines=num_machines)
        job.spec = {
            "machine": machine,
            "command": command,
            "studio": studio,
            "env": dict(env or {}),
            "interruptible": interruptible,
            "num_machines": num_machines,
        }
        for rank in range(num_machines):
            sub = cls(f"{name}-{rank}", _fetch_job=False)
            sub._rank, sub._host = rank, places[rank]
            job._subjobs.append(sub)
        cls.started.append(job)
        threading.Thread(target=job._provision, daemon=True).start()
        return job

    def _provision(self) -> None:
        """After ``startup`` s, run the command on every machine and watch it."""
        time.sleep(self.startup)
        assert self.hosts is not None
        script = "set -e\n" + str(self.spec["command"])
        env = {
            # The Studio's environment: its interpreter first on PATH, the project
            # installed (here: importable from the checkout), then the job's env.
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), *SYSTEM_PATH]),
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": ROOT,
            "LIGHTNING_CLOUD_SPACE_ID": os.environ.get("LIGHTNING_CLOUD_SPACE_ID", "standin"),
            **self.studio_env,
            **self.spec["env"],
        }
        # A machine reports Running (with its address) while its environment still
        # boots; the command starts ``boot`` s later.
        with self._lock:
            if self._stopping:
                return
            for sub in self.machines:
                sub._ip, sub._state = self.hosts.hosts[sub._host].addr, Status.Running
        time.sleep(self.boot)
        for sub in self.machines:
            with self._lock:
                if self._stopping:
                    return
                with open(os.path.join(self.log_dir, f"{sub._name}.log"), "wb") as log:
                    sub._proc = self.hosts.popen(
                        sub._host,
                        ["bash", "-c", script],
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # stop() ends the whole machine's tree
                    )
            threading.Thread(target=sub._watch, daemon=True).start()

    def _watch(self) -> None:
        proc = self._proc
        assert proc is not None
        code = proc.wait()
        with self._lock:
            if self._state is Status.Running:
                self._state = Status.Completed if code == 0 else Status.Failed

    # -- the SDK's public interface -------------------------------------------------
    def stop(self) -> None:
        self.stop_calls += 1
        if self.status in ENDED:
            return
        with self._lock:
            self._stopping = True
        for sub in self.machines:
            sub._kill()

    def _kill(self) -> None:
        """End everything on this machine: SIGTERM, then SIGKILL what is left."""
        with self._lock:
            proc = self._proc
            if self._state in (Status.Pending, Status.Running):
                self._state = Status.Stopping
        if proc is not None:
            for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(grace)
                    os.killpg(proc.pid, 0)  # the agent exited: is its group gone too?
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        with self._lock:
            if self._state is Status.Stopping:
                self._state = Status.Stopped

    def wait(
        self, interval: float = 5.0, timeout: float | None = None, stop_on_timeout: bool = False
    ) -> None:
        start = time.time()
        while self.status not in ENDED:
            if timeout is not None and time.time() - start > timeout:
                if stop_on_timeout:
                    self.stop()
                raise TimeoutError("Job didn't finish within the provided timeout.")
            time.sleep(interval)

    @property
    def status(self) -> Status:
        if not self.is_multi_machine and not self._subjobs:
            return self._state
        states = [s.status for s in self.machines]
        if self._stopping:
            return Status.Stopped if all(s in ENDED for s in states) else Status.Stopping
        for s in (Status.Failed, Status.Pending):
            if s in states:
                return s
        return Status.Completed if all(s is Status.Completed for s in states) else Status.Running

    @property
    def machines(self) -> tuple[Job, ...]:
        return tuple(self._subjobs) if self._subjobs else (self,)

    @property
    def name(self) -> str:
        return self._name

    @property
    def rank(self) -> int | None:
        return None if self.is_multi_machine else self._rank

    @property
    def private_ip_address(self) -> str | None:
        return None if self.is_multi_machine else self._ip

    @property
    def is_multi_machine(self) -> bool:
        return self._num_machines > 1

    @property
    def num_machines(self) -> int:
        return self._num_machines

    @property
    def link(self) -> str:
        return f"https://lightning.ai/stand-in/jobs/{self._name}"


def make_sdk(
    net: NetHosts,
    startup: float = 1.0,
    boot: float = 0.5,
    studio_env: dict[str, str] | None = None,
) -> types.SimpleNamespace:
    """An SDK object (``Job``, ``Machine``, ``Studio``) whose jobs run on ``net``;
    ``sdk.close()`` stops every job it started and removes its logs."""
    log_dir = tempfile.mkdtemp(prefix="mk-lightning-standin-")
    attrs = {
        "hosts": net,
        "startup": startup,
        "boot": boot,
        "studio_env": dict(studio_env or {}),
        "log_dir": log_dir,
        "started": [],
    }
    job_cls = cast("type[Job]", type("Job", (Job,), attrs))

    def close() -> None:
        for job in job_cls.started:
            job.stop()
        shutil.rmtree(log_dir, ignore_errors=True)

    def logs(job: Job) -> str:
        out = []
        for sub in job.machines:
            try:
                with open(os.path.join(log_dir, f"{sub.name}.log")) as f:
                    out.append(f.read())
            except OSError:
                pass
        return "\n".join(out)

    return types.SimpleNamespace(
        Job=job_cls, Machine=Machine, Studio=Studio, close=close, logs=logs, log_dir=log_dir
    )
