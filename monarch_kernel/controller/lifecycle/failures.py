"""Failure policy: a failed rank never leaves the others hanging.

The hang this module exists for: one rank raises (or dies) while the other ranks of the
same request wait for it inside a collective, so their part of the request never ends
and neither does the cell. When a rank fails a request (an error reply) or dies while
other ranks still run that request, an :class:`Incident` is opened and, after a short
grace (the others may simply finish), the ranks still running it are released, each
step only if the previous one was not enough:

1. **abort the process group** on every live rank of the request: the re-formable
   group (gloo on CPU, ``rank/pg/reformable.py``) kills its worker and fails the pending
   collectives, so a rank blocked in one, even inside DDP's backward, is released in
   milliseconds and keeps its state; with plain gloo the idle failed rank closing its
   connections releases its peers; with NCCL, aborting is how a stuck communicator is
   freed (a rank whose answer is the abort's error is named released by it, however
   late the answer comes: ``calls.errors.released_by_abort``);
2. **interrupt** them (KeyboardInterrupt in the user code they run);
3. **kill** them: only a rank stuck in native code gets here, and the error names it.

Under the ``continue`` policy none of this happens: the request fails after the grace
and the others run on (inspect them with ``%mesh stacks``).

The request then fails with one error that names the root cause (the failure the
others waited for; a death wins over its peers' connection errors) and says what was
done to the others (:meth:`Incident.summary`, which the request's observer appends).
Finally the mesh's :class:`~monarch_kernel.controller.state.records.FailurePolicy` is applied:
``restart`` restarts
dead ranks and re-forms the mesh in the background (new requests wait for it), at most
``MAX_RESTARTS`` times per rank in ``RESTART_WINDOW``; ``stop`` stops the mesh. Deaths
outside any request get the same policy. A request a person interrupted is not a fault:
its release may re-form the mesh, never stop it. The controller's own requests (while it
re-forms a mesh) get no incident.

When no rank died, the mesh is put right *in place* before the request's error is
final, so the error says what was done: the process group is formed again if any rank
aborted it (or left a collective pending), and the data-parallel replicas are compared
and, if the ranks stopped at different points of a step, made the same again from the
most advanced rank (``Restarter.recover``). That also runs, under every policy but
``continue``, when a failed or interrupted cell (or an endpoint call on a mesh with a
process group) on several ranks released itself (nobody had to be aborted): ranks
interrupted between two collectives can still hold different parameters. (On a mesh
without a process group the check is one ping.)

Invariants: at most one incident per request; the release steps run on the incident's
own thread and change the request table only through ``Receiver.post`` (the receiving
thread owns it); recovery runs on one thread at a time and coalesces deaths that
arrive while it runs; nothing acts while the mesh starts or stops.

Size: over the ~450-line habit: one failure policy's decision and its three ways of
releasing the survivors (abort the process group, interrupt, kill) share the incident
they act on; split, each part would take the whole incident and the policy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from monarch_kernel.calls.errors import format_ranks, released_by_abort
from monarch_kernel.calls.reply import IncidentObserver
from monarch_kernel.controller.lifecycle.control_probe import ControlProbe, step_due
from monarch_kernel.controller.lifecycle.incident import Incident, ReleasedError
from monarch_kernel.controller.state.events import EventBus, RankDied, RequestFailed, RequestKind
from monarch_kernel.controller.state.phase import MeshLifecycle
from monarch_kernel.controller.state.records import (
    FailurePolicy,
    MeshPhase,
    RankInfo,
    RankState,
    RecoveryReport,
)
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Header
from monarch_kernel.wire.headers import AbortPg

log = logging.getLogger("monarch_kernel.controller")

#: How a rank released by step 1 is named in the request's error.
BY_ABORT = "released by aborting the process group"

#: Seconds the survivors of a failed request get to finish on their own.
DEFAULT_GRACE = 1.0
#: Seconds each release step (abort, interrupt) is given before the next one, counted
#: from when each rank's control thread had handled it (``control_probe``).
STEP_WAIT = 0.5
#: Seconds a release step waits for a rank's control thread to say it handled the step:
#: a loaded machine's ranks answer late but answer; one that holds the GIL in native
#: code never does, and is not waited for longer than this.
ACK_WAIT = 2.0
#: Seconds for killed ranks' deaths to be reported before the request gives up on them.
KILL_WAIT = 5.0
#: Seconds an in-place recovery (re-form the process group, compare and copy replicas)
#: may take before the request's error is given without saying how it ended.
IN_PLACE_WAIT = 60.0
#: Automatic restarts of one rank allowed within RESTART_WINDOW seconds; a rank that
#: keeps dying (a setup cell that kills it, a bad machine) is then left dead.
MAX_RESTARTS = 3
RESTART_WINDOW = 60.0


class PolicyActions(Protocol):
    """What the failure policy does to its mesh (``MeshRuntime`` provides it)."""

    def send_control(self, rank: int, header: Header, payload: bytes = b"") -> None: ...
    def probe(self, ranks: Sequence[int]) -> ControlProbe: ...
    def kill_ranks(self, ranks: Sequence[int]) -> None: ...
    def stop(self, timeout: float = ..., grace: float = ...) -> None: ...
    def recover(
        self,
        ranks: Sequence[int] | None = None,
        timeout: float = ...,
        reason: str = "",
        skip: frozenset[int] = frozenset(),
    ) -> RecoveryReport: ...
    def shrink_dead(self) -> bool: ...


class FailureHandler:
    """Applies one mesh's failure policy (see the module docstring)."""

    def __init__(
        self,
        name: str,
        policy: FailurePolicy,
        grace: float,
        *,
        actions: PolicyActions,
        ranks: list[RankInfo],
        requests: RequestTable,
        events: EventBus,
        lifecycle: MeshLifecycle,
        post: Callable[..., None],
        has_process_group: Callable[[], bool] = lambda: False,
    ):
        """``post``: ``Receiver.post`` (the request table changes on the thread holding
        the receive token); ``has_process_group()``: whether the ranks are known to have
        formed one."""
        self._name = name
        self._actions = actions
        self._ranks = ranks
        self._requests = requests
        self._lifecycle = lifecycle
        self._post = post
        self._has_process_group = has_process_group
        self.policy = policy
        self.grace = grace
        self._lock = threading.Lock()
        self._incidents: dict[str, Incident] = {}
        self._recovery_due = False
        self._recovering = False
        #: A request interrupted by a person was released: re-form, even under "stop".
        self._restart_not_stop = False
        #: rank -> times (monotonic) it was restarted automatically, within the window.
        self._restarts: dict[int, list[float]] = {}
        events.subscribe(self._on_event, RequestFailed, RankDied)

    def renumber(self, mapping: dict[int, int]) -> None:
        """The mesh's ranks were renumbered (old -> new): the restart counts follow."""
        with self._lock:
            self._restarts = {
                mapping[r]: times for r, times in self._restarts.items() if r in mapping
            }

    def gave_up_on(self, rank: int) -> bool:
        """Whether ``rank`` died too often to be restarted automatically again."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(rank, ()) if now - t < RESTART_WINDOW]
        return len(recent) >= MAX_RESTARTS

    # -- noticing (receiving thread: quick, never blocks) --------------------------------
    def _on_event(self, event: object) -> None:
        if self._lifecycle.phase not in (MeshPhase.RUNNING, MeshPhase.RECOVERING):
            return  # starting (start() reports its own failures) or stopping
        if isinstance(event, RequestFailed):
            if event.kind is not RequestKind.CONTROL:
                report = event.report
                if released_by_abort(report):
                    # Named by what released it, not by when its answer came: on a
                    # loaded host the abort's answer may come after the interrupt went.
                    incident = self._incidents.get(event.request)
                    if incident is not None and incident.aborted:
                        incident.released.setdefault(event.rank, BY_ABORT)
                self._open(event.request, event.rank, f"raised {report.get('type', 'an error')}")
        elif isinstance(event, RankDied):
            if event.state is not RankState.DEAD or self._lifecycle.phase.ended:
                return  # stopped on purpose (a stop, or killed by this very policy)
            if event.claimed:
                return  # recovered from peers (controller.training.recovery), not here
            cause = f"died ({event.death.how})"
            for rid in event.requests:
                self._open(rid, event.rank, cause)
            self._death()

    def _open(self, rid: str, rank: int, cause: str) -> None:
        requests = self._requests
        pending = requests.get(rid)
        if pending is None or not pending.waiting or pending.kind is RequestKind.CONTROL:
            return  # complete already: nobody is left waiting for the failed rank
        if pending.internal:
            return  # re-forming the mesh: the restart reports its own problems
        with self._lock:
            known = self._incidents.get(rid)
            if known is not None:
                # A death reported a moment after a peer's error is the root cause: peers
                # in a collective with a rank that dies fail at once (connection closed),
                # often before its host agent's exit report arrives.
                young = time.monotonic() - known.opened < max(self.grace, 0.5)
                if cause.startswith("died") and not known.cause.startswith("died") and young:
                    known.root_rank, known.cause = rank, cause
                    known.outcome = self._plan()
                return
            if pending.cancelled:
                cause = "was interrupted"
            incident = Incident(
                rid, pending.what, rank, cause, self.grace, tuple(pending.ranks), pending.kind
            )
            incident.cancelled = pending.cancelled
            if cause.startswith("died"):
                incident.outcome = self._plan()
            self._incidents[rid] = incident
        if isinstance(pending.observer, IncidentObserver):
            pending.observer.on_incident(incident)
        threading.Thread(
            target=self._release, args=(incident,), name=f"mk-incident-{rid}", daemon=True
        ).start()

    def _death(self) -> None:
        """A rank died: apply the policy once its requests' incidents are released."""
        if self.policy is FailurePolicy.CONTINUE:
            return
        with self._lock:
            if self._incidents:  # the last incident to end applies it
                self._recovery_due = True
                return
        self._apply_policy()

    # -- releasing (the incident's own thread) -------------------------------------------
    def _release(self, incident: Incident) -> None:
        try:
            self._release_steps(incident)
        except Exception:  # never let a failed release wedge the request
            if self._lifecycle.phase.ended:
                return  # stopped meanwhile: the stop failed the request
            log.exception("mesh %s: releasing request %s failed", self._name, incident.request)
            self._give_up(incident, "left running (the release failed; see the kernel log)")
        finally:
            with self._lock:
                self._incidents.pop(incident.request, None)
                if incident.needs_policy:
                    self._recovery_due = True
                due = self._recovery_due and not self._incidents
                if due:
                    self._recovery_due = False
                if incident.cancelled:
                    self._restart_not_stop = True
            # before the caller hears: its next request must wait for it
            if (due or self._check_due(incident)) and self._in_place():
                self._recover_in_place(incident)
            elif due:
                self._apply_policy()
            incident.settled.set()

    def _release_steps(self, incident: Incident) -> None:
        rid = incident.request
        if self._settled(rid, incident.opened + self.grace):
            return
        if self.policy is FailurePolicy.CONTINUE:
            # Nothing is done to them: the request fails now, they run on (and can be
            # inspected with %mesh stacks, interrupted, or restarted by hand).
            self._give_up(incident, "left running (on_failure='continue')")
            return
        pending = self._requests.get(rid)
        live = [r for r in (pending.ranks if pending else ()) if self._ranks[r].alive]
        # 1. abort the process group everywhere: a re-formable group releases the rank
        # at once; with plain gloo the failed rank closing its connections is what
        # releases its peers; aborting elsewhere is harmless.
        incident.needs_policy = True
        before = set(self._requests.waiting(rid))
        incident.aborted = True
        why = AbortPg(why=f"rank {incident.root_rank} {incident.cause}").encode()
        self._step(rid, live, why)
        self._note(incident, before, BY_ABORT)
        # 2. interrupt what they run
        before = set(self._requests.waiting(rid))
        self._step(rid, sorted(before), {"k": K.CANCEL, "c": rid})
        self._note(incident, before, "interrupted")
        stuck = set(self._requests.waiting(rid))
        incident.outcome = self._plan(extra=stuck)
        if not stuck:
            return
        # 3. kill them
        reason = (
            f"killed by the failure policy: still running {incident.what or 'a request'} "
            f"{time.monotonic() - incident.opened:.1f}s after rank {incident.root_rank} "
            f"{incident.cause}"
        )
        for r in stuck:
            incident.released[r] = (
                "killed (stuck in native code: neither aborting the process group nor an "
                "interrupt released it)"
            )
            self._ranks[r].kill_reason = reason
        self._actions.kill_ranks(sorted(stuck))
        if not self._settled(rid, time.monotonic() + KILL_WAIT):  # their host is stuck too
            self._give_up(incident, "left running (could not be killed; its host is lost?)")

    def _step(self, rid: str, ranks: Sequence[int], header: Header) -> bool:
        """Send ``header`` to each of ``ranks`` on the control path, then wait
        until ``rid`` waits on nobody (True) or the step has had its time (False):
        :data:`STEP_WAIT` from when each rank's control thread answered a ping sent behind
        it, so that a loaded machine's slow delivery is not taken for a stuck rank."""
        sent = time.monotonic()
        for r in ranks:
            self._actions.send_control(r, header)
        probe = self._actions.probe(ranks)
        return self._settled_by(
            rid, lambda waiting: step_due(probe, waiting, sent, STEP_WAIT, ACK_WAIT)
        )

    def _settled(self, rid: str, until: float) -> bool:
        """Wait until ``rid`` waits on nobody (True) or ``until`` passes (False)."""
        return self._settled_by(rid, lambda _: until)

    def _settled_by(self, rid: str, due: Callable[[frozenset[int]], float]) -> bool:
        """Wait until ``rid`` waits on nobody (True) or the time ``due(ranks it still
        waits on)`` passes (False; also once the mesh stopped)."""
        requests = self._requests
        while waiting := requests.waiting(rid):
            if self._lifecycle.phase.ended or time.monotonic() >= due(waiting):
                return False
            time.sleep(0.01)
        return True

    def _note(self, incident: Incident, before: set[int], how: str) -> None:
        """Ranks that stopped running the request during a step were released by it."""
        for r in before - self._requests.waiting(incident.request):
            incident.released.setdefault(r, how)

    def _give_up(self, incident: Incident, how: str) -> None:
        rid = incident.request
        stuck = set(self._requests.waiting(rid))
        for r in stuck:
            incident.released[r] = how
        error = ReleasedError(
            f"rank(s) {format_ranks(sorted(stuck))} of mesh {self._name!r} still run "
            f"{incident.what or 'the request'}: {how}",
            None,
            self._name,
        )
        self._post(self._requests.abandon, rid, stuck, error)
        self._settled(rid, time.monotonic() + 2.0)

    def _plan(self, extra: set[int] | None = None) -> str:
        """What the policy will do next, as a sentence for the error."""
        dead = {r.rank for r in self._ranks if r.state is RankState.DEAD} | (extra or set())
        dead = {r for r in dead if not self.gave_up_on(r)}
        if self.policy is FailurePolicy.STOP and not self._restart_not_stop:
            return f"on_failure='stop': stopping mesh {self._name!r}."
        if self.policy is FailurePolicy.SHRINK and dead:
            return (
                f"on_failure='shrink': going on without rank(s) {format_ranks(sorted(dead))} "
                "(the others renumbered in order if they were not the last ones; restarted "
                "instead if the mesh is at its minimum size)."
            )
        if self.policy is FailurePolicy.RESTART:
            if dead:
                return (
                    f"on_failure='restart': restarting rank(s) {format_ranks(sorted(dead))} "
                    "and re-forming the mesh; the next request waits for it."
                )
            return (
                "on_failure='restart': re-forming the process group (if the ranks had one); "
                "the next request waits for it."
            )
        return ""

    # -- putting the mesh right in place ----------------------------------------------------
    def _check_due(self, incident: Incident) -> bool:
        """A request that released itself still gets its process group and replicas
        checked when it ran on several ranks (not under ``continue``): a cell always (the
        check asks the ranks, a ping, whether they have a group: one made a moment ago is
        not known here yet), an endpoint call when the ranks have a group."""
        if self.policy is FailurePolicy.CONTINUE or len(incident.ranks) < 2:
            return False
        return incident.kind is RequestKind.CELL or self._has_process_group()

    def _in_place(self) -> bool:
        """Nothing to restart, and the policy does not stop the mesh."""
        if self._lifecycle.phase.ended or self.policy is FailurePolicy.CONTINUE:
            return False
        if not self._restarting() and self.policy is FailurePolicy.STOP:
            return False
        return all(r.alive for r in self._ranks)

    def _recover_in_place(self, incident: Incident) -> None:
        """Re-form the process group if it broke and make the replicas the same, on this
        (the incident's) thread; the request's error then says what was done."""
        with self._lock:
            if self._recovering:  # a restart runs: it re-forms the group too
                self._recovery_due = True
                return
            self._recovering = True
            self._restart_not_stop = False
        # Requests sent from now on wait for it, until the policy's own recovery (if a
        # death came meanwhile: ``again``) has taken over the hold.
        self._lifecycle.hold_recovery()
        try:
            how = (
                "the interrupt"
                if incident.cancelled
                else (f"rank {incident.root_rank} {incident.cause}")
            )
            report = self._actions.recover([], timeout=IN_PLACE_WAIT, reason=f"after {how}")
            incident.outcome = report.describe(self._name, in_place=True)
        except Exception as exc:
            if not self._lifecycle.phase.ended:
                log.warning("mesh %s: re-forming in place failed: %s", self._name, exc)
                incident.outcome = f"re-forming the mesh in place failed: {exc}"
        finally:
            with self._lock:
                self._recovering = False
                again, self._recovery_due = self._recovery_due, False
            try:
                if again:  # a death while it ran
                    self._apply_policy()
            finally:
                self._lifecycle.release_recovery()

    # -- the policy ------------------------------------------------------------------------
    def _apply_policy(self) -> None:
        """Restart or stop, on a thread of its own (one at a time)."""
        if self.policy is FailurePolicy.CONTINUE or self._lifecycle.phase.ended:
            return
        if self.policy is FailurePolicy.SHRINK and not self._restart_not_stop:
            with self._lock:
                if self._recovering:
                    self._recovery_due = True
                    return
                self._recovering = True
            threading.Thread(target=self._shrink, name="mk-shrink", daemon=True).start()
            return
        restarting = self._restarting()
        with self._lock:
            if self._recovering:  # the recovery running now takes this death on
                self._recovery_due = True
                if restarting:
                    self._lifecycle.begin_recovery()  # requests sent from now on wait
                return
            self._recovering = True
        if restarting:
            # Requests sent from now on wait for it: held, not just begun, so that another
            # recovery ending first (a restart of an earlier death, a person's
            # procs.restart()) does not let a request through to a rank that is still
            # dead; released when the thread's last round is done.
            self._lifecycle.hold_recovery()
        threading.Thread(
            target=self._recover, args=(restarting,), name="mk-recover", daemon=True
        ).start()

    def _shrink(self) -> None:
        """``shrink``: go on without the dead ranks (renumbering the others when they
        were not the last ones); where that cannot be done (the minimum size, a cell
        that is not a training loop runs), restart them as ``restart`` would."""
        try:
            done = self._actions.shrink_dead()
        except Exception as exc:
            log.warning("mesh %s: shrinking after a failure failed: %s", self._name, exc)
            done = False
        with self._lock:
            self._recovering = False
            again, self._recovery_due = self._recovery_due, False
            self._restart_not_stop = not done
        if again or not done:
            self._apply_policy()

    def _restarting(self) -> bool:
        """Restart (not stop): the policy, or a person interrupted what failed."""
        return self.policy is FailurePolicy.RESTART or self._restart_not_stop

    def _recover(self, held: bool) -> None:
        """Restart (or stop) until no death is left to handle; ``held``: the recovery
        hold :meth:`_apply_policy` took, let go at the end."""
        try:
            while True:
                if self._lifecycle.phase.ended:
                    return
                if not self._restarting():
                    self._actions.stop()
                    return
                self._restart_not_stop = False
                given_up = frozenset(r.rank for r in self._ranks if self.gave_up_on(r.rank))
                dead = [r.rank for r in self._ranks if not r.alive and r.rank not in given_up]
                now = time.monotonic()
                for r in dead:
                    self._restarts[r] = [
                        t for t in self._restarts.get(r, ()) if now - t < RESTART_WINDOW
                    ] + [now]
                try:
                    self._actions.recover(
                        reason="after a failure, on_failure='restart'", skip=given_up
                    )
                except Exception as exc:
                    if not self._lifecycle.phase.ended:
                        log.warning("mesh %s: automatic restart failed: %s", self._name, exc)
                with self._lock:
                    if not self._recovery_due:
                        self._recovering = False
                        return
                    self._recovery_due = False
        finally:
            with self._lock:
                self._recovering = False
            if held:
                self._lifecycle.release_recovery()
