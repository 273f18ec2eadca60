"""A Slurm allocation running the host agents: salloc (when we allocate), the job's
watchdog, and one srun step per host (:mod:`.slurm_steps`), each started and followed
by its own thread.

See :mod:`.slurm_engine` for the two cases (inside an allocation or not) and why each
process is watched by the thread that started it; the command lines are built in
:mod:`.slurm_commands`. A detachable mesh's steps outlive the kernel: a *keeper*
(:mod:`.slurm_keeper`) takes the watchdog's place and runs the sruns (see there).

A host cleaned up while the others run on (a shrink: :meth:`SlurmAllocation.
release_machine`) ends its step alone; in a job we allocated, the job is then shrunk
off that node (``scontrol update JobId=J NodeList=...``) so that other jobs can use it.
The user's own job is never shrunk: only our step on that node ends.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import sys
import threading
import time
from enum import Enum

from monarch_kernel.launchers.engine import Allocation, JoinCommand
from monarch_kernel.launchers.reservation import Reservation
from monarch_kernel.launchers.slurm_commands import (
    cancel_job,
    cancel_step,
    end,
    popen,
    shrink_job,
    tail,
    wait_step_gone,
)
from monarch_kernel.launchers.slurm_steps import HostStep, place_steps

#: Seconds ``allocate`` waits for salloc to say granted/pending/refused before it returns
#: anyway (the start then waits on :meth:`SlurmAllocation.status`).
GRANT_WAIT = 30.0
#: Seconds release gives our steps to end by themselves (their agents were told to exit).
STEP_GRACE = 3.0

#: The job's watchdog (``sh -c``), started in its own session so it outlives a killed
#: kernel: it reads the job id from the kernel's pipe, waits for that pipe to close
#: (release, or the kernel dying) and cancels the job. ``salloc --no-shell`` leaves a
#: job that nothing else would end before its time limit.
WATCHDOG = 'read -r job || exit 0; cat >/dev/null; exec scancel "$job"'
#: A detachable mesh's keeper (the watchdog's place, and the sruns' parent).
KEEPER = [sys.executable, "-m", "monarch_kernel.launchers.slurm_keeper"]
_QUIET: dict[str, int] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}

_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"(?:Pending job allocation|job) (\d+)(?: queued)?")


class Phase(Enum):
    """Where the allocation is; the status line is built from it."""

    REQUESTING = "requesting an allocation"
    PENDING = "job pending"
    GRANTED = "job granted"
    STEP = "srun steps running"
    FAILED = "failed"
    RELEASED = "released"


class SlurmAllocation(Allocation):
    """A Slurm job (ours from salloc, or the user's) running one srun step per host.

    ``job``: the user's job id when the kernel runs inside one (``salloc`` None), else
    None until ``salloc`` (its command line) is granted one. ``env``: the clients'
    environment (each step adds its host's token).
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
        #: Nodes our steps must not run on (inside the user's job: a grow's new hosts go
        #: on nodes the mesh does not use yet; a job of ours was allocated without them).
        self._exclude = exclude if salloc is None else frozenset()
        self._env = env
        self.job = job  #: the job id (None until salloc is granted one)
        self.ours = salloc is not None  #: whether we allocated the job (then we cancel it)
        #: A detachable mesh: the steps outlive the kernel under a keeper (it then is
        #: ``_watchdog``, and stands for the sruns).
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
        self._kept = False  #: the keeper runs our steps (a detachable mesh's)
        # The steps' names share this prefix, unique, so that release finds exactly ours.
        self.step_name = f"mk-{command.mesh}-{secrets.token_hex(3)}"
        self._steps = [HostStep(i, f"{self.step_name}-{i}", command.env(i)) for i in range(hosts)]
        self._threads: list[threading.Thread] = []

    # -- status (never blocks) -------------------------------------------------------
    def status(self, i: int) -> str:
        with self._lock:
            phase, job, nodes = self.phase, self.job, self.nodes
            failure = self._failure
            step = self._steps[i]
        if failure:
            return failure
        if phase is Phase.REQUESTING:
            return "salloc: requesting an allocation"
        if phase is Phase.PENDING:
            return f"salloc: job {job} pending (waiting for resources)"
        if phase is Phase.GRANTED:
            where = f" on {nodes}" if nodes else ""
            return f"job {job} allocated{where}; starting srun"
        if phase is Phase.STEP:
            return f"job {job}: srun step {step.name} running on {step.node}; agent starting"
        return f"job {job}: {phase.value}"

    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    def reservation(self, i: int = 0) -> Reservation | None:
        # one job holds every machine: the same record (all our steps) for each
        with self._lock:
            job = self.job
            names = [s.name for s in self._steps]
        if not self.detached or job is None:
            return None
        return Reservation("slurm", job, members=names, ours=self.ours)

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
        """Start salloc (then the steps once granted) or, inside a job, the steps;
        returns once salloc said granted or pending (a refusal raises ValueError with
        its stderr)."""
        target = self._run_salloc if self.ours else self._run_steps
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
        """The steps are placed and started from a thread of their own (salloc's thread
        ends with salloc)."""
        self._spawn(self._run_steps, "mk-slurm-steps")

    def _spawn(self, target: object, name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def node_names(self) -> list[str]:
        """The nodes our live steps run on ([] until the job is granted)."""
        with self._lock:
            return [s.node for s in self._steps if s.node and not s.released]

    def _run_steps(self) -> None:
        """Give each host a node of the job, then start its step: each srun from a
        thread of its own (a detachable mesh's: all in the keeper)."""
        with self._lock:
            if self._released:
                return
            job = self.job
        assert job is not None
        try:
            nodes = place_steps(self._steps, job, self._exclude, self._env)
        except ValueError as exc:
            self._fail(str(exc))
            return
        with self._lock:
            self.nodes = ",".join(nodes)  # for the status line
        if self.detached:
            self._keep_steps()
            return
        for step in self._steps:
            self._spawn(self._run_step, f"mk-slurm-srun-{step.index}", step)

    def _run_step(self, step: HostStep) -> None:
        """One step's thread: it lives as long as its srun (srun's parent-death signal)."""
        argv = step.argv(self.job, self._command.argv)
        with self._lock:  # held while srun starts: a release then waits for it
            if self._released or step.released:
                return
            try:
                with step.open_log() as log:
                    proc = popen(
                        argv,
                        {**self._env, **step.env},
                        True,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
            except OSError as exc:
                error: OSError | None = exc
            else:
                error, step.proc = None, proc
        if error is not None:
            self._fail(f"cannot run srun: {error}")
            return
        with self._changed:
            if self.phase is not Phase.FAILED:
                self.phase = Phase.STEP
            self._changed.notify_all()
        code = proc.wait()
        with self._lock:
            released = self._released or step.released
        # Exit 0: the agent was told to exit (its host is being shrunk or stopped).
        if not released and code != 0:
            output = tail(step.read_log()) or "(no output)"
            self._fail(f"srun step {step.name} on {step.node} exited (code {code}):\n{output}")

    def _keep_steps(self) -> None:
        """A detachable mesh's steps: the keeper runs the sruns (started now inside the
        user's job; when we allocated, it is the job's watchdog already). The keeper
        stands for them: it exits once every step has ended (and cancels our job)."""
        with self._lock:
            keeper = self._watchdog
        try:
            if keeper is None:
                keeper = popen(KEEPER, self._env, False, stdin=subprocess.PIPE, **_QUIET)
                with self._lock:
                    self._watchdog = keeper
            assert keeper.stdin is not None
            steps = [
                {"srun": s.argv(self.job, self._command.argv), "env": s.env, "log": s.log}
                for s in self._steps
            ]
            # The tokens go through the pipe, never on a command line.
            keeper.stdin.write(f"{json.dumps({'steps': steps})}\n".encode())
            keeper.stdin.flush()
        except OSError as exc:
            self._fail(f"cannot run the srun steps' keeper: {exc}")
            return
        with self._changed:
            self._kept = True
            if self.phase is not Phase.FAILED:
                self.phase = Phase.STEP
            self._changed.notify_all()
        code = keeper.wait()
        with self._lock:
            released = self._released
        if not released:
            output = "\n".join(tail(s.read_log(), 4) for s in self._steps) or "(no output)"
            self._fail(f"the srun steps ended (keeper exit {code}):\n{output}")

    # -- release ---------------------------------------------------------------------
    def release_machine(self, i: int) -> None:
        """Host ``i`` was cleaned up while others of this job live on (a shrink): end
        its step, then shrink our job off its node so that other jobs can use it (the
        user's own job is never shrunk: only our step on that node ends).
        RuntimeError if Slurm refuses the shrink."""
        with self._lock:
            step = self._steps[i]
            if self._released or step.released:
                return
            step.released = True
            job, proc = self.job, step.proc
            keep = [s.node for s in self._steps if s.node and not s.released]
        if job is None or not step.node:
            return  # not placed yet: no step runs, nothing to free
        self._end_step(job, step, proc)
        step.remove_log()
        if self.ours and keep:
            shrink_job(job, keep, self._env)

    def _end_step(self, job: str, step: HostStep, proc: subprocess.Popen[bytes] | None) -> None:
        """Give one step :data:`STEP_GRACE` to end (its agent was told to exit), then
        cancel it by name (under a keeper there is no srun of ours to wait for)."""
        if proc is None:
            if not wait_step_gone(job, step.name, self._env, STEP_GRACE):
                cancel_step(job, step.name, self._env)
            return
        try:
            proc.wait(STEP_GRACE)
        except subprocess.TimeoutExpired:
            cancel_step(job, step.name, self._env)
        end(proc)

    def release(self) -> None:
        """End our steps, cancel the job if it is ours, and reap every process."""
        with self._changed:
            if self._released:
                return
            self._released = True
            self.phase = Phase.RELEASED
            salloc, dog, kept = self._salloc, self._watchdog, self._kept
            live = [s for s in self._steps if not s.released]
            for s in self._steps:
                s.released = True
            self._changed.notify_all()
        procs = [s.proc for s in live if s.proc is not None]
        # Under a keeper the keeper stands for the sruns.
        waited = [dog] if kept and dog is not None else procs
        if waited and not self._ended(waited) and not self.ours:
            for s in live:  # in the user's job: only our steps, never the job
                cancel_step(self.job, s.name, self._env)
        if self.ours and self.job is not None:
            cancel_job(self.job, self._env)
        self._close_watchdog()  # it cancels the job too (harmless twice) and exits
        for proc in (*procs, salloc, dog):
            if proc is not None:
                end(proc)
        for s in self._steps:
            s.remove_log()

    @staticmethod
    def _ended(procs: list[subprocess.Popen[bytes]]) -> bool:
        """Whether ``procs`` all end within :data:`STEP_GRACE` (the agents were told to
        exit); in our job, the job's own cancel stops what is left."""
        deadline = time.monotonic() + STEP_GRACE
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def _close_watchdog(self) -> None:
        with self._lock:
            dog = self._watchdog
        if dog is not None and dog.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                dog.stdin.close()
