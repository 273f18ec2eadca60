"""Per-step telemetry: what a rank's step spent where, measured by hooks in torch
(no change to the loop), and how the controller judges and shows it.

In process: the step clock on a real optimizer, DataLoader and re-formable process
group of one rank (collectives of a group of one complete in place, so the group's
ops are driven through its watcher as the worker's reader would); the straggler
detector's margins and hysteresis on recorded steps (noise of a loaded machine names
nobody). On real ranks: a 4-rank DDP loop's breakdown reaches the dashboard's model
(its ``steps`` state) with the slow rank's data time and the others' wait.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from test_dashboard import WidgetKernel

from monarch_kernel.controller.telemetry.stragglers import Margins, StragglerDetector
from monarch_kernel.rank.pg.work import PendingOp
from monarch_kernel.rank.telemetry.clock import StepClock
from monarch_kernel.wire.steps import StepBatch, StepRecord, decode_steps, encode_steps


def _record(step: int, data=0.002, compute=0.005, comm=0.001, other=0.0005) -> StepRecord:
    wall = data + compute + comm + other
    return StepRecord(step, time.time(), wall, data, compute, comm, 0.0, other, 0, 0.0, 0.0,
                      "all_reduce")  # fmt: skip


# -- the step clock, in process -----------------------------------------------------------


class _Fixed:
    """A clock the test moves (so the categories are exact)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.unit
def test_clock_splits_a_step_into_data_compute_comm_optimizer():
    got: list[StepRecord] = []
    now = _Fixed()
    clock = StepClock(lambda r, _req: got.append(r), clock=now)
    clock.optimizer_started()
    clock.optimizer_stepped()  # step 1 ends at 100.0: the next one starts there
    clock.data(100.0, 100.010)  # 10 ms in the data loader
    now.t = 100.030  # forward + backward: 20 ms, then the all-reduce is issued
    op = PendingOp("allreduce", None, [], None)
    clock.issued(op, [torch.zeros(256)], 4)
    now.t = 100.045  # blocked 15 ms until it completes
    op.finish(None)
    now.t = 100.046
    clock.optimizer_started()
    now.t = 100.050  # optimizer: 4 ms
    clock.optimizer_stepped()
    rec = got[-1]
    assert rec.step == 2
    assert rec.wall == pytest.approx(0.050)
    assert rec.data == pytest.approx(0.010)
    assert rec.comm == pytest.approx(0.015)
    assert rec.compute == pytest.approx(0.046 - 0.010 - 0.015)
    assert rec.optim == pytest.approx(0.004)
    assert rec.other == pytest.approx(0.0, abs=1e-9)
    assert rec.nbytes == 1024 and rec.bus_bytes == pytest.approx(1024 * 2 * 3 / 4)
    assert rec.wait_op == "all_reduce" and rec.in_flight == pytest.approx(0.015)


@pytest.mark.unit
def test_clock_counts_overlapped_ops_from_the_last_issue_only():
    got: list[StepRecord] = []
    now = _Fixed()
    clock = StepClock(lambda r, _req: got.append(r), clock=now)
    clock.optimizer_stepped()
    ops = [PendingOp("allreduce", None, [], None) for _ in range(3)]
    for i, op in enumerate(ops):  # buckets issued during backward, 5 ms apart
        now.t = 100.0 + 0.005 * (i + 1)
        clock.issued(op, [torch.zeros(4)], 2)
    now.t = 100.020
    ops[0].finish(None)
    now.t = 100.022
    ops[1].finish(None)
    ops[2].finish(None)  # the last completes 7 ms after the last bucket was issued
    clock.optimizer_started()
    clock.optimizer_stepped()
    assert got[-1].comm == pytest.approx(0.007)
    assert got[-1].in_flight == pytest.approx(0.017)


@pytest.mark.unit
def test_a_step_left_open_by_another_request_starts_afresh(monkeypatch):
    from monarch_kernel.rank import context

    got: list[tuple[StepRecord, str | None]] = []
    now = _Fixed()
    clock = StepClock(lambda r, q: got.append((r, q)), clock=now)
    monkeypatch.setattr(context, "current_request", "setup-cell")
    op = PendingOp("broadcast", None, [], None)
    clock.issued(op, [torch.zeros(2)], 2)  # DDP's first broadcast opens a step
    now.t = 100.5
    op.finish(None)
    monkeypatch.setattr(context, "current_request", "loop-cell")
    now.t = 105.0
    clock.data(105.0, 105.010)
    now.t = 105.020
    clock.optimizer_started()
    clock.optimizer_stepped()
    assert [(r.step, q) for r, q in got] == [(1, "loop-cell")]
    assert got[0][0].wall == pytest.approx(0.020) and got[0][0].comm == 0.0


@pytest.mark.unit
def test_real_torch_hooks_time_the_data_loader_and_the_optimizer():
    from torch.utils.data import DataLoader, Dataset

    import monarch_kernel.rank.telemetry as telemetry

    class Slow(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.randn(4)

    sent: list[bytes] = []
    tel = telemetry.install(7, lambda _h, payload: sent.append(payload), lambda *a: None)
    assert tel is not None
    try:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in DataLoader(Slow(), batch_size=None):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        tel.sender.flush()
    finally:
        tel.remove()
    steps = [s for p in sent for s in decode_steps(p).steps]
    assert [s.step for s in steps] == list(range(1, 7))
    for s in steps[1:]:
        assert s.data >= 0.009, s
        assert s.data < s.wall and s.compute >= 0 and s.optim > 0, s
        total = s.data + s.compute + s.comm + s.optim + s.other
        assert total == pytest.approx(s.wall, rel=1e-6, abs=1e-6), s
    assert telemetry.installed() is None  # hooks removed


@pytest.mark.unit
def test_steps_payload_round_trip():
    batch = StepBatch("r12", [_record(1), _record(2, data=0.03)])
    again = decode_steps(encode_steps(batch))
    assert again == batch
    with pytest.raises(ValueError, match="malformed steps payload"):
        decode_steps(b"not a pickle")


@pytest.mark.unit
def test_a_host_agent_sends_its_ranks_batches_on_as_one_message():
    import pickle

    from monarch_kernel.host.step_fanin import STEPS_EVERY, StepFanIn
    from monarch_kernel.wire import kinds as K

    sent: list[tuple[dict, bytes]] = []
    fan = StepFanIn(3, lambda h, p: sent.append((h, p)))
    t0 = time.monotonic()
    for rank in (4, 5, 6, 7):
        fan.add(rank, encode_steps(StepBatch("r1", [_record(1), _record(2)])))
    fan.add(5, encode_steps(StepBatch("r1", [_record(3)])))
    fan.send_due(t0)  # not yet: it waits for the others of its 0.1 s
    assert sent == [] and fan.due is not None and fan.due >= t0 + STEPS_EVERY * 0.99
    fan.send_due(fan.due)
    assert len(sent) == 1 and fan.due is None
    header, payload = sent[0]
    assert header == {"k": K.HOST_STEPS, "h": 3}
    by_rank = pickle.loads(payload)
    assert sorted(by_rank) == [4, 5, 6, 7] and len(by_rank[5]) == 2
    assert [s.step for p in by_rank[5] for s in decode_steps(p).steps] == [1, 2, 3]
    fan.send_due(time.monotonic() + 1)  # nothing waits: nothing sent
    assert len(sent) == 1 and (fan.sent, fan.carried) == (1, 5)


# -- the straggler detector -----------------------------------------------------------


def _judge_all(detector, steps):
    out = []
    for step, records in steps:
        n = detector.judge(step, records)
        if n is not None:
            out.append(n)
    return out


def _world(step, slow=None, category="data", extra=0.03, noise=None, n=4):
    records = {}
    for r in range(n):
        data, compute = 0.002, 0.005
        if noise is not None:
            data += noise.expovariate(1 / 0.004)
            compute += noise.expovariate(1 / 0.006)
        if r == slow:
            if category == "data":
                data += extra
            else:
                compute += extra
        records[r] = (data, compute)
    waits = {}
    longest = max(d + c for d, c in records.values())
    for r, (d, c) in records.items():
        waits[r] = longest - (d + c) + 0.0005
    return step, {
        r: _record(step, data=d, compute=c, comm=waits[r]) for r, (d, c) in records.items()
    }


@pytest.mark.unit
def test_detector_names_a_rank_after_consecutive_steps_and_its_recovery():
    det = StragglerDetector(lambda r: f"host-{r // 2}")
    notices = _judge_all(det, [_world(s, slow=2) for s in range(1, 12)])
    assert len(notices) == 1
    first = notices[0]
    assert (first.rank, first.category, first.step, first.recovered) == (2, "data", 5, False)
    assert first.line().startswith("rank 2 (host-1) is the straggler: data loading 32 ms/step")
    assert "vs 2 ms median; ranks wait 30 ms/step in all_reduce" in first.line()
    notices = _judge_all(det, [_world(s) for s in range(12, 20)])
    assert [(n.rank, n.recovered, n.step) for n in notices] == [(2, True, 15)]
    assert "is no longer the straggler" in notices[0].line()


@pytest.mark.unit
def test_detector_blames_compute_and_keeps_quiet_on_noise():
    det = StragglerDetector(lambda r: "host-0")
    notices = _judge_all(det, [_world(s, slow=1, category="compute") for s in range(1, 8)])
    assert [(n.rank, n.category) for n in notices] == [(1, "compute")]
    # a loaded machine: every rank's times jitter by several ms, heavy-tailed
    rng = random.Random(5)
    det = StragglerDetector(lambda r: "host-0")
    assert _judge_all(det, [_world(s, noise=rng) for s in range(1, 2000)]) == []


@pytest.mark.unit
def test_detector_margins_are_absolute_and_relative():
    det = StragglerDetector(lambda r: "host-0", Margins(steps=3))
    # 10 ms above a 2 ms median: above twice the median but under the absolute margin
    assert _judge_all(det, [_world(s, slow=0, extra=0.010) for s in range(1, 30)]) == []
    # a slow mesh: 20 ms above a 100 ms median is under the relative margin
    records = [
        (s, {r: _record(s, compute=0.100 + (0.020 if r == 3 else 0), comm=0.02) for r in range(4)})
        for s in range(1, 30)
    ]
    assert _judge_all(det, records) == []
    # interrupted streaks name nobody
    steps = [_world(s, slow=2 if s % 3 else None) for s in range(1, 30)]
    assert _judge_all(det, steps) == []


# -- on real ranks: the dashboard's model ---------------------------------------------

LOOP = """\
%%remote tm
import os, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
RANK = int(os.environ["RANK"])
ddp = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
class Batches(Dataset):
    def __len__(self):
        return 60
    def __getitem__(self, i):
        if RANK == 2:
            time.sleep(0.03)
        return torch.randn(8)
for x in DataLoader(Batches(), batch_size=None):
    opt.zero_grad()
    ddp(x[None]).sum().backward()
    opt.step()
"""


@pytest.mark.local
def test_the_dashboard_model_carries_the_per_rank_breakdown():
    k = WidgetKernel()
    try:
        r = k.run("%mesh tm --gpus 4 --dist", timeout=120)
        assert "process group initialised" in r.stdout, r.stdout + r.error_text
        r = k.run(LOOP, timeout=120)
        assert not r.errors, r.error_text

        def steps_model() -> dict:
            for m in k.models.values():
                s = m.get("steps")
                if s and s.get("ranks") == [0, 1, 2, 3] and min(s["step"]) >= 40:
                    return s
            return {}

        k.wait_for(lambda: steps_model(), timeout=30, what="the step view's model")
        s = steps_model()
        assert s["data"][2] >= 25, s
        assert max(s["data"][r] for r in (0, 1, 3)) < 10, s
        assert min(s["comm"][r] for r in (0, 1, 3)) >= 15, s  # they wait for rank 2
        assert min(s["bus_bytes_per_s"]) > 0, s  # every rank moved its gradients
        assert s["straggler"].startswith("rank 2 (host-0) is the straggler: data loading"), s
        view = next(m["value"] for m in k.models.values() if m.get("steps") == s)
        assert "Where the time goes" in view and "mk-step-heat" in view
        assert view.count("mk-step-row") == 4
    finally:
        k.shutdown_and_check()


@pytest.mark.unit
def test_detector_on_a_large_mesh_names_one_rank_among_many():
    det = StragglerDetector(lambda r: f"host-{r // 8}")
    rng = random.Random(11)
    steps = [_world(s, slow=21, extra=0.04, noise=rng, n=32) for s in range(1, 10)]
    notices = _judge_all(det, steps)
    assert [(n.rank, n.host, n.category) for n in notices] == [(21, "host-2", "data")]
    det = StragglerDetector(lambda r: "host-0")
    assert _judge_all(det, [_world(s, noise=rng, n=32) for s in range(1, 500)]) == []
