"""What a recovery from peers does to its mesh (:class:`~.rounds.RoundMesh`), made
of the mesh's parts: requests to ranks' control threads, the controller's own cells,
restarts, the cell sent again under its request id, and the outcome told to the cell
and the dashboard."""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from monarch_kernel.calls.future import Future
from monarch_kernel.calls.reply import Reply, RequestObserver
from monarch_kernel.calls.requester import CallOptions
from monarch_kernel.controller.lifecycle.restart import Restarter
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, MeshRecovered, StreamOutput
from monarch_kernel.controller.state.records import (
    HostInfo,
    MeshRecipe,
    RankInfo,
    RecoveryReport,
    SetupCell,
)
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.controller.training.rounds import Recovery
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.headers.control import AbortPg
from monarch_kernel.wire.train_msgs import Order

_ORDER = CallOptions(control=True, internal=True, during_restart=True)
log = logging.getLogger("monarch_kernel.controller")


class MeshSends(Protocol):
    """The mesh's own request path (``MeshRuntime.request``) and control sends."""

    def request(
        self,
        ranks: list[int],
        header: Header,
        payload: bytes,
        buffers: Sequence[Buffer],
        observer: RequestObserver,
        options: CallOptions = ...,
        request_id: str | None = None,
    ) -> str: ...
    def send_control(self, rank: int, header: Header, payload: bytes = b"") -> None: ...
    def recover(
        self,
        ranks: Sequence[int] | None = None,
        timeout: float = ...,
        reason: str = "",
        skip: frozenset[int] = frozenset(),
    ) -> RecoveryReport: ...


class Replies:
    """Observer of one order to several ranks: every reply (a lost rank: a failed one)."""

    def __init__(self, n: int):
        self._left = n
        self._lock = threading.Lock()
        self.replies: list[Reply] = []
        self.future: Future[list[Reply]] = Future()
        if n == 0:
            self.future.set_result([])

    def on_reply(self, reply: Reply) -> None:
        with self._lock:
            self.replies.append(reply)
            self._left -= 1
            done = self._left == 0
        if done:
            self.future.set_result(list(self.replies))

    def on_lost(self, rank: int, error: BaseException) -> None:
        report = {"type": type(error).__name__, "message": str(error).splitlines()[0]}
        self.on_reply(_Lost(rank, report))  # type: ignore[arg-type]


class _Lost:
    """A reply that never came (the rank died)."""

    ok = False

    def __init__(self, rank: int, report: dict[str, str]):
        self.rank = rank
        self.report = report


class PeerMesh:
    """:class:`~.rounds.RoundMesh` over a mesh's parts."""

    def __init__(
        self,
        name: str,
        sends: MeshSends,
        *,
        ranks: list[RankInfo],
        hosts: list[HostInfo],
        recipe: MeshRecipe,
        restarter: Restarter,
        transport: Transport,
        requests: RequestTable,
        events: EventBus,
        post: Callable[..., None],
    ):
        self.name = name
        self.ranks = ranks
        self._sends = sends
        self._hosts = hosts
        self._recipe = recipe
        self._restarter = restarter
        self._transport = transport
        self._requests = requests
        self._events = events
        self._post = post

    def runner(
        self,
        rid: str,
        payload: bytes,
        buffers: Sequence[Buffer],
        dead: int,
        on_done: Callable[[str], None],
    ) -> Recovery:
        """A recovery from peers of request ``rid`` whose rank ``dead`` died."""
        return Recovery(rid, payload, buffers, dead, self, on_done)

    def raise_parked(self, rid: str, ranks: list[int], why: str) -> None:
        """Ranks parked at a step boundary with no recovery to wait for raise."""
        self.ask_ranks(ranks, Order("raise", rid, why=why))

    def ask_ranks(self, ranks: Sequence[int], order: Order) -> Future[list[Reply]]:
        replies = Replies(len(ranks))
        if ranks:
            payload = pickle.dumps(order)
            self._sends.request(list(ranks), {"k": K.TRAIN}, payload, (), replies, _ORDER)
        return replies.future

    def run_internal(self, ranks: list[int], code: str, label: str, deadline: float) -> str:
        return self._restarter.run_cell(ranks, code, label, (), deadline)

    def restart_ranks(self, ranks: list[int], timeout: float = 60.0) -> None:
        self._restarter.restart_ranks(ranks, timeout)

    def has_process_group(self) -> bool:
        """Whether the ranks had a torch.distributed process group (to re-form)."""
        return self._recipe.pg_backend is not None

    def pg_backend(self) -> str | None:
        """The backend of the ranks' process group (``gloo``, ``nccl``), as they said."""
        return self._recipe.pg_backend

    def rendezvous(self) -> tuple[str, int]:
        return self._hosts[0].addr, self._restarter.new_port(0)

    def setup_cells_now(self) -> list[SetupCell]:
        return list(self._recipe.setup_cells)

    def abort_groups(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            if self.ranks[r].alive:
                why = "another rank died in the training step"
                self._sends.send_control(r, AbortPg(why=why).encode())

    def resend_cell(self, rid: str, rank: int, payload: bytes, buffers: Sequence[Buffer]) -> None:
        """Send the cell of request ``rid`` to ``rank`` again (a restarted rank): its
        reply and output are the request's, as if it had never died."""
        self._requests.rejoin(rid, rank)
        header: Header = {"k": K.EXEC, "i": rid, "w": 1}
        self._transport.send([rank], header, payload, buffers)

    def restart_dead(self, reason: str) -> None:
        """A recovery from peers gave up: restart the dead ranks the usual way (restart
        in place: process group, actors, set-up cells), as the failure policy would."""
        try:
            self._sends.recover(reason=reason)
        except Exception as exc:
            log.warning("mesh %s: restarting after a failed recovery failed: %s", self.name, exc)

    def lose_part(self, rid: str, rank: int, error: BaseException) -> None:
        self._post(self._requests.abandon, rid, {rank}, error)

    def request_ranks(self, rid: str) -> list[int] | None:
        pending = self._requests.get(rid)
        return list(pending.ranks) if pending is not None else None

    def request_waiting(self, rid: str) -> list[int]:
        """The ranks of request ``rid`` that have not answered it yet (none once it ended)."""
        return sorted(self._requests.waiting(rid))

    def recovered(self, rid: str, text: str, restarted: tuple[int, ...], seconds: float) -> None:
        """Say under the cell, and on the dashboard, what the recovery did."""
        events = self._events
        first = restarted[0] if restarted else 0
        events.emit(StreamOutput(self.name, first, rid, "stderr", f"[recovered] {text}\n"))
        report = RecoveryReport(
            restarted,
            self._recipe.pg_backend,
            (),
            tuple(c.label for c in self._recipe.setup_cells),
            seconds,
            (),
            "a rank died in a training step",
            peer_state=text,
        )
        self._restarter.last_recovery = report  # what MeshRuntime.last_recovery says
        events.emit(MeshRecovered(self.name, report))
