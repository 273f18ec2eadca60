"""Taking over a detachable mesh: the controller side of a mesh another controller made.

:func:`adopt` builds the :class:`~.mesh.MeshRuntime` of an attach file whose host agents
accepted this controller (their desks' answers): the same key and run, the same unix
sockets bound again (the ranks and agents reconnect by themselves), sequence numbers of
the next epoch (``wire.kinds.SEQ_EPOCH``: a rank drops what the earlier controller sent
and it never ran), the records of hosts and ranks as their agents report them, the
failure policy and the ``--setup`` cells. Ranks that ended while no controller held the
mesh are told to supervision once the mesh runs, so the failure policy applies to them
(``restart`` restarts them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.attach_file import AttachFile, HostEntry
from monarch_kernel.controller.detach import release as detach
from monarch_kernel.controller.detach.held_output import HeldOutput
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.controller.messaging import listener_key
from monarch_kernel.controller.state.records import FailurePolicy, MeshPhase, RankEnd, RankState
from monarch_kernel.launchers import get_launcher
from monarch_kernel.launchers.adopted import AdoptedHost, RemoteAdoptedHost, SharedReservation
from monarch_kernel.launchers.base import HostHandle
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.desk import DeskReply, RankStatus
from monarch_kernel.wire.osutil import request_tail
from monarch_kernel.wire.peer_address import PeerAddress

#: Seconds the ranks and agents get to reconnect to the controller's sockets.
RECONNECT_TIMEOUT = 15.0
#: Backends whose hosts an engine reserved: an adopted mesh of theirs gets the join
#: launcher (it re-uses the engine's reservation, recorded in the attach file, and
#: does not connect to the engine until it releases that).
ENGINE_BACKENDS = ("ray", "slurm", "lightning")


@dataclass
class Adopted:
    """A mesh taken over, and the ranks whose fate must still be dealt with once the
    caller follows the requests that were running (see ``attach.Attached.finish``)."""

    runtime: MeshRuntime
    #: Ranks that ended while no controller held the mesh, with how.
    ended: list[tuple[int, RankEnd]] = field(default_factory=list)
    #: Ranks their host agent restarted meanwhile (the failure policy): how each ended.
    restarted: dict[int, RankStatus] = field(default_factory=dict)
    #: The output of each job left running, kept until the job is followed.
    held: dict[str, HeldOutput] = field(default_factory=dict)


def adopt(file: AttachFile, replies: dict[int, DeskReply]) -> Adopted:
    """The running mesh of ``file``, now held here (``replies``: each host's answer to
    this controller's attach). MeshStartError if its ranks do not reconnect."""
    runtime = MeshRuntime(
        file.name,
        dict(file.per_host),
        file.n_hosts,
        get_launcher("join" if file.backend in ENGINE_BACKENDS else file.backend),
        env=dict(file.env),
        backend=file.backend,
        on_failure=FailurePolicy(file.on_failure),
        grace=file.grace,
        detach_keep=file.keep,
        identity=file.identity(),
    )
    try:
        runtime.transport.set_epoch(max(r.epoch for r in replies.values()))
        runtime.starter.common = file.common  # type: ignore[assignment]
        # Its ranks admit the listener key of the kernel that started it: ours from now on.
        listener_key.adopt(str(file.common.get("listener_key") or ""), file.name)
        runtime.recipe.setup_cells = [detach.setup_cell(c) for c in file.setup_cells]
        for record in file.actors:
            runtime.remember_actor(detach.actor_spec(record))
        adopted = Adopted(runtime)
        for job in file.jobs:  # its output waits for its job to be followed (or not)
            adopted.held[job.request] = HeldOutput()
            runtime.output.route(job.request, adopted.held[job.request])
        _take_records(adopted, file, replies)
        _wait_reconnected(runtime)
        runtime.lifecycle.set(MeshPhase.RUNNING)
    except BaseException:
        runtime.release("could not be attached")
        raise
    detach.enable(runtime)
    return adopted


def _take_records(adopted: Adopted, file: AttachFile, replies: dict[int, DeskReply]) -> None:
    """Fill the host and rank records; note the ranks that ended or were restarted."""
    runtime = adopted.runtime
    now = time.monotonic()
    kept = _reservations(file)
    for entry in file.hosts:
        host = runtime.hosts[entry.index]
        host.slot = entry.slot if entry.slot >= 0 else entry.index
        host.pid, host.hostname, host.desk = entry.pid, entry.hostname, entry.desk
        host.addr, host.port = entry.addr, entry.port
        host.handle = _handle(runtime, entry, kept)
        host.dir = entry.dir
        host.last_seen, host.ready = now, True
    for rank in file.ranks:  # the wire ids first: what arrives is mapped by them
        runtime.ranks[rank.rank].slot = rank.slot if rank.slot >= 0 else rank.rank
    with runtime.transport.send_lock:
        runtime.slots.rebuild()
    # host agents know their ranks by slot
    statuses = {s.rank: s for reply in replies.values() for s in reply.ranks}
    for rank in file.ranks:
        info = runtime.ranks[rank.rank]
        status = statuses.get(info.slot)
        info.hostname, info.device = rank.hostname, rank.device
        info.peer_secret = rank.peer_secret
        info.restarts = rank.restarts + (status.restarts if status is not None else 0)
        try:
            info.peer = PeerAddress.decode(rank.peer)
        except ValueError:
            info.peer = PeerAddress(rank.hostname)
        info.pid = status.pid if status is not None else rank.pid
        info.last_seen = now
        if status is not None and status.alive:
            runtime.requests.set_state(info, RankState.IDLE)
            if status.restarts:
                adopted.restarted[rank.rank] = status
        else:
            log = file.hosts[rank.host].rank_log(info.slot)
            adopted.ended.append((rank.rank, _end(status, log)))


def _reservations(file: AttachFile) -> dict[str, SharedReservation]:
    """The engine reservations the mesh's hosts run in, each shared by its hosts."""
    records: dict[str, list[HostEntry]] = {}
    for entry in file.hosts:
        if entry.reservation:
            records.setdefault(_key(entry), []).append(entry)
    return {
        key: SharedReservation(dict(entries[0].reservation or {}), len(entries))
        for key, entries in records.items()
    }


def _key(entry: HostEntry) -> str:
    return json.dumps(entry.reservation, sort_keys=True)


def _handle(
    runtime: MeshRuntime, entry: HostEntry, kept: dict[str, SharedReservation]
) -> HostHandle:
    """A handle on a host agent this controller did not start."""
    if not entry.desk.startswith("tcp://"):
        return AdoptedHost(entry.pid, entry.log, entry.private_dir)
    shared = kept.get(_key(entry)) if entry.reservation else None
    handle = RemoteAdoptedHost(entry.desk, entry.hostname, shared)
    slot, transport = entry.slot if entry.slot >= 0 else entry.index, runtime.transport
    handle.tell_exit = lambda: transport.send_host_slot(slot, {"k": K.STOP, "grace": 0.0})
    return handle


def _end(status: RankStatus | None, log: str) -> RankEnd:
    """How a rank that ended while detached ended (its last lines from its log)."""
    if status is None:
        return RankEnd(reason="its host agent does not know it (it ended unseen)")
    return RankEnd(
        pid=status.pid, code=status.code, signal=status.signal, tail=tuple(request_tail(log))
    )


def _wait_reconnected(runtime: MeshRuntime) -> None:
    """Wait until every live rank and every agent can be sent to (they reconnect to
    the sockets this controller bound again)."""
    t = runtime.transport
    idents = [t.ids.host_id(h.index) for h in runtime.hosts]
    for info in runtime.ranks:
        if info.state is RankState.IDLE:
            idents += [t.ids.rank_id(info.rank), t.ids.rank_id(info.rank, b"c")]
    if not t.probe(idents, timeout=RECONNECT_TIMEOUT):
        raise MeshStartError(
            f"mesh {runtime.name!r}: its ranks did not reconnect within "
            f"{RECONNECT_TIMEOUT:.0f}s (is the kernel that held it still running and "
            "stuck? stop that kernel, then attach again)"
        )
