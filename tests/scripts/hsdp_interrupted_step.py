"""A training step of an HSDP model (FSDP2 on a 2×2 mesh: replicate × shard) stopped at
chosen points on each rank, then the replica check the mesh runs after the stop button,
on real processes under torchrun:
``python -m torch.distributed.run --nproc-per-node 4 hsdp_interrupted_step.py SCENARIO``.
With ``MK_HSDP_DEVICE=cuda`` the model, its shards and the optimizer's moments are on the
GPU (NCCL for CUDA tensors, gloo beside it for the CPU ones: Adam's step counters; the 4
ranks may share one GPU, each with an ``NCCL_HOSTID`` of its own). With
``MK_HSDP_RESET_BY_HAND=1`` FSDP2 is without ``reset_iter_state`` (as in torch 2.11, the
GPU machine's), so the mesh resets its per-iteration state by hand (``fsdp_reset``).

The stop is a ``KeyboardInterrupt`` raised where the rank's SIGINT handler could raise
it: inside a layer's forward (its parameters unsharded), before ``opt.step()``, or
inside ``opt.step()`` after some of the parameters took the step. Each rank prints
``RESULT {json}`` lines that tests/test_hsdp_interrupted_step.py judges.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim.adam as adam
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from monarch_kernel.calls.replica_plan import describe, plan_sync
from monarch_kernel.rank.replicas import replicas

RANK = int(os.environ.get("RANK", "0"))
DEVICE = os.environ.get("MK_HSDP_DEVICE", "cpu")


def report(**values: object) -> None:
    """One ``RESULT`` line, written at once (no interleaving under PIPE_BUF bytes)."""
    line = "RESULT " + json.dumps({"rank": RANK, **values}) + "\n"
    sys.stdout.flush()
    os.write(1, line.encode())


def build() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    net = net.to(DEVICE)
    mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("hosts", "gpus"))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, adam_of(net)


def adam_of(net: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam's loop over one parameter at a time (the default on the CPU; on CUDA the
    default is the foreach one), where :func:`stop_inside_adam` stops it."""
    return torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)


def forward_backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(8, 16, generator=g).to(DEVICE)
    F.mse_loss(model(x), x[:, :4] * 2 - 1).backward()


def shards_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's shards of the model and of the optimizer state (as the user's own
    check in tests/test_hsdp.py computes it)."""
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.to_local().detach().cpu().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            local = v.to_local() if hasattr(v, "to_local") else v
            h.update(local.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def stopped(action: Callable[[], None]) -> bool:
    """Run ``action``; whether the stop (KeyboardInterrupt) came inside it."""
    try:
        action()
    except KeyboardInterrupt:
        return True
    return False


def stop_inside_forward(model: torch.nn.Sequential) -> Callable[[], None]:
    """The next forward stops in the middle layer, its parameters gathered (FSDP2's
    pre-forward hook, which unshards them, runs before this one)."""
    layer = model[2]

    def stop(_module: Any, _args: Any) -> None:
        handle.remove()
        assert not hasattr(layer.weight, "to_local"), "the layer is not unsharded here"
        raise KeyboardInterrupt

    handle = layer.register_forward_pre_hook(stop)
    return lambda: forward_backward(model, 99)


def stop_inside_adam(after: int) -> None:
    """The next ``opt.step()`` stops after ``after`` parameters (and their moments) took
    the step, the others not (Adam's per-parameter loop, as on CPU)."""
    original = adam._single_tensor_adam

    def partly(*args: Any, **kwargs: Any) -> None:
        adam._single_tensor_adam = original
        # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps: the first
        # ``after`` of each take the step
        lists = [a[:after] for a in args[:6]]
        original(*lists, *args[6:], **kwargs)
        raise KeyboardInterrupt

    setattr(adam, "_single_tensor_adam", partly)  # noqa: B010 (another signature)


def stop_at_start_of_step(opt: torch.optim.Optimizer) -> None:
    """The next ``opt.step()`` stops before it made any state (or changed anything)."""

    def stop(_opt: Any, _args: Any, _kwargs: Any) -> None:
        handle.remove()
        raise KeyboardInterrupt

    handle = opt.register_step_pre_hook(stop)


def replica_check(namespace: dict[str, Any]) -> dict[str, Any]:
    """What the controller's replica check does (controller/lifecycle/replica_check.py),
    with the digests gathered over the process group instead of sent to a controller."""
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, replicas.digest_namespace(namespace))
    plan = plan_sync(digests)
    seen = [sorted(o.name for o in d.objects) for d in sorted(digests, key=lambda d: d.rank)]
    if not plan.needed:
        return {"text": describe(plan), "seen": seen, "still_differ": False}
    report_ = replicas.sync_namespace(
        namespace,
        list(plan.names),
        plan.source,
        list(plan.shard_names),
        dict(plan.shard_sources),
    )
    afters: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(afters, report_.after)
    after = plan_sync(afters)
    text = describe(plan, report_.nbytes, report_.seconds, after=not after.needed)
    return {"text": text, "seen": seen, "still_differ": after.needed}


def run(scenario: str) -> None:
    model, opt = build()
    for step in range(2):  # every rank: two whole steps
        opt.zero_grad()
        forward_backward(model, step)
        opt.step()
    opt.zero_grad()
    forward_backward(model, 2)  # the step the stop comes in: its collectives done
    host = RANK // 2  # ranks 0-1: host 0, ranks 2-3: host 1 (replicas: r and r ^ 2)
    if scenario == "forward_and_inside_step":
        # host 0 finished opt.step() and went on into the next forward; host 1 stopped
        # inside opt.step() after some parameters took it
        if host == 0:
            opt.step()
            assert stopped(stop_inside_forward(model))
        else:
            stop_inside_adam(after=RANK)
            assert stopped(opt.step)
    elif scenario == "inside_step_on_every_replica":
        # ranks 0 and 2 (replicas of one shard) both stopped inside opt.step(), at
        # different parameters; ranks 1 and 3 before it
        if RANK % 2 == 0:
            stop_inside_adam(after=1 + RANK)
            assert stopped(opt.step)
    elif scenario == "before_the_first_state":
        # rank 2 stopped as its opt.step() began (Adam had made no state yet: a fresh
        # optimizer here), the others took the step
        opt = adam_of(model)
        if RANK == 2:
            stop_at_start_of_step(opt)
            assert stopped(opt.step)
        else:
            opt.step()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    namespace = {"model": model, "opt": opt}
    # what find_training_state sees before the FSDP2 reset (the cause of the bug)
    unsettled = sorted(replicas.find_training_state(namespace))
    result = replica_check(namespace)
    digest_after = shards_digest(model, opt)
    # every rank trains on, one whole step, and the replicas stay the same
    opt.zero_grad()
    forward_backward(model, 3)
    opt.step()
    report(
        scenario=scenario,
        unsettled=unsettled,
        **result,
        after=digest_after,
        trained=shards_digest(model, opt),
        steps=replicas.optimizer_steps(opt),
        # where the copied state is: the moments on the parameters' device, the step
        # counters on the CPU (Adam's, unless capturable)
        devices={
            key: value.device.type
            for state in opt.state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        },
        resets_by_hand=RESETS_BY_HAND[0],
    )


#: How many times the mesh reset FSDP2 by hand (``fsdp_reset._reset_by_hand``).
RESETS_BY_HAND = [0]


def main() -> None:
    from monarch_kernel.rank.replicas import fsdp_reset

    by_hand = fsdp_reset._reset_by_hand

    def counted(state: Any, groups: list[Any]) -> None:
        RESETS_BY_HAND[0] += 1
        by_hand(state, groups)

    fsdp_reset._reset_by_hand = counted
    if os.environ.get("MK_HSDP_RESET_BY_HAND") == "1":
        from torch.distributed.fsdp import FSDPModule

        FSDPModule.reset_iter_state = None  # type: ignore[assignment,method-assign]
    if DEVICE == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            os.environ.setdefault("NCCL_HOSTID", f"hsdp-test-{local}")  # ranks share a GPU
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    replicas.install_step_counter()
    try:
        for scenario in sys.argv[1:]:  # one after another, in one process group
            run(scenario)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
