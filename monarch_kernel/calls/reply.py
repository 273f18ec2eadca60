"""What a request hands back to its caller: one :class:`Reply` per rank, told to the
request's :class:`RequestObserver`.

Both sides of a call use these: the notebook's controller (``MeshRuntime``) and a rank
calling another mesh (``actor.peer.client``) decode the answers of the ranks they asked
into ``Reply`` objects and hand them to the request's observer, which completes a
:class:`~.future.Future` (see :mod:`.gather`).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from monarch_kernel.wire import Message, loads
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.reports import FailureReport
from monarch_kernel.wire.serialize import What


class Reply:
    """One rank's answer to a request, decoded once.

    ``ok``: the request succeeded; :meth:`value` unpickles the result (in the thread
    that asks, so not on the receiving thread). Otherwise ``report`` is the failure,
    already unpickled on receipt (small, and rare) so that the request's observer and
    the :class:`RequestFailed` event share the same object.
    """

    __slots__ = ("rank", "ok", "message", "report")

    def __init__(self, rank: int, message: Message):
        self.rank = rank
        self.message = message
        self.ok = bool(message.header.get("ok"))
        self.report: FailureReport | None = None
        if not self.ok:
            try:
                report: FailureReport = pickle.loads(message.payload)
            except Exception as exc:  # a report we cannot read is still a failure
                report = {"type": "Error", "message": f"unreadable error report: {exc}"}
            report["rank"] = rank
            report.setdefault("where", "")
            report.setdefault("traceback", "")
            self.report = report

    def value(self, what: What) -> object:
        """The result (``what`` names it in an error if it cannot be unpickled)."""
        msg = self.message
        return loads(msg.payload, msg.buffers, what)

    def discard(self, why: str) -> None:
        """The value will not be read (``why``: another rank failed the request, the
        read stopped at an error): let go of what the answering rank keeps for it
        (nothing, but for a :class:`HandleReply`)."""


class HandleReader(Protocol):
    """Reads the replies whose large CUDA tensors came as data-plane handles on copies
    the answering rank keeps for this process (``rank.dataplane.cuda_results``)."""

    def read(self, payload: bytes, buffers: Sequence[Buffer], what: What) -> object:
        """The value; the copies are then let go of."""

    def discard(self, payload: bytes) -> None:
        """The reply will never be read: let go of its copies (must not block)."""


#: Set by ``rank.dataplane.cuda_results`` when it is loaded: a rank asks for results by
#: handle (a call's ``rp``) only once it is.
handle_reader: HandleReader | None = None


class HandleReply(Reply):
    """A reply whose value holds handles on copies the answering rank keeps until this
    process reads them (the result header's ``x``): :meth:`value` reads them once (and
    gives the same value after); a reply collected unread lets them go."""

    __slots__ = ("_value", "_error", "_read")

    def __init__(self, rank: int, message: Message):
        super().__init__(rank, message)
        self._value: object = None
        self._error: Exception | None = None
        self._read = False

    def value(self, what: What) -> object:
        if not self._read:
            self._read = True  # (first: a failed read lets the copies go too)
            msg = self.message
            try:
                self._value = _reader().read(bytes(msg.payload), msg.buffers, what)
            except Exception as exc:
                self._error = exc
            except BaseException:  # Ctrl-C: the copies are gone, a later read says so
                self._error = _gone(self.rank, "its read was interrupted")
                if handle_reader is not None:  # (wherever it stopped: said twice is harmless)
                    handle_reader.discard(bytes(msg.payload))
                raise
        if self._error is not None:
            raise self._error
        return self._value

    def discard(self, why: str) -> None:
        if not self._read:
            self._read = True
            self._error = _gone(self.rank, f"it was let go of unread ({why})")
            if handle_reader is not None:
                handle_reader.discard(bytes(self.message.payload))

    def __del__(self) -> None:
        if not self._read and self.ok and handle_reader is not None:
            handle_reader.discard(bytes(self.message.payload))


def _gone(rank: int, why: str) -> RuntimeError:
    return RuntimeError(
        f"the result from rank {rank} cannot be read: {why}, and its CUDA tensors, which "
        "came by CUDA IPC, are read once; call the endpoint again"
    )


def _reader() -> HandleReader:
    if handle_reader is None:  # a reply by handle to a process that never asked
        raise RuntimeError("a result came as CUDA IPC handles to a process that cannot read them")
    return handle_reader


def reply_of(rank: int, message: Message) -> Reply:
    """The :class:`Reply` (or :class:`HandleReply`) of a decoded ``res`` message."""
    if message.header.get("x"):
        return HandleReply(rank, message)
    return Reply(rank, message)


class RequestObserver(Protocol):
    """What a request tells its caller. Both methods run on a controller thread
    (the receiving one), once per rank of the request; they must not block."""

    def on_reply(self, reply: Reply) -> None:
        """``reply.rank`` answered (successfully or with a failure report)."""

    def on_lost(self, rank: int, error: BaseException) -> None:
        """``rank`` will never answer: it died or the mesh stopped (``error`` says which)."""


@runtime_checkable
class BatchObserver(Protocol):
    """A request observer that takes several ranks' replies in one call (the ranks of
    a host agent's ``fan_in`` part): the same as calling ``on_reply`` for each, in
    order, at a lower cost per rank."""

    def on_replies(self, replies: list[Reply]) -> None: ...


class IncidentView(Protocol):
    """What the observer of a failed request may read of the incident the mesh's failure
    policy opened for it (the controller's ``incident.Incident``): which rank was the
    root cause, how the others were released, and a summary for the error."""

    @property
    def root_rank(self) -> int: ...

    @property
    def released(self) -> dict[int, str]: ...

    @property
    def settled(self) -> threading.Event: ...

    @property
    def outcome(self) -> str:
        """What the policy did or does next (restart, the mesh put right in place)."""
        ...

    def summary(self) -> str: ...


@runtime_checkable
class IncidentObserver(Protocol):
    """A request observer that wants to know of its request's incident (to name the
    root cause and append :meth:`IncidentView.summary` to the error it builds)."""

    def on_incident(self, incident: IncidentView) -> None: ...
