"""Jobs: named host meshes from a scheduler (Monarch's ``monarch.job``).

A job names the host meshes a program needs; ``job.state()`` starts (applies) it and
gives them as attributes, ``job.kill()`` stops every process mesh spawned on them and
releases the allocation::

    from monarch_kernel.job import SlurmJob

    job = SlurmJob(meshes={"trainers": 2}, time_limit="06:00:00")
    procs = job.state().trainers.spawn_procs({"gpus": 8})
    ...
    job.kill()

Each job maps onto a launcher: :class:`LocalJob` and :class:`ProcessJob` the local one
(``ProcessJob``'s hosts are host agents on this machine), :class:`SlurmJob` ``slurm``,
:class:`RayJob` ``ray``, :class:`LightningJob` ``lightning`` and :class:`JoinJob`
``join``. As with ``%mesh``, machines are allocated when the first process mesh is
spawned on a host mesh (that is when the ranks per host are known), not by ``state()``.

Unlike Monarch's, a job's state is not cached in ``.monarch/job_state.pkl`` for a later
client: host agents belong to the controller that started them. ``cached_path`` is
accepted and ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from monarch_kernel.actor.hosts import HostMesh, this_host

#: Monarch's default ``cached_path`` of :meth:`JobTrait.state` (accepted and ignored here:
#: host agents belong to the controller that started them).
DEFAULT_JOB_PATH = ".monarch/job_state.pkl"


class JobState:
    """The host meshes of a running job, as attributes (``state.trainers``)."""

    def __init__(self, hosts: Mapping[str, HostMesh]):
        self._hosts = dict(hosts)

    def __getattr__(self, attr: str) -> HostMesh:
        if attr.startswith("_"):
            raise AttributeError(attr)
        try:
            return self._hosts[attr]
        except KeyError:
            available = ", ".join(sorted(self._hosts))
            raise AttributeError(
                f"'{attr}' is not a valid host mesh name. Available names: {available}"
            ) from None

    def __getitem__(self, name: str) -> HostMesh:
        return self._hosts[name]

    def __iter__(self) -> Any:
        return iter(self._hosts)

    def __repr__(self) -> str:
        return f"JobState(hosts={self._hosts})"


class JobTrait:
    """What every job does: :meth:`~JobTrait.apply`, :meth:`~JobTrait.state`,
    :meth:`~JobTrait.kill`, :attr:`~JobTrait.active`. Subclasses say which host meshes to
    make (``_host_meshes()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[str, HostMesh] | None = None

    def _host_meshes(self) -> dict[str, HostMesh]:
        raise NotImplementedError

    def apply(self, client_script: str | None = None) -> None:
        """Bring the job into existence (nothing if it runs). Running a client script
        as a batch job is not supported: run the script itself as the client."""
        if client_script is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.apply(client_script=...) is not supported: the "
                "notebook or script is the client; run it directly"
            )
        with self._lock:
            if self._hosts is None:
                self._hosts = self._host_meshes()

    @property
    def active(self) -> bool:
        """Whether the job was applied and not killed."""
        return self._hosts is not None

    def state(self, cached_path: str | None = DEFAULT_JOB_PATH) -> JobState:
        """The job's host meshes (applying it first if needed)."""
        self.apply()
        hosts = self._hosts
        if hosts is None:  # killed meanwhile by another thread
            raise RuntimeError(f"{type(self).__name__} was killed")
        return JobState(hosts)

    def kill(self) -> None:
        """Stop every process mesh spawned on the job's host meshes and release their
        allocations. The job can be applied again afterwards."""
        with self._lock:
            hosts, self._hosts = self._hosts, None
        errors: list[BaseException] = []
        for mesh in (hosts or {}).values():
            try:
                mesh.shutdown()
            except Exception as exc:  # the others are still shut down
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        state = "active" if self.active else "not applied"
        return f"<{type(self).__name__} {state}>"


class LocalJob(JobTrait):
    """Every host mesh is this machine (``this_host()``): switch a program between a
    cluster and a laptop by changing the job only."""

    def __init__(self, hosts: Sequence[str] = ("hosts",)):
        super().__init__()
        if isinstance(hosts, str):
            hosts = (hosts,)
        self._host_names = tuple(hosts)

    def _host_meshes(self) -> dict[str, HostMesh]:
        return {name: this_host() for name in self._host_names}

    def kill(self) -> None:
        """Stop the process meshes spawned through this job (this machine's host mesh
        is shared: it stays usable)."""
        with self._lock:
            hosts, self._hosts = self._hosts, None
        for mesh in {id(m): m for m in (hosts or {}).values()}.values():
            mesh.shutdown()


def _check_meshes(meshes: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(meshes, Mapping) or not meshes:
        raise ValueError("meshes must be a non-empty dict: {mesh name: number of hosts}")
    out = {}
    for name, n in meshes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh name {name!r} must be an identifier (job.state().{name})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"meshes[{name!r}] must be a positive number of hosts, got {n!r}")
        out[name] = n
    return out


class _LauncherJob(JobTrait):
    """Host meshes of ``meshes[name]`` hosts each from one launcher backend."""

    backend = "local"

    def __init__(self, meshes: Mapping[str, int], **launcher_options: Any):
        super().__init__()
        self._meshes = _check_meshes(meshes)
        self._options = launcher_options

    def _host_meshes(self) -> dict[str, HostMesh]:
        made: dict[str, HostMesh] = {}
        try:
            for name, n in self._meshes.items():
                made[name] = HostMesh(n, self.backend, **self._options)
        except BaseException:
            for mesh in made.values():
                mesh.shutdown()
            raise
        return made


class ProcessJob(_LauncherJob):
    """Each host is a host agent on this machine (Monarch's ``ProcessJob``): multi-host
    programs tested on one box. ``env``: extra environment of the ranks."""

    def __init__(self, meshes: dict[str, int], env: dict[str, str] | None = None):
        super().__init__(meshes)
        self._env = dict(env or {})

    def _host_meshes(self) -> dict[str, HostMesh]:
        made = super()._host_meshes()
        if self._env:
            for mesh in made.values():
                mesh.default_env = dict(self._env)
        return made


class SlurmJob(_LauncherJob):
    """Host meshes on a Slurm cluster (Monarch's ``SlurmJob``): one node per host, the
    ranks of a host started by ``srun``. Inside an allocation its nodes are used;
    otherwise ``salloc`` reserves them when a process mesh is first spawned, with
    ``time_limit``, ``partition``, ``account``, ``qos``, ``exclusive``, ``mem``,
    ``cpus_per_task`` and ``slurm_args`` as given. GPUs per node follow the process
    mesh's ``per_host`` (``gpus_per_node`` is kept as an attribute for the program to
    read); ``python_exe``, ``monarch_port``, ``log_dir`` and ``job_start_timeout`` are
    taken for Monarch's signature (the host agent runs this Python, talks over the
    controller's ports and logs to the dashboard)."""

    backend = "slurm"

    def __init__(
        self,
        meshes: dict[str, int],
        python_exe: str = "python",
        slurm_args: Sequence[str] = (),
        monarch_port: int = 22222,
        job_name: str = "monarch_job",
        ntasks_per_node: int = 1,
        time_limit: str | None = None,
        partition: str | None = None,
        log_dir: str | None = None,
        exclusive: bool = True,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        job_start_timeout: int | None = None,
        account: str | None = None,
        qos: str | None = None,
        **unsupported: Any,
    ):
        if unsupported:
            raise TypeError(
                f"SlurmJob() options not supported here: {', '.join(sorted(unsupported))}"
            )
        if ntasks_per_node != 1:
            raise ValueError("ntasks_per_node must be 1: one host agent per node starts the ranks")
        extra = [f"--job-name={job_name}"]
        if exclusive:
            extra.append("--exclusive")
        if cpus_per_task is not None:
            extra.append(f"--cpus-per-task={cpus_per_task}")
        if mem is not None:
            extra.append(f"--mem={mem}")
        if qos is not None:
            extra.append(f"--qos={qos}")
        extra.extend(slurm_args)
        super().__init__(
            meshes,
            partition=partition,
            time=time_limit,
            account=account,
            salloc_args=tuple(extra),
        )
        self.gpus_per_node = gpus_per_node
        self.job_start_timeout = job_start_timeout


class RayJob(_LauncherJob):
    """Host meshes on a Ray cluster: one placement-group bundle per host
    (``address``: the cluster's, default the one ``ray.init()`` finds)."""

    backend = "ray"

    def __init__(self, meshes: dict[str, int], address: str | None = None):
        super().__init__(meshes, address=address)


class LightningJob(_LauncherJob):
    """Host meshes on Lightning.ai machines (``machine``: e.g. ``"H100_X_8"``)."""

    backend = "lightning"

    def __init__(self, meshes: dict[str, int], machine: str | None = None):
        super().__init__(meshes, machine=machine)


class JoinJob(_LauncherJob):
    """Host meshes of machines started any other way: each runs the one-line join
    command shown when a process mesh is spawned."""

    backend = "join"

    def __init__(self, meshes: dict[str, int], **join_options: Any):
        super().__init__(meshes, **join_options)


__all__ = [
    "DEFAULT_JOB_PATH",
    "JobState",
    "JobTrait",
    "JoinJob",
    "LightningJob",
    "LocalJob",
    "ProcessJob",
    "RayJob",
    "SlurmJob",
]
