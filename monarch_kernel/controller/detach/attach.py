"""Detachable meshes seen from a controller that does not hold them: list them, attach
to one (take it over), stop one.

Everything goes through the host agents' desks (:mod:`monarch_kernel.wire.desk`), with
what the mesh's attach file (:mod:`.attach_file`) says: a request signed with the
mesh's key, one answer per agent. Whether a mesh has ended is never judged by an answer
coming late (a loaded machine can starve an agent for seconds): a mesh has ended when
none of its agents' desks takes connections any more (its ``--keep`` ran out, it was
stopped, or its agents were killed), and only then is its file removed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace

import zmq

from monarch_kernel.calls.errors import MeshStartError, MonarchError
from monarch_kernel.controller import attach_file
from monarch_kernel.controller.attach_file import AttachFile, AttachFileError, HostEntry
from monarch_kernel.controller.detach.adopt import adopt
from monarch_kernel.controller.detach.takeover import Attached
from monarch_kernel.controller.mesh import registry
from monarch_kernel.launchers import reservation as reservations
from monarch_kernel.launchers.adopted import desk_listens
from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire.desk import (
    DESK,
    DESK_REPLY,
    FORGED_REPLY,
    ControllerId,
    DeskOp,
    DeskReply,
    DeskRequest,
)

#: Seconds a desk gets to answer (an agent answers between two heartbeats).
DESK_TIMEOUT = 5.0
#: ... when only asked how the mesh is (``%mesh`` lists detached meshes).
STATUS_TIMEOUT = 1.0


class AttachError(MonarchError):
    """A detached mesh cannot be attached or stopped (the message says why and what to do)."""


class DeskClient:
    """Asks the desks of one mesh's host agents."""

    def __init__(self, file: AttachFile):
        self.file = file
        self.codec = Codec(bytes.fromhex(file.key))

    def ask(self, host: HostEntry, req: DeskRequest, timeout: float) -> DeskReply | None:
        """Host ``host``'s answer; None if it does not answer (its agent is gone, or
        stopped or too busy to answer in time).

        An unanswered request is withdrawn before this returns: the socket and its own
        context are torn down (``term`` waits for libzmq's I/O thread), so an agent that
        did not take it in time (stopped, say) never gets it later, when it runs again and
        no one waits for the answer (a late ``stop`` would end a mesh whose user was told
        it did not answer; a late ``attach`` would hand it to a kernel told it failed).
        One the agent took but did not answer yet (its loop busy) is still carried out."""
        if host.desk.startswith("ipc://") and not os.path.exists(host.desk[6:]):
            return None  # the agent removed its directory on its way out
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            return self._ask(ctx, host, req, timeout)
        finally:
            ctx.destroy(linger=0)

    def _ask(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        host: HostEntry,
        req: DeskRequest,
        timeout: float,
    ) -> DeskReply | None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys = self.file.curve_keys()
        if host.desk.startswith("tcp://") and keys is not None:
            # The desk serves with its agent's key and admits the controller's only.
            sock.setsockopt(zmq.CURVE_SERVERKEY, host.curve_public.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
        try:
            sock.connect(host.desk)
            sock.send_multipart(self.codec.encode({"k": DESK}, req.to_json()))
            if not sock.poll(int(timeout * 1000)):
                return None
            frames = sock.recv_multipart()
        finally:
            sock.close(0)
        if frames == [FORGED_REPLY]:
            return DeskReply(False, FORGED_REPLY.decode())
        try:
            msg = self.codec.decode(frames)
            if msg.header.get("k") != DESK_REPLY:
                raise WireError("not a desk reply")
            return DeskReply.from_json(bytes(msg.payload))
        except (WireError, ValueError) as exc:
            return DeskReply(False, f"a malformed answer from host {host.index}: {exc}")

    def ask_all(
        self,
        op: DeskOp,
        *,
        force: bool = False,
        grace: float = 3.0,
        timeout: float = DESK_TIMEOUT,
        hosts: list[HostEntry] | None = None,
    ) -> dict[int, DeskReply | None]:
        """Every host's (or those of ``hosts``) answer to ``op``, asked as this process."""
        me = ControllerId.of_this_process()
        return {
            h.index: self.ask(h, DeskRequest(op, me, force, grace), timeout)
            for h in (self.file.hosts if hosts is None else hosts)
        }

    def ended(self) -> bool:
        """Whether every agent of the mesh is gone (no desk takes connections)."""
        return not any(desk_listens(h.desk) for h in self.file.hosts)


def _held_here(name: str) -> bool:
    """Whether this kernel holds a live mesh named ``name`` (then not a detached one)."""
    live = registry.get(name)
    return live is not None and not live.state.ended


def find_detached(name: str) -> AttachFile | None:
    """The attach file of detached mesh ``name`` if the mesh runs (some agent's desk
    takes connections, however busy that agent is) and this kernel does not hold it;
    None if there is none. The file of a mesh that has ended is removed."""
    if _held_here(name):
        return None
    try:
        file = attach_file.read(attach_file.file_for(name))
    except (AttachFileError, ValueError):
        return None
    if DeskClient(file).ended():
        file.remove()
        return None
    return file


def read_file(name: str | None, path: str | None = None) -> AttachFile:
    """The attach file of detached mesh ``name`` (or at ``path``, a copy from another
    machine: then of mesh ``name`` if given); AttachError if none."""
    where = path or attach_file.file_for(name or "")
    try:
        file = attach_file.read(where)
    except AttachFileError as exc:
        if path is None and not os.path.exists(where):
            raise AttachError(
                f"no detached mesh named {name!r} on this machine for this user "
                f"(no {where}); %mesh lists the meshes you can attach"
            ) from None
        raise AttachError(str(exc)) from None
    if name is not None and file.name != name:
        raise AttachError(
            f"{where} is the attach file of mesh {file.name!r}, not {name!r}: attach it as "
            f"%mesh attach {file.name} --from {where}"
        )
    return file


def attach(name: str | None, *, path: str | None = None, force: bool = False) -> Attached:
    """Take over detached mesh ``name`` (or the one whose attach file is ``path``):
    the running mesh, now held by this controller (call :meth:`Attached.finish` once
    the jobs it returns are followed). AttachError saying why not."""
    file = read_file(name, path)
    if _held_here(file.name):
        raise AttachError(f"mesh {file.name!r} is already attached to this kernel")
    client = DeskClient(file)
    replies = client.ask_all(DeskOp.ATTACH, force=force)
    accepted = {h: r for h, r in replies.items() if r is not None and r.ok}
    if len(accepted) < len(replies):
        if accepted:
            _release(client, accepted)
        raise _refusal(client, replies, own=path is None)
    holders = [r.holder for r in accepted.values() if r.holder is not None]
    try:
        adopted = adopt(file, accepted)
    except MeshStartError as exc:  # its addresses cannot be bound, or no rank came back
        _release(client, accepted)
        raise AttachError(f"cannot attach mesh {file.name!r}: {exc}") from None
    except BaseException:
        _release(client, accepted)
        raise
    since = [r.detached_since for r in accepted.values() if r.detached_since is not None]
    refused: dict[str, int] = {}
    for r in accepted.values():
        for why, n in r.refused.items():
            refused[why] = refused.get(why, 0) + n
    return Attached(
        adopted,
        file,
        time.time() - min(since) if since and not holders else None,
        holders[0] if holders else None,
        refused,
    )


def _release(client: DeskClient, accepted: dict[int, DeskReply]) -> None:
    """Undo an attach the agents in ``accepted`` took."""
    me = ControllerId.of_this_process()
    for host in client.file.hosts:
        if host.index in accepted:
            client.ask(host, DeskRequest(DeskOp.RELEASE, me), DESK_TIMEOUT)


def _refusal(
    client: DeskClient, replies: dict[int, DeskReply | None], own: bool = True
) -> AttachError:
    """Why the agents did not all accept (``own``: the file is the one in this
    machine's runtime directory, which goes once no agent runs; a copy given with
    ``--from`` is left alone, as it may be a stale or forged one)."""
    file = client.file
    name = file.name
    for r in replies.values():
        if r is not None and not r.ok:
            return AttachError(f"cannot attach mesh {name!r}: {r.error}")
    silent = [h for h, r in replies.items() if r is None]
    hosts = {h.index: h for h in file.hosts}
    running = [h for h in silent if desk_listens(hosts[h].desk)]
    if running:  # there, but too busy (or stopped) to answer in time: nothing is lost
        return AttachError(
            f"cannot attach mesh {name!r}: host agent(s) {running} run but did not answer "
            f"within {DESK_TIMEOUT:.0f}s (the machine is overloaded, or the agent is "
            f"stopped); try %mesh attach {name} again"
        )
    if len(silent) == len(replies):
        if own:
            file.remove()
        return AttachError(
            f"mesh {name!r} has ended, or its host agents cannot be reached from here: none "
            f"answers (it was stopped, no kernel attached within its --keep, or the file's "
            f"keys are not the mesh's)" + ("; its attach file was removed" if own else "")
        )
    return AttachError(
        f"cannot attach mesh {name!r}: host agent(s) {silent} are gone; "
        f"stop the mesh with %mesh stop {name}"
    )


def stop_detached(
    name: str | None, *, path: str | None = None, force: bool = False, grace: float = 3.0
) -> str:
    """Stop detached mesh ``name`` (or the one whose attach file is ``path``) without
    attaching to it; what was done, in words. AttachError if it cannot."""
    file = read_file(name, path)
    name = file.name
    client = DeskClient(file)
    replies = client.ask_all(DeskOp.STOP, force=force, grace=grace)
    busy = [h for h in file.hosts if replies[h.index] is None and desk_listens(h.desk)]
    if busy:  # they run but were too busy to answer: once more
        replies.update(client.ask_all(DeskOp.STOP, force=force, grace=grace, hosts=busy))
    refused = [r for r in replies.values() if r is not None and not r.ok]
    if refused:
        raise AttachError(f"cannot stop mesh {name!r}: {refused[0].error}")
    deadline = time.monotonic() + grace + 10.0
    pids = [h.pid for h in file.hosts if replies.get(h.index) is not None]
    while time.monotonic() < deadline and any(desk_listens(h.desk) for h in file.hosts):
        time.sleep(0.05)
    left = [h.pid for h in file.hosts if desk_listens(h.desk)]
    if not left:  # the engine's reservation (its own keeper releases it too)
        for record in {json.dumps(h.reservation, sort_keys=True) for h in file.hosts}:
            reservations.release(json.loads(record))
    file.remove()
    if file.ipc_dir and os.path.basename(file.ipc_dir).startswith("mk-mesh-") and not left:
        import shutil

        shutil.rmtree(file.ipc_dir, ignore_errors=True)
    if left:
        raise AttachError(f"mesh {name!r}: host agent(s) {left} did not exit in time")
    return f"mesh {name!r} stopped ({len(pids)} host agent(s) answered)"


@dataclass(frozen=True)
class DetachedMesh:
    """One row of ``%mesh``'s list of detached meshes."""

    name: str
    shape: str
    hosts: int
    alive: int
    world: int
    age: float  #: seconds since the mesh started
    detached_for: float | None  #: seconds without a controller (None: one holds it)
    keep_left: float | None  #: seconds before it stops by itself
    holder: ControllerId | None
    running: tuple[str, ...]
    #: The backend, and what its engine reserves (``ray pg mk-x``, ``slurm job 12``).
    backend: str = ""
    #: False: its agents run but none answered in time (a loaded machine, or an agent
    #: stopped with SIGSTOP): what is above comes from its attach file alone.
    answered: bool = True


def list_detached() -> list[DetachedMesh]:
    """The detachable meshes of this user on this machine that this kernel does not
    hold, as their agents report them; files of meshes that ended are removed."""
    rows = []
    for path in attach_file.all_files():
        try:
            file = attach_file.read(path)
        except AttachFileError:
            continue
        if _held_here(file.name):
            continue
        client = DeskClient(file)
        replies = client.ask_all(DeskOp.STATUS, timeout=STATUS_TIMEOUT)
        answers = [r for r in replies.values() if r is not None and r.ok]
        if answers:
            rows.append(_row(file, answers))
        elif client.ended():
            file.remove()
        else:
            rows.append(replace(_row(file, []), answered=False))
    return rows


def _row(file: AttachFile, answers: list[DeskReply]) -> DetachedMesh:
    now = time.time()
    since = [r.detached_since for r in answers if r.detached_since is not None]
    until = [r.keep_until for r in answers if r.keep_until is not None]
    holders = [r.holder for r in answers if r.holder is not None]
    world = len(file.ranks)
    alive = sum(1 for r in answers for s in r.ranks if s.alive)
    dims = ({"hosts": file.n_hosts} if file.n_hosts > 1 else {}) | file.per_host
    return DetachedMesh(
        name=file.name,
        shape=" × ".join(f"{k}={v}" for k, v in dims.items()),
        hosts=file.n_hosts,
        alive=alive,
        world=world,
        age=now - file.created,
        detached_for=now - min(since) if since and not holders else None,
        keep_left=min(until) - now if until and not holders else None,
        holder=holders[0] if holders else None,
        running=tuple(file.running),
        backend=_reserved(file),
    )


def _reserved(file: AttachFile) -> str:
    """The backend, or what its engine reserved (``ray pg mk-x``, ``slurm job 12``)."""
    held = [d for d in dict.fromkeys(reservations.describe(h.reservation) for h in file.hosts) if d]
    if len(held) > 3:  # one per host (Ray's groups): the first, the last and how many
        return f"{held[0]} … {held[-1]} ({len(held)} reservations)"
    return ", ".join(held) or file.backend
