"""The ``mkgloo`` torch.distributed backend: forming and re-forming :class:`ReformableGroup`.

:func:`register` makes ``mkgloo`` a torch backend whose groups are re-formable
(``init_process_group`` picks it for CPU/gloo through :func:`choose_backend`; the
rank's wrapped ``init_process_group`` in :mod:`.distributed` asks). Every group, the
default one and each ``new_group``, gets its own worker, which joins a rendezvous on the
TCPStore torch's rendezvous made, under a prefix of its own.

:func:`reform` forms every group of this rank again at a fresh rendezvous (a TCPStore
that rank 0 serves at ``master_addr:master_port``), all at once: each group's new worker
is asked to join first, then all are waited for, so groups never wait for each other.
A spare worker is kept forked, so a re-form costs the rendezvous, not a process start.

Around a restarted rank (a training recovery) the ``new_group`` groups (a
``device_mesh()``'s subgroups) are formed in a second step: :func:`reform` with
``defer`` forms the default group only and leaves the others unformed; the restarted
rank's set-up cells make its subgroups again, unformed too (:func:`defer_forming`);
then :func:`reform_subgroups` forms every subgroup of every rank at once, matched by
their members (not by torch's group names, which count groups made in the process).

``mknccl`` is the same for NCCL: its worker holds an NCCL group for CUDA tensors (which
cross by CUDA IPC, in place) and a gloo group for CPU ones; ``init_process_group("nccl")``
(or no backend, or ``cpu:gloo,cuda:nccl``, on a machine with CUDA) picks it.
:data:`REFORMABLE` maps a device to the backend that makes it re-formable.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from monarch_kernel.rank.pg.nccl_env import worker_env
from monarch_kernel.rank.pg.protocol import ConfigFailed, Configure, Ready
from monarch_kernel.rank.pg.reformable import BACKEND, NCCL_BACKEND, ReformableGroup
from monarch_kernel.rank.pg.spawn import Spawner, WorkerHandle

#: Device type -> the re-formable backend for it.
REFORMABLE = {"cpu": BACKEND, "cuda": NCCL_BACKEND}
#: What ``init_process_group`` is asked for -> the re-formable backend that does it.
_CHOICES = {
    "gloo": BACKEND,
    "cpu:gloo": BACKEND,
    "nccl": NCCL_BACKEND,
    "cuda:nccl": NCCL_BACKEND,
    "cpu:gloo,cuda:nccl": NCCL_BACKEND,
    "cuda:nccl,cpu:gloo": NCCL_BACKEND,
}
#: Set to ``0`` in a rank's environment to get plain gloo or NCCL from ``init_process_group``.
OPT_OUT = "MONARCH_KERNEL_REFORMABLE_PG"
#: Seconds a rendezvous may take when the caller gives no timeout (torch's default).
DEFAULT_TIMEOUT = 1800.0

_spawner = Spawner()
_spare: WorkerHandle | None = None
_spare_lock = threading.Lock()
#: Every re-formable group of this rank, oldest first (weakly: a dropped group goes).
_groups: list[weakref.ref[ReformableGroup]] = []
#: Times a group name was formed here (the rendezvous prefix must never repeat).
_formed: dict[str, itertools.count[int]] = {}
#: The TCPStore of the last re-form (rank 0 serves it), kept alive while in use.
_store: Any = None
#: The TCPStore of the last :func:`reform_subgroups` (rank 0 serves it).
_sub_store: Any = None
#: While set (a restarted rank's set-up cells run again), ``new_group`` makes its group
#: unformed: the peers are parked, :func:`reform_subgroups` forms it with theirs after.
_deferring = False
#: Why an unformed group cannot run collectives yet.
DEFERRED = "made while the mesh recovers a rank; it is formed when the set-up cells end"
#: Seconds :func:`reform_subgroups` waits for the members of each subgroup.
SUBGROUP_WAIT = 60.0


@dataclass(frozen=True)
class _Plan:
    """One group to form: join ``host:port`` under ``prefix`` as ``rank`` of ``size``."""

    group: ReformableGroup
    host: str
    port: int
    prefix: str
    rank: int
    size: int


@dataclass(frozen=True)
class ReformResult:
    """What :func:`reform` did on this rank."""

    groups: int  #: groups formed again (the default one and new_group ones)
    stale: int  #: new_group groups that could not be (the world changed)
    seconds: float
    deferred: int = 0  #: new_group groups left for :func:`reform_subgroups`


def enabled() -> bool:
    """Whether ``init_process_group`` should make re-formable groups here."""
    return os.environ.get(OPT_OUT, "1") not in ("0", "false", "no")


def choose_backend(requested: Any) -> Any:
    """The backend ``init_process_group`` should use for ``requested``: ``mkgloo`` for
    gloo, ``mknccl`` for NCCL (with gloo beside it for CPU tensors) when CUDA is
    there; no backend named means torch's default for the machine (``mknccl`` with
    CUDA, ``mkgloo`` without). Anything else is left as asked."""
    if not enabled():
        return requested
    name = None if requested is None else str(requested).lower().replace(" ", "")
    if name in (None, "undefined"):
        return NCCL_BACKEND if _has_cuda() else BACKEND
    chosen = _CHOICES.get(name)
    if chosen == NCCL_BACKEND and not _has_cuda():
        return requested  # torch's own error ("NCCL ... not available") says it best
    return chosen or requested


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def register() -> None:
    """Make ``mkgloo`` a torch.distributed backend (idempotent)."""
    import torch.distributed as dist

    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    dist.Backend.register_backend(
        NCCL_BACKEND,
        functools.partial(_create, kind="nccl"),
        extended_api=True,
        devices=["cpu", "cuda"],
    )


def groups() -> list[ReformableGroup]:
    """This rank's re-formable groups (not destroyed), oldest first."""
    alive = [g for g in (r() for r in _groups) if g is not None and not g.destroyed]
    _groups[:] = [weakref.ref(g) for g in alive]
    return alive


def _create(opts: Any, _backend_options: Any, kind: str = "gloo") -> Any:
    """The backends' creator (torch calls it inside init_process_group / new_group)."""
    import torch.distributed as dist

    timeout_s = opts.timeout.total_seconds() if opts.timeout else DEFAULT_TIMEOUT
    address = _tcp_address(opts.store)
    if address is None:  # a FileStore or HashStore rendezvous: no worker can join it
        import warnings

        plain = "NCCL" if kind == "nccl" else "gloo"
        warnings.warn(
            f"the rendezvous store is not a TCPStore: this process group is plain {plain}, "
            "which the mesh cannot re-form after a failure",
            stacklevel=2,
        )
        if kind == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = opts.timeout
            return dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, options)
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    group_id = str(opts.group_id)
    group = ReformableGroup(opts.group_rank, opts.group_size, group_id, timeout_s, kind)
    ranks = list(opts.global_ranks_in_group or [])
    world = dist.get_world_size() if dist.is_initialized() else opts.group_size
    if ranks and len(ranks) != world:
        group.global_ranks = tuple(ranks)
    if _deferring and dist.is_initialized():
        # A restarted rank's set-up: its peers are parked and join no rendezvous now.
        group.mark_stale(DEFERRED)
        _groups.append(weakref.ref(group))
        return group
    host, port = address
    # torch's store is reused after destroy_process_group + init: never repeat a prefix
    counter = _formed.setdefault(group.group_id, itertools.count())
    prefix = f"mk/{group.group_id}/{next(counter)}/"
    plan = _Plan(group, host, port, prefix, opts.group_rank, opts.group_size)
    handle = _form([plan], timeout_s)[0]
    group.attach(handle, opts.group_rank, opts.group_size)
    _groups.append(weakref.ref(group))
    keep_spare()
    return group


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the TCPStore under ``store``'s prefixes, if it is one."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


def defer_forming(on: bool) -> None:
    """While ``on``, ``new_group`` makes its re-formable group unformed (see the module);
    :func:`reform_subgroups` forms it."""
    global _deferring
    _deferring = on


def _subgroup_prefixes(subgroups: list[ReformableGroup]) -> list[str]:
    """The rendezvous prefix of each subgroup for :func:`reform_subgroups`: its members
    (global ranks) and its place among this rank's groups of the same members, the same
    on every member however many groups each process made before."""
    seen: dict[tuple[int, ...] | None, int] = {}
    out = []
    for group in subgroups:
        n = seen.get(group.global_ranks, 0)
        seen[group.global_ranks] = n + 1
        members = "all" if group.global_ranks is None else "-".join(map(str, group.global_ranks))
        out.append(f"mk/sub/{members}/{n}/")
    return out


def _check_members_have(
    store: Any, rank: int, subgroups: list[ReformableGroup], prefixes: list[str], timeout: float
) -> None:
    """Every rank says which subgroups it has; raise at once (naming the subgroup and
    the rank) when a member of one of this rank's subgroups does not have it, instead
    of waiting for a rendezvous it will never join."""
    import json

    store.set(f"mk/sub-keys/{rank}", json.dumps(prefixes))
    world = None
    for group, prefix in zip(subgroups, prefixes):
        members = group.global_ranks
        if members is None:
            world = world or range(int(os.environ.get("WORLD_SIZE", "1")))
            members = tuple(world)
        for member in members:
            if member == rank:
                continue
            key = f"mk/sub-keys/{member}"
            store.wait([key], timedelta(seconds=timeout))
            if prefix not in json.loads(store.get(key)):
                raise RuntimeError(
                    f"rank {member} has no subgroup of ranks {list(members)} like this rank's "
                    "(made by new_group or a device_mesh() view outside the --setup cells, "
                    "which a restarted rank runs again): make every device mesh and "
                    "new_group in a --setup cell"
                )


def take_worker() -> WorkerHandle:
    """The spare worker if it is still alive, else a new one."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and spare.alive():
        return spare
    if spare is not None:
        spare.kill()
    return _spawner.spawn()


def keep_spare() -> None:
    """Fork the next spare worker now, unless one is waiting."""
    global _spare
    with _spare_lock:
        if _spare is not None and _spare.alive():
            return
    handle = _spawner.spawn()
    with _spare_lock:
        if _spare is None:
            _spare = handle
            return
    handle.kill()


def _form(plans: list[_Plan], timeout_s: float) -> list[WorkerHandle]:
    """Start one worker per plan joining its rendezvous, then wait for all
    (interruptibly); the workers, formed."""
    gpus = _gpu_count() if any(p.group.kind == "nccl" for p in plans) else 0
    env = worker_env(os.environ, gpus)
    handles: list[WorkerHandle] = []
    try:
        for p in plans:
            handle = take_worker()
            handles.append(handle)
            group = p.group
            handle.send(
                Configure(
                    p.host,
                    p.port,
                    p.prefix,
                    p.rank,
                    p.size,
                    group.timeout_s,
                    env,
                    group.kind,
                    group.device,
                )
            )
        deadline = time.monotonic() + timeout_s
        for p, handle in zip(plans, handles):
            group = p.group
            answer = handle.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(answer, ConfigFailed):
                raise RuntimeError(f"forming process group {group.group_id!r}: {answer.error}")
            if not isinstance(answer, Ready):
                raise RuntimeError(
                    f"forming process group {group.group_id!r}: its worker process died"
                )
    except BaseException:
        for handle in handles:
            handle.kill()
        raise
    return handles


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def reform(
    default: ReformableGroup,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    subgroups: bool = True,
    defer: bool = False,
) -> ReformResult:
    """Form every re-formable group of this rank again at the rendezvous
    ``master_addr:master_port`` (rank 0 serves it), as ``rank`` of ``world_size``.

    Every rank of the mesh must call it (with the same address), or, on a rank that has
    no group (restarted), ``init_process_group`` at that address: both join under the
    same prefix. The default group becomes ``rank`` of ``world_size``; a ``new_group``
    group keeps its ranks if ``subgroups`` and the world size is unchanged, else it is
    marked stale (its ops raise, saying to make it again). Pending ops on the old
    workers fail with ``ProcessGroupAborted``.
    """

    global _store
    t0 = time.monotonic()
    timeout = default.timeout_s
    store = _rendezvous_store(master_addr, int(master_port), rank, world_size, timeout)
    keep = subgroups and world_size == default.size()
    port = int(master_port)
    # A fresh store each time: the prefix is the one a restarted rank's first
    # init_process_group uses on it (see _create).
    plans = [_Plan(default, master_addr, port, f"mk/{default.group_id}/0/", rank, world_size)]
    stale = deferred = 0
    for group in groups():
        if group is default:
            continue
        if not keep:
            group.mark_stale(
                "made by new_group before the mesh re-formed with other ranks; call new_group again"
            )
            stale += 1
        elif defer:
            group.mark_stale(DEFERRED)
            deferred += 1
        else:
            prefix = f"mk/{group.group_id}/0/"
            plans.append(_Plan(group, master_addr, port, prefix, group.rank(), group.size()))
    handles = _form(plans, timeout)
    for plan, handle in zip(plans, handles):
        plan.group.attach(handle, plan.rank, plan.size)
    _store = store
    _update_world(default, store, world_size)
    keep_spare()
    return ReformResult(len(plans), stale, time.monotonic() - t0, deferred)


def form_group(group: ReformableGroup, prefix: str) -> None:
    """Form ``group`` alone again, in place, with its members only: each of them calls
    this with the same ``prefix``, new on the default group's rendezvous store (the
    TCPStore that rank 0 serves). The other groups of the rank are left as they are.
    The tensor engine's way back after its stop aborted one group
    (``rank.tensors.collectives``); a mesh-wide re-form is :func:`reform`."""
    import torch.distributed.distributed_c10d as c10d

    address = _tcp_address(c10d._get_default_store())
    if address is None:
        raise RuntimeError(
            f"process group {group.group_id!r} cannot be formed again: the default "
            "group's rendezvous store is not a TCPStore"
        )
    host, port = address
    plan = _Plan(group, host, port, prefix, group.rank(), group.size())
    handle = _form([plan], group.timeout_s)[0]
    group.attach(handle, plan.rank, plan.size)
    keep_spare()


def reform_subgroups(
    master_addr: str, master_port: int, rank: int, world_size: int, timeout: float = SUBGROUP_WAIT
) -> ReformResult:
    """Form every ``new_group`` group of this rank at the rendezvous
    ``master_addr:master_port`` (rank 0 serves it; every rank of the mesh calls this),
    each with the members that have the same one (see :func:`_subgroup_prefixes`).
    A subgroup some member did not make again (its set-up cells do not make it) fails
    after ``timeout`` seconds, naming its ranks."""
    import torch.distributed as dist

    global _sub_store
    t0 = time.monotonic()
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    subgroups = [g for g in groups() if g is not default]
    store = _rendezvous_store(master_addr, int(master_port), rank, world_size, timeout)
    prefixes = _subgroup_prefixes(subgroups)
    _check_members_have(store, rank, subgroups, prefixes, timeout)
    plans = [
        _Plan(g, master_addr, int(master_port), prefix, g.rank(), g.size())
        for g, prefix in zip(subgroups, prefixes)
    ]
    try:
        handles = _form(plans, timeout)
    except (RuntimeError, TimeoutError) as exc:
        members = ", ".join(
            "all ranks" if g.global_ranks is None else f"ranks {list(g.global_ranks)}"
            for g in subgroups
        )
        raise RuntimeError(
            f"the process group's subgroups ({members}) could not be formed again with "
            f"the restarted rank: {exc}. A restarted rank makes them again only when its "
            "--setup cells make them: build the device mesh (device_mesh(), new_group) in "
            "a --setup cell"
        ) from None
    for plan, handle in zip(plans, handles):
        plan.group.attach(handle, plan.rank, plan.size)
    _sub_store = store
    return ReformResult(len(plans), 0, time.monotonic() - t0)


def _rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: float) -> Any:
    """The TCPStore of a re-form's rendezvous at ``host:port``: rank 0 serves it, the
    others join it once it listens."""
    import torch.distributed as dist

    if rank != 0:  # a store client that finds no server yet backs off for up to a second
        _wait_listening(host, port, timeout)
    return dist.TCPStore(
        host,
        port,
        world_size if rank == 0 else None,
        rank == 0,
        timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def _wait_listening(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts connections (rank 0 is serving the store), or
    after ``timeout`` (the store's own connect then says what is wrong); interruptible."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.005)


def _update_world(default: ReformableGroup, store: Any, world_size: int) -> None:
    """torch's bookkeeping for the default group: its rank map and store (``new_group``
    rendezvous on it) follow the re-formed group."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    if default in world.pg_map:
        backend = world.pg_map[default][0]
        world.pg_map[default] = (backend, dist.PrefixStore(f"{default.group_id}/", store))
    if default in world.pg_group_ranks:
        world.pg_group_ranks[default] = {i: i for i in range(world_size)}


ReformableGroup.reformer = reform
