"""Checks of the re-formable process group on real processes, run under torchrun:
``python -m torch.distributed.run --nproc-per-node 4 reformable_group.py SCENARIO``.

Each rank prints ``RESULT {json}`` lines that tests/test_reformable_pg.py reads. The
group comes from a plain ``dist.init_process_group("gloo")`` after the rank-side
install (as in a mesh's warm template).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from monarch_kernel.calls.errors import ProcessGroupAborted
from monarch_kernel.rank.pg import backend as pg_backend
from monarch_kernel.rank.pg import distributed, malloc
from monarch_kernel.rank.pg.reformable import ReformableGroup
from monarch_kernel.rank.replicas import replicas


def report(**values: object) -> None:
    """One ``RESULT`` line, written at once (4 ranks share the pipe: no interleaving
    under PIPE_BUF bytes)."""
    line = "RESULT " + json.dumps({"rank": dist.get_rank(), **values}) + "\n"
    sys.stdout.flush()
    os.write(1, line.encode())


def default_group() -> ReformableGroup:
    group = dist.distributed_c10d._get_default_group()
    assert isinstance(group, ReformableGroup), type(group)
    return group


# -- parity: every op as plain gloo computes it --------------------------------------------
def ops(group: object, rank: int, world: int) -> dict[str, list[float]]:
    """Run every supported op on ``group``; name -> flattened results."""
    g: dict[str, Any] = {"group": group}
    out: dict[str, list[float]] = {}

    def base(n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype)

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        t = base()
        dist.all_reduce(t, op=op, **g)
        out[f"all_reduce {op}"] = t.tolist()
    t = base(dtype=torch.bfloat16)
    dist.all_reduce(t, **g)
    out["all_reduce bf16"] = t.float().tolist()
    t = base(12).view(3, 4).t()  # a non-contiguous view, reduced in place
    dist.all_reduce(t, **g)
    out["all_reduce strided"] = t.reshape(-1).tolist()
    t = torch.tensor(float(rank))
    work = dist.all_reduce(t, async_op=True, **g)
    work.wait()
    out["all_reduce async 0-dim"] = [t.item()]
    t = base()
    dist.broadcast(t, src=world - 1, **g)
    out["broadcast"] = t.tolist()
    gathered = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(gathered, base(), **g)
    out["all_gather"] = torch.cat(gathered).tolist()
    flat = torch.zeros(6 * world)
    dist.all_gather_into_tensor(flat, base(), **g)
    out["all_gather_into_tensor"] = flat.tolist()
    result = torch.zeros(2)
    dist.reduce_scatter(result, [base(2) + i for i in range(world)], **g)
    out["reduce_scatter"] = result.tolist()
    result = torch.zeros(3)
    dist.reduce_scatter_tensor(result, base(3 * world), **g)
    out["reduce_scatter_tensor"] = result.tolist()
    sizes_in = [rank + 1] * world  # uneven: rank r sends r + 1 values to each
    inp = base(sum(sizes_in))
    sizes_out = [r + 1 for r in range(world)]
    res = torch.zeros(sum(sizes_out))
    dist.all_to_all_single(res, inp, sizes_out, sizes_in, **g)
    out["all_to_all_single uneven"] = res.tolist()
    outs = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(outs, [base(2) + i for i in range(world)], **g)
    out["all_to_all"] = torch.cat(outs).tolist()
    t = base()
    dist.reduce(t, dst=1, **g)
    out["reduce"] = t.tolist() if rank == 1 else []
    gather_list = [torch.zeros(6) for _ in range(world)] if rank == 0 else None
    dist.gather(base(), gather_list, dst=0, **g)
    out["gather"] = torch.cat(gather_list).tolist() if gather_list else []
    t = torch.zeros(6)
    dist.scatter(t, [base() + i for i in range(world)] if rank == 0 else None, src=0, **g)
    out["scatter"] = t.tolist()
    ring = torch.zeros(6)
    if rank % 2 == 0:
        dist.send(base(), dst=(rank + 1) % world, **g)
        dist.recv(ring, src=(rank - 1) % world, **g)
    else:
        dist.recv(ring, src=(rank - 1) % world, **g)
        dist.send(base(), dst=(rank + 1) % world, **g)
    out["send/recv ring"] = ring.tolist()
    dist.barrier(**g)
    objs: list[object] = [{"from": rank}]
    dist.broadcast_object_list(objs, src=2, **g)
    out["broadcast_object_list"] = [float(objs[0]["from"])]  # type: ignore[index]
    # the fast path (allreduce_coalesced); with a device (torch's gloo has none such),
    # each op on its own between _start_coalescing and _end_coalescing
    for device in (None, torch.device("cpu") if group is None else None):
        many = [base(3) for _ in range(3)]
        with dist._coalescing_manager(device=device, **g):
            for t in many:
                dist.all_reduce(t, **g)
        name = "coalesced all_reduce" + (" (device)" if device is not None else "")
        out[name] = torch.cat(many).tolist()
    if group is not None:  # the reference for the device form is the fast path's
        out["coalesced all_reduce (device)"] = out["coalesced all_reduce"]
    return out


def parity() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = dist.new_group(backend="gloo")  # torch's own gloo, for the reference
    mine = ops(None, rank, world)
    theirs = ops(plain, rank, world)
    report(
        group=type(default_group()).__name__,
        plain=type(plain).__name__,
        backend=str(dist.get_backend()),
        ops=sorted(mine),
        differ=[name for name in mine if mine[name] != theirs[name]],
    )
    refused = {}
    for what, call in {
        "cuda": lambda: default_group().allreduce([torch.zeros(1, device="meta")]),
        "recv from any source": lambda: dist.recv(torch.zeros(1)),
    }.items():
        try:
            call()
            refused[what] = ""
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            refused[what] = f"{type(exc).__name__}: {exc}"
    report(refused=refused)
    dist.destroy_process_group()


# -- abort and re-form ----------------------------------------------------------------------
def exchange_port(rank: int) -> int:
    """A free port rank 0 picked, through torch's rendezvous store (alive after aborts)."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            store.set("mk-test-port", str(s.getsockname()[1]))
    return int(store.get("mk-test-port"))


def blocked(call: object, late: int, reason: str, tag: str) -> dict[str, object]:
    """Every rank but ``late`` runs ``call`` (it blocks: ``late`` never joins) and aborts
    its group 0.3 s later; ``late`` aborts once they all have (through the rendezvous
    store, so that the others are released by an abort of theirs, never by ``late``'s
    alone); how each left it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    group = default_group()
    if rank == late:
        store.wait([f"mk-test-aborted-{tag}-{r}" for r in range(world) if r != late])
        group.abort(reason)
        return {"left": "late rank", "seconds": 0.0, "error": ""}
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        group.abort(reason)
        store.set(f"mk-test-aborted-{tag}-{rank}", "1")

    timer = threading.Timer(0.3, abort)
    timer.start()
    try:
        call()  # type: ignore[operator]
        left, error = "completed", ""
    except Exception as exc:
        left, error = type(exc).__name__, str(exc)[:400]
    timer.join()
    return {"left": left, "seconds": time.monotonic() - aborted_at[0], "error": error}


def abort_and_reform() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = default_group()
    pair = dist.new_group([0, 1])
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):  # past DDP's bucket rebuild
        opt.zero_grad()
        ddp(torch.randn(8, 16)).sum().backward()
        opt.step()
    t = torch.ones(1)
    collective = blocked(lambda: dist.all_reduce(t), 3, "rank 3 raised ValueError", "collective")
    after = ""
    try:
        dist.all_reduce(torch.ones(1))
    except ProcessGroupAborted as exc:
        after = str(exc)
    report(collective=collective, after_abort=after, pid=os.getpid())
    port = exchange_port(rank)
    t0 = time.monotonic()
    group.configure(os.environ["MASTER_ADDR"], port, rank, world)
    reform_s = time.monotonic() - t0
    x = torch.full((1,), float(rank))
    dist.all_reduce(x)
    y = torch.ones(1)
    if rank < 2:
        dist.all_reduce(y, group=pair)
    # a backward (C++ waiting on the future) cut short by the abort
    backward = blocked(
        lambda: ddp(torch.randn(8, 16)).sum().backward(), 2, "interrupted", "backward"
    )
    group.configure(os.environ["MASTER_ADDR"], exchange_port(rank), rank, world)
    repaired = replicas.reset_ddp(pg_backend.groups())
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 16)).sum().backward()
        opt.step()
    digest = replicas.digest(ddp)[0]
    digests: list[object] = [None] * world
    dist.all_gather_object(digests, digest)
    report(
        same_object=dist.distributed_c10d._get_default_group() is group,
        reform_seconds=reform_s,
        default_sum=x.item(),
        pair_sum=y.item() if rank < 2 else None,
        backward=backward,
        repaired=repaired,
        replicas_identical=len(set(digests)) == 1,
        generation=group.generation,
        pid=os.getpid(),
    )
    dist.destroy_process_group()


def worker_death() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = default_group()
    t = torch.ones(1)
    if rank == 1:  # its worker dies while it waits in a collective
        killer = threading.Timer(0.3, lambda: os.kill(group._worker.pid, 9))  # type: ignore[union-attr]
        killer.start()
    t0 = time.monotonic()
    try:
        if rank == 3:  # never joins: releases its peers as the mesh would, by an abort
            time.sleep(1.0)
            group.abort("rank 3 skipped the collective")
            raise RuntimeError("rank 3 skipped the collective")
        dist.all_reduce(t)
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    report(error=error, seconds=time.monotonic() - t0, aborted=group.aborted or "")
    group.configure(os.environ["MASTER_ADDR"], exchange_port(rank), rank, world)
    x = torch.ones(1)
    dist.all_reduce(x)
    report(after=x.item())
    dist.destroy_process_group()


# -- state copy ----------------------------------------------------------------------------
def state_copy() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2)
        )
    )
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for i in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        if rank < 2 or i < 2:  # ranks 2-3 skip the last opt.step()
            opt.step()
            sched.step()
    ns = {"ddp": ddp, "opt": opt, "sched": sched}
    before = replicas.digest_namespace(ns)
    digests: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, before)
    from monarch_kernel.calls.replica_plan import describe, plan_sync

    plan = plan_sync(digests)  # type: ignore[arg-type]
    sync = replicas.sync_namespace(ns, plan.names, plan.source or 0)
    dist.all_gather_object(digests, sync.after)
    after = plan_sync(digests)  # type: ignore[arg-type]
    mismatch = ""
    try:  # rank 1 holds another model: every rank refuses, none hangs
        other = torch.nn.Linear(8, 3 if rank == 1 else 2)
        replicas.broadcast_state([other], src=0)
    except ValueError as exc:
        mismatch = str(exc)
    # rank 3 cannot make the tensors the optimizer state goes into (as a GPU out of
    # memory would): every rank raises, none waits in a broadcast for it
    from monarch_kernel.rank.replicas import state_copy

    no_memory = ""
    real_device = state_copy._local_device

    def no_room(device_type: str) -> object:
        raise RuntimeError("CUDA out of memory (as told by the test)")

    if rank == 3:
        state_copy._local_device = no_room
    try:
        replicas.broadcast_state([opt], src=0)
    except ValueError as exc:
        no_memory = str(exc)
    finally:
        state_copy._local_device = real_device
    report(
        no_memory=no_memory,
        text=describe(plan, sync.nbytes, sync.seconds, after.source is None),
        source=plan.source,
        targets=list(plan.targets),
        steps=replicas.optimizer_steps(opt),
        lr=opt.param_groups[0]["lr"],
        identical=after.source is None,
        mismatch=mismatch,
    )
    dist.destroy_process_group()


# -- a group of one ---------------------------------------------------------------------------
def alone() -> None:
    """Ops that leave a lone rank's tensors as they are never reach the worker; the
    others still run there."""
    dist.init_process_group("gloo")
    group = default_group()
    t = torch.arange(4.0)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.broadcast(t, src=0)
    dist.reduce(t, dst=0)
    dist.barrier()
    sent_before_gather = group._next_op
    out = [torch.zeros(4)]
    dist.all_gather(out, t)
    report(
        values=t.tolist(),
        gathered=out[0].tolist(),
        sent_before_gather=sent_before_gather,
        sent_after_gather=group._next_op,
        kind=group.kind,
        zygote_exec=pg_backend._spawner._process is not None,
    )
    dist.destroy_process_group()


# -- a DDP backward cut short with no collective in flight --------------------------------------
def ddp_cut_short() -> None:
    """A backward stopped before its first bucket's all-reduce (what the stop button can
    do between two buckets: the group is not aborted, so not re-formed) leaves the
    reducer expecting the rest; the replica check's settling resets it on every rank,
    and the next step trains."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64) * (dist.get_rank() + 1)

    def step() -> str:
        try:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            return "ok"
        except Exception as exc:  # what the next cell would show
            return f"{type(exc).__name__}: {str(exc)[:80]}"

    first = step()

    def stop(_: torch.Tensor) -> None:
        raise ValueError("stopped")  # the last layer's gradient comes first

    hook = model.module[1].weight.register_hook(stop)
    cut = step()
    hook.remove()
    replicas.settled_training_state({"model": model, "opt": opt})
    after = step()
    digest = replicas.digest(model)[0]
    report(first=first, cut=cut[:40], after=after, digest=digest)
    dist.destroy_process_group()


# -- FSDP2/HSDP memory: steady, step after step ---------------------------------------------
def _anonymous_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return 0.0


def fsdp_memory() -> None:
    """HSDP (2 × 2) of 8 layers of 1024² for 12 steps: this rank's anonymous memory and the
    regions its groups' workers map, after step 4 and after step 12."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1 << 20))  # a DDP-style op: glibc left as it is (pg.malloc)
    pinned_before = malloc._pinned
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("r", "s"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, 1024)

    def regions() -> int:
        groups = [g for g in gc.get_objects() if isinstance(g, ReformableGroup)]
        return sum(len(g._worker.known) for g in groups if g._worker is not None)

    seen: dict[int, tuple[float, int]] = {}
    for step in range(1, 13):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step in (4, 12):
            dist.barrier()
            seen[step] = (_anonymous_mb(), regions())
    report(
        anon_mb=[seen[4][0], seen[12][0]],
        regions=[seen[4][1], seen[12][1]],
        pinned=[pinned_before, malloc._pinned],
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    distributed.install_idempotent_init()
    {
        "parity": parity,
        "abort": abort_and_reform,
        "worker_death": worker_death,
        "state": state_copy,
        "alone": alone,
        "fsdp_memory": fsdp_memory,
        "ddp_cut_short": ddp_cut_short,
    }[sys.argv[1]]()
