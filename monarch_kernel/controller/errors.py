"""Errors users see. Each message says what went wrong and what to do about it."""

from __future__ import annotations

from typing import Any


class MonarchError(Exception):
    """Base class of monarch_kernel's errors."""


class MeshStoppedError(MonarchError):
    """The mesh was stopped (or its hosts are gone); spawn a new one."""


class MeshStartError(MonarchError):
    """Ranks or host agents could not be started."""


class RankDiedError(MonarchError):
    """A rank a call was waiting on died. Names rank, host, pid, exit code or signal."""

    def __init__(self, message: str, death: dict[str, Any] | None = None):
        super().__init__(message)
        self.death = death or {}


class ActorError(MonarchError):
    """An endpoint raised on one or more ranks.

    ``failures`` lists one report per failing rank (type, message, traceback, rank, host);
    identical failures are grouped in the message, root cause (first failure) first.
    ``exception`` is the original exception of the first failure when it could be
    rebuilt here (else ``None``).
    """

    def __init__(self, message: str, failures: list[dict[str, Any]], exception: Any = None):
        super().__init__(message)
        self.failures = failures
        self.exception = exception

    @property
    def ranks(self) -> list[int]:
        return [f["rank"] for f in self.failures]

    @property
    def traceback(self) -> str:
        return self.failures[0]["traceback"] if self.failures else ""


def group_failures(failures: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """Group identical failures (same type, message and user line); keep arrival order."""
    groups: dict[tuple, tuple[dict[str, Any], list[int]]] = {}
    for f in failures:
        line = f.get("line") or {}
        key = (f["type"], f["message"], line.get("line"), line.get("code"))
        if key in groups:
            groups[key][1].append(f["rank"])
        else:
            groups[key] = (f, [f["rank"]])
    return list(groups.values())


def format_ranks(ranks: list[int]) -> str:
    """``1, 3`` or ``0-3`` style."""
    ranks = sorted(ranks)
    parts, start, prev = [], None, None
    for r in ranks + [None]:  # type: ignore[list-item]
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    return ", ".join(parts)


def actor_error(failures: list[dict[str, Any]], total: int) -> ActorError:
    """One grouped :class:`ActorError` for the failures of one call."""
    import pickle

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
    text = "\n".join(lines)
    text += f"\n\nRemote traceback (rank {first['rank']}, root cause):\n{first['traceback']}"
    if first.get("tensors"):
        text += "Tensors in the failing frame:\n  " + "\n  ".join(first["tensors"]) + "\n"
    exc = None
    if first.get("exception"):
        try:
            exc = pickle.loads(first["exception"])
        except Exception:
            exc = None
    return ActorError(text, failures, exc)
