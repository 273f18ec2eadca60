"""The ``slurm`` backend: ``srun`` runs the host agent on every node of an allocation.

Two cases, told apart by ``$SLURM_JOB_ID`` in the kernel's environment:

* **Inside an allocation** (the kernel runs in an ``salloc`` shell or an ``sbatch`` job):
  the agents run as one job step, ``srun --jobid $SLURM_JOB_ID --nodes H --ntasks H
  --ntasks-per-node=1 --overlap ...``. The user's job is theirs: we only ever stop our
  step, never cancel the job.
* **Outside one**: ``salloc --no-shell --nodes H --ntasks-per-node=1 --job-name
  mk-<mesh>`` reserves the nodes, then the step is started as above with ``--jobid`` of
  that job. A *watchdog* (a small ``sh``, in its own session) holds a pipe from the kernel
  and cancels the job when the pipe closes: on release, and when the kernel exits or is
  killed, so a dead kernel never keeps nodes. (Not ``salloc CMD`` with a holder command:
  salloc 22.05 was seen spinning forever in ``waitpid`` after its job ended that way.)
  A GPU cluster (gpu GRES in ``sinfo``) is asked for ``--gpus-per-node G``; a CPU
  cluster is asked for no GPUs.

``srun`` runs the same command on every node, so the hosts share one *group* join token
(each agent takes the next host slot; see :meth:`~.join.JoinLauncher.start_for_engine`),
passed in srun's environment, never on a command line. The interpreter is this one
(``sys.executable``): cluster nodes share the file system.

Every process we start (salloc, srun) is started *and watched* by its own thread: the
parent-death signal Linux gives srun belongs to the thread that forked it, so that thread
lives exactly as long as srun does. Status and failure are plain fields those threads
update, so :meth:`SlurmAllocation.status` never blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from enum import Enum

from monarch_kernel.launchers.base import HostConfig
from monarch_kernel.launchers.engine import Allocation, EngineLauncher, JoinCommand

#: Seconds a Slurm client command may take to answer (a dead controller makes sinfo
#: retry for about 9 s before it gives up).
CLIENT_TIMEOUT = 20.0
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
_QUIET: dict[str, int] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}

_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"(?:Pending job allocation|job) (\d+)(?: queued)?")
_GPU = re.compile(r"gpu(?::[^:(,]+)?:(\d+)")


class Phase(Enum):
    """Where the allocation is; the status line is built from it."""

    REQUESTING = "requesting an allocation"
    PENDING = "job pending"
    GRANTED = "job granted"
    STEP = "srun step running"
    FAILED = "failed"
    RELEASED = "released"


@dataclass(frozen=True)
class Node:
    """One node as ``sinfo`` shows it."""

    name: str
    gpus: int  #: gpu GRES count (0: none configured)


def _tail(text: str, n: int = 8) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def slurm_nodes(partition: str | None, env: dict[str, str]) -> list[Node]:
    """The nodes Slurm would allocate from (``sinfo -N``), or ValueError that says why
    Slurm cannot be asked (not installed, controller unreachable: sinfo's stderr)."""
    sinfo = shutil.which("sinfo", path=env.get("PATH"))
    if sinfo is None or shutil.which("salloc", path=env.get("PATH")) is None:
        raise ValueError(
            "the slurm backend needs Slurm's client commands (sinfo, salloc, srun) on PATH, "
            "or a kernel started inside an allocation ($SLURM_JOB_ID); found no `sinfo`/"
            "`salloc` here"
        )
    argv = [sinfo, "-h", "-N", "-o", "%N|%G"]
    if partition:
        argv += ["-p", partition]
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"the Slurm controller did not answer `{' '.join(argv)}` within {CLIENT_TIMEOUT:.0f} s"
        ) from None
    if out.returncode != 0:
        raise ValueError(
            f"cannot reach Slurm: `{' '.join(argv)}` failed (exit {out.returncode}):\n"
            f"{_tail(out.stderr) or '(no output)'}"
        )
    nodes: dict[str, Node] = {}
    for line in out.stdout.splitlines():
        name, _, gres = line.strip().partition("|")
        if name:
            gpus = sum(int(m.group(1)) for m in _GPU.finditer(gres))
            nodes[name] = Node(name, gpus)  # a node in several partitions counts once
    return list(nodes.values())


# Loaded once here: the child of a fork in a threaded process must not dlopen.
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _popen(
    argv: list[str], env: dict[str, str], die_with_us: bool, **kw: object
) -> subprocess.Popen[bytes]:
    """A Slurm client in its own session (a Ctrl-C meant for the kernel does not reach
    it); with ``die_with_us`` it gets SIGTERM when the thread that started it ends."""
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        argv,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_us else None,
        **kw,
    )


class SlurmAllocation(Allocation):
    """A Slurm job (ours from salloc, or the user's) running our srun step."""

    def __init__(
        self,
        command: JoinCommand,
        hosts: int,
        env: dict[str, str],
        job: str | None,
        salloc: list[str] | None,
    ):
        self._command = command
        self._hosts = hosts
        self._env = env  # srun's environment: has the token
        self.job = job  #: the job id (None until salloc is granted one)
        self.ours = salloc is not None  #: whether we allocated the job (then we cancel it)
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

    def _fail(self, why: str) -> None:
        with self._changed:
            if self._failure is None and not self._released:
                self._failure = why
                self.phase = Phase.FAILED
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
        assert self._salloc_argv is not None
        try:
            # The watchdog first: from the moment the job exists, a kernel that dies
            # (its end of the pipe closes) gets it cancelled.
            watchdog = _popen(
                ["sh", "-c", WATCHDOG], self._env, False, stdin=subprocess.PIPE, **_QUIET
            )
            with self._lock:
                self._watchdog = watchdog
            # salloc --no-shell waits while the job is pending (a SIGTERM then withdraws
            # the request: it dies with this thread) and exits once it is granted.
            proc = _popen(
                self._salloc_argv,
                self._env,
                True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            self._fail(f"cannot run salloc: {exc}")
            return
        with self._lock:
            self._salloc = proc
        assert proc.stderr is not None
        seen: list[str] = []
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            seen.append(line)
            m = _GRANTED.search(line)
            if m:
                self._arm_watchdog(m.group(1))
                with self._changed:
                    self.job, self.phase = m.group(1), Phase.GRANTED
                    self._changed.notify_all()
                self._step_thread()
                continue
            m = _PENDING.search(line)
            if m and self.phase is Phase.REQUESTING:
                self._arm_watchdog(m.group(1))
                with self._changed:
                    self.job, self.phase = m.group(1), Phase.PENDING
                    self._changed.notify_all()
        code = proc.wait()
        with self._lock:
            released, phase = self._released, self.phase
        if not released:
            text = _tail("\n".join(seen)) or "(no output)"
            if phase is Phase.REQUESTING:
                self._fail(f"salloc refused the allocation (exit {code}):\n{text}")
            elif code != 0:  # --no-shell: exit 0 once granted is the normal case
                self._fail(f"salloc failed (exit {code}):\n{text}")

    def _arm_watchdog(self, job: str) -> None:
        """Tell the watchdog which job to cancel when its pipe closes."""
        with self._lock:
            dog = self._watchdog
            if dog is None or dog.stdin is None or self.job == job:
                return
            with contextlib.suppress(OSError, ValueError):
                dog.stdin.write(f"{job}\n".encode())
                dog.stdin.flush()

    def _step_thread(self) -> None:
        """srun gets its own thread: it dies with the thread that started it."""
        t = threading.Thread(target=self._run_srun, name="mk-slurm-srun", daemon=True)
        self._threads.append(t)
        t.start()

    def srun_argv(self) -> list[str]:
        n = self._hosts
        return [
            "srun",
            f"--jobid={self.job}",
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            # Share the job's CPUs and memory with steps already running (the user's
            # shell, the batch script): else the step waits for them to finish.
            "--overlap",
            f"--job-name={self.step_name}",
            # One agent that ends must not take the others down: the controller decides.
            "--kill-on-bad-exit=0",
            *self._command.argv,
        ]

    def _run_srun(self) -> None:
        with self._lock:
            if self._released:
                return
        nodes = self._job_nodes()
        try:
            with open(self._log, "wb") as log:
                proc = _popen(
                    self.srun_argv(),
                    self._env,
                    True,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
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
            self._fail(f"srun exited (code {code}):\n{_tail(self._read_log()) or '(no output)'}")

    def _job_nodes(self) -> str:
        """The job's node list (compact Slurm form), for the status line."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["squeue", "-h", "-j", str(self.job), "-o", "%N"],
                env=self._env,
                capture_output=True,
                text=True,
                timeout=CLIENT_TIMEOUT,
            )
            return out.stdout.strip()
        return ""

    def _read_log(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-8192:]
        except OSError:
            return ""

    # -- release ---------------------------------------------------------------------
    def _close_watchdog(self) -> None:
        with self._lock:
            dog = self._watchdog
        if dog is not None and dog.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                dog.stdin.close()

    def _cancel_step(self) -> None:
        """scancel our step only (found by its unique name), never the user's job."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["squeue", "-h", "-s", "-j", str(self.job), "-o", "%i %j"],
                env=self._env,
                capture_output=True,
                text=True,
                timeout=CLIENT_TIMEOUT,
            )
            for line in out.stdout.splitlines():
                step, _, name = line.strip().partition(" ")
                if name == self.step_name:
                    subprocess.run(
                        ["scancel", step],
                        env=self._env,
                        capture_output=True,
                        timeout=CLIENT_TIMEOUT,
                    )

    def release(self) -> None:
        with self._changed:
            if self._released:
                return
            self._released = True
            self.phase = Phase.RELEASED
            srun, salloc, dog = self._srun, self._salloc, self._watchdog
            self._changed.notify_all()
        if srun is not None:
            try:
                srun.wait(STEP_GRACE)  # the agents were told to exit; the step ends
            except subprocess.TimeoutExpired:
                if self.ours:
                    pass  # scancel of the whole job below stops it
                else:
                    self._cancel_step()
        if self.ours and self.job is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    ["scancel", str(self.job)],
                    env=self._env,
                    capture_output=True,
                    timeout=CLIENT_TIMEOUT,
                )
        self._close_watchdog()  # it cancels the job too (harmless twice) and exits
        for proc in (srun, salloc, dog):
            if proc is None:
                continue
            _end(proc)
        with contextlib.suppress(OSError):
            os.unlink(self._log)


def _end(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Wait for ``proc``; SIGTERM, then SIGKILL, if it does not end."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


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
    name: str = "slurm"
    per_host_tokens: bool = False

    def allocate(self, command: JoinCommand, configs: list[HostConfig]) -> Allocation:
        hosts = len(configs)
        gpus = configs[0].ranks
        env = dict(os.environ)
        env.update(command.env(0))
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            have = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
            if have and have.isdigit() and hosts > int(have):
                raise ValueError(
                    f"mesh {command.mesh!r} asks for {hosts} hosts but Slurm job {job} "
                    f"(this kernel's allocation) has {have} nodes"
                )
            if shutil.which("srun", path=env.get("PATH")) is None:
                raise ValueError(f"inside Slurm job {job} but `srun` is not on PATH")
            alloc = SlurmAllocation(command, hosts, env, job, salloc=None)
        else:
            alloc = SlurmAllocation(command, hosts, env, None, self._salloc(command, hosts, gpus))
        alloc.start()
        return alloc

    def _salloc(self, command: JoinCommand, hosts: int, gpus: int) -> list[str]:
        """salloc's command line, after checking what the cluster has."""
        nodes = slurm_nodes(self.partition, dict(os.environ))
        where = f"partition {self.partition!r}" if self.partition else "this Slurm cluster"
        if not nodes:
            raise ValueError(f"{where} has no nodes (sinfo lists none)")
        if hosts > len(nodes):
            raise ValueError(
                f"mesh {command.mesh!r} asks for {hosts} hosts but {where} has "
                f"{len(nodes)} nodes ({', '.join(n.name for n in nodes)})"
            )
        has_gpus = any(n.gpus for n in nodes)
        most = max(n.gpus for n in nodes)
        if has_gpus and gpus > most:
            raise ValueError(
                f"mesh {command.mesh!r} asks for {gpus} GPUs per host but the nodes of "
                f"{where} have at most {most} GPUs"
            )
        argv = [
            "salloc",
            f"--nodes={hosts}",
            "--ntasks-per-node=1",
            f"--job-name=mk-{command.mesh}",
        ]
        if has_gpus:  # a CPU cluster has no gpu GRES to ask for
            argv.append(f"--gpus-per-node={gpus}")
        if self.time:
            argv.append(f"--time={self.time}")
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.account:
            argv.append(f"--account={self.account}")
        return [*argv, "--no-shell"]
