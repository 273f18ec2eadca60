"""What step telemetry costs: training steps/s with it on and off, and the controller's
CPU per training step as the mesh grows.

* ``overhead``: a small GPT-style decoder (DDP over the mesh's re-formable gloo group,
  synthetic tokens) on 4 and on 64 ranks; phases alternate telemetry on / off in the
  same mesh (the rank's hooks installed or removed between phases), each phase a fixed
  number of steps timed on rank 0 (DDP keeps the ranks in step). The overhead is
  ``1 - on/off`` of the medians; ``noise`` is how much two "off" phases differ, the
  floor under which a figure says nothing on a shared machine.
* ``controller``: 16, 64 and 256 ranks (16 per host agent) each run a tiny model's
  optimizer step every 10 ms (no process group: this row is about the steps' fan-in to
  the controller, not collectives); the controller's CPU time is measured over a phase
  with telemetry on and one with it off, per mesh-wide step, and the part spent in
  the telemetry handler itself (``MeshTelemetry.cpu_seconds``).

    python -m bench telemetry [--quick]   # writes bench/results/telemetry.md
    python -m bench.telemetry [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from bench.common import command_line, write_results


def _trainer() -> Any:
    """The actor class (defined in a function: it pickles by value to the ranks)."""
    from monarch_kernel.actor import Actor, endpoint

    class Trainer(Actor):
        def __init__(self, dim: int, layers: int, ddp: bool) -> None:
            import torch
            import torch.distributed as dist
            from torch import nn

            torch.manual_seed(0)
            torch.set_num_threads(1)
            self.torch = torch
            vocab, self.seq, self.batch = 512, 32, 4

            class Block(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
                    self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
                    self.mlp = nn.Sequential(
                        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                    )

                def forward(self, x: Any) -> Any:
                    h = self.ln1(x)
                    mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
                    x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
                    return x + self.mlp(self.ln2(x))

            class GPT(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.emb = nn.Embedding(vocab, dim)
                    self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
                    self.head = nn.Linear(dim, vocab)

                def forward(self, t: Any) -> Any:
                    return self.head(self.blocks(self.emb(t)))

            model: nn.Module = GPT()
            if ddp:
                if not dist.is_initialized():
                    dist.init_process_group()
                model = nn.parallel.DistributedDataParallel(model)
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            self.vocab = vocab

        def _step(self) -> None:
            torch = self.torch
            tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1))
            self.opt.zero_grad()
            logits = self.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            self.opt.step()

        @endpoint
        def telemetry(self, on: bool) -> bool:
            from monarch_kernel.rank import context, telemetry

            tel = telemetry.installed()
            if on and tel is None:
                rank: Any = context.services()
                out = rank.outbox
                telemetry.install(rank.rank, out.send_stats, out.reply, rank.control.handlers)
            elif not on and tel is not None:
                tel.remove()
            return telemetry.installed() is not None

        @endpoint
        def run(self, steps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                self._step()
            return steps / (time.perf_counter() - t0)

        @endpoint
        def paced(self, seconds: float, every: float) -> int:
            end = time.monotonic() + seconds
            n = 0
            nxt = time.monotonic()
            while time.monotonic() < end:
                self.opt.zero_grad()
                self.opt.step()
                n += 1
                nxt += every
                left = nxt - time.monotonic()
                if left > 0:
                    time.sleep(left)
            return n

    return Trainer


def overhead(ranks: int, steps: int, pairs: int) -> dict[str, Any]:
    """Steps/s of the GPT loop on ``ranks`` ranks, telemetry on vs off (medians)."""
    from monarch_kernel.actor import host_mesh

    per_host = min(ranks, 16)
    hosts = ranks // per_host
    hm = host_mesh(hosts=hosts, backend="local")
    procs = hm.spawn_procs({"gpus": per_host}, timeout=900)
    try:
        dim, layers = (128, 2) if ranks <= 8 else (32, 1)
        trainers = procs.spawn("trainers", _trainer(), dim, layers, True)
        trainers.run.call(3).get(timeout=900)  # warm-up
        rates: dict[bool, list[float]] = {True: [], False: []}
        for i in range(pairs):
            for on in (i % 2 == 0, i % 2 != 0):  # alternate which goes first
                trainers.telemetry.call(on).get(timeout=120)
                got = trainers.run.call(steps).get(timeout=900)
                rates[on].append(min(got.values()))
        rate_on, rate_off = statistics.median(rates[True]), statistics.median(rates[False])
        offs = rates[False]
        noise = abs(offs[0] - offs[-1]) / max(offs) if len(offs) > 1 else 0.0
        return {
            "ranks": ranks,
            "model": f"GPT dim {dim}, {layers} layer(s), seq 32, batch 4, AdamW, DDP",
            "steps_per_s_off": round(rate_off, 3),
            "steps_per_s_on": round(rate_on, 3),
            "overhead": round(1 - rate_on / rate_off, 4),
            "noise_off_vs_off": round(noise, 4),
            "phases": {"on": rates[True], "off": rates[False]},
        }
    finally:
        procs.stop()


def controller_cost(ranks: int, seconds: float, every: float = 0.01) -> dict[str, Any]:
    """The controller's CPU per mesh-wide step with telemetry on and off."""
    from monarch_kernel.actor import host_mesh

    per_host = min(ranks, 16)
    hosts = ranks // per_host
    limit = int(os.environ.get("MONARCH_KERNEL_MAX_LOCAL_RANKS", "0") or 0)
    if limit < ranks:  # a harness of local "hosts": more ranks than the local default
        os.environ["MONARCH_KERNEL_MAX_LOCAL_RANKS"] = str(ranks)
    hm = host_mesh(hosts=hosts, backend="local")
    procs = hm.spawn_procs({"gpus": per_host}, timeout=900)
    try:
        trainers = procs.spawn("tiny", _trainer(), 4, 0, False)
        runtime: Any = procs.runtime
        tel = runtime.telemetry
        out: dict[str, Any] = {"ranks": ranks, "hosts": hosts, "step_every_ms": every * 1000}
        for on in (False, True):
            trainers.telemetry.call(on).get(timeout=120)
            cpu0, handler0, recv0 = time.process_time(), tel.cpu_seconds, tel.received
            steps = trainers.paced.call(seconds, every).get(timeout=seconds + 300)
            time.sleep(0.3)  # the last batches
            mesh_steps = min(steps.values())
            cpu = time.process_time() - cpu0
            key = "on" if on else "off"
            out[f"controller_cpu_ms_per_step_{key}"] = round(1000 * cpu / mesh_steps, 4)
            if on:
                out["telemetry_handler_ms_per_step"] = round(
                    1000 * (tel.cpu_seconds - handler0) / mesh_steps, 4
                )
                out["rank_steps_received"] = tel.received - recv0
        out["added_ms_per_step"] = round(
            out["controller_cpu_ms_per_step_on"] - out["controller_cpu_ms_per_step_off"], 4
        )
        return out
    finally:
        procs.stop()


def hook_cost(iterations: int = 20000) -> dict[str, Any]:
    """The telemetry's own CPU per step on the loop's thread, measured directly: one
    step's hook calls (a data-loader ``__next__``, the optimizer's pre and post hooks,
    one all-reduce issued and completed) and the sender's share of a batch, in a tight
    loop. An A/B of steps/s on a shared 2-core machine is noisier than this figure."""
    import torch

    from monarch_kernel.rank.pg.work import PendingOp
    from monarch_kernel.rank.telemetry.clock import StepClock
    from monarch_kernel.rank.telemetry.sender import StepSender

    sent: list[int] = []
    sender = StepSender(lambda _h, p: sent.append(len(p)), 0)
    clock = StepClock(sender.put)
    bucket = [torch.zeros(1 << 16)]
    t0 = time.perf_counter()
    for _ in range(iterations):
        t = time.perf_counter()
        clock.data(t, t)
        op = PendingOp("allreduce", None, [], None)
        clock.issued(op, bucket, 4)
        watcher = op.watcher
        assert watcher is not None
        watcher(op)  # what finish() calls first
        clock.optimizer_started()
        clock.optimizer_stepped()
    loop = time.perf_counter() - t0
    base0 = time.perf_counter()
    for _ in range(iterations):
        PendingOp("allreduce", None, [], None)  # made with or without telemetry
    base = time.perf_counter() - base0
    # the sender's share: batches of 20 steps (0.1 s of 5 ms steps), encoded and sent
    quiet = StepSender(lambda _h, p: sent.append(len(p)), 0)  # its thread is asleep
    record = clock_record(clock)
    t1 = time.perf_counter()
    for _ in range(iterations // 20):
        quiet._queue.extend([(record, "r1")] * 20)
        quiet.flush()
    flush = time.perf_counter() - t1
    return {
        "us_per_step_loop_thread": round(1e6 * (loop - base) / iterations, 2),
        "us_per_step_sender": round(1e6 * flush / iterations, 2),
    }


def handler_cost(ranks: int, steps: int = 300, per_host: int = 16) -> dict[str, Any]:
    """The controller's telemetry handler alone, in process, fed what ``ranks`` ranks on
    hosts of ``per_host`` send (one ``host_steps`` message per host every 10 steps, as
    at 10 ms a step): its CPU per mesh-wide step, judging included. No ranks run, so
    this row reaches mesh sizes this machine cannot hold (256 ranks of torch do not fit
    in its memory); it leaves out the receiving (one verified message per host per
    0.1 s)."""
    import pickle
    from types import SimpleNamespace

    from monarch_kernel.controller.telemetry import steps as tsteps
    from monarch_kernel.wire.steps import StepBatch, StepRecord, encode_steps

    infos = [SimpleNamespace(host=r // per_host) for r in range(ranks)]
    tel = tsteps.MeshTelemetry("bench", infos)  # type: ignore[arg-type]
    settle, tsteps.SETTLE = tsteps.SETTLE, 0.0
    try:
        messages = []
        for first in range(1, steps + 1, 10):
            for host in range(ranks // per_host):
                by_rank = {}
                for r in range(host * per_host, (host + 1) * per_host):
                    batch = [
                        StepRecord(
                            s,
                            0.0,
                            0.01,
                            0.001,
                            0.006,
                            0.002,
                            0.001,
                            0.0,
                            4096,
                            6144.0,
                            0.002,
                            "all_reduce",
                        )  # fmt: skip
                        for s in range(first, first + 10)
                    ]
                    by_rank[r] = [encode_steps(StepBatch("req", batch))]
                messages.append(({"h": host}, SimpleNamespace(payload=pickle.dumps(by_rank))))
        t0 = time.thread_time()
        for header, msg in messages:
            tel.on_host_steps(header, msg)  # type: ignore[arg-type]
        cpu = time.thread_time() - t0
    finally:
        tsteps.SETTLE = settle
    return {
        "ranks": ranks,
        "hosts": ranks // per_host,
        "handler_ms_per_step": round(1000 * cpu / steps, 4),
        "handler_us_per_rank_step": round(1e6 * cpu / steps / ranks, 3),
    }


def clock_record(clock: Any) -> Any:
    """A step record as the clock makes them."""
    got: list[Any] = []
    clock._sink, sink = (lambda r, _q: got.append(r)), clock._sink
    clock.optimizer_started()
    clock.optimizer_stepped()
    clock._sink = sink
    return got[0]


def run(
    quick: bool = False, rows: frozenset[str] = frozenset({"overhead", "controller"})
) -> dict[str, Any]:
    """Every row of ``rows`` (``quick``: fewer steps and pairs)."""
    steps, pairs, seconds = (20, 2, 2.0) if quick else (40, 4, 5.0)
    result: dict[str, Any] = {
        "overhead": [],
        "controller": [],
        "hooks": hook_cost(),
        "handler": [handler_cost(n) for n in (16, 64, 256)],
    }
    if "overhead" in rows:
        for ranks in (4, 64):
            row = overhead(ranks, steps if ranks <= 8 else steps // 2, pairs)
            print(json.dumps(row), flush=True)
            result["overhead"].append(row)
    if "controller" in rows:
        for ranks in (16, 64):  # 256 ranks of torch exceed this machine's memory: see handler
            row = controller_cost(ranks, seconds)
            print(json.dumps(row), flush=True)
            result["controller"].append(row)
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    """The results as the page bench/results/telemetry.md."""
    lines = [
        "# Step telemetry: overhead and controller cost",
        "",
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs "
        f"({os.uname().nodename})",
        "",
        "| ranks | model | steps/s off | steps/s on | overhead | noise (off vs off) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["overhead"]:
        lines.append(
            f"| {row['ranks']} | {row['model']} | {row['steps_per_s_off']} | "
            f"{row['steps_per_s_on']} | {row['overhead']:.2%} | {row['noise_off_vs_off']:.2%} |"
        )
    hooks = result.get("hooks") or {}
    if hooks:
        per_step = hooks["us_per_step_loop_thread"] + hooks["us_per_step_sender"]
        lines += [
            "",
            f"Measured directly: the hooks cost {hooks['us_per_step_loop_thread']} µs of the "
            f"loop's thread per step and the sender {hooks['us_per_step_sender']} µs per step "
            f"on its own thread: {per_step:.0f} µs, 1% of a {per_step / 10:.1f} ms step.",
        ]
        for row in result["overhead"]:
            step_ms = 1000 / row["steps_per_s_off"]
            share = per_step / 1000 / step_ms
            lines.append(f"- {row['ranks']} ranks: {step_ms:.1f} ms/step, hooks {share:.3%}")
    lines += [
        "",
        "| ranks | hosts | controller CPU ms/step off | on | added | telemetry handler ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for row in result.get("handler", []):
        lines.append(
            f"| {row['ranks']} | {row['hosts']} | (in process) | | | "
            f"{row['handler_ms_per_step']} ({row['handler_us_per_rank_step']} µs a rank) |"
        )
    for row in result["controller"]:
        lines.append(
            f"| {row['ranks']} | {row['hosts']} | {row['controller_cpu_ms_per_step_off']} | "
            f"{row['controller_cpu_ms_per_step_on']} | {row['added_ms_per_step']} | "
            f"{row['telemetry_handler_ms_per_step']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench telemetry")
    ap.add_argument("--quick", action="store_true", help="fewer steps and phases")
    ap.add_argument("--rows", default="overhead,controller", help="overhead, controller or both")
    args = ap.parse_args(argv)
    result = run(args.quick, frozenset(args.rows.split(",")))
    print(json.dumps(result, indent=2))
    text = markdown(result, command_line("telemetry", argv))
    write_results("telemetry.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
