"""The workload benchmark (``python -m bench --bench train``): the GPT-style decoder of
:mod:`bench.train_gpt`, DDP on 4 ranks over gloo, run six ways one after the other on the
same machine, each system in fresh processes:

* ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 4
  --max-restarts 1`` (the floor; the script resumes from its checkpoint when restarted);
* ours, ``%%remote``: a loop over a ``TrainingState`` in a real kernel (jupyter_client),
  ``%mesh tr --gpus 4 --dist``;
* ours, ``%torchrun``: the unchanged script on ``%mesh tr --gpus 4``;
* Monarch 0.7: ``SPMDActor.main`` running the script on ``spawn_procs(per_host={"gpus": 4})``;
* Ray Train: ``TorchTrainer`` (gloo), ``FailureConfig(max_failures=1)``, a Ray checkpoint;
* Dask: ``LocalCluster(n_workers=4, threads_per_worker=1)``, one task per worker forming
  the process group over a TCP rendezvous.

One run of each system: ``warmup`` steps, the timed window of ``steps`` steps (steps/s
from rank 0's completion times), a checkpoint where the system has one, then rank 2 is
SIGKILLed after ``kill_after`` more steps and the run goes on to the end. The loss curves
of the warm-up and the timed window are compared with torchrun's; they must agree within
:data:`LOSS_TOL` or the run fails (the comparison would be void).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil

from bench import train_gpt
from bench.common import Recorder, Settings

HERE = os.path.dirname(os.path.abspath(__file__))

#: System key -> column title.
SYSTEMS = {
    "torchrun": "torchrun (floor)",
    "ours_remote": "ours, %%remote",
    "ours_torchrun": "ours, %torchrun",
    "monarch": "Monarch SPMDActor",
    "ray": "Ray Train",
    "dask": "Dask",
}
#: Largest |loss - torchrun's loss| allowed at any step of the warm-up and timed window.
LOSS_TOL = 1e-3
#: The rank that is killed.
VICTIM = 2


@dataclass
class Plan:
    """What one system's run does (the same for every system)."""

    cfg: train_gpt.Config
    kill_after: int  # steps after the checkpoint before the SIGKILL (0: no kill)
    timeout_s: float


@dataclass
class Outcome:
    """What the parent saw of one system's run."""

    sps: float | None = None
    cold_s: float | None = None
    recover_s: float | None = None
    redone: int | None = None
    driver_rss: float | None = None
    support_rss: float | None = None
    #: CPU the processes other than the ranks used during the timed window (cores).
    support_cpu: float | None = None
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Line:
    kind: str
    fields: list[str]
    t: float


def read_lines(path: str) -> list[Line]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) >= 2:
            try:
                out.append(Line(parts[0], parts[1:-1], float(parts[-1])))
            except ValueError:
                continue
    return out


def command(system: str, cfg: train_gpt.Config) -> list[str]:
    if system == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "1",
            os.path.join(HERE, "train_gpt.py"),
            *cfg.args(),
        ]
    return [sys.executable, "-m", "bench.train_drive", system, json.dumps(dataclasses.asdict(cfg))]


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rss_sample(driver: int, ranks: set[int]) -> tuple[float, float]:
    """(the driver's RSS, the RSS of every process under it that is not a rank or under
    one), in bytes."""
    own = total = 0.0
    skip: set[int] = set()
    for p in tree(driver):
        try:
            if p.pid in ranks:
                skip |= {c.pid for c in p.children(recursive=True)} | {p.pid}
                continue
            if p.pid in skip:
                continue
            rss = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        total += rss
        if p.pid == driver:
            own = rss
    return own, total


def cpu_sample(driver: int, ranks: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of every process under the driver that is not
    a rank or under one, by pid."""
    out: dict[int, float] = {}
    skip: set[int] = set()
    for p in tree(driver):
        try:
            if p.pid in ranks:
                skip |= {c.pid for c in p.children(recursive=True)} | {p.pid}
                continue
            if p.pid in skip:
                continue
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[p.pid] = t.user + t.system
    return out


def run_system(system: str, plan: Plan, work: str) -> Outcome:
    """Launch one system, watch its progress file, kill rank ``VICTIM`` once, measure."""
    cfg = dataclasses.replace(
        plan.cfg,
        progress=os.path.join(work, "progress.log"),
        ckpt=os.path.join(work, "ckpt"),
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if system == "torchrun":
        # Without it the restarted workers read the dead round's gloo addresses from the
        # shared rendezvous store and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    out = Outcome()
    t_launch = time.time()
    with open(os.path.join(work, "driver.log"), "w") as log:
        proc = subprocess.Popen(
            command(system, cfg), cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        kill_at = cfg.ckpt_step + plan.kill_after if plan.kill_after else None
        t_kill: float | None = None
        window = (cfg.warmup, cfg.warmup + cfg.steps)
        driver, rss_own, rss_all = proc.pid, 0.0, 0.0
        cpu_at: list[tuple[float, dict[int, float]]] = []  # window start, window end
        deadline = time.monotonic() + plan.timeout_s
        try:
            while True:
                lines = read_lines(cfg.progress)
                pids = {int(x.fields[0]): int(x.fields[1]) for x in lines if x.kind == "pid"}
                for x in lines:
                    if x.kind == "driver":
                        driver = int(x.fields[0])
                steps = [(int(x.fields[0]), x.t) for x in lines if x.kind == "step"]
                done = max((s for s, _ in steps), default=0)
                if window[0] < done <= window[1]:
                    own, total = rss_sample(driver, set(pids.values()))
                    rss_own, rss_all = max(rss_own, own), max(rss_all, total)
                if (done >= window[0] and not cpu_at) or (done >= window[1] and len(cpu_at) == 1):
                    cpu_at.append((time.monotonic(), cpu_sample(driver, set(pids.values()))))
                if kill_at is not None and t_kill is None and done >= kill_at and VICTIM in pids:
                    t_kill = time.time()
                    os.kill(pids[VICTIM], signal.SIGKILL)
                if proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    out.error = f"timed out after {plan.timeout_s:.0f} s"
                    break
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                stop(proc)
    lines = read_lines(cfg.progress)
    logged = [(int(x.fields[0]), float(x.fields[1]), x.t) for x in lines if x.kind == "step"]
    first: dict[int, tuple[float, float]] = {}
    for s, loss, t in logged:
        first.setdefault(s, (loss, t))
    if logged:
        out.cold_s = logged[0][2] - t_launch
    if all(s in first for s in range(1, window[1] + 1)) and window[0] >= 1:
        t_a, t_b = first[window[0]][1], first[window[1]][1]
        out.sps = cfg.steps / (t_b - t_a)
        out.losses = [first[s][0] for s in range(1, window[1] + 1)]
    out.driver_rss, out.support_rss = (rss_own or None), (rss_all or None)
    if len(cpu_at) == 2:
        (t_a, a), (t_b, b) = cpu_at
        used = sum(b[pid] - a[pid] for pid in b if pid in a)
        out.support_cpu = used / (t_b - t_a) if t_b > t_a else None
    if t_kill is not None:
        # The next step is the first one after the killed rank's replacement started (a
        # step in flight at the kill may still complete on rank 0 before the failure is
        # seen; every system here starts a new process for the killed rank).
        new = [x.t for x in lines if x.kind == "pid" and x.fields[0] == str(VICTIM)]
        back = min((t for t in new if t > t_kill), default=None)
        after = [(s, t) for s, _, t in logged if back is not None and t > back]
        if after:
            out.recover_s = after[0][1] - t_kill
            before = max(s for s, _, t in logged if back is not None and t <= back)
            out.redone = before - after[0][0] + 1
    out.notes = [" ".join(x.fields) for x in lines if x.kind == "retry"]
    if proc.returncode not in (0, None) and out.error is None:
        with open(os.path.join(work, "driver.log")) as f:
            said = [x.strip() for x in f.read().splitlines() if x.strip()]
        why = next((x for x in reversed(said) if "Error" in x or "Exception" in x), "")
        out.error = f"exit code {proc.returncode}" + (f": {why[:240]}" if why else "")
    return out


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a driver and everything under it (SIGTERM, then SIGKILL)."""
    procs = tree(proc.pid)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def plan_for(s: Settings) -> Plan:
    if s.quick:
        cfg = train_gpt.Config(warmup=2, steps=5, extra=4)
    else:
        cfg = train_gpt.Config(warmup=3, steps=30, extra=5)
    return Plan(cfg, kill_after=2, timeout_s=300.0)


def loss_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def record(rec: Recorder, system: str, o: Outcome, base: Outcome | None) -> None:
    def put(key: str, value: float | None, why: str) -> None:
        if value is not None:
            rec.value(f"train_{key}_{system}", value)
        else:
            rec.note(f"train_{key}_{system}", why)

    failed = f"failed: {o.error}" if o.error else "not measured"
    put("sps", o.sps, failed)
    if base is not None and base.sps and o.sps:
        rec.value(f"train_ratio_{system}", o.sps / base.sps)
    put("cold", o.cold_s, failed)
    why = "n/a: " + (o.error or "no step completed after the kill")
    put("recover", o.recover_s, why)
    put("redone", None if o.redone is None else float(o.redone), why)
    put("driver_rss", o.driver_rss, failed)
    put("support_rss", o.support_rss, failed)
    put("support_cpu", o.support_cpu, failed)
    if o.losses:
        rec.value(f"train_loss_{system}", o.losses[-1], losses=o.losses)
    if base is not None and base.losses and o.losses and len(o.losses) == len(base.losses):
        rec.value(f"train_loss_gap_{system}", loss_gap(o.losses, base.losses))
    if o.notes:
        rec.note(f"train_retry_{system}", "; ".join(o.notes)[:300])


def run(s: Settings, rec: Recorder) -> None:
    """The worker's entry point (``python -m bench.worker train``)."""
    if not s.wants("train"):
        return
    plan = plan_for(s)
    rec.note("train_model", train_gpt.describe(plan.cfg))
    base: Outcome | None = None
    outcomes: dict[str, Outcome] = {}
    only = [x for x in os.environ.get("MK_BENCH_TRAIN_ONLY", "").split(",") if x]
    for system in SYSTEMS:
        if only and system not in only and system != "torchrun":
            continue
        work = tempfile.mkdtemp(prefix=f"mk-bench-train-{system}-")
        print(f"  -- {system}", flush=True)
        try:
            o = run_system(system, plan, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        outcomes[system] = o
        if system == "torchrun":
            base = o
        record(rec, system, o, base)
    check = loss_check(outcomes)
    rec.note("train_loss_check", check)
    if check.startswith("FAILED"):
        raise AssertionError(check)


def loss_check(outcomes: dict[str, Outcome]) -> str:
    """Every system's loss curve against torchrun's: ``passed ...`` or ``FAILED ...``."""
    base = outcomes.get("torchrun")
    if base is None or not base.losses:
        return "FAILED: torchrun produced no loss curve"
    gaps, bad = [], []
    for system, o in outcomes.items():
        if system == "torchrun":
            continue
        if len(o.losses) != len(base.losses):
            bad.append(f"{system} (no full curve: {o.error or 'steps missing'})"[:200])
            continue
        gap = loss_gap(o.losses, base.losses)
        gaps.append(gap)
        if gap > LOSS_TOL:
            bad.append(f"{system} (max gap {gap:.2e})")
    steps = len(base.losses)
    if bad:
        return f"FAILED over {steps} steps, tolerance {LOSS_TOL:g}: " + "; ".join(bad)
    return (
        f"passed: {len(gaps)} systems, {steps} steps each, largest |loss - torchrun's| "
        f"{max(gaps, default=0.0):.2e} (tolerance {LOSS_TOL:g}); torchrun's loss "
        f"{base.losses[0]:.4f} -> {base.losses[-1]:.4f}"
    )


if __name__ == "__main__":
    run(Settings(benches=["train"]), Recorder())
