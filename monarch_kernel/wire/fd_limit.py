"""Enough file descriptors for a big mesh: the soft ``RLIMIT_NOFILE`` raised as needed.

Every rank keeps a connection open to its controller's two sockets (and to its host
agent's two), so a controller of 1,000 ranks holds over 2,000 descriptors. Linux
distributions commonly start processes with a soft limit of 1,024 (the hard limit is
often far higher), and past it ZeroMQ fails in the middle of a start with "Too many open
files". Like Ray and torchrun's launchers, the controller and each host agent raise
their own soft limit up to the hard one when a mesh needs it; when even the hard limit
is too low, the mesh is refused before anything starts, with what to change.
"""

from __future__ import annotations

import resource

#: Descriptors a process needs per rank it talks to (two connections, with room for
#: a reconnect in flight), and for everything else it has open.
PER_RANK = 4
BASE = 256


def needed(ranks: int) -> int:
    """Descriptors a controller (or host agent) of ``ranks`` ranks needs at most."""
    return BASE + PER_RANK * max(0, ranks)


def ensure(ranks: int, who: str = "this controller") -> None:
    """Raise this process's soft descriptor limit so that it can talk to ``ranks``
    ranks; ValueError, saying what to change, if the hard limit does not allow it."""
    want = needed(ranks)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        raise ValueError(
            f"{who} may open at most {hard:,} files (the hard `ulimit -n`), and "
            f"{ranks:,} ranks need about {want:,}: raise the hard limit (e.g. `nofile` in "
            "/etc/security/limits.conf, or LimitNOFILE= for a service) or start fewer ranks"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
