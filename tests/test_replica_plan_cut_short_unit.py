"""``calls.replica_plan`` with optimizers whose last ``opt.step()`` was cut short (the
stop came inside it: some parameters took the step, the others not): a whole step wins
over a cut one, and where every replica's step was cut the output says so."""

from __future__ import annotations

from monarch_kernel.calls.replica_plan import ObjectDigest, ReplicaDigest, describe, plan_sync


def hsdp(rank: int, shard: str, steps: int, cut: bool = False) -> ReplicaDigest:
    """Rank ``rank`` of a 2×2 HSDP mesh: replicas of its shard are ``rank`` and ``rank ^ 2``."""
    group = tuple(sorted((rank, rank ^ 2)))
    state = f"{shard}-{steps}{'-cut' if cut else ''}"
    return ReplicaDigest(
        rank,
        (
            ObjectDigest("model", "model", state, 512, None, group),
            ObjectDigest("opt", "optimizer", state, 1024, steps, group, "", cut),
        ),
    )


def ddp(rank: int, state: str, steps: int, cut: bool = False) -> ReplicaDigest:
    return ReplicaDigest(
        rank,
        (
            ObjectDigest("model", "model", state, 1024),
            ObjectDigest("opt", "optimizer", state, 2048, steps, (), "", cut),
        ),
    )


def test_a_replica_that_had_not_begun_the_step_wins_over_one_stopped_inside_it():
    # same count: rank 0 stopped inside opt.step() (half updated), rank 2 before it;
    # rank 0 is the lower rank, but rank 2's state is a whole step
    plan = plan_sync([hsdp(0, "a", 3, cut=True), hsdp(1, "b", 3), hsdp(2, "a", 3), hsdp(3, "b", 3)])
    assert dict(plan.shard_sources) == {0: 2, 2: 2}
    assert plan.shard_why == "rank 0 stopped inside opt.step()"
    assert not plan.torn_warning and not plan.shard_warning


def test_a_replica_stopped_inside_the_step_takes_the_one_that_finished_it():
    plan = plan_sync([hsdp(0, "a", 4), hsdp(1, "b", 4), hsdp(2, "a", 3, cut=True), hsdp(3, "b", 4)])
    assert dict(plan.shard_sources) == {0: 0, 2: 0}
    text = describe(plan, 2048, 0.02)
    assert text == (
        "shards: rank 2 stopped inside opt.step(); copied from rank 0 within the "
        "replicate dim (2.0 KB, 20 ms); replicas identical"
    )


def test_stopped_inside_the_step_on_every_replica_is_said_after_the_copy():
    plan = plan_sync(
        [
            hsdp(0, "a", 3, cut=True),
            hsdp(1, "b", 3),
            hsdp(2, "a2", 3, cut=True),
            hsdp(3, "b", 3),
        ]
    )
    assert dict(plan.shard_sources) == {0: 0, 2: 0}
    assert plan.torn_warning.startswith("WARNING: ranks 0, 2 hold an optimizer step cut short")
    assert describe(plan, 1024, 0.01).endswith("replicas identical; " + plan.torn_warning)


def test_replicas_identical_but_all_cut_short_still_say_so():
    plan = plan_sync([ddp(r, "x", 5, cut=True) for r in range(2)])
    assert not plan.needed
    assert describe(plan) == (
        "DDP replicas identical (model, opt compared); WARNING: ranks 0-1 hold an "
        "optimizer step cut short partway (the stop came inside opt.step() on every "
        "replica of that state: some parameters and optimizer moments took the step, the "
        "others not); load a checkpoint to be exact"
    )


def test_ddp_ranks_stopped_inside_the_step_and_before_it_are_told_apart():
    plan = plan_sync([ddp(0, "new", 6), ddp(1, "half", 5, cut=True), ddp(2, "old", 5)])
    assert plan.source == 0 and plan.targets == (1, 2)
    assert plan.why == "rank 1 stopped inside opt.step(), rank 2 had not run it"
    assert not plan.torn_warning
