"""Renumbering a mesh's ranks when a shrink drops ranks (or hosts) other than the last
ones (``%mesh shrink NAME --drop-ranks 1,3`` / ``--drop-hosts 1``, and the failure policy
``shrink`` for a dead rank or host anywhere): the survivors are renumbered contiguously
in their old order (3 hosts of 1 rank, host 1 dropped: old ranks 0, 2 are ranks 0, 1
now; hosts likewise). The rules:

* *A process's identity never changes.* Each rank process has a slot (its wire id,
  ``records.Slots``): its routing ids, the ``r`` of everything it sends (to the
  controller, its host agent, peer callers), its host agent's name for it, its peer
  socket's path. Survivors keep theirs, so nothing on the wire and no socket changes:
  no message in flight is lost or misdirected by a renumbering.
* *Logical numbers live in the controller's records only, and change at one moment.*
  ``RankInfo.rank``/``host``, ``HostInfo.index``, the ``ranks``/``hosts`` lists, the
  slot maps, the outstanding requests (their ranks, what they wait for, their
  observers) are rewritten together on the thread that holds the receive token, with
  the transport's send lock held (:func:`forget_and_renumber`): every message is mapped
  from its slot to a rank by the numbering in force when it is handled, every send
  maps a rank to a slot by the numbering in force when it leaves. The recipe's actors,
  the failure policy's restart counts, the training requests' ranks and the per-rank
  logs are re-keyed right after; the dashboard re-keys what it keeps per rank on the
  ``RanksRenumbered`` event emitted at that moment (events before it name old numbers,
  events after it new ones).
* *Sequence numbers, backlogs and replay counters belong to the process*: kept per slot
  (``Transport.next_seq``) or per connection, so they carry over untouched.
* *Nothing runs during it*: between cells (the resize is refused while a cell that is
  not a ``TrainingState`` loop runs), or with a ``--bg`` loop parked at a step boundary
  (``elastic.training_loop``); removed ranks leave every request first (their part fails, or
  they leave the training cell's). The survivors learn their new rank from their slot
  (``rank.world.set_world``: ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, the shape) before
  the process group is re-formed at a fresh rendezvous (it reads ``RANK``).
* *Work in flight follows or fails*: a request outstanding across it (an actor call
  made from another thread, a stream) has its ranks, what it waits for and its
  observer (``Gather``, ``One``, ``Each``: ``renumber``) re-keyed, so the replies still
  to come land under the new numbers; one whose observer cannot be re-keyed makes the
  shrink refuse (``RequestTable.unmovable``); the removed ranks' part of anything fails
  (``RankDiedError``). Rank-to-rank calls are matched by slot (``PeerClient``) and are
  not touched. What it does not cover: a caller on another thread that picked rank
  numbers before the renumbering and sends after it reaches the process that has that
  number now (the same holds for a plain shrink from the end, for numbers past it).
* *Handles follow*: the mesh's generation goes up and every live rank of the
  controller's meshes gets the new ``MeshRef`` (addresses and slots in the new order),
  so mesh handles held by ranks and actors cover the new shape (``actor.peer.requester``); the
  notebook's follow ``MeshResized``. A reference made before still reaches each
  survivor (its address and slot did not change); a slice made before names ranks by
  their numbers, which may be other processes now.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.controller.elastic.plan import MeshSize, ResizeError, ResizePlan
from monarch_kernel.controller.lifecycle.failures import FailureHandler
from monarch_kernel.controller.messaging.receiver import Receiver
from monarch_kernel.controller.messaging.streams import RankLogs
from monarch_kernel.controller.messaging.transport import Transport
from monarch_kernel.controller.state.events import EventBus, RanksRenumbered
from monarch_kernel.controller.state.records import HostInfo, MeshRecipe, RankInfo, Slots
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.controller.training.recovery import PeerRecovery

#: Seconds the receiving thread gets to take a renumbering (it never blocks long: a
#: bound for a stopped or wedged controller only).
RENUMBER_WAIT = 60.0


class RenumberedMesh(Protocol):
    """The parts of a mesh (``MeshRuntime``) a renumbering rewrites."""

    name: str
    ranks: list[RankInfo]
    hosts: list[HostInfo]
    slots: Slots
    requests: RequestTable
    transport: Transport
    receiver: Receiver
    events: EventBus
    recipe: MeshRecipe
    failures: FailureHandler
    peers: PeerRecovery
    logs: RankLogs


def forget_and_renumber(
    m: RenumberedMesh, plan: ResizePlan, apply_shape: Callable[[MeshSize], None]
) -> None:
    """Take ``plan``'s removed ranks and hosts out of ``m``'s records and renumber the
    survivors in their old order (``apply_shape``: the records take on the new shape);
    a shrink from the end renumbers nobody and only forgets. See the module's rules."""
    gone = [r for r in plan.removed if r < len(m.ranks)]
    mapping = {old: new for old, new in plan.renumbering.items() if old < len(m.ranks)}
    host_map = {o: n for o, n in plan.host_renumbering.items() if o < len(m.hosts)}
    why = f"rank removed from mesh {m.name!r} by a shrink"

    def change() -> None:  # under the send lock, on the receiving thread
        for r in gone:  # what still waits for them fails (the training cell's they left)
            m.requests.fail_rank(r, RankDiedError(f"{why} (it was rank {r})", None, m.name))
        m.transport.forget_ranks(gone)
        kept = [m.ranks[old] for old in sorted(mapping)]
        hosts = [m.hosts[old] for old in sorted(host_map)]
        for info in kept:
            info.rank, info.host = mapping[info.rank], host_map.get(info.host, info.host)
        for host in hosts:
            host.index = host_map[host.index]
        m.ranks[:] = kept
        m.hosts[:] = hosts
        apply_shape(plan.after)  # with the records: readers see both or neither
        m.slots.rebuild()
        m.requests.renumber(mapping)
        moved = tuple((o, n) for o, n in sorted(mapping.items()) if o != n)
        if moved and m.events.wants(RanksRenumbered):
            m.events.emit(RanksRenumbered(m.name, moved, tuple(gone)))

    on_receiver(m, lambda: m.transport.rekey(change))
    m.recipe.renumber(mapping)
    if any(old != new for old, new in mapping.items()):
        m.failures.renumber(mapping)
        m.peers.renumber(mapping)
        m.logs.renumber(mapping)


def on_receiver(m: RenumberedMesh, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the thread that holds ``m``'s receive token (no message is handled
    meanwhile) and wait for it; what it raises is raised here."""
    if m.receiver.on_receiving_thread:
        fn()
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    m.receiver.post(run)
    if not done.wait(RENUMBER_WAIT):
        raise ResizeError(
            f"mesh {m.name!r}: its controller did not take the new numbering in "
            f"{RENUMBER_WAIT:.0f}s"
        )
    if failed:
        raise failed[0]
