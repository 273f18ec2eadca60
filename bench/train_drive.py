"""The driver of one system in the workload benchmark, in a process of its own:
``python -m bench.train_drive SYSTEM CONFIG_JSON``.

Each driver starts its system the way that system's users do and runs
:mod:`bench.train_gpt` on 4 ranks; the parent (:mod:`bench.train`) watches the progress
file, samples this process's memory and kills a rank. Where a system can go on after a
rank is killed only when its driver starts the work again (Dask, Monarch, ``%torchrun``),
the driver does that once, the way a user would, and the run resumes from the disk
checkpoint the script wrote.

Plain ``torchrun`` needs no driver: the parent runs it directly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import train_gpt
from monarch_kernel.wire.ports import PortReservation

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "train_gpt.py")
RANKS = 4


def note(cfg: train_gpt.Config, text: str) -> None:
    """A driver's line in the progress file (``driver PID``, ``retry ...``)."""
    with open(cfg.progress, "a") as f:
        f.write(f"{text} {time.time()!r}\n")


def finished(cfg: train_gpt.Config) -> bool:
    """Whether rank 0 completed the last step (the progress file says so)."""
    with open(cfg.progress) as f:
        return any(line.startswith(f"step {cfg.total} ") for line in f)


# -- ours: %%remote loop over a TrainingState, and %torchrun of the script --------------
SETUP = """\
%%remote tr --setup
import os, sys, torch
sys.path.insert(0, {here!r})
RANK = int(os.environ["RANK"])
import train_gpt
from monarch_kernel.training import TrainingState
cfg = train_gpt.Config(**{cfg!r})
model, opt = train_gpt.build(cfg)
batches = train_gpt.Batches(cfg, RANK)
log = train_gpt.Progress(cfg.progress, RANK)
"""

LOOP = """\
%%remote tr
state = TrainingState(model=model, optimizer=opt, data=batches)
while state.step < cfg.total:
    with state.stepping():
        loss = train_gpt.step_once(model, opt, batches)
    log.step(state.step, loss)
"""


def _kernel() -> Any:
    from bench.peer_state import _Kernel

    return _Kernel()


def ours_remote(cfg: train_gpt.Config) -> None:
    k = _kernel()
    try:
        note(cfg, f"driver {k.km.provisioner.process.pid}")
        k.run("%mesh tr --gpus 4 --dist", timeout=300)
        fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
        k.run(SETUP.format(here=HERE, cfg=fields), timeout=300)
        text = k.run(LOOP, timeout=900)
        print(text, flush=True)  # the cell's output, in driver.log
        if not finished(cfg):
            raise RuntimeError(f"the %%remote loop did not finish: {text[-500:]}")
        k.run("%mesh stop tr")
    finally:
        k.stop()


def ours_torchrun(cfg: train_gpt.Config) -> None:
    """``%torchrun`` of the unchanged script; after a rank's death the cell fails, the mesh
    restarts the rank, and the driver runs the cell again (resuming from the checkpoint)."""
    k = _kernel()
    try:
        note(cfg, f"driver {k.km.provisioner.process.pid}")
        k.run("%mesh tr --gpus 4", timeout=300)
        line = "%torchrun tr " + " ".join([SCRIPT, *cfg.args()])
        for attempt in range(2):
            try:
                text = k.run(line, timeout=900)
            except RuntimeError as exc:
                text = str(exc)
            print(text, flush=True)  # the cell's output, in driver.log
            if finished(cfg):
                break
            if attempt:
                raise RuntimeError(f"%torchrun did not finish: {text[-500:]}")
            died = next((x for x in text.splitlines() if "died" in x or "Error" in x), "")
            note(cfg, "retry after: " + " ".join(died.split())[:160])
        k.run("%mesh stop tr")
    finally:
        k.stop()


# -- Monarch 0.7: SPMDActor ---------------------------------------------------------------
def monarch(cfg: train_gpt.Config) -> None:
    """``SPMDActor.main`` runs the script on a mesh of 4; a killed process fails the call
    (Monarch 0.7 restarts nothing): the driver starts a new mesh and runs it again."""
    import monarch.actor
    from monarch.actor import this_host
    from monarch.spmd import SPMDActor

    monarch.actor.unhandled_fault_hook = lambda failure: None  # fail the call, not us
    note(cfg, f"driver {os.getpid()}")
    for attempt in range(2):
        procs = this_host().spawn_procs(per_host={"gpus": RANKS})
        actors = procs.spawn("spmd", SPMDActor)
        try:
            addr, port = actors.slice(gpus=0).get_host_port.call_one(None).get()
            actors.main.call(addr, port, [SCRIPT, *cfg.args()]).get()
            procs.stop().get()
            return
        except Exception as exc:
            if attempt:
                raise
            note(cfg, f"retry {type(exc).__name__}")
            try:
                procs.stop().get()
            except Exception:  # a mesh with a dead process may not stop cleanly
                pass


# -- Ray Train: TorchTrainer with FailureConfig and Ray's checkpoints ----------------------
def _ray_loop(config: dict[str, Any]) -> None:
    import tempfile

    import ray.train
    import torch

    sys.path.insert(0, config.pop("_here"))
    import train_gpt as tg  # type: ignore[import-not-found]  # bench/, on sys.path

    cfg = tg.Config(**config)
    rank = ray.train.get_context().get_world_rank()

    def save(step: int, state: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save({"step": step, **state}, os.path.join(d, "state.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": step}, checkpoint=checkpoint)

    def load() -> dict[str, Any] | None:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as d:
            state: dict[str, Any] = torch.load(os.path.join(d, "state.pt"), weights_only=False)
            return state

    torch.set_num_threads(1)
    tg.train(cfg, rank, save, load)


def ray_train(cfg: train_gpt.Config) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    note(cfg, f"driver {os.getpid()}")
    ray.init(num_cpus=RANKS + 1, include_dashboard=False)
    config = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    config["_here"] = HERE
    trainer = TorchTrainer(
        _ray_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=RANKS, use_gpu=False),
        run_config=RunConfig(
            name="mk-bench-train",
            storage_path=os.path.join(os.path.dirname(cfg.progress), "ray"),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    trainer.fit()
    ray.shutdown()


# -- Dask: a task per worker, each forming the torch process group ------------------------
def _dask_rank(cfg_fields: dict[str, Any], here: str, rank: int, port: int) -> int:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, here)
    import train_gpt as tg  # bench/, on sys.path (as in _ray_loop)

    cfg = tg.Config(**cfg_fields)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS
    )
    try:
        save, load = tg.disk_saver(cfg, rank)
        tg.train(cfg, rank, save, load)
    finally:
        dist.destroy_process_group()
    return rank


def dask(cfg: train_gpt.Config) -> None:
    """``LocalCluster`` of 4 single-threaded worker processes (each with its nanny), one
    task per worker; on a failure the driver restarts the workers (``client.restart()``:
    each nanny starts its worker again) and submits the 4 tasks again (they resume from
    the disk checkpoint)."""
    from dask.distributed import Client, LocalCluster, as_completed

    note(cfg, f"driver {os.getpid()}")
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    with (
        LocalCluster(n_workers=RANKS, threads_per_worker=1, processes=True) as cluster,
        Client(cluster) as client,
    ):
        for attempt in range(2):
            client.wait_for_workers(RANKS, timeout=120)
            workers = sorted(client.scheduler_info()["workers"])
            # held until the ranks' store listens on it (monarch_kernel.wire.ports)
            with PortReservation() as hold:
                port = hold.port
                futures = [
                    client.submit(
                        _dask_rank, fields, HERE, r, port, workers=[w], pure=False, retries=0
                    )
                    for r, w in enumerate(workers)
                ]
                for done in as_completed(futures):  # until all finish or the first fails
                    if done.status == "error":
                        break
                failed = [f for f in futures if f.status == "error"]
                if not failed:
                    client.gather(futures)
                    return
                if attempt:
                    raise RuntimeError(f"dask: {failed[0].exception()}")
                note(cfg, f"retry {type(failed[0].exception()).__name__}")
                # The survivors may still be blocked in a collective with the dead rank (one
                # thread per worker): restart every worker, as a Dask user does.
                client.restart(timeout=300)


DRIVERS: dict[str, Callable[[train_gpt.Config], None]] = {
    "ours_remote": ours_remote,
    "ours_torchrun": ours_torchrun,
    "monarch": monarch,
    "ray": ray_train,
    "dask": dask,
}


def main(argv: list[str]) -> int:
    system, cfg_json = argv
    cfg = train_gpt.Config(**json.loads(cfg_json))
    t0 = time.time()
    DRIVERS[system](cfg)
    note(cfg, f"finished {time.time() - t0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
