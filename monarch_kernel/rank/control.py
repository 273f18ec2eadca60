"""A rank's control thread: what the controller asks while user code runs on the main
thread (``push``, ``pull``, ``ping``, ``cancel``, ``stacks``, ``abort_pg``,
``input_reply``), and the once-a-second ``stats``. It also ends the rank when its host
agent is gone."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from monarch_kernel.rank import context
from monarch_kernel.rank.context import UserNamespace
from monarch_kernel.rank.link import ControllerLink
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.signals import MainThread
from monarch_kernel.wire import Codec, Message, WireError, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.chunks import Assembler
from monarch_kernel.wire.codec import recv as wire_recv

log = logging.getLogger("monarch_kernel.rank")

STATS_INTERVAL = 1.0
#: How long the control thread waits for an abort of the process group to finish.
ABORT_WAIT = 1.0
#: Seconds after an ABORT_PG during which failures are not kept for post-mortem.
ABORT_KEEP_PAUSE = 5.0

#: A control-thread handler: ``handler(msg)``.
ControlHandler = Callable[[Message], None]


class FailureKeeper(Protocol):
    """The rank's debugger, as far as the control thread touches it."""

    last_failure: BaseException | None
    keep_after: float


class InputAnswers(Protocol):
    """The rank's ``input()`` bridge, as far as the control thread touches it."""

    def answer(self, reply: H.InputReply) -> None:
        """Wake the ``input()`` waiting for ``reply``."""
        ...


class ControlThread:
    """Serves the rank's control socket ``ctl`` on a thread of its own."""

    def __init__(
        self,
        rank: int,
        ctl: zmq.Socket[bytes],
        codec: Codec,
        outbox: Outbox,
        main: MainThread,
        namespace: UserNamespace,
        debugger: FailureKeeper,
        stdin: InputAnswers,
    ):
        self.rank = rank
        self.ctl = ctl
        self.codec = codec
        self.outbox = outbox
        self.main = main
        self.namespace = namespace
        self.debugger = debugger
        self.stdin = stdin
        self.parent = os.getppid()
        #: The process group backend the controller was last told of (``stats["pg"]``).
        self._pg_told: object = None
        #: (job, error type) of the periodic jobs' failures logged (see ``_guarded``)
        self._logged_failures: set[tuple[str, str]] = set()
        #: A detachable mesh's rank: the controller link whose events this thread reads.
        self.link: ControllerLink | None = None
        #: Reassembles large pushed values, which come in chunks.
        self.assembler = Assembler()
        #: Interrupts a request that a thread besides the main one runs (the inbox's
        #: ``interrupt_request``): True if one did.
        self.interrupt_request: Callable[[str], bool] | None = None
        #: Handlers by kind: what they raise is sent back as an error reply to the
        #: request (header ``i``), or as a fault if there is none.
        self.handlers: dict[str, ControlHandler] = {
            K.HELLO: _ignore,  # the controller's connection probe
            K.CANCEL: self.cancel,
            K.TENSOR_STOP: self.tensor_stop,
            K.STACKS: self.stacks,
            K.PUSH: self.push,
            K.PULL: self.pull,
            K.PING: self.ping,
            K.ABORT_PG: self.abort_pg,
            K.INPUT_REPLY: self.input_reply,
            K.TRAIN: self.train,
            K.MESH_REF: self.mesh_ref,
        }

    def start(self) -> None:
        """Start serving (a daemon thread)."""
        threading.Thread(target=self.loop, name="rank-control", daemon=True).start()

    def loop(self) -> None:
        """Serve control messages; send stats once a second; exit with the agent."""
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        link = self.link
        if link is not None:
            link.watcher = threading.get_ident()
            poller.register(link.monitor, zmq.POLLIN)
        next_stats = 0.0
        phase = stats_phase(self.parent)
        while True:
            if os.getppid() != self.parent:  # our host agent is gone
                os._exit(3)
            now = time.monotonic()
            if now >= next_stats:
                next_stats = next_stats_at(now, phase)
                self._guarded("sending its stats", self.send_stats)
                # idle shared memory of large results goes back
                self._guarded("returning idle shared memory", self.outbox.tidy)
            wait_ms = int((next_stats - time.monotonic()) * 1000) + 1
            ready = dict(poller.poll(max(wait_ms, 1)))
            if link is not None and link.monitor in ready:
                self._guarded("watching its link to the controller", link.watch)
            if self.ctl not in ready:
                continue
            try:
                msg = self.assembler.receive(self.codec, wire_recv(self.ctl))
            except WireError as exc:
                log.warning("rank %s dropped a control message: %s", self.rank, exc)
                continue
            if msg is None:  # a part of a large pushed value
                continue
            try:
                self.handle(msg)
            except Exception as exc:
                request = msg.header.get("i")
                self.outbox.reply_error(
                    request if isinstance(request, str) else None, exc, msg.kind
                )

    def _guarded(self, what: str, work: Callable[[], object]) -> None:
        """Run one of the loop's own periodic jobs. Invariant: nothing it raises ends
        the thread (a rank without it answers no cancel, stack or ping, and the
        controller would take it for hung): the failure is logged, once per kind of
        error and job, and the loop goes on."""
        try:
            work()
        except Exception as exc:
            key = (what, type(exc).__name__)
            if key not in self._logged_failures:
                self._logged_failures.add(key)
                log.exception("rank %s: %s failed (the control thread goes on)", self.rank, what)

    def handle(self, msg: Message) -> None:
        """Handle one control message; unknown kinds are ignored."""
        try:
            handler = self.handlers[msg.header["k"]]
        except (KeyError, TypeError):  # unknown (or unhashable) kind
            return
        handler(msg)

    def send_stats(self) -> None:
        """The once-a-second ``stats``: memory, data-plane bytes, process group."""
        from monarch_kernel.rank.dataplane.plane import counters

        stats: dict[str, object] = {"rss": _rss(), "time": time.time(), **counters()}
        if "torch.distributed" in sys.modules:  # so a restart can re-form the group
            from monarch_kernel.rank.pg import distributed

            if distributed.last_backend:
                stats["pg"] = distributed.last_backend
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["gpu_mem"] = torch.cuda.memory_allocated()
        from monarch_kernel.rank.tensors import ops_done  # (loaded at the rank's start)

        done = ops_done()
        if done is not None:  # the tensor engine's ops run here (the dashboard's count)
            stats["te_ops"] = done
        header, payload = H.RankNotice(kind=K.STATS, rank=self.rank).encode(), pickle.dumps(stats)
        pg = stats.get("pg")
        try:
            if pg != self._pg_told:
                # A new process group goes straight to the controller, not a second
                # later with the host's stats: a restart re-forms the group from it.
                self.outbox.send(header, payload)
                self._pg_told = pg
            else:
                self.outbox.send_stats(header, payload)
        except zmq.ZMQError:
            pass

    def mesh_ref(self, msg: Message) -> None:
        """MESH_REF: meshes of the controller as they are now (one was resized): the
        mesh handles this rank holds take on the newest (``calls.mesh_refs``)."""
        from monarch_kernel.calls import mesh_refs
        from monarch_kernel.calls.requester import MeshRef

        for ref in pickle.loads(msg.payload):
            if isinstance(ref, MeshRef):
                mesh_refs.publish(ref)

    def cancel(self, msg: Message) -> None:
        """CANCEL: interrupt request ``c`` if it runs now, skip it if it has not started."""
        target = H.Cancel.decode(msg.header).target
        cancelled = self.main.cancelled
        cancelled.add(target)  # skipped if it has not started yet
        if len(cancelled) > 1000:  # cancels of requests that never came
            cancelled.pop()
        interrupt = self.interrupt_request
        if interrupt is not None and interrupt(target):
            return  # a worker thread of the rank ran it (``rank.runners``)
        if context.main_serving().request == target and self.main.in_user_code:
            os.kill(os.getpid(), signal.SIGINT)  # raises in the main thread
            if "monarch_kernel.rank.pg.backend" in sys.modules:
                # A main thread waiting in C++ for a collective (DDP's backward) takes no
                # interrupt, and its peers are being interrupted: release it.
                from monarch_kernel.rank.pg import distributed

                distributed.release_collectives("interrupted")

    def tensor_stop(self, msg: Message) -> None:
        """TENSOR_STOP: the tensor-engine ops up to ``s`` that have not run do not run
        (the SIGINT sent beside this stops the one running)."""
        from monarch_kernel.rank import tensors

        tensors.stop_ops(H.TensorStop.decode(msg.header).through)

    def _request(self, msg: Message) -> str:
        """The id of the request ``msg`` (asked once the work is done, as the handlers
        always did: a push without one still sets the names, then fails)."""
        request = H.ControlRequest.decode(msg.header).request
        if request is None:
            raise H.HeaderError(f"{msg.kind!r} header: missing key 'i'")
        return request

    def stacks(self, msg: Message) -> None:
        """STACKS: reply every other thread's Python stack (``wire.stacks``)."""
        from monarch_kernel.wire.stacks import capture_stacks

        stacks = capture_stacks(threading.get_ident())
        self.outbox.reply(self._request(msg), stacks, "stacks")

    def push(self, msg: Message) -> None:
        """PUSH: set the pickled ``{name: value}`` in the namespace; reply the names."""
        values = loads(msg.payload, msg.buffers, "pushed values")
        self.namespace.update(values)
        self.outbox.reply(self._request(msg), sorted(values), "push")

    def pull(self, msg: Message) -> None:
        """PULL: reply the values of the pickled list of names, in that order."""
        names = loads(msg.payload, msg.buffers, "pull request")
        missing = [n for n in names if n not in self.namespace]
        if missing:
            here = context.current_rank().rank
            raise NameError(f"name {missing[0]!r} is not defined on rank {here}")
        values = [self.namespace[n] for n in names]
        self.outbox.reply(self._request(msg), values, f"pulled {', '.join(names)}")

    def ping(self, msg: Message) -> None:
        """PING: reply this rank's pid, its count of rejected (forged) messages, the
        backend of its last torch.distributed process group (``pg``) and whether that
        group is live now (``pg_live``)."""
        from monarch_kernel.rank.pg import distributed

        backend, live = distributed.state()
        value = {
            "pid": os.getpid(),
            "rejected": self.codec.rejected,
            "pg": backend,
            "pg_live": live,
        }
        self.outbox.reply(self._request(msg), value, "ping")

    def abort_pg(self, msg: Message) -> None:
        """ABORT_PG: abort the default process group (releases peers blocked in a
        collective with this rank); fire and forget, errors go to the log. It runs on a
        thread of its own and is waited for at most ABORT_WAIT seconds (so that a ping
        right after it sees the group gone), so a backend slow to abort never holds up
        pings, cancels and stack dumps for long."""
        from monarch_kernel.rank.pg import distributed

        why = H.AbortPg.decode(msg.header).why
        # A failure the abort causes (a collective released with an error) is not kept
        # for post-mortem: its frames hold the aborted group's pending work, and while
        # they live the group cannot be destroyed (the ranks would stay in a dead group).
        self.debugger.last_failure = None
        self.debugger.keep_after = time.monotonic() + ABORT_KEEP_PAUSE

        def abort() -> None:
            try:
                distributed.abort_process_group(why)
            except Exception:
                log.exception("rank %s: aborting the process group failed", self.rank)

        thread = threading.Thread(target=abort, name="mk-abort-pg", daemon=True)
        thread.start()
        thread.join(ABORT_WAIT)

    def train(self, msg: Message) -> None:
        """TRAIN: an order for the main thread parked at a training step boundary (see
        ``rank.training.park``)."""
        from monarch_kernel.rank.training import park as train_park

        train_park.on_control(msg, self.outbox)

    def input_reply(self, msg: Message) -> None:
        """INPUT_REPLY: the notebook's answer to an ``input()`` waiting on this rank."""
        self.stdin.answer(H.InputReply.decode(msg.header))


def stats_phase(agent_pid: int) -> float:
    """Where in each :data:`STATS_INTERVAL` of the machine's monotonic clock the ranks of
    the host agent ``agent_pid`` send their stats: the same for all of them, so that the
    agent takes them in one wake-up instead of one per rank (an idle mesh's agents used
    about three times the CPU with each rank on a phase of its own), and spread over the
    interval from one agent to the next (golden-ratio steps), so that the hosts' bursts do
    not all come at once."""
    return (agent_pid * 0.6180339887) % 1.0 * STATS_INTERVAL


def next_stats_at(now: float, phase: float) -> float:
    """The first time after ``now`` that is ``phase`` into a :data:`STATS_INTERVAL`."""
    start = (now - phase) // STATS_INTERVAL * STATS_INTERVAL + phase
    return start + STATS_INTERVAL


def _ignore(msg: Message) -> None:
    """A control message that needs nothing done (HELLO)."""


def _rss() -> int:
    """Resident memory of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
