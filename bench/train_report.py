"""The workload section of the report: one column per system of :mod:`bench.train`,
figures and ratios to torchrun, the loss check, and what each system needed."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from bench.runner import PeerRun
from bench.train import LOSS_TOL, SYSTEMS, VICTIM


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


#: (key, label, unit, better, ratio to torchrun?)
ROWS = [
    ("sps", "steps/s, DDP on 4 ranks", "steps/s", "higher", True),
    ("cold", "nothing -> first step completed (cold)", "s", "lower", True),
    ("recover", f"SIGKILL of rank {VICTIM} -> next step completed", "s", "lower", True),
    ("redone", "completed steps done again after the kill", "steps", "lower", False),
    ("driver_rss", "controller / driver process memory (RSS)", "MiB", "lower", True),
    ("support_rss", "all processes but the ranks (RSS)", "MiB", "lower", True),
    ("support_cpu", "CPU of all processes but the ranks while training", "cores", "lower", False),
    ("loss", "loss at the end of the timed window (rank 0)", "", "lower", False),
    ("loss_gap", "largest |loss - torchrun's loss| over those steps", "", "lower", False),
]


def _cell(entry: dict[str, Any] | None, unit: str, notes: list[str]) -> tuple[str, float | None]:
    if entry is None:
        return "—", None
    if "value" not in entry:
        text = entry["note"]
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]", None
    v = float(entry["value"])
    if unit == "MiB":
        return f"{v / 2**20:,.0f} MiB", v
    if unit == "s":
        return f"{v:.2f} s", v
    if unit == "steps/s":
        return f"{v:.3g} steps/s", v
    if unit == "cores":
        return f"{v:.3f} cores", v
    if unit == "steps":
        return f"{v:.0f}", v
    return f"{v:.4g}", v


def section(run: PeerRun) -> list[str]:
    """The Markdown lines of the workload section."""
    r = run.results
    if "_unavailable" in r:
        return ["## Training workload", "", r["_unavailable"]["note"], ""]
    notes: list[str] = []
    systems = [s for s in SYSTEMS if any(k.endswith(f"_{s}") for k in r)]
    head = ["", *(SYSTEMS[s] for s in systems)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, unit, better, ratio in ROWS:
        cells, vals = [], {}
        for s in systems:
            text, v = _cell(r.get(f"train_{key}_{s}"), unit, notes)
            cells.append(text)
            if v is not None:
                vals[s] = v
        arrow = "↓" if better == "lower" else "↑"
        lines.append(f"| {label} ({arrow}) | " + " | ".join(cells) + " |")
        base = vals.get("torchrun")
        if ratio and base:
            ratios = [f"{vals[s] / base:.3f}×" if s in vals else "—" for s in systems]
            lines.append(f"| {label}, ÷ torchrun | " + " | ".join(ratios) + " |")
    check = r.get("train_loss_check", {}).get("note", "not run")
    model = r.get("train_model", {}).get("note", "")
    retries = [
        f"{SYSTEMS[s]}: {r[f'train_retry_{s}']['note']}" for s in systems if f"train_retry_{s}" in r
    ]
    out = [
        "## Training workload (GPT-style decoder, DDP on 4 ranks over gloo)",
        "",
        f"Model: {model}. Every system runs `bench/train_gpt.py` (the same init seed, the same "
        "synthetic batches per rank and step), one after the other in fresh processes.",
        "",
        f"**Loss check: {check}**",
        "",
        *lines,
        "",
        *[f"[{i + 1}] {t}" for i, t in enumerate(notes)],
        "",
    ]
    if retries:
        out += ["What the drivers caught before running again: " + "; ".join(retries), ""]
    if run.error:
        out += [f"The workload worker {run.error}.", ""]
    return out + how() + [""]


def how() -> list[str]:
    return [
        "How: each system trains `warmup` steps, then the timed window (steps/s = steps ÷ "
        "the time between rank 0 completing the window's first and last step, from rank 0's "
        "progress lines), then writes a checkpoint where it has a checkpoint path (torchrun "
        "script, Dask, Monarch, `%torchrun`: `torch.save` on rank 0; Ray Train: "
        "`ray.train.report(checkpoint=...)`; ours `%%remote` writes none: `TrainingState` "
        "takes a dead rank's state from a live replica), then after 2 more steps rank "
        f"{VICTIM}'s process is SIGKILLed and the time to the next step completed by rank 0 "
        "is measured. Cold: from launching the driver (or torchrun) to rank 0's first "
        "completed step, torch imports and cluster start included. Memory: the highest "
        "RSS sampled during the timed window; ours' controller is the kernel process (the "
        "jupyter_client driver plays the notebook and is not counted); 'all processes but "
        "the ranks' sums the driver's process tree without the ranks (ours: kernel + host "
        f"agent; Ray: driver + GCS, raylet and Train's controller actors; Dask: client + "
        f"scheduler thread + nannies); their CPU is their CPU seconds during the timed window "
        f"÷ its length (on 2 cores, what they take from the ranks). The loss check "
        f"compares rank 0's loss at every step of "
        f"the warm-up and timed window with torchrun's (tolerance {LOSS_TOL:g}).",
        "",
        "Systems and settings: "
        f"torch {_version('torch')}: `torchrun --standalone --nproc-per-node 4 "
        "--max-restarts 1` with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (without it the "
        "restarted workers read the dead round's gloo addresses, pytorch/pytorch#135712); "
        "ours: `%mesh tr --gpus 4 --dist` and a foreground `%%remote` loop over "
        "`TrainingState` (failure policy: the default, restart), and `%mesh tr --gpus 4` + "
        "`%torchrun tr bench/train_gpt.py ...` (after a death the cell fails, the mesh "
        "restarts the rank, the driver runs the cell again: the script resumes from its "
        f"checkpoint); Monarch {_version('torchmonarch')}: `SPMDActor.main` on "
        '`this_host().spawn_procs(per_host={"gpus": 4})` (Monarch 0.7 restarts no process: '
        "the call fails, the driver spawns a new mesh and calls again); Ray "
        f"{_version('ray')}: `TorchTrainer` (Train v2, `TorchConfig(backend='gloo')`, "
        "`ScalingConfig(num_workers=4)`, `FailureConfig(max_failures=1)`, "
        "`ray.init(num_cpus=5)`); Dask "
        f"{_version('distributed')}: `LocalCluster(n_workers=4, threads_per_worker=1)`, "
        "one task per worker calling `init_process_group('gloo', 'tcp://...')`; on a failure "
        "the driver waits for the nanny's restarted worker and submits the 4 tasks again. "
        "All ranks run with `OMP_NUM_THREADS=1` (torchrun's default).",
    ]
