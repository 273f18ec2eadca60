"""The ``slurm`` backend: ``srun`` runs the host agent on every node of an allocation.

Two cases, told apart by ``$SLURM_JOB_ID`` in the kernel's environment:

* **Inside an allocation** (the kernel runs in an ``salloc`` shell or an ``sbatch`` job):
  each agent runs as a job step of its own on one node, ``srun --jobid $SLURM_JOB_ID
  --nodes=1 --ntasks=1 --nodelist=NODE --overlap ...``. The user's job is theirs: we
  only ever stop our steps, never cancel or shrink the job.
* **Outside one**: ``salloc --no-shell --nodes H --ntasks-per-node=1 --job-name
  mk-<mesh>`` reserves the nodes, then the steps are started as above with ``--jobid``
  of that job. A *watchdog* (a small ``sh``, in its own session) holds a pipe from the
  kernel and cancels the job when the pipe closes: on release, and when the kernel exits
  or is killed, so a dead kernel never keeps nodes. (Not ``salloc CMD`` with a holder
  command: salloc 22.05 was seen spinning forever in ``waitpid`` after its job ended
  that way.) A GPU cluster (gpu GRES in ``sinfo``) is asked for ``--gpus-per-node G``;
  a CPU cluster is asked for no GPUs.

One step per host (:mod:`.slurm_steps`), so that a shrink ends a host's step alone and
then shrinks our job off its node (``scontrol update JobId=J NodeList=<kept nodes>``):
the node is free for other jobs at once, while the other hosts run on. A grow by hosts
(``%mesh grow NAME --hosts +K``) is one more allocation of the same kind: a new salloc
job, or new steps in the user's job, on nodes none of the mesh's steps runs on
(``--exclude``; fewer such nodes than asked for is refused before anything starts).

Each step has its own host's join token in srun's environment, never on a command
line (so host ``i`` is known to run on its step's node). The interpreter is this one
(``sys.executable``): cluster nodes share the file system.

Every process we start (salloc, each srun) is started *and watched* by its own thread:
the parent-death signal Linux gives srun belongs to the thread that forked it, so that
thread lives exactly as long as srun does. Status and failure are plain fields those
threads update, so :meth:`SlurmAllocation.status` never blocks.

The pieces: :class:`SlurmLauncher` here (which case, and the checks before anything
starts); the allocation, its threads and watchdog in :mod:`.slurm_allocation`; the
steps in :mod:`.slurm_steps`; the client commands (probing the cluster, the salloc/srun
command lines, scancel, the shrink) in :mod:`.slurm_commands`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from monarch_kernel.launchers.base import HostConfig
from monarch_kernel.launchers.engine import Allocation, EngineLauncher, JoinCommand
from monarch_kernel.launchers.slurm_allocation import (
    GRANT_WAIT,
    STEP_GRACE,
    WATCHDOG,
    Phase,
    SlurmAllocation,
)
from monarch_kernel.launchers.slurm_commands import (
    CLIENT_TIMEOUT,
    Node,
    SallocOptions,
    check_free_nodes,
    hostnames,
    salloc_argv,
    slurm_nodes,
)

# Importable from here as before the split.
__all__ = [
    "CLIENT_TIMEOUT",
    "GRANT_WAIT",
    "STEP_GRACE",
    "WATCHDOG",
    "Node",
    "Phase",
    "SlurmAllocation",
    "SlurmLauncher",
    "slurm_nodes",
]


# eq=False: a launcher is an identity (two with the same options are still two sets of
# allocations), and stays hashable.
@dataclass(eq=False)
class SlurmLauncher(EngineLauncher):
    """Starts the hosts of a mesh with ``srun`` on a Slurm allocation (see the module
    docstring). ``partition``, ``time``, ``account``: salloc's options when we allocate
    (ignored inside an allocation, which has its own)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    #: further salloc arguments when we allocate (``--qos=high``, ``--mem=64G`` ...)
    salloc_args: tuple[str, ...] = ()
    name: str = "slurm"
    #: One srun step per host, each with its host's own token.
    per_host_tokens: bool = True

    def allocate(self, command: JoinCommand, configs: list[HostConfig]) -> Allocation:
        """Start the agents of ``configs`` (one per node): in this kernel's job if it
        runs inside one, else in a job salloc reserves now."""
        hosts = len(configs)
        env = dict(os.environ)  # each step adds its host's token
        job = os.environ.get("SLURM_JOB_ID")
        # A grow's new hosts go on nodes none of the mesh's hosts is on yet.
        used = self._used_nodes(command.mesh) if min(command.hosts) > 0 else frozenset()
        if job:
            _check_inside_job(command, job, hosts, env, used)
            alloc = SlurmAllocation(command, hosts, env, job, None, used)
        else:
            options = SallocOptions(
                self.partition, self.time, self.account, tuple(self.salloc_args)
            )
            salloc = salloc_argv(command.mesh, hosts, configs[0].ranks, options, used)
            alloc = SlurmAllocation(command, hosts, env, None, salloc)
        alloc.start()
        return alloc

    def _used_nodes(self, mesh: str) -> frozenset[str]:
        """The nodes our steps for ``mesh`` run on (a grow adds hosts elsewhere)."""
        with self._lock:
            allocs = [a for a in self._holders if isinstance(a, SlurmAllocation)]
        names = [a.node_names() for a in allocs if a.mesh == mesh]
        return frozenset(n for some in names for n in some)


def _check_inside_job(
    command: JoinCommand,
    job: str,
    hosts: int,
    env: dict[str, str],
    used: frozenset[str] = frozenset(),
) -> None:
    """ValueError unless this kernel's job ``job`` has ``hosts`` nodes (besides the
    ``used`` ones, for a grow) and srun."""
    have = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if used and nodelist:
        where = f"Slurm job {job} (this kernel's allocation)"
        check_free_nodes(hosts, used, hostnames(nodelist, env), where)
    elif have and have.isdigit() and hosts > int(have):
        raise ValueError(
            f"mesh {command.mesh!r} asks for {hosts} hosts but Slurm job {job} "
            f"(this kernel's allocation) has {have} nodes"
        )
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise ValueError(f"inside Slurm job {job} but `srun` is not on PATH")
