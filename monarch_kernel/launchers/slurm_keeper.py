"""The keeper of a detachable mesh's Slurm steps: ``python -m
monarch_kernel.launchers.slurm_keeper``, started by the kernel in a session of its own
and with no parent-death signal, so that it outlives the kernel.

It replaces the job's watchdog (:data:`.slurm_allocation.WATCHDOG`) for a
``--detachable`` mesh. It reads JSON lines from the kernel's pipe on stdin:

* ``{"job": ID}``: the job we allocated (salloc said pending or granted). Until the
  steps start, a pipe that closes (the kernel released it, or died) cancels the job, as
  the watchdog does;
* ``{"steps": [{"srun": ARGV, "env": ENV, "log": PATH}, ...]}``: run our steps, one
  ``srun`` per host (its output to ``PATH``; ``ENV`` adds the host's join token to the
  keeper's environment: through the pipe, never on a command line). From then on the
  kernel may go: the steps run on; one that ends (its host was shrunk away, and the
  kernel shrank the job) leaves the others running. Once every step has ended (the
  agents ended: ``--keep`` ran out, or the mesh was stopped) the keeper cancels the job
  if we allocated it (inside the user's own job only our steps were ours, and they have
  ended) and exits with the first failing srun's code. Once the kernel is gone the
  keeper removes the logs too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from monarch_kernel.launchers.slurm_commands import cancel_job, cancel_step


def release_job(job: str, steps: list[str], ours: bool) -> None:
    """Release a detachable mesh's Slurm reservation by what its attach file records:
    cancel job ``job`` if we allocated it, else only our steps (by name) of it."""
    env = dict(os.environ)
    if ours:
        cancel_job(job, env)
        return
    for step in steps:
        cancel_step(job, step, env)


def main() -> int:
    """Follow the kernel's pipe (see the module docstring); the steps' exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    job = ""
    for line in sys.stdin:
        msg = json.loads(line)
        if "job" in msg:
            job = str(msg["job"])
        if "steps" in msg:
            return _run(job, list(msg["steps"]))
    if job:  # the kernel released it (or died) before the steps started
        cancel_job(job, dict(os.environ))
    return 0


def _run(job: str, steps: list[dict[str, Any]]) -> int:
    """Run the steps; once all ended, cancel the job (``job``: ours, else "")."""
    gone = threading.Event()

    def follow_kernel() -> None:
        for _ in sys.stdin:
            pass
        gone.set()

    procs = []
    for step in steps:
        env = {**os.environ, **{str(k): str(v) for k, v in step["env"].items()}}
        with open(str(step["log"]), "ab") as out:
            argv = [str(a) for a in step["srun"]]
            procs.append(
                subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            )
    threading.Thread(target=follow_kernel, daemon=True).start()
    codes = [proc.wait() for proc in procs]
    if job:
        cancel_job(job, dict(os.environ))
    if gone.is_set():
        for step in steps:
            with contextlib.suppress(OSError):
                os.unlink(str(step["log"]))
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
