"""Our temporary directories know who owns them, so that none outlives its owners.

A controller's sockets (``mk-mesh-*``), a local launcher's agents (``mk-launch-*``), a
host agent started by Ray, Slurm or a join command (``mk-host-*``), a detachable
mesh's agent (``mk-detached-*``), a rank without a host agent's directory (``mk-dp-*``)
and the kernel's reply socket for calls to ranks (``mk-peer-*``) each live in a private
directory under the temporary directory (or ``/tmp``, see :func:`make_private_dir`).
Their owners remove them on the way out; a process killed outright cannot, so each
directory carries a small file naming its owner processes (pid and start time, so
that a recycled pid is not taken for an owner). :func:`sweep` (run by
the next kernel, and by the next such host agent) removes the directories of this
user whose owners are all gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable

#: The file, in each directory, that names its owners: ``[[pid, start time], ...]``.
OWNERS = ".mk-owners"
#: The private directory of a host agent that no local launcher made for it.
HOST_PREFIX = "mk-host-"
#: A rank's own directory for its data-plane socket, where it has no host agent's
#: (``monarch_kernel.rank.dataplane.common.own_dir``).
DATAPLANE_PREFIX = "mk-dp-"
#: The reply socket's directory of a process that is not a rank (the notebook's
#: kernel calling ranks directly: ``monarch_kernel.actor.peer.reply``).
PEER_PREFIX = "mk-peer-"
#: The directories :func:`sweep` looks at (by name prefix).
SWEPT = ("mk-launch-", "mk-mesh-", "mk-detached-", HOST_PREFIX, DATAPLANE_PREFIX, PEER_PREFIX)
#: A unix socket's path is at most this long (``sockaddr_un.sun_path`` less its NUL).
SOCKET_PATH_MAX = 107
#: Where a private directory goes when the temporary directory's path leaves too little
#: of :data:`SOCKET_PATH_MAX` for the sockets in it (a long ``$TMPDIR``).
SHORT_ROOT = "/tmp"
#: What a private directory leaves for the names of the sockets in it: the longest is a
#: rank's data socket ``/dp<rank>-<pid>`` (16 bytes at 99,999 ranks and 7-digit pids;
#: ``/c<rank>-<pid>``, ``/fanin``, ``/desk`` and ``/pr<slot>`` are shorter).
SOCKET_NAME_ROOM = 20
#: What a local launcher's directory leaves: an agent's ``/h-XXXXXXXX`` and its sockets.
LAUNCH_DIR_ROOM = len("/h-XXXXXXXX") + SOCKET_NAME_ROOM


def make_private_dir(prefix: str, room: int) -> str:
    """A fresh 0700 directory ``<prefix>XXXXXXXX`` in the temporary directory, or in
    :data:`SHORT_ROOT` where a path there would leave fewer than ``room`` bytes for the
    socket names (and directories) that go in it: a unix socket's path is short, and
    binding one with a longer path fails (the agent exited with zmq's "ipc path is
    longer than 107 characters"). Both are swept (:func:`sweep`)."""
    root = tempfile.gettempdir()
    if len(os.path.join(root, prefix + "x" * 8)) + room > SOCKET_PATH_MAX and os.path.isdir(
        SHORT_ROOT
    ):
        root = SHORT_ROOT
    return tempfile.mkdtemp(prefix=prefix, dir=root)


def _started(pid: int) -> float | None:
    try:
        import psutil

        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except Exception:  # psutil.Error: gone (or not ours to look at)
        return None


def mark_owners(path: str, pids: Iterable[int]) -> None:
    """Add ``pids`` (running processes) to the owners of directory ``path``."""
    owners = _read(path)
    known = {pid for pid, _ in owners}
    for pid in pids:
        started = _started(pid)
        if started is not None and pid not in known:
            owners.append((pid, started))
    tmp = os.path.join(path, OWNERS + ".tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(owners, f)
        os.replace(tmp, os.path.join(path, OWNERS))


def _read(path: str) -> list[tuple[int, float]]:
    try:
        with open(os.path.join(path, OWNERS)) as f:
            return [(int(pid), float(started)) for pid, started in json.load(f)]
    except (OSError, ValueError, TypeError):
        return []


def owned_by_nobody(path: str) -> bool:
    """Whether ``path`` names owners and none of them runs any more."""
    owners = _read(path)
    if not owners:
        return False  # not ours to judge (made by another version, or being made)
    for pid, started in owners:
        now = _started(pid)
        if now is not None and abs(now - started) < 1.0:
            return False
    return True


def sweep(root: str | None = None) -> list[str]:
    """Remove this user's directories under ``root`` (default: the temporary
    directory, and :data:`SHORT_ROOT`) whose owners are all gone; the removed paths."""
    if root is None:
        roots = dict.fromkeys((tempfile.gettempdir(), SHORT_ROOT))
        return [path for r in roots if os.path.isdir(r) for path in sweep(r)]
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(SWEPT):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != uid or not os.path.isdir(path):
                continue
        except OSError:
            continue
        if owned_by_nobody(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
