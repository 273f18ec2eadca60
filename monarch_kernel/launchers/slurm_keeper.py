"""The keeper of a detachable mesh's Slurm step: ``python -m
monarch_kernel.launchers.slurm_keeper``, started by the kernel in a session of its own
and with no parent-death signal, so that it outlives the kernel.

It replaces the job's watchdog (:data:`.slurm_allocation.WATCHDOG`) for a
``--detachable`` mesh. It reads JSON lines from the kernel's pipe on stdin:

* ``{"job": ID}``: the job we allocated (salloc said pending or granted). Until the
  step starts, a pipe that closes (the kernel released it, or died) cancels the job, as
  the watchdog does;
* ``{"srun": ARGV, "log": PATH}``: run our step (``srun``, its output to ``PATH``;
  the join token is in the keeper's environment, never on a command line). From then
  on the kernel may go: the step runs on, and when it ends (the agents ended: ``--keep``
  ran out, or the mesh was stopped) the keeper cancels the job if we allocated it (inside
  the user's own job only our step was ours, and it has ended) and exits with srun's code.
  Once the kernel is gone the keeper removes the log too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

from monarch_kernel.launchers.slurm_commands import cancel_job, cancel_step


def release_job(job: str, step: str, ours: bool) -> None:
    """Release a detachable mesh's Slurm reservation by what its attach file records:
    cancel job ``job`` if we allocated it, else only our step ``step`` of it."""
    env = dict(os.environ)
    if ours:
        cancel_job(job, env)
    elif step:
        cancel_step(job, step, env)


def main() -> int:
    """Follow the kernel's pipe (see the module docstring); srun's exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    job = ""
    for line in sys.stdin:
        msg = json.loads(line)
        if "job" in msg:
            job = str(msg["job"])
        if "srun" in msg:
            return _run(job, [str(a) for a in msg["srun"]], str(msg["log"]))
    if job:  # the kernel released it (or died) before the step started
        cancel_job(job, dict(os.environ))
    return 0


def _run(job: str, argv: list[str], log: str) -> int:
    """Run the step; once it ends, cancel the job (``job``: ours, else "")."""
    gone = threading.Event()

    def follow_kernel() -> None:
        for _ in sys.stdin:
            pass
        gone.set()

    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    threading.Thread(target=follow_kernel, daemon=True).start()
    code = proc.wait()
    if job:
        cancel_job(job, dict(os.environ))
    if gone.is_set():
        with contextlib.suppress(OSError):
            os.unlink(log)
    return code


if __name__ == "__main__":
    sys.exit(main())
