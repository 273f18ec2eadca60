"""Errors users see. Each message says what went wrong and what to do about it."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from monarch_kernel.wire.osutil import describe_exit
from monarch_kernel.wire.reports import FailureReport


@dataclass(frozen=True)
class DeathInfo:
    """How a rank ended: pushed by its host agent, or decided by supervision."""

    rank: int
    host: str  #: hostname (or ``host N`` before the host said its name)
    pid: int | None
    code: int | None = None  #: exit code, if it exited
    signal: int | None = None  #: the signal that killed it, if one did
    reason: str | None = None  #: why, when it was not an exit (e.g. its host was lost)
    tail: tuple[str, ...] = ()  #: its last output lines
    time: float = 0.0  #: ``time.time()`` when the controller learnt of it

    @property
    def how(self) -> str:
        """``exit code 7``, ``killed by SIGKILL``, or the reason supervision gave."""
        if self.reason:
            return self.reason
        if self.code is None and not self.signal:
            return "exited"
        return describe_exit(self.code, self.signal)


class MonarchError(Exception):
    """Base class of monarch_kernel's errors."""


class ProcessGroupAborted(RuntimeError):
    """A collective was cut short because the mesh aborted the rank's process group (a
    failure on another rank, or the stop button); the mesh forms the group again.

    Raised on ranks by the re-formable group (``rank/reformable.py``); defined here, with
    no torch import, so that a controller can unpickle it without importing torch."""


class MeshStartError(MonarchError):
    """Ranks or host agents could not be started."""


class ActorError(MonarchError):
    """An endpoint raised on one or more ranks.

    ``failures`` lists one report per failing rank (type, message, traceback, rank, host);
    identical failures are grouped in the message, root cause (first failure) first.
    ``exception`` is the original exception of the first failure when it could be
    rebuilt here (else ``None``).
    """

    def __init__(
        self,
        message: str,
        failures: list[FailureReport],
        exception: BaseException | None = None,
    ):
        super().__init__(message)
        self.failures = failures
        self.exception = exception

    @property
    def ranks(self) -> list[int]:
        return [f["rank"] for f in self.failures]

    @property
    def traceback(self) -> str:
        return self.failures[0]["traceback"] if self.failures else ""


class SupervisionError(ActorError, RuntimeError):
    """A call failed because its actor cannot answer any more: the actor, its process or
    its mesh died or was stopped (Monarch's ``SupervisionError``; also a RuntimeError, as
    Monarch's is). Its subclasses say which: :class:`RankDiedError` (the process died),
    :class:`MeshStoppedError` (the mesh was stopped). ``endpoint``: the endpoint called,
    when known."""

    def __init__(
        self,
        message: str,
        failures: list[FailureReport] | None = None,
        exception: BaseException | None = None,
        endpoint: str | None = None,
    ):
        if failures is None:
            failures = [_gone_report(type(self).__name__, message, -1)]
        super().__init__(message, failures, exception)
        self.endpoint = endpoint


class MeshStoppedError(SupervisionError):
    """The mesh was stopped (or its hosts are gone); spawn a new one."""

    def __init__(self, message: str, failures: list[FailureReport] | None = None):
        super().__init__(message, failures)

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.failures)


class RankDiedError(SupervisionError):
    """A rank a call was waiting on died. Names rank, host, pid, exit code or signal.

    ``death`` holds the details (None when the rank was already gone before the call);
    ``mesh`` is the mesh's name.
    """

    def __init__(self, message: str, death: DeathInfo | None = None, mesh: str = ""):
        rank = death.rank if death is not None else -1
        super().__init__(message, [_gone_report("RankDiedError", message, rank)])
        self.death = death
        self.mesh = mesh

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.death, self.mesh)


def _gone_report(kind: str, message: str, rank: int) -> FailureReport:
    return {
        "type": kind,
        "message": message.split("\n", 1)[0],
        "traceback": "",
        "where": "",
        "rank": rank,
    }


def group_failures(failures: list[FailureReport]) -> list[tuple[FailureReport, list[int]]]:
    """Group identical failures (same type, message and user line); keep arrival order."""
    groups: dict[tuple[object, ...], tuple[FailureReport, list[int]]] = {}
    for f in failures:
        line = f.get("line") or {}
        key = (f["type"], f["message"], line.get("line"), line.get("code"))
        if key in groups:
            groups[key][1].append(f["rank"])
        else:
            groups[key] = (f, [f["rank"]])
    return list(groups.values())


def format_ranks(ranks: list[int]) -> str:
    """``1, 3`` or ``0-3`` style: consecutive ranks as ranges."""
    parts: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(r)
    if run:
        parts.append(_span(run))
    return ", ".join(parts)


def _span(run: list[int]) -> str:
    return f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"


def actor_error(
    failures: list[FailureReport],
    total: int,
    error_class: type[ActorError] = ActorError,
    note: str = "",
) -> ActorError:
    """One grouped :class:`ActorError` (or ``error_class``) for the failures of one call;
    ``note`` (what was done to the other ranks) follows the grouped lines."""
    groups = group_failures(failures)
    lines = []
    for f, ranks in groups:
        plural = "ranks" if len(ranks) > 1 else "rank"
        host = f" on {f['host']}" if f.get("host") and len(ranks) == 1 else ""
        lines.append(
            f"{f['type']} in {f['where']} on {plural} {format_ranks(ranks)} of {total}{host}:"
            f" {f['message']}"
        )
    first = groups[0][0]
    causes = first.get("causes") or []
    if causes:  # the root cause, which the grouped line (the last exception) hides
        root = causes[0]
        lines.append(f"caused by {root['type']}: {root['message']}")
    if note:
        lines.append(note)
    text = "\n".join(lines)
    text += f"\n\nRemote traceback (rank {first['rank']}, root cause):\n{first['traceback']}"
    if first.get("tensors"):
        text += "Tensors in the failing frame:\n  " + "\n  ".join(first["tensors"]) + "\n"
    exc = None
    pickled = first.get("exception")
    if pickled:
        try:
            exc = pickle.loads(pickled)
        except Exception:
            exc = None
    return error_class(text, failures, exc)
