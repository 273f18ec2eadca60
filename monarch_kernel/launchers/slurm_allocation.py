"""A Slurm allocation running the host agents: salloc (when we allocate), the job's
watchdog, and our srun step, each started and followed by its own thread.

See :mod:`.slurm_engine` for the two cases (inside an allocation or not) and why each
process is watched by the thread that started it; the command lines are built in
:mod:`.slurm_commands`. A detachable mesh's step outlives the kernel: a *keeper*
(:mod:`.slurm_keeper`) takes the watchdog's place and runs srun (see there).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
from enum import Enum

from monarch_kernel.launchers.engine import Allocation, JoinCommand
from monarch_kernel.launchers.reservation import Reservation
from monarch_kernel.launchers.slurm_commands import (
    cancel_job,
    cancel_step,
    end,
    job_nodes,
    popen,
    srun_argv,
    step_nodes,
    tail,
)

#: Seconds ``allocate`` waits for salloc to say granted/pending/refused before it returns
#: anyway (the start then waits on :meth:`SlurmAllocation.status`).
GRANT_WAIT = 30.0
#: Seconds release gives our step to end by itself (its agents were told to exit).
STEP_GRACE = 3.0

#: The job's watchdog (``sh -c``), started in its own session so it outlives a killed
#: kernel: it reads the job id from the kernel's pipe, waits for that pipe to close
#: (release, or the kernel dying) and cancels the job. ``salloc --no-shell`` leaves a
#: job that nothing else would end before its time limit.
WATCHDOG = 'read -r job || exit 0; cat >/dev/null; exec scancel "$job"'
#: A detachable mesh's keeper (the watchdog's place, and srun's parent).
KEEPER = [sys.executable, "-m", "monarch_kernel.launchers.slurm_keeper"]
_QUIET: dict[str, int] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}

_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"(?:Pending job allocation|job) (\d+)(?: queued)?")


class Phase(Enum):
    """Where the allocation is; the status line is built from it."""

    REQUESTING = "requesting an allocation"
    PENDING = "job pending"
    GRANTED = "job granted"
    STEP = "srun step running"
    FAILED = "failed"
    RELEASED = "released"


class SlurmAllocation(Allocation):
    """A Slurm job (ours from salloc, or the user's) running our srun step.

    ``job``: the user's job id when the kernel runs inside one (``salloc`` None), else
    None until ``salloc`` (its command line) is granted one.
    """

    def __init__(
        self,
        command: JoinCommand,
        hosts: int,
        env: dict[str, str],
        job: str | None,
        salloc: list[str] | None,
        exclude: frozenset[str] = frozenset(),
    ):
        self._command = command
        self.mesh = command.mesh
        #: Nodes our step must not run on (inside the user's job: a grow's new hosts go
        #: on nodes the mesh does not use yet; a job of ours was allocated without them).
        self._exclude = exclude if salloc is None else frozenset()
        self._node_names: list[str] = []
        self._hosts = hosts
        self._env = env  # srun's environment: has the token
        self.job = job  #: the job id (None until salloc is granted one)
        self.ours = salloc is not None  #: whether we allocated the job (then we cancel it)
        #: A detachable mesh: the step outlives the kernel under a keeper (it then is
        #: ``_watchdog``, and stands for srun as ``_srun``).
        self.detached = command.keep > 0
        self._salloc_argv = salloc
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.phase = Phase.REQUESTING if salloc else Phase.GRANTED
        self.nodes = ""
        self._failure: str | None = None
        self._released = False
        self._salloc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._srun: subprocess.Popen[bytes] | None = None
        # The step's name, unique, so release can find and cancel exactly our step.
        self.step_name = f"mk-{command.mesh}-{secrets.token_hex(3)}"
        fd, self._log = tempfile.mkstemp(prefix="mk-srun-", suffix=".log")
        os.close(fd)
        self._threads: list[threading.Thread] = []

    # -- status (never blocks) -------------------------------------------------------
    def status(self, i: int) -> str:
        with self._lock:
            phase, job, nodes = self.phase, self.job, self.nodes
            failure = self._failure
        if failure:
            return failure
        if phase is Phase.REQUESTING:
            return "salloc: requesting an allocation"
        if phase is Phase.PENDING:
            return f"salloc: job {job} pending (waiting for resources)"
        where = f" on {nodes}" if nodes else ""
        if phase is Phase.GRANTED:
            return f"job {job} allocated{where}; starting srun"
        if phase is Phase.STEP:
            return f"job {job}{where}: srun step {self.step_name} running; agent starting"
        return f"job {job}: {phase.value}"

    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    def reservation(self, i: int = 0) -> Reservation | None:
        # one job (one step) holds every machine: the same record for each
        with self._lock:
            job = self.job
        if not self.detached or job is None:
            return None
        return Reservation("slurm", job, members=[self.step_name], ours=self.ours)

    def _fail(self, why: str) -> None:
        with self._changed:
            if self._failure is None and not self._released:
                self._failure = why
                self.phase = Phase.FAILED
            self._changed.notify_all()

    def _advance(self, job: str, phase: Phase) -> None:
        """salloc said ``job`` is pending or granted: wake :meth:`start`."""
        with self._changed:
            self.job, self.phase = job, phase
            self._changed.notify_all()

    # -- start -----------------------------------------------------------------------
    def start(self) -> None:
        """Start salloc (then srun once granted) or, inside a job, srun; returns once
        salloc said granted or pending (a refusal raises ValueError with its stderr)."""
        target = self._run_salloc if self.ours else self._run_srun
        t = threading.Thread(target=target, name=f"mk-slurm-{self._command.mesh}", daemon=True)
        self._threads.append(t)
        t.start()
        if not self.ours:
            return
        with self._changed:
            self._changed.wait_for(lambda: self.phase is not Phase.REQUESTING, GRANT_WAIT)
            failure = self._failure
        if failure is not None:
            self.release()
            raise ValueError(failure)

    def _run_salloc(self) -> None:
        """salloc's thread: it lives as long as salloc (salloc's parent-death signal)."""
        proc = self._start_salloc()
        if proc is None:
            return
        seen = self._follow_salloc(proc)
        code = proc.wait()
        with self._lock:
            released, phase = self._released, self.phase
        if not released:
            text = tail("\n".join(seen)) or "(no output)"
            if phase is Phase.REQUESTING:
                self._fail(f"salloc refused the allocation (exit {code}):\n{text}")
            elif code != 0:  # --no-shell: exit 0 once granted is the normal case
                self._fail(f"salloc failed (exit {code}):\n{text}")

    def _start_salloc(self) -> subprocess.Popen[bytes] | None:
        """The watchdog, then salloc; None (the allocation failed) if either cannot run."""
        assert self._salloc_argv is not None
        try:
            # The watchdog first: from the moment the job exists, a kernel that dies
            # (its end of the pipe closes) gets it cancelled.
            argv = KEEPER if self.detached else ["sh", "-c", WATCHDOG]
            watchdog = popen(argv, self._env, False, stdin=subprocess.PIPE, **_QUIET)
            with self._lock:
                self._watchdog = watchdog
            # salloc --no-shell waits while the job is pending (a SIGTERM then withdraws
            # the request: it dies with this thread) and exits once it is granted.
            proc = popen(
                self._salloc_argv,
                self._env,
                True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            self._fail(f"cannot run salloc: {exc}")
            return None
        with self._lock:
            self._salloc = proc
        return proc

    def _follow_salloc(self, proc: subprocess.Popen[bytes]) -> list[str]:
        """Read salloc's stderr until it ends: the job id once pending or granted (the
        watchdog is told it), the srun step once granted; every line, for errors."""
        assert proc.stderr is not None
        seen: list[str] = []
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            seen.append(line)
            m = _GRANTED.search(line)
            if m:
                self._arm_watchdog(m.group(1))
                self._advance(m.group(1), Phase.GRANTED)
                self._step_thread()
                continue
            m = _PENDING.search(line)
            if m and self.phase is Phase.REQUESTING:
                self._arm_watchdog(m.group(1))
                self._advance(m.group(1), Phase.PENDING)
        return seen

    def _arm_watchdog(self, job: str) -> None:
        """Tell the watchdog which job to cancel when its pipe closes."""
        with self._lock:
            dog = self._watchdog
            if dog is None or dog.stdin is None or self.job == job:
                return
            line = json.dumps({"job": job}) if self.detached else job
            with contextlib.suppress(OSError, ValueError):
                dog.stdin.write(f"{line}\n".encode())
                dog.stdin.flush()

    def _step_thread(self) -> None:
        """srun gets its own thread: it dies with the thread that started it."""
        t = threading.Thread(target=self._run_srun, name="mk-slurm-srun", daemon=True)
        self._threads.append(t)
        t.start()

    def srun_argv(self) -> list[str]:
        """Our step's srun command line (the join command on every node of the job)."""
        return srun_argv(self.job, self._hosts, self.step_name, self._command.argv, self._exclude)

    def node_names(self) -> list[str]:
        """The nodes our step runs on ([] until Slurm says: asked once it runs)."""
        with self._lock:
            known, job, phase = list(self._node_names), self.job, self.phase
        if known or job is None or phase is not Phase.STEP:
            return known
        names = step_nodes(job, self.step_name, self._env)
        with self._lock:
            self._node_names = names
        return names

    def _run_srun(self) -> None:
        """srun's thread: it lives as long as srun (srun's parent-death signal)."""
        with self._lock:
            if self._released:
                return
        nodes = job_nodes(self.job, self._env)  # for the status line
        try:
            proc = self._keep_step() if self.detached else self._start_srun()
        except OSError as exc:
            self._fail(f"cannot run srun: {exc}")
            return
        with self._changed:
            self._srun, self.nodes = proc, nodes
            if self.phase is not Phase.FAILED:
                self.phase = Phase.STEP
            self._changed.notify_all()
        code = proc.wait()  # this thread lives as long as srun (its parent-death signal)
        with self._lock:
            released = self._released
        if not released:
            self._fail(f"srun exited (code {code}):\n{tail(self._read_log()) or '(no output)'}")

    def _start_srun(self) -> subprocess.Popen[bytes]:
        with open(self._log, "wb") as log:
            return popen(
                self.srun_argv(),
                self._env,
                True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _keep_step(self) -> subprocess.Popen[bytes]:
        """A detachable mesh's step: the keeper runs srun (started now inside the
        user's job; when we allocated, it is the job's watchdog already). The keeper
        stands for srun: it exits once the step has ended (and the job is cancelled)."""
        with self._lock:
            keeper = self._watchdog
        if keeper is None:
            keeper = popen(KEEPER, self._env, False, stdin=subprocess.PIPE, **_QUIET)
            with self._lock:
                self._watchdog = keeper
        assert keeper.stdin is not None
        line = json.dumps({"srun": self.srun_argv(), "log": self._log})
        keeper.stdin.write(f"{line}\n".encode())
        keeper.stdin.flush()
        return keeper

    def _read_log(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-8192:]
        except OSError:
            return ""

    # -- release ---------------------------------------------------------------------
    def release(self) -> None:
        """End our step, cancel the job if it is ours, and reap every process."""
        with self._changed:
            if self._released:
                return
            self._released = True
            self.phase = Phase.RELEASED
            srun, salloc, dog = self._srun, self._salloc, self._watchdog
            self._changed.notify_all()
        if srun is not None:
            self._stop_step(srun)
        if self.ours and self.job is not None:
            cancel_job(self.job, self._env)
        self._close_watchdog()  # it cancels the job too (harmless twice) and exits
        for proc in (srun, salloc, dog):
            if proc is None:
                continue
            end(proc)
        with contextlib.suppress(OSError):
            os.unlink(self._log)

    def _stop_step(self, srun: subprocess.Popen[bytes]) -> None:
        """Give the step :data:`STEP_GRACE` to end (the agents were told to exit), then
        cancel it: by name in the user's job; in ours, the job's own cancel stops it."""
        try:
            srun.wait(STEP_GRACE)
        except subprocess.TimeoutExpired:
            if not self.ours:
                cancel_step(self.job, self.step_name, self._env)

    def _close_watchdog(self) -> None:
        with self._lock:
            dog = self._watchdog
        if dog is not None and dog.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                dog.stdin.close()
