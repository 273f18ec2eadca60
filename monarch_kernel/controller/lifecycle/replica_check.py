"""Making the data-parallel replicas of a mesh the same again, from the controller.

Every rank reports a digest of its training objects; ``calls.replica_plan.plan_sync``
decides; if they differ every rank runs the copy from the most advanced rank; then the
digests are compared again. The ranks do the work (``monarch_kernel.rank.replicas.replicas``),
as cells of the controller's own (``run_values``).
"""

from __future__ import annotations

from collections.abc import Callable

from monarch_kernel.calls.replica_plan import (
    ReplicaDigest,
    ReplicaPlan,
    SyncReport,
    describe,
    misbuilt_problem,
    plan_sync,
)

#: ``run_values(ranks, code, label, deadline)``: rank -> the value of the cell's last
#: expression, and '' or what went wrong (``Restarter.run_values``).
RunValues = Callable[[list[int], str, str, float], "tuple[dict[int, object], str]"]

_CALL = "__import__('monarch_kernel.rank.replicas.replicas', fromlist=['_'])."


def make_replicas_consistent(
    run_values: RunValues, ranks: list[int], deadline: float, problems: list[str]
) -> str:
    """Compare the data-parallel training objects of ``ranks`` (a digest of each); if
    they differ, copy the most advanced rank's state to the others over the process
    group, and check again. What was done, in one line ('' when the ranks hold no such
    objects); what went wrong is added to ``problems``."""
    code = _CALL + "digest_namespace(globals())"
    digests, failed = run_values(ranks, code, "restart: compare replicas", deadline)
    if failed:
        problems.append(f"comparing the replicas failed: {failed}")
        return ""
    plan = plan_sync([d for d in digests.values() if isinstance(d, ReplicaDigest)])
    if plan.misbuilt:
        problems.append(misbuilt_problem(plan))
    if not plan.needed:
        return describe(plan)
    code = _CALL + (
        f"sync_namespace(globals(), {list(plan.names)!r}, {plan.source}, "
        f"{list(plan.shard_names)!r}, {dict(plan.shard_sources)!r})"
    )
    reports, failed = run_values(ranks, code, "restart: copy replicas", deadline)
    if failed:
        why = "; ".join(w for w in (plan.why, plan.shard_why) if w)
        problems.append(f"{why}; copying the most advanced replica's state failed: {failed}")
        return ""
    return _synced(plan, [r for r in reports.values() if isinstance(r, SyncReport)])


def _synced(plan: ReplicaPlan, reports: list[SyncReport]) -> str:
    after = plan_sync([r.after for r in reports])
    nbytes = max((r.nbytes for r in reports), default=0)
    seconds = max((r.seconds for r in reports), default=0.0)
    return describe(plan, nbytes, seconds, after=not after.needed)
