"""Slurm's client commands, as the ``slurm`` backend uses them: probing the cluster
(``sinfo``, ``squeue``), the ``salloc`` and ``srun`` command lines, ``scancel``, shrinking
a job (``scontrol update``), and starting a client process that ends with the thread
that started it.

Everything here is a plain function of its arguments (no state); the allocation that
runs these commands and follows them is in :mod:`.slurm_allocation`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

#: Seconds a Slurm client command may take to answer (a dead controller makes sinfo
#: retry for about 9 s before it gives up).
CLIENT_TIMEOUT = 20.0

_GPU = re.compile(r"gpu(?::[^:(,]+)?:(\d+)")


@dataclass(frozen=True)
class Node:
    """One node as ``sinfo`` shows it."""

    name: str
    gpus: int  #: gpu GRES count (0: none configured)


def tail(text: str, n: int = 8) -> str:
    """The last ``n`` non-blank lines of a client's output (what an error quotes)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


# -- probing the cluster ---------------------------------------------------------------
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
            f"{tail(out.stderr) or '(no output)'}"
        )
    nodes: dict[str, Node] = {}
    for line in out.stdout.splitlines():
        name, _, gres = line.strip().partition("|")
        if name:
            gpus = sum(int(m.group(1)) for m in _GPU.finditer(gres))
            nodes[name] = Node(name, gpus)  # a node in several partitions counts once
    return list(nodes.values())


def job_steps(job: str | None, env: dict[str, str]) -> list[tuple[str, str, str]]:
    """The running steps of ``job`` as ``(step id, step name, node list)``; [] when
    Slurm cannot say."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", str(job), "-o", "%i|%j|%N"],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT,
        )
        steps = []
        for line in out.stdout.splitlines():
            step, _, rest = line.strip().partition("|")
            name, _, nodes = rest.partition("|")
            steps.append((step, name, nodes))
        return steps
    return []


def hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """``node[1-3]`` as Slurm expands it (``scontrol show hostnames``); the list itself
    split at commas when scontrol cannot be asked."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT,
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    return [n for n in nodelist.split(",") if n]


def job_nodes(job: str | None, env: dict[str, str]) -> str:
    """The node list of ``job`` (compact Slurm form), or "" when squeue cannot say."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job), "-o", "%N"],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT,
        )
        return out.stdout.strip()
    return ""


# -- command lines ---------------------------------------------------------------------
@dataclass(frozen=True)
class SallocOptions:
    """salloc's options that the user chose (``%mesh --partition/--time/--account``)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    #: further salloc arguments, as given (``--qos=high``, ``--exclusive`` ...)
    extra: tuple[str, ...] = ()


def salloc_argv(
    mesh: str, hosts: int, gpus: int, options: SallocOptions, exclude: frozenset[str] = frozenset()
) -> list[str]:
    """salloc's command line for ``hosts`` nodes with ``gpus`` GPUs each (none on a CPU
    cluster), after checking that the cluster has them (ValueError that says why not).
    ``exclude``: nodes the mesh's hosts are on already (a grow's hosts go elsewhere)."""
    nodes = slurm_nodes(options.partition, dict(os.environ))
    if exclude:
        check_free_nodes(hosts, exclude, [n.name for n in nodes], "this Slurm cluster")
        nodes = [n for n in nodes if n.name not in exclude]
    has_gpus = _check_cluster(nodes, options.partition, mesh, hosts, gpus)
    argv = [
        "salloc",
        f"--nodes={hosts}",
        "--ntasks-per-node=1",
        f"--job-name=mk-{mesh}",
    ]
    if has_gpus:  # a CPU cluster has no gpu GRES to ask for
        argv.append(f"--gpus-per-node={gpus}")
    if options.time:
        argv.append(f"--time={options.time}")
    if options.partition:
        argv.append(f"--partition={options.partition}")
    if options.account:
        argv.append(f"--account={options.account}")
    if exclude:
        argv.append(f"--exclude={','.join(sorted(exclude))}")
    return [*argv, *options.extra, "--no-shell"]


def check_free_nodes(hosts: int, used: frozenset[str], nodes: list[str], where: str) -> None:
    """ValueError unless ``nodes`` has ``hosts`` nodes none of the mesh's hosts is on
    (``used``): a grow's hosts each need a node of their own, one host per node."""
    free = [n for n in nodes if n not in used]
    if len(free) < hosts:
        raise ValueError(
            f"{hosts} more host(s) need {hosts} Slurm node(s) this mesh does not use yet "
            f"(one host per node), but {len([n for n in nodes if n in used])} of the "
            f"{len(nodes)} nodes of {where} hold its hosts and {len(free)} are left; grow by "
            "fewer hosts, or ask for more nodes (a bigger partition or allocation)"
        )


def _check_cluster(
    nodes: list[Node], partition: str | None, mesh: str, hosts: int, gpus: int
) -> bool:
    """ValueError unless ``nodes`` can hold ``hosts`` hosts of ``gpus`` GPUs; whether the
    cluster has GPUs at all."""
    where = f"partition {partition!r}" if partition else "this Slurm cluster"
    if not nodes:
        raise ValueError(f"{where} has no nodes (sinfo lists none)")
    if hosts > len(nodes):
        raise ValueError(
            f"mesh {mesh!r} asks for {hosts} hosts but {where} has "
            f"{len(nodes)} nodes ({', '.join(n.name for n in nodes)})"
        )
    has_gpus = any(n.gpus for n in nodes)
    most = max(n.gpus for n in nodes)
    if has_gpus and gpus > most:
        raise ValueError(
            f"mesh {mesh!r} asks for {gpus} GPUs per host but the nodes of "
            f"{where} have at most {most} GPUs"
        )
    return has_gpus


def srun_argv(job: str | None, node: str, step_name: str, command: list[str]) -> list[str]:
    """srun's command line: ``command`` once on node ``node`` of ``job``, as a step
    named ``step_name`` (one host's step: it ends alone, see :mod:`.slurm_steps`)."""
    return [
        "srun",
        f"--jobid={job}",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        # Share the job's CPUs and memory with steps already running (the user's
        # shell, the batch script, the other hosts' steps): else the step waits.
        "--overlap",
        f"--job-name={step_name}",
        *command,
    ]


# -- cancelling ------------------------------------------------------------------------
def cancel_step(job: str | None, step_name: str, env: dict[str, str]) -> None:
    """scancel the step of ``job`` named ``step_name`` only, never the job itself."""
    for step, name, _ in job_steps(job, env):
        if name == step_name:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    ["scancel", step], env=env, capture_output=True, timeout=CLIENT_TIMEOUT
                )


def wait_step_gone(job: str | None, step_name: str, env: dict[str, str], timeout: float) -> bool:
    """Whether the step ``step_name`` of ``job`` left squeue within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while any(name == step_name for _, name, _ in job_steps(job, env)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def shrink_job(job: str, keep: list[str], env: dict[str, str]) -> None:
    """Shrink our job ``job`` to the nodes ``keep`` (``scontrol update JobId=J
    NodeList=...``): Slurm frees its other nodes for other jobs at once. RuntimeError
    with scontrol's output if Slurm refuses."""
    argv = ["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"]
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        out = subprocess.CompletedProcess(argv, -1, "", str(exc))
    if out.returncode != 0:
        raise RuntimeError(
            f"could not shrink Slurm job {job} to node(s) {','.join(keep)}: `{' '.join(argv)}` "
            f"failed (exit {out.returncode}): {tail(out.stderr + out.stdout, 2) or '(no output)'}"
            "; its other nodes stay allocated until `%mesh stop`"
        )


def cancel_job(job: str, env: dict[str, str]) -> None:
    """scancel ``job`` (errors ignored: the watchdog cancels it too)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=CLIENT_TIMEOUT)


# -- client processes ------------------------------------------------------------------
# Loaded once here: the child of a fork in a threaded process must not dlopen.
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def popen(
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


def end(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
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
