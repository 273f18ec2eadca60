"""``%debug_remote``: attach the notebook to ranks' paused debuggers, or open a
post-mortem pdb where their last cell or endpoint failed (the console itself is
:class:`~monarch_kernel.kernel.debug.console.DebugConsole`)."""

from __future__ import annotations

import queue
import time

from monarch_kernel.actor import ProcMesh
from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.controller.state.events import InputRequested, MeshEvent
from monarch_kernel.controller.state.records import RankState
from monarch_kernel.kernel.debug.console import DebugConsole
from monarch_kernel.kernel.remote import InputRouter, RemoteJob
from monarch_kernel.shape import Shape
from monarch_kernel.wire import kinds as K

#: How long ``%debug_remote`` waits for a busy rank to stop at a breakpoint.
PARK_WAIT = 2.0
#: How long ``%debug_remote`` stays attached after the last paused rank ran on.
ATTACH_GRACE = 0.5


def debug_remote(procs: ProcMesh, ranks: list[int], cell: str, clear: bool = False) -> None:
    """``%debug_remote``: attach to ``ranks``' paused debuggers (parked breakpoints of
    ``--bg`` cells and endpoints), else open a post-mortem pdb on the frame where each
    one's last cell or endpoint failed; ``clear`` only releases those frames."""
    rt = procs.runtime
    router = InputRouter.of(rt)
    deadline = time.monotonic() + PARK_WAIT
    while not clear:
        if _attach_parked(rt, router, set(ranks)):
            return
        # a rank at work may be about to stop at a breakpoint (a call just sent)
        if time.monotonic() > deadline or all(rt.ranks[r].state is not BUSY for r in ranks):
            break
        time.sleep(0.05)
    # The post-mortem pdb runs on the rank's main thread: only idle ranks can serve it
    # now (a busy one would make this cell wait for its work to end).
    busy = [r for r in ranks if rt.ranks[r].state is not RankState.IDLE]
    ranks = [r for r in ranks if rt.ranks[r].state is RankState.IDLE]
    if busy:
        print(f"(ranks {format_ranks(busy)} are not idle: skipped)")
    if not ranks:
        return
    spec: dict[str, object] = {"x": 1} if clear else {}
    shape = Shape(("ranks",), (len(ranks),))
    job = RemoteJob(procs, "", cell, None, ranks, shape, kind=K.DEBUG, spec=spec)
    job.start()
    values = job.wait()
    had = sorted(r for r, v in zip(job.ranks, values.values()) if v)
    name = procs.name
    if clear:
        if had:
            print(f"mesh {name!r}: released the failed frames kept on ranks {format_ranks(had)}")
        else:
            print(f"mesh {name!r}: no failed frame was kept on ranks {format_ranks(ranks)}")
    elif not had:
        print(
            f"mesh {name!r}: nothing to debug on ranks {format_ranks(ranks)}: no rank is paused "
            "at a breakpoint, and their last cell or endpoint did not fail (or its frame was "
            "debugged or released already)"
        )


BUSY = RankState.BUSY


def _attach_parked(rt: MeshRuntime, router: InputRouter, ranks: set[int]) -> bool:
    """Serve the parked debugger prompts of ``ranks`` until no session is open; False
    when there were none."""
    inbox: queue.Queue[MeshEvent | None] = queue.Queue()
    if not router.attach(inbox, ranks):
        router.detach()
        return False
    console = DebugConsole(rt, inbox, lambda rank: rt.ranks[rank].alive)
    router.consoles.add(console)
    idle_since: float | None = None
    try:
        while True:
            try:
                event = inbox.get(timeout=0.1)
            except queue.Empty:
                event = None
            if event is not None:
                console.feed(event)
            console.serve()
            if console.busy() or not inbox.empty():
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > ATTACH_GRACE:
                # (a rank that ran on may stop again at once: a breakpoint in a loop)
                return True
    finally:
        router.consoles.discard(console)
        router.detach()
        # prompts that came after the session ended wait for the next %debug_remote
        while not inbox.empty():
            event = inbox.get()
            if isinstance(event, InputRequested) and event.debug:
                router.parked[event.rank] = event
