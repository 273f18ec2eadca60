"""torch.distributed in a notebook: re-running the init cell must be harmless.

Installed in the warm template before any rank is forked, so user code that does
``dist.init_process_group()`` (with or without arguments) a second time keeps the
existing process group instead of failing.

For gloo (and, with CUDA, NCCL) the wrapped ``init_process_group`` makes a re-formable
group (:mod:`.reformable`, backends ``mkgloo`` and ``mknccl``): the mesh can abort it
without killing the rank and form it again in place, under the user's DDP objects. Set
``MONARCH_KERNEL_REFORMABLE_PG=0`` in a rank (``%mesh ... --env``) for plain gloo/NCCL.

Also what the rank and the controller need to take a process group down and form it
again after a failure: :func:`abort_process_group` (the ``abort_pg`` control message),
:func:`release_collectives` (a ``cancel``), :func:`reform_process_group` (run on every
rank as cell code), and :func:`state` (in the ``ping`` reply). None of them imports
torch: without torch they do nothing.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any

#: Held while the default group is aborted, destroyed or formed again (an abort comes
#: on a thread of its own, a re-form on the main thread).
_lock = threading.RLock()

#: Backend of the last process group this rank initialised (kept after an abort or a
#: destroy, so that a re-form uses the same one); None if it never had one.
last_backend: str | None = None


def _reformable() -> list[Any]:
    """This rank's re-formable groups (none unless one was made: no import of torch)."""
    backend = sys.modules.get("monarch_kernel.rank.pg.backend")
    return [] if backend is None else list(backend.groups())


def _default_reformable() -> Any:
    """The default group if it is re-formable, else None."""
    dist = _dist()
    if dist is None or not dist.is_initialized() or not _reformable():
        return None
    from monarch_kernel.rank.pg.reformable import ReformableGroup

    default = dist.distributed_c10d._get_default_group()
    return default if isinstance(default, ReformableGroup) else None


def _dist() -> Any:
    """``torch.distributed`` if it is imported and usable here, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    return dist


def is_initialized() -> bool:
    """Whether this rank has a live default process group (without importing torch)."""
    dist = _dist()
    return dist is not None and dist.is_initialized()


def state() -> tuple[str | None, bool]:
    """``(backend of the last process group or None, whether a group is live now)``."""
    global last_backend
    dist = _dist()
    live = dist is not None and dist.is_initialized()
    # A re-formable group is live only if usable: not aborted, and no collective left
    # pending now that the rank is idle (its peers gave up on it).
    if live and any(g.aborted or g.pending() for g in _reformable()):
        live = False
    if live and last_backend is None:  # initialised around our wrapper
        try:
            last_backend = _backend_name(dist)
        except Exception:
            pass
    return last_backend, live


def destroy_process_group() -> None:
    """Destroy the default process group if there is one."""
    dist = _dist()
    with _lock:
        if dist is not None and dist.is_initialized():
            state()  # remember its backend
            dist.destroy_process_group()


def abort_process_group(reason: str = "") -> bool:
    """Abort the default process group (and every other group) if there is one.

    Aborting closes this rank's connections, so peers blocked in a collective with it
    are released with an error. Re-formable groups stay the groups (their pending ops
    fail with ``ProcessGroupAborted`` naming ``reason``; :func:`reform_process_group`
    forms them again); other groups are destroyed, so a re-form can initialise again.
    Returns whether there was a group to abort.
    """
    groups = _reformable()
    if groups:
        for group in groups:
            group.abort(reason)
        return True
    dist = _dist()
    with _lock:
        if dist is None or not dist.is_initialized():
            return False
        state()  # remember its backend
        import torch.distributed.distributed_c10d as c10d

        abort = getattr(c10d, "_abort_process_group", None)
        try:
            if abort is not None:
                abort()
        finally:
            if dist.is_initialized():  # no abort here, or it left the default group
                dist.destroy_process_group()
        return True


def release_collectives(reason: str) -> int:
    """Abort the re-formable groups that have collectives in flight (a ``cancel``: a main
    thread waiting in C++ for one, as in DDP's backward, cannot take an interrupt, and
    its peers are being interrupted too). Returns how many were aborted."""
    busy = [g for g in _reformable() if g.pending() and not g.aborted]
    for group in busy:
        group.abort(reason)
    return len(busy)


def reform_process_group(
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    subgroups: bool = True,
    defer: bool = False,
) -> str:
    """Form this rank's default process group again, at a fresh rendezvous address.

    Run on every rank of the mesh (the controller sends it as cell code). A re-formable
    default group is formed again in place (the same object; with ``subgroups`` its
    ``new_group`` groups too, else they are marked stale: a restarted rank has none to
    join; with ``defer`` they are left for :func:`reform_subgroups`) and the DDP objects
    on it are repaired. Otherwise the current default group is
    destroyed if any and a new one initialised with ``backend`` (default: the backend of
    the last group, else torch's default for the devices; gloo on CPU gives a
    re-formable group that joins the same rendezvous), this rank's ``RANK`` and
    ``WORLD_SIZE`` and the rendezvous ``master_addr:master_port``, with torch's default
    timeout (it also bounds every collective, so no shorter one here: the controller
    gives up on a rendezvous that does not complete by itself). Returns the backend.

    Long on purpose: its two ways (the re-formable group formed again in place; any other destroyed
    and made anew) share the rendezvous set-up and the lock, and read best side by side.
    """
    import torch.distributed as dist

    global last_backend
    os.environ["MASTER_ADDR"] = str(master_addr)
    os.environ["MASTER_PORT"] = str(int(master_port))
    if not is_initialized():  # a restarted rank: join the rendezvous as the others do
        from monarch_kernel.rank.pg.alone import form_alone

        form_alone(backend or last_backend)
    default = _default_reformable()
    if default is not None:
        from monarch_kernel.rank.pg import backend as pg_backend
        from monarch_kernel.rank.replicas import replicas

        with _lock:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            pg_backend.reform(default, master_addr, int(master_port), rank, world, subgroups, defer)
            replicas.reset_ddp(pg_backend.groups())
        last_backend = default.kind  # "gloo" or "nccl", as _backend_name says
        return last_backend
    with _lock:
        try:
            destroy_process_group()
        except Exception:  # a broken group is what we replace
            if dist.is_initialized():
                try:
                    import torch.distributed.distributed_c10d as c10d

                    c10d._abort_process_group()
                except Exception:
                    pass
        chosen = backend or last_backend
        if chosen in (None, "undefined"):
            chosen = None  # torch's default for the devices it has (gloo / nccl)
        if "monarch_kernel.rank.pg.backend" in sys.modules:  # installed: gloo re-formable
            from monarch_kernel.rank.pg import backend as pg_backend

            chosen = pg_backend.choose_backend(chosen)
        init = getattr(dist.init_process_group, "__wrapped__", dist.init_process_group)
        init(
            chosen,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        last_backend = _backend_name(dist)
    return last_backend or "default"


def deferred_subgroups() -> int:
    """How many of this rank's re-formable subgroups wait for :func:`reform_subgroups`."""
    backend = sys.modules.get("monarch_kernel.rank.pg.backend")
    if backend is None:
        return 0
    return sum(1 for g in backend.groups() if g.aborted == backend.DEFERRED)


def reform_subgroups(master_addr: str, master_port: int) -> int:
    """Form this rank's subgroups (``new_group``, ``device_mesh()``) again at the
    rendezvous ``master_addr:master_port``, after a re-form that deferred them: every
    rank of the mesh runs it. Returns how many were formed."""
    if _default_reformable() is None:
        return 0
    from monarch_kernel.rank.pg import backend as pg_backend
    from monarch_kernel.rank.replicas import replicas

    with _lock:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        result = pg_backend.reform_subgroups(master_addr, int(master_port), rank, world)
        replicas.reset_ddp(pg_backend.groups())
    return result.groups


def _backend_name(dist: Any) -> str:
    """``gloo``, ``nccl`` or ``cpu:gloo,cuda:nccl`` for the default process group."""
    name = str(dist.get_backend())
    if name == "mkgloo":  # the re-formable group: gloo, to people and to a re-form
        return "gloo"
    if name == "mknccl":  # the re-formable NCCL group (gloo beside it for CPU tensors)
        return "nccl"
    if name == "undefined":  # initialised without a backend: one per device type
        try:
            name = str(dist.get_backend_config())
        except Exception:
            pass
    return name


def install_idempotent_init() -> None:
    """Make ``torch.distributed.init_process_group`` a no-op when already initialised,
    and make it choose the re-formable group for gloo on CPU; count optimizer steps."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    from monarch_kernel.rank.pg import backend as pg_backend
    from monarch_kernel.rank.replicas import replicas

    pg_backend.register()
    replicas.install_step_counter()
    original = dist.init_process_group
    if getattr(original, "__monarch_idempotent__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        global last_backend
        if dist.is_initialized():
            return None  # the notebook twist: re-running the init cell keeps the group
        if args:
            args = (pg_backend.choose_backend(args[0]), *args[1:])
        else:
            kwargs["backend"] = pg_backend.choose_backend(kwargs.get("backend"))
        result = original(*args, **kwargs)
        try:
            last_backend = _backend_name(dist)
        except Exception:
            pass
        return result

    init_process_group.__monarch_idempotent__ = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group
    # `from torch.distributed import init_process_group` binds through the package too
    import torch.distributed.distributed_c10d as c10d

    c10d.init_process_group = init_process_group
