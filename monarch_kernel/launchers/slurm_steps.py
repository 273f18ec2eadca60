"""One srun step per host: the host agent on one node of a Slurm job.

A mesh's hosts in one job each run as a step of their own (``srun --nodes=1 --ntasks=1
--nodelist=NODE``), not as one step across the nodes, so that one host can end (a shrink)
while the others run on: its step ends alone, and a job we allocated can then be shrunk
off its node (:func:`.slurm_commands.shrink_job`). Each step has the host's own join
token in its environment (never on a command line), so host ``i`` is known to run on
``HostStep.node``.

Here: the step record and where the steps go (:func:`place_steps`); the allocation in
:mod:`.slurm_allocation` starts and follows them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from dataclasses import dataclass, field

from monarch_kernel.launchers.slurm_commands import hostnames, job_nodes, srun_argv


@dataclass(eq=False)
class HostStep:
    """Host ``index``'s srun step (its node is known once the job is granted)."""

    index: int
    #: The step's name, unique: status, ``squeue`` and cancelling find it by name.
    name: str
    #: What srun's environment adds for this host: its join token.
    env: dict[str, str]
    #: srun's output (quoted when the step fails).
    log: str = field(default_factory=lambda: _new_log())
    node: str = ""  #: the node it runs on ("" until placed)
    proc: subprocess.Popen[bytes] | None = None  #: srun (None under a keeper)
    #: The host was cleaned up (a shrink, or the whole allocation released): the step's
    #: end is no failure, and a step not started yet never starts.
    released: bool = False

    def argv(self, job: str | None, command: list[str]) -> list[str]:
        """srun's command line for this step (``command`` once, on :attr:`node`)."""
        return srun_argv(job, self.node, self.name, command)

    def read_log(self) -> str:
        """The end of srun's output ("" if none)."""
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-8192:]
        except OSError:
            return ""

    def remove_log(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.log)


def _new_log() -> str:
    fd, path = tempfile.mkstemp(prefix="mk-srun-", suffix=".log")
    os.close(fd)
    return path


def place_steps(
    steps: list[HostStep], job: str, exclude: frozenset[str], env: dict[str, str]
) -> list[str]:
    """Give each step a node of ``job`` (in Slurm's node order), none of ``exclude``
    (nodes the mesh's other hosts are on); the nodes, or ValueError that says why not."""
    listed = job_nodes(job, env)
    if not listed:
        raise ValueError(
            f"cannot tell the nodes of Slurm job {job}: `squeue -j {job}` listed none "
            "(has the job ended?); start the mesh again"
        )
    free = [n for n in hostnames(listed, env) if n not in exclude]
    if len(free) < len(steps):
        raise ValueError(
            f"Slurm job {job} has {len(free)} node(s) free for this mesh ({listed}) but "
            f"{len(steps)} host(s) need one each; ask for fewer hosts"
        )
    for step, node in zip(steps, free, strict=False):
        step.node = node
    return free[: len(steps)]
