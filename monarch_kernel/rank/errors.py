"""Turning an exception inside a rank into a report the controller can group and show."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType

from monarch_kernel.rank import oom
from monarch_kernel.wire.reports import FailureReport, SourceLine

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ActorAborted(BaseException):
    """Raised by ``context().actor_instance.abort(reason)`` in an actor: that actor stops
    with a failure (its caller and its creator's supervision are told); the rank and its
    other actors keep running. A BaseException, so that ``except Exception`` in user code
    does not swallow it."""

    def __init__(self, reason: str | None = None):
        super().__init__(reason or "abort() was called")
        self.reason = reason or "abort() was called"


class ActorGoneError(LookupError):
    """A call reached a rank (or the controller's process) where its actor no longer
    runs: it was stopped (``stopped``), or it aborted or its constructor failed. The
    caller gets a ``SupervisionError`` (the report's ``gone`` says which)."""

    def __init__(self, message: str, stopped: bool = False):
        super().__init__(message)
        self.stopped = stopped


#: The waits a KeyboardInterrupt lands in (``Event.wait``): not the user's to read.
_THREADING = os.path.abspath(threading.__file__)


def _is_internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PKG_DIR + os.sep)


def _user_tb(tb: TracebackType | None) -> TracebackType | None:
    """Skip the leading frames that belong to monarch_kernel itself."""
    while tb is not None and _is_internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def describe_tensors(frame_locals: Mapping[str, object], limit: int = 12) -> list[str]:
    """``name: shape (2, 3) float32 on cpu`` for each tensor/array local of a frame."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    out = []
    for name, value in frame_locals.items():
        if torch is not None and isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            out.append(f"{name}: shape {tuple(value.shape)} {dtype} on {value.device}")
        elif np is not None and isinstance(value, np.ndarray):
            out.append(f"{name}: shape {value.shape} {value.dtype} (numpy)")
        if len(out) >= limit:
            break
    return out


def _drop_trailing_internal(tb: TracebackType | None) -> list[TracebackType]:
    """The traceback's entries, without internal frames at its end (e.g. the SIGINT
    handler that raised KeyboardInterrupt inside the user's code, or a collective's
    wait in the process group, down to the lock it was waiting on)."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while len(entries) > 1 and _trailing_noise(entries[-1].tb_frame.f_code.co_filename):
        entries.pop()
    return entries


def _trailing_noise(filename: str) -> bool:
    return _is_internal(filename) or os.path.abspath(filename) == _THREADING


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _format_one(exc: BaseException) -> tuple[str, traceback.StackSummary, list[TracebackType]]:
    """``exc``'s own traceback text (user frames only), its frames and entries."""
    tb = _user_tb(exc.__traceback__) or exc.__traceback__
    entries = _drop_trailing_internal(tb)
    frames = traceback.StackSummary.extract((e.tb_frame, e.tb_lineno) for e in entries)
    text = "Traceback (most recent call last):\n" if frames else ""
    text += "".join(frames.format()) + "".join(traceback.format_exception_only(type(exc), exc))
    return text, frames, entries


def _chain(exc: BaseException) -> list[tuple[BaseException, str]]:
    """The exceptions before ``exc`` in its chain (``raise X from Y``, or raised while
    handling another), oldest first, each with the line that links it to the next:
    Python's own order, so the root cause is shown first, as in a local traceback."""
    out: list[tuple[BaseException, str]] = []
    seen = {id(exc)}
    cur: BaseException | None = exc
    while cur is not None and len(out) < 8:
        if cur.__cause__ is not None:
            prev, link = cur.__cause__, _CAUSE
        elif cur.__context__ is not None and not cur.__suppress_context__:
            prev, link = cur.__context__, _CONTEXT
        else:
            break
        if id(prev) in seen:
            break
        seen.add(id(prev))
        out.append((prev, link))
        cur = prev
    out.reverse()
    return out


#: How torch's futures wrap an error raised in a ``then`` callback (how an aborted
#: process group's errors reach C++ waiters such as DDP's backward): this prefix, the
#: error, then the callback's Python stack after ``\n\nAt:\n``.
_FUTURE_PREFIX = "Got the following error when running the callback: "


def unwrap_future_error(text: str) -> str:
    """``text`` with every future-callback wrapping removed (the error inside stays)."""
    while _FUTURE_PREFIX in text:
        head, _, rest = text.partition(_FUTURE_PREFIX)
        inner, at, tail = rest.partition("\n\nAt:\n")
        if at:  # the stack lines run to the first blank line or the end
            _stack, _, tail = tail.partition("\n\n")
            tail = "\n" + tail if tail else ""
        text = head + inner + tail
    return text


#: Layers above that explain some failures further (``rank.sharding`` names the DTensors
#: of a failed DTensor op): each takes the exception and returns a note or None; the note
#: is added to the exception (``add_note``), so it shows under its traceback.
Explainer = Callable[[BaseException], "str | None"]
_explainers: list[Explainer] = []


def add_explainer(explainer: Explainer) -> None:
    """Have :func:`exception_report` ask ``explainer`` about every failure (once)."""
    if explainer not in _explainers:
        _explainers.append(explainer)


def _explain(exc: BaseException) -> None:
    for explainer in _explainers:
        try:
            note = explainer(exc)
        except Exception:  # an explanation never hides the failure itself
            continue
        if note and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)


def exception_report(exc: BaseException, where: str = "", note: str = "") -> FailureReport:
    """A picklable, plain-data description of ``exc`` raised inside a rank, with its
    chain of causes (``causes``: type and message of each, root cause first); ``note``
    (e.g. the out-of-memory report of ``rank.oom``) follows the traceback."""
    _explain(exc)
    text, frames, entries = _format_one(exc)
    chain = _chain(exc)
    if chain:
        text = "".join(_format_one(e)[0] + link for e, link in chain) + text
    if note:
        text = text.rstrip("\n") + "\n\n" + note.rstrip("\n") + "\n"
    last = entries[-1] if entries else None
    tensors = describe_tensors(last.tb_frame.f_locals) if last is not None else []
    line: SourceLine | None = None
    for fs in reversed(frames):
        if not _is_internal(fs.filename):
            line = SourceLine(file=fs.filename, line=fs.lineno or 0, func=fs.name, code=fs.line)
            break
    try:
        import pickle

        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    message = unwrap_future_error(str(exc))
    if oom.is_oom(exc):  # torch's long text differs per rank by the free memory
        message = oom.headline(message)
    report: FailureReport = {
        "type": type(exc).__name__,
        "qualname": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": message,
        "traceback": unwrap_future_error(text),
        "line": line,
        "tensors": tensors,
        "where": where,
        "exception": pickled,
        "causes": [
            {"type": type(e).__name__, "message": unwrap_future_error(str(e))} for e, _ in chain
        ],
    }
    if isinstance(exc, ActorGoneError):
        report["gone"] = "stopped" if exc.stopped else "failed"
    return report
