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
from typing import BinaryIO

from monarch_kernel.launchers.slurm_commands import hostnames, job_nodes, srun_argv

#: How much of the end of srun's output a failure quotes (bytes).
LOG_TAIL = 8192


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
    #: Our own srun's output, read through this descriptor (-1: read :attr:`log`).
    log_fd: int = -1

    def argv(self, job: str | None, command: list[str]) -> list[str]:
        """srun's command line for this step (``command`` once, on :attr:`node`)."""
        return srun_argv(job, self.node, self.name, command)

    def open_log(self) -> BinaryIO:
        """The log, opened for our own srun's output. Its name is removed at once (a
        descriptor to read it by is kept): a kernel killed outright leaves no file."""
        self.remove_log()  # a step started again writes a new log
        out = open(self.log, "wb")  # noqa: SIM115  # the caller's with block closes it
        self.log_fd = os.open(self.log, os.O_RDONLY)
        with contextlib.suppress(OSError):
            os.unlink(self.log)
        return out

    def read_log(self) -> str:
        """The end of srun's output ("" if none)."""
        try:
            if self.log_fd >= 0:
                size = os.fstat(self.log_fd).st_size
                data = os.pread(self.log_fd, LOG_TAIL, max(0, size - LOG_TAIL))
            else:
                with open(self.log, "rb") as f:
                    data = f.read()[-LOG_TAIL:]
        except OSError:
            return ""
        return data.decode(errors="replace")

    def remove_log(self) -> None:
        """Remove the log (a keeper's steps write it by name) or close our descriptor."""
        if self.log_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.log_fd)
            self.log_fd = -1
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
