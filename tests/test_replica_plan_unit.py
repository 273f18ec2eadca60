"""``calls.replica_plan``: which replicas differ and which rank's state wins, for DDP
replicas (every rank the same) and sharded ones (FSDP2/HSDP: the same within each group
of replicas of a shard)."""

from __future__ import annotations

from monarch_kernel.calls.replica_plan import (
    ObjectDigest,
    ReplicaDigest,
    describe,
    misbuilt_problem,
    plan_sync,
)


def ddp(rank: int, model: str, steps: int) -> ReplicaDigest:
    return ReplicaDigest(
        rank,
        (
            ObjectDigest("model", "model", model, 1024),
            ObjectDigest("opt", "optimizer", f"{model}-{steps}", 2048, steps),
        ),
    )


def hsdp(rank: int, shard: str, steps: int) -> ReplicaDigest:
    """Rank ``rank`` of a 2×2 HSDP mesh: replicas of its shard are ``rank`` and ``rank ^ 2``."""
    group = tuple(sorted((rank, rank ^ 2)))
    return ReplicaDigest(
        rank,
        (
            ObjectDigest("model", "model", shard, 512, None, group),
            ObjectDigest("opt", "optimizer", f"{shard}-{steps}", 1024, steps, group),
        ),
    )


def test_identical_ddp_replicas_need_nothing():
    plan = plan_sync([ddp(r, "a", 5) for r in range(4)])
    assert not plan.needed and plan.source is None
    assert describe(plan) == "DDP replicas identical (model, opt compared)"


def test_ddp_ranks_behind_take_the_most_advanced_state():
    plan = plan_sync([ddp(0, "b", 6), ddp(1, "b", 6), ddp(2, "a", 5), ddp(3, "a", 5)])
    assert plan.source == 0 and plan.targets == (2, 3)
    assert plan.why == "ranks 2-3 had not run opt.step() of the interrupted step"
    text = describe(plan, 4096, 0.012)
    assert text == (
        "ranks 2-3 had not run opt.step() of the interrupted step; parameters and optimizer "
        "state of rank 0 copied to ranks 2-3 (4.0 KB, 12 ms); DDP replicas identical"
    )


def test_hsdp_shards_are_compared_within_each_replica_group_only():
    # ranks 0 and 1 hold different shards: that is no difference
    plan = plan_sync([hsdp(0, "s0", 3), hsdp(1, "s1", 3), hsdp(2, "s0", 3), hsdp(3, "s1", 3)])
    assert not plan.needed and plan.shard_names == ("model", "opt")
    assert describe(plan) == (
        "replicas identical (model, opt compared; shards compared within each replica group)"
    )


def test_an_hsdp_replica_behind_takes_the_shards_of_its_group_s_most_advanced_rank():
    plan = plan_sync([hsdp(0, "s0+", 4), hsdp(1, "s1+", 4), hsdp(2, "s0", 3), hsdp(3, "s1+", 4)])
    assert plan.source is None  # no whole (DDP) object differs
    assert dict(plan.shard_sources) == {0: 0, 2: 0}  # rank 2's group only; 1 and 3 agree
    assert plan.shard_why == "rank 2 had not run opt.step() of the interrupted step"
    assert describe(plan, 1024, 0.003) == (
        "shards: rank 2 had not run opt.step() of the interrupted step; copied from rank 0 "
        "within the replicate dim (1.0 KB, 3 ms); replicas identical"
    )


def test_fsdp_without_replicas_has_nothing_to_compare_a_shard_with():
    digests = [
        ReplicaDigest(r, (ObjectDigest("model", "model", f"s{r}", 64, None, (r,)),))
        for r in range(4)
    ]
    assert not plan_sync(digests).needed


def test_shard_groups_at_different_optimizer_steps_are_said_not_hidden():
    plan = plan_sync([hsdp(0, "s0+", 4), hsdp(1, "s1", 3), hsdp(2, "s0+", 4), hsdp(3, "s1", 3)])
    assert not plan.needed  # each group agrees within itself: nothing to copy ...
    text = describe(plan)
    assert "WARNING: the model's shards are at different optimizer steps" in text, text
    assert "ranks 1, 3: 3, ranks 0, 2: 4 steps" in text, text


def _built(rank: int, layout: str, group: tuple[int, ...] = ()) -> ReplicaDigest:
    """A model (and its optimizer) whose values differ on every rank, built with
    ``layout`` (its tensors' names, dtypes and shapes)."""
    return ReplicaDigest(
        rank,
        (
            ObjectDigest("model", "model", f"m{rank}", 64, None, group, layout),
            ObjectDigest("opt", "optimizer", "o", 64, 0, group, "opt"),
        ),
    )


def test_ddp_replicas_built_differently_are_not_copied_and_named():
    plan = plan_sync([_built(0, "8x8"), _built(1, "8x8"), _built(2, "12x8"), _built(3, "8x8")])
    assert "model" not in plan.names and not plan.needed, plan
    assert plan.misbuilt == ("model: rank 2 laid out differently from ranks 0-1, 3",)
    assert misbuilt_problem(plan) == (
        "replicas built differently, left as they are (a rank-dependent size in the "
        "model's code?): model: rank 2 laid out differently from ranks 0-1, 3"
    )
    assert describe(plan) == "DDP replicas identical (opt compared)"


def test_hsdp_replicas_built_differently_leave_the_model_and_its_optimizer_alone():
    digests = [_built(r, "12x8" if r == 2 else "8x8", tuple(sorted((r, r ^ 2)))) for r in range(4)]
    plan = plan_sync(digests)
    assert not plan.needed and plan.shard_names == (), plan
    assert plan.misbuilt == (
        "model: rank 2 laid out differently from rank 0",
        "opt: trains model",
    )
    # ranks 1 and 3 (one group) agree: a layout differing in another group is not theirs
    same = plan_sync([_built(r, "8x8", tuple(sorted((r, r ^ 2)))) for r in range(4)])
    assert same.misbuilt == () and same.shard_sources, same


def test_digests_without_a_layout_are_compared_by_value_as_before():
    plan = plan_sync([_built(0, ""), _built(1, "")])
    assert plan.misbuilt == () and plan.source is not None
