"""Errors users see. Each message says what went wrong and what to do about it."""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from monarch_kernel.wire.osutil import describe_exit, signal_name
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

    @property
    def process_phrase(self) -> str:
        """Monarch's words for it: ``the process this actor was running on exited with
        non-zero code 3`` (``was killed by signal 9 (SIGKILL)``, ``is gone: <reason>``)."""
        gone = "the process this actor was running on"
        if self.reason:
            return f"{gone} is gone: {self.reason}"
        if self.signal:  # Monarch's "killed by signal N", and its name
            return f"{gone} was killed by signal {self.signal} ({signal_name(self.signal)})"
        if self.code:
            return f"{gone} exited with non-zero code {self.code}"
        return f"{gone} exited"


class MonarchError(Exception):
    """Base class of monarch_kernel's errors."""


class ProcessGroupAborted(RuntimeError):
    """A collective was cut short because the mesh aborted the rank's process group (a
    failure on another rank, or the stop button); the mesh forms the group again.

    Raised on ranks by the re-formable group (``rank/pg/reformable.py``); defined here, with
    no torch import, so that a controller can unpickle it without importing torch."""


def released_by_abort(report: Mapping[str, object]) -> bool:
    """Whether a rank's failure ``report`` is its process group's abort: a
    :class:`ProcessGroupAborted`, or a ``RuntimeError`` that torch's C++ made of it on
    its way through DDP's reducer or autograd (its message then starts with the type's
    name)."""
    name = ProcessGroupAborted.__name__
    if report.get("type") == name:
        return True
    return str(report.get("message") or "").startswith(name + ":")


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


@dataclass(frozen=True)
class CallSite:
    """The endpoint call an error belongs to: actor ``actor`` of process mesh ``mesh``,
    endpoint ``method``. A :class:`SupervisionError` of a call says it in Monarch's
    words (``Endpoint call actor.method() failed, ...``); see :func:`call_failed`."""

    mesh: str
    actor: str
    method: str

    @property
    def label(self) -> str:
        """``actor.method()``, as Monarch names an endpoint call."""
        return f"{self.actor}.{self.method}()"

    def who(self, rank: int | None) -> str:
        """The called actor on ``rank``: ``mesh/actor[rank]`` (``context()``'s actor id;
        ``mesh/actor`` when the rank is not known)."""
        return f"{self.mesh}/{self.actor}" + ("" if rank is None else f"[{rank}]")


def call_failed(error: BaseException, call: CallSite | None, rank: int | None) -> BaseException:
    """``error`` (a call to ``rank`` could not be answered) as the failure of ``call``:
    a :class:`SupervisionError` gets Monarch's text, ``Endpoint call a.m() failed,``
    then ``The actor X and all its descendants have failed:`` and why (a process that
    ended), or ``Supervision event: actor X has status: stopped`` (a stopped mesh),
    followed by this project's own details (host, pid, last output lines). Others are
    returned as they are."""
    if call is None or not isinstance(error, SupervisionError) or error.endpoint:
        return error
    head = f"Endpoint call {call.label} failed, "
    new: SupervisionError
    if isinstance(error, RankDiedError) and error.death is not None:
        rank = error.death.rank  # the rank that died (the call may be to several)
    if isinstance(error, RankDiedError):
        d = error.death
        phrase = (
            d.process_phrase if d is not None else "the process this actor was running on is gone"
        )
        body = f"The actor {call.who(rank)} and all its descendants have failed:\n  {phrase}"
        new = RankDiedError(f"{head}{body}\n{error}", error.death, error.mesh)
    elif isinstance(error, MeshStoppedError):
        body = f"Supervision event: actor {call.who(rank)} has status:\n  stopped: {error}"
        new = MeshStoppedError(f"{head}{body}", error.failures)
    else:
        new = SupervisionError(f"{head}{error}", error.failures, error.exception)
    new.endpoint = call.label
    return new


#: The report ``type`` of a process that ended (a rank died): its message is Monarch's
#: phrase for it, and the reason of the failure.
PROCESS_ENDED = "RankDied"


def failure_reason(f: FailureReport) -> str:
    """Why an actor failed, as Monarch's supervision events say it: the remote traceback
    ending with ``Type: message`` (or that line alone); the message alone for a process
    that ended (``the process this actor was running on exited with ...``)."""
    message = str(f.get("message", ""))
    if f.get("type") == PROCESS_ENDED:
        return message
    line = f"{f.get('type', 'Error')}: {message}"
    tb = str(f.get("traceback") or "").rstrip("\n")
    if not tb:
        return line
    if tb.endswith(line):
        return tb + "\n"
    return f"{line}\n{tb}\n"


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


def ranks_word(ranks: Iterable[int]) -> str:
    """``rank 2`` or ``ranks 0-1, 3``: :func:`format_ranks` with its noun."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)


def _span(run: list[int]) -> str:
    return f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"


def actor_error(
    failures: list[FailureReport],
    total: int,
    error_class: type[ActorError] = ActorError,
    note: str = "",
    call: CallSite | None = None,
) -> ActorError:
    """One grouped :class:`ActorError` (or ``error_class``) for the failures of one call;
    ``note`` (what was done to the other ranks) follows the grouped lines. When the root
    cause is an actor that no longer runs (report ``gone``: stopped, aborted, its
    constructor failed) it is a :class:`SupervisionError`, in Monarch's words for
    ``call``."""
    groups = group_failures(failures)
    gone = groups[0][0].get("gone")
    if gone and error_class is ActorError:
        return _gone_error(groups, total, str(gone), call)
    lines = []
    for f, ranks in groups:
        plural = "ranks" if len(ranks) > 1 else "rank"
        host = f" on {f['host']}" if f.get("host") and len(ranks) == 1 else ""
        said = f": {f['message']}" if f["message"] else ""  # (KeyboardInterrupt says nothing)
        lines.append(
            f"{f['type']} in {f['where']} on {plural} {format_ranks(ranks)} of {total}{host}" + said
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


def _gone_error(
    groups: list[tuple[FailureReport, list[int]]], total: int, gone: str, call: CallSite | None
) -> SupervisionError:
    """The calls reached ranks where the actor no longer runs (``gone``: ``stopped`` or
    ``failed``): Monarch's ``Endpoint call a.m() failed, ...`` naming the first."""
    first, ranks = groups[0]
    rank = ranks[0]
    who = call.who(rank) if call is not None else f"on rank {rank}"
    if first.get("type") == "ActorGoneError":  # its own traceback is ours: the words only
        reason = str(first["message"])
    else:  # it failed just now, by this exception (Monarch shows its traceback)
        reason = failure_reason(first).rstrip("\n")
    reason = "".join("  " + ln for ln in reason.splitlines(keepends=True))
    if gone == "stopped":
        body = f"Supervision event: actor {who} has status:\n  stopped: {reason.lstrip()}"
    else:
        body = f"The actor {who} and all its descendants have failed:\n{reason}"
    if len(ranks) > 1 or len(groups) > 1:
        body += f"\n(on rank(s) {format_ranks([r for _, rs in groups for r in rs])} of {total})"
    head = f"Endpoint call {call.label} failed, " if call is not None else ""
    failures = [f for f, _ in groups]
    return SupervisionError(head + body, failures, None, call.label if call else None)
