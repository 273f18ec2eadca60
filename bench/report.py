"""The Markdown report: machine info, one table of absolute figures and ratios, notes."""

from __future__ import annotations

import ast
import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from bench import train_report
from bench.common import (
    FANOUT_MIB,
    FANOUT_RANKS,
    FANOUT_ROW,
    SMALL_MESH,
    Settings,
    back_sizes,
)
from bench.runner import PeerRun
from bench.shm_floor import MODES as SHM_MODES
from bench.wire_floor import MODES

#: What each wire-floor mode (bench/wire_floor.py) sends, for the row labels.
WIRE_LABELS = {
    "pickled": "pickles only",
    "framed": "+ our header",
    "hmac": "+ HMAC-SHA256 (until protocol 14)",
    "signed": "+ keyed BLAKE2b (ours)",
    "codec": "our Codec (+ replay window)",
}
#: The same for the shared-memory floor's modes (bench/shm_floor.py).
SHM_LABELS = {
    "raw": "1 byte, eventfd wake-ups",
    "codec": "our Codec, eventfd wake-ups",
}

HERE = os.path.dirname(os.path.abspath(__file__))

PEERS = {  # key -> (column title, distribution whose version is shown, module file)
    "ours": ("ours", "monarch_kernel", "ours.py"),
    "zmq": ("raw ZeroMQ (floor)", "pyzmq", "raw_zmq.py"),
    "monarch": ("Monarch", "torchmonarch", "monarch_peer.py"),
    "ray": ("Ray", "ray", "ray_peer.py"),
    "ipp": ("ipyparallel", "ipyparallel", "ipp_peer.py"),
    "dask": ("Dask", "distributed", "dask_peer.py"),
    "train": ("training workload", "torch", "train.py"),
}
COMPARED = ["zmq", "monarch", "ray", "ipp", "dask"]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str  # us | ms | s | MiB/s | msg/s | "" (static text)
    better: str = "lower"  # lower | higher
    static: str = ""  # text for every column (a pending or missing benchmark)


def rows(s: Settings) -> list[Row]:
    out = [
        Row("rtt", "1. one-rank call round trip, median", "us"),
        Row("rtt_p99", "1. one-rank call round trip, p99", "us"),
        Row("rtt_floor", "1. raw ZeroMQ round trip beside the mesh, alternating, median", "us"),
        Row("rtt_floor_p99", "1. raw ZeroMQ round trip beside the mesh, alternating, p99", "us"),
        Row("rtt_vs_floor", "1. one-rank call ÷ raw beside it (same conditions), median", "x"),
        Row("rtt_p99_vs_floor", "1. one-rank call ÷ raw beside it (same conditions), p99", "x"),
        Row(
            "rtt_floor_spin",
            "1. raw ZeroMQ round trip, both ends spinning before they block as ours, median",
            "us",
        ),
        Row("rtt_vs_floor_spin", "1. one-rank call ÷ that spinning raw beside it, median", "x"),
    ]
    out += [Row(f"call_{n}", f"2. call {n} rank(s), gathered", "us") for n in s.call_ns]
    for n in s.call_ns:
        out += [
            Row(f"call_{n}_beside", f"2. call {n} rank(s), alternating with the raw beside", "us"),
            Row(f"call_{n}_floor", f"2. raw ZeroMQ to {n} processes beside the mesh", "us"),
            Row(f"call_{n}_vs_floor", f"2. call {n} rank(s) ÷ raw beside it", "x"),
        ]
        if n <= SMALL_MESH:
            out += [
                Row(
                    f"call_{n}_wire_{mode}_vs_floor",
                    f"2. wire floor to {n}: {WIRE_LABELS[mode]} ÷ raw beside it",
                    "x",
                )
                for mode in MODES
            ]
            out += [
                Row(
                    f"call_{n}_shm_{mode}_vs_floor",
                    f"2. shared-memory floor to {n}: {SHM_LABELS[mode]} ÷ raw beside it",
                    "x",
                )
                for mode in SHM_MODES
            ]
    out.append(
        Row(
            "bcast",
            f"3. fire-and-forget broadcast to {s.bcast_ranks} ranks, delivered",
            "msg/s",
            "higher",
        )
    )
    out.append(Row("pipe", "3. pipelined calls to one rank, 1,000 in flight", "calls/s", "higher"))
    for mib in s.tensor_mib:
        out.append(
            Row(f"tensor_{mib}", f"4. {mib} MiB tensor controller -> rank", "MiB/s", "higher")
        )
        out.append(
            Row(
                f"tensor_{mib}_floor",
                f"4. {mib} MiB raw ZeroMQ beside the mesh, alternating",
                "MiB/s",
                "higher",
            )
        )
        out.append(
            Row(
                f"tensor_{mib}_vs_floor",
                f"4. {mib} MiB controller -> rank ÷ raw beside it (same conditions)",
                "x",
                "higher",
            )
        )
        if mib == 1:
            out.append(
                Row(
                    f"tensor_{mib}_ipc_floor",
                    f"4. {mib} MiB raw ZeroMQ over unix sockets (a local mesh's transport), "
                    "beside the mesh",
                    "MiB/s",
                    "higher",
                )
            )
            out.append(
                Row(
                    f"tensor_{mib}_vs_ipc_floor",
                    f"4. {mib} MiB controller -> rank ÷ raw over unix sockets beside it",
                    "x",
                    "higher",
                )
            )
        out.append(
            Row(
                f"tensor_rdma_{mib}",
                f"4. {mib} MiB tensor via Monarch RDMABuffer (TCP)",
                "MiB/s",
                "higher",
            )
        )
        out.append(
            Row(f"memcpy_{mib}", f"4. {mib} MiB torch clone (memcpy bound)", "MiB/s", "higher")
        )
    for mib in back_sizes(s):
        key = f"tensor_back_{mib}"
        out.append(
            Row(key, f"4. {mib} MiB tensor rank -> controller (a call's result)", "MiB/s", "higher")
        )
        out.append(
            Row(
                f"{key}_floor",
                f"4. {mib} MiB raw ZeroMQ server -> client beside the mesh, alternating",
                "MiB/s",
                "higher",
            )
        )
        out.append(
            Row(
                f"{key}_vs_floor",
                f"4. {mib} MiB rank -> controller ÷ raw beside it (same conditions)",
                "x",
                "higher",
            )
        )
    fan, size = FANOUT_ROW, f"{FANOUT_MIB} MiB"
    out.append(
        Row(fan, f"4. {size} tensor to {FANOUT_RANKS} ranks, gathered call", "MiB/s", "higher")
    )
    out.append(
        Row(
            f"{fan}_floor",
            f"4. {size} raw ZeroMQ to {FANOUT_RANKS} processes, beside the mesh",
            "MiB/s",
            "higher",
        )
    )
    out.append(
        Row(
            f"{fan}_vs_floor",
            f"4. {size} to {FANOUT_RANKS} ranks ÷ raw to as many processes beside it",
            "x",
            "higher",
        )
    )
    for mib in s.tensor_mib:
        out.append(
            Row(
                f"r2r_shm_{mib}",
                f"4. {mib} MiB tensor rank -> rank, same host (shm)",
                "MiB/s",
                "higher",
            )
        )
        out.append(
            Row(
                f"r2r_tcp_{mib}",
                f"4. {mib} MiB tensor rank -> rank, other host (TCP)",
                "MiB/s",
                "higher",
            )
        )
        out.append(
            Row(
                f"r2r_share_{mib}",
                f"4. {mib} MiB `share()` (storage moved into shared memory in place)",
                "MiB/s",
                "higher",
            )
        )
    out.append(Row("init", "5. cluster/runtime init (ray.init)", "s"))
    for n in s.ready_sizes:
        out.append(Row(f"ready_{n}_cold", f"5. mesh of {n} ready, torch imported, cold", "s"))
        out.append(Row(f"ready_{n}_warm", f"5. mesh of {n} ready, pre-warmed host agent", "s"))
    out.append(Row("stop_4", "5. stop a mesh of 4", "s"))
    out.append(Row("plain_cell", "6. an empty cell in the same kernel (baseline)", "ms"))
    out.append(Row("remote_1", "6. trivial %%remote cell on 1 rank (%px for ipyparallel)", "ms"))
    out.append(Row("remote_4", "6. trivial %%remote cell on 4 ranks (%px for ipyparallel)", "ms"))
    out.append(Row("print_delay", "6. rank print -> notebook output", "ms"))
    out.append(Row("bar_delay", "6. rank progress-bar frame (\\r) -> notebook bar redrawn", "ms"))
    out.append(Row("bar_delay_ipykernel", "6. same bar frames in plain ipykernel -> stream", "ms"))
    out.append(
        Row(
            "lines_remote",
            "6. print flood: lines/s from one rank to the notebook",
            "lines/s",
            "higher",
        )
    )
    out.append(
        Row("lines_ipykernel", "6. print flood: same lines in plain ipykernel", "lines/s", "higher")
    )
    out.append(Row("lines_ratio", "6. print flood, ours ÷ plain ipykernel", "x", "higher"))
    out.append(Row("death", "7. rank death noticed (SIGKILL -> future raises)", "ms"))
    out.append(Row("interrupt", "7. interrupt -> running call stopped", "ms"))
    out.append(
        Row("death_collective", "7. rank SIGKILLed inside all_reduce -> call on 4 raises", "ms")
    )
    out.append(Row("raise_collective", "7. rank raises, 3 wait in all_reduce -> call raises", "ms"))
    out.append(Row("restart_1of4", "7. restart 1 rank of 4 + re-form process group", "s"))
    out += [
        Row(
            "peer_first_step", "7. SIGKILL -> first step done, 100M params, state from a peer", "s"
        ),
        Row("peer_recovery", "7. SIGKILL -> survivors resume (state from a peer)", "s"),
        Row("peer_step", "7. one training step of that model (4 ranks, for scale)", "s"),
        Row("peer_state_gb", "7. state copied from the peer (params + momentum)", "GB"),
        Row("peer_state_gbps", "7. state transfer from the peer", "GB/s", "higher"),
        Row("peer_raw_gbps", "7. raw data plane, same bytes, same ranks", "GB/s", "higher"),
        Row("peer_steps_lost", "7. steps lost (state from a peer)", "steps"),
        Row("disk_first_step", "7. SIGKILL -> first step done, disk checkpoint", "s"),
        Row("disk_steps_lost", "7. steps lost (disk checkpoint every 10 steps)", "steps"),
        Row("elastic_grow", "7. grow 2 -> 4 ranks mid-training, 100 MB model: pause", "s"),
        Row("elastic_grow_gap", "7. grow 2 -> 4: longest gap between two steps", "s"),
        Row("elastic_shrink", "7. shrink 4 -> 3 ranks mid-training: pause", "s"),
        Row("elastic_restarted", "7. survivors restarted by grow + shrink", "ranks"),
    ]
    out.append(Row("attach_dashboard", "7. %mesh attach -> dashboard with the whole history", "s"))
    out.append(
        Row(
            "attached_sps",
            "7. steps/s (report + print) with a kernel attached",
            "steps/s",
            "higher",
        )
    )
    out.append(Row("detached_sps", "7. same loop while no kernel is attached", "steps/s", "higher"))
    out.append(Row("detached_ratio", "7. steps/s detached ÷ attached", "x", "higher"))
    out.append(Row("ddp_mesh_sps", "8. DDP steps/s, 2 ranks in a mesh", "steps/s", "higher"))
    out.append(
        Row("ddp_torchrun_sps", "8. DDP steps/s, same script under torchrun", "steps/s", "higher")
    )
    out.append(Row("ddp_ratio", "8. DDP throughput, mesh ÷ torchrun", "x", "higher"))
    out.append(Row("ddp_stop_idle", "8. stop button -> every rank idle, DDP loop on 4 ranks", "ms"))
    out.append(
        Row("ddp_step_mkgloo", "8. DDP step, 25 MB bucket, 4 ranks, re-formable group", "ms")
    )
    out.append(Row("ddp_step_gloo", "8. DDP step, 25 MB bucket, 4 ranks, torch's gloo", "ms"))
    out.append(Row("ddp_step_overhead", "8. DDP step, re-formable ÷ torch's gloo", "x"))
    out += [
        Row("xhost_rtt", "9. call round trip, controller -> rank on another netns host", "us"),
        Row("xhost_zmq_rtt", "9. raw ZeroMQ round trip over the same veth, plain", "us"),
        Row("xhost_zmq_curve_rtt", "9. raw ZeroMQ round trip over the same veth, CURVE", "us"),
        Row("xhost_rtt_ratio", "9. cross-host round trip, ours ÷ raw CURVE", "x"),
        Row("xhost_r2r_64", "9. 64 MiB tensor rank -> rank across netns hosts", "MiB/s", "higher"),
        Row("xhost_zmq_64", "9. raw ZeroMQ 64 MiB over the same veth, plain", "MiB/s", "higher"),
        Row(
            "xhost_zmq_curve_64",
            "9. raw ZeroMQ 64 MiB over the same veth, CURVE",
            "MiB/s",
            "higher",
        ),
        Row("xhost_r2r_ratio", "9. cross-host 64 MiB, ours ÷ raw CURVE", "x", "higher"),
        Row("xhost_r2r_plain_ratio", "9. cross-host 64 MiB, ours ÷ raw plain", "x", "higher"),
        Row(
            "xhost_r2r_64_enc",
            "9. same, data plane encrypted (MONARCH_KERNEL_ENCRYPT_DATA=1)",
            "MiB/s",
            "higher",
        ),
        Row("xhost_r2r_enc_ratio", "9. encrypted 64 MiB, ours ÷ raw CURVE", "x", "higher"),
        Row("xhost_a2a", "9. actor -> actor round trip across netns hosts (rank to rank)", "us"),
        Row("xhost_a2a_p99", "9. actor -> actor across netns hosts, p99", "us"),
        Row("xhost_a2a_ratio", "9. actor -> actor across netns hosts, ours ÷ raw CURVE", "x"),
        Row("ray_cluster_up", "10. two-node Ray cluster up (head + namespace node)", "s"),
        Row("ray_ready_2x1", "10. %mesh --backend ray --hosts 2 -> ready mesh", "s"),
        Row("ray_actors_2", "10. Ray's own: STRICT_SPREAD group + 2 actors answered", "s"),
        Row("ray_ready_ratio", "10. ready 2-host mesh on Ray, ours ÷ Ray's own actors", "x"),
        Row("slurm_cluster_up", "10. Slurm up (slurmctld + 2 namespace slurmd)", "s"),
        Row("slurm_ready_2x1", "10. %mesh --backend slurm --hosts 2 --gpus 1 -> ready", "s"),
        Row("slurm_ready_2x2", "10. %mesh --backend slurm --hosts 2 --gpus 2 -> ready", "s"),
        Row("a2a", "11. actor -> actor call round trip across meshes (rank to rank)", "us"),
        Row("a2a_p99", "11. actor -> actor call round trip, p99", "us"),
        Row("dap_panel_ipykernel", "12. stopped -> Debugger panel filled, plain ipykernel", "ms"),
        Row("dap_panel_4", "12. stopped -> Debugger panel filled, %%remote on 4 ranks", "ms"),
        Row("dap_panel_ratio", "12. panel filled, 4 ranks ÷ plain ipykernel (local cell)", "x"),
        Row("dap_panel_64", "12. stopped -> Debugger panel filled, 64 ranks paused", "ms"),
        Row("dap_threads_64", "12. DAP threads, 64 ranks paused", "ms"),
        Row("dap_stack_64", "12. DAP stackTrace, 64 ranks paused", "ms"),
    ]
    return out


SCALE = {
    "us": 1e6,
    "ms": 1e3,
    "s": 1.0,
    "MiB/s": 1.0,
    "msg/s": 1.0,
    "calls/s": 1.0,
    "lines/s": 1.0,
    "steps/s": 1.0,
    "x": 1.0,
    "GB/s": 1.0,
    "GB": 1.0,
    "steps": 1.0,
    "ranks": 1.0,
}


def fmt(value: float, unit: str) -> str:
    v = value * SCALE[unit]
    if unit == "s":
        return f"{v:.2f} s"
    if v >= 100:
        return f"{v:,.0f} {unit}".replace("us", "µs")
    return f"{v:.3g} {unit}".replace("us", "µs")


class Notes:
    """Footnotes: identical texts share one number."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        label = text.split(":", 1)[0] if ":" in text[:30] else "see"
        return f"{label} [{self.texts.index(text) + 1}]"


def table(runs: dict[str, PeerRun], s: Settings) -> tuple[str, list[str]]:
    present = [p for p in ["ours", *COMPARED] if p in runs]
    ratio_to = [p for p in present if p != "ours"] if "ours" in runs else []
    notes = Notes()
    head = ["benchmark", *(column(p) for p in present)]
    head += [f"ours ÷ {'floor' if p == 'zmq' else PEERS[p][0]}" for p in ratio_to]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows(s):
        if row.static:
            if "ours" in runs:
                filler = ["—"] * (len(present) - 1 + len(ratio_to))
                lines.append("| " + " | ".join([row.label, row.static, *filler]) + " |")
            continue
        cells: list[str] = []
        values: dict[str, float] = {}
        for p in present:
            cell, value = cell_for(runs[p], row, notes)
            cells.append(cell)
            if value is not None:
                values[p] = value
        if all(c in ("—", "not available") for c in cells):
            continue  # a row nobody measured (RDMA rows without Monarch, --bench ...)
        for p in ratio_to:
            if "ours" in values and p in values and values[p] > 0:
                cells.append(f"{values['ours'] / values[p]:#.3g}×")
            else:
                cells.append("—")
        arrow = "↓" if row.better == "lower" else "↑"
        lines.append("| " + " | ".join([f"{row.label} ({arrow})", *cells]) + " |")
    footnotes = [f"[{i + 1}] {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(lines), footnotes


def column(p: str) -> str:
    title, dist, _ = PEERS[p]
    return f"{title} {version(dist)}" if p in ("monarch", "ray", "ipp", "dask") else title


def cell_for(run: PeerRun, row: Row, notes: Notes) -> tuple[str, float | None]:
    unavailable = run.results.get("_unavailable")
    if unavailable:
        return "not available", None
    entry = run.results.get(row.key)
    if entry is None:
        if run.error:
            return notes.ref(f"missing: {run.peer} worker {run.error}"), None
        return "—", None
    if "value" in entry:
        return fmt(entry["value"], row.unit), entry["value"]
    return notes.ref(entry["note"]), None


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    """The checkout's short commit, and whether the package had uncommitted changes."""
    out = git("rev-parse", "--short", "HEAD") or "?"
    if git("status", "--porcelain", "--", ":/monarch_kernel"):
        out += " + uncommitted changes in monarch_kernel/"
    return out


def memory() -> str:
    try:
        import psutil

        return f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        return "?"


def now_utc() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"


def generated_by(command: str) -> str:
    """The line under the title of every file the benchmarks write into bench/results/:
    what wrote it, when, on what machine. Those files are never edited by hand (the README
    links to them instead of quoting their figures): run the command again."""
    gpu = "a GPU" if _has_gpu() else "no GPU"
    return (
        f"Generated by `{command}` (`make bench` runs `python -m bench` and "
        f"`python -m bench scale`) on {now_utc()}: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"{memory()} RAM, {gpu}; monarch_kernel git {commit()}. Do not edit by hand: run the "
        "command again."
    )


def machine_info() -> list[str]:
    import zmq

    mem = memory()
    return [
        f"- date: {now_utc()}",
        f"- CPU: {cpu_model()}, {os.cpu_count()} cores, {mem} RAM, no GPU"
        if not _has_gpu()
        else f"- CPU: {cpu_model()}, {os.cpu_count()} cores, {mem} RAM",
        f"- OS: {platform.platform()}",
        f"- Python {platform.python_version()} ({sys.executable})",
        f"- pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}",
        f"- torch {version('torch')}",
        f"- monarch_kernel {version('monarch_kernel')} (git {commit()})",
        f"- torchmonarch {version('torchmonarch')}, ray {version('ray')}, "
        f"ipyparallel {version('ipyparallel')}, dask.distributed {version('distributed')}",
    ]


def git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE)
    except OSError:
        return ""
    return done.stdout.strip()


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidia0")


def peer_settings(runs: dict[str, PeerRun]) -> list[str]:
    out = []
    for p, run in runs.items():
        title, dist, module = PEERS[p]
        with open(os.path.join(HERE, module)) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        doc = " ".join(doc.split())
        status = run.results.get("_unavailable", {}).get("note")
        if not status:
            status = f"worker {run.error}" if run.error else "ran"
            status += f" in {run.wall_s:.0f} s"
        if run.leftovers:
            status += f"; leftover processes killed: {'; '.join(run.leftovers)}"
        out.append(f"- **{title}** ({dist} {version(dist)}): {status}. {doc}")
    return out


def markdown(
    runs: dict[str, PeerRun],
    s: Settings,
    total_s: float,
    load: list[str],
    command: str = "python -m bench",
) -> str:
    train = runs.get("train")
    runs = {p: r for p, r in runs.items() if p != "train"}
    body, footnotes = table(runs, s) if runs else ("(no peer benchmarks in this run)", [])
    mode = "quick" if s.quick else "full"
    parts = [
        "# Benchmarks: monarch_kernel vs raw ZeroMQ, Monarch, Ray, ipyparallel, Dask",
        "",
        generated_by(command),
        "",
        f"One `python -m bench` run ({mode} mode), {total_s:.0f} s in all, every system on the "
        "same machine in the same run, one after another, each in a fresh process. Figures are "
        "medians after warm-up (p99 where it says so); ↓ lower is better, ↑ higher is better. "
        "Ratios are ours ÷ peer: below 1 means ours is faster for ↓ rows, above 1 for ↑ rows. "
        "MiB = 2^20 bytes.",
        "",
        "## Machine",
        "",
        *machine_info(),
        f"- load average (1 min) before / after: {load[0]} / {load[1]} "
        "(other jobs share this machine; compare ratios from one run, not absolute figures "
        "across runs)",
        "",
        "## Results",
        "",
        body,
        "",
        *footnotes,
        "",
        *noise_line(runs),
        *(train_report.section(train) if train is not None else []),
        "## How each figure is measured",
        "",
        *how_measured(s),
        "",
        "## Peers and their settings",
        "",
        *peer_settings(runs),
        "",
    ]
    return "\n".join(parts)


def noise_line(runs: dict[str, PeerRun]) -> list[str]:
    """The raw ZeroMQ round trip as re-measured just before each peer ran (noise check)."""
    seen = []
    for p, run in runs.items():
        entry = run.results.get("floor_rtt" if p != "zmq" else "rtt", {})
        if "value" in entry:
            seen.append(f"{PEERS[p][0]} {fmt(entry['value'], 'us')}")
    if len(seen) < 2:
        return []
    return [
        "Noise check: the raw ZeroMQ round trip, re-measured in each peer's process just "
        "before its benchmarks: " + ", ".join(seen) + ".",
        "",
    ]


def how_measured(s: Settings) -> list[str]:
    big = ", ".join(str(n) for n in s.big_ns)
    lines = [
        "1. A no-op endpoint on one rank: `call_one().get()` (ours, Monarch), "
        "`ray.get(actor.m.remote())`, `view.apply_sync(f)`, a Dask actor's `a.m().result()`; "
        "the floor is one DEALER/ROUTER "
        "round trip of a 1-byte message between two processes over tcp loopback. The floor "
        "column is that peer's own run (a process of its own, no mesh alive); the rows "
        '"beside the mesh" measure the same raw round trip inside ours\' worker, with the '
        "mesh's ranks and host agent alive, in blocks alternating with ours' calls (4 blocks "
        "per side, the same number of samples each; ours' median and p99 are those "
        "alternating samples): the same CPU state and load, so that ratio is the one that "
        "says how far a call is from the wire (bench/floor.py). Ours and Monarch time "
        "rows 1 to 3 once the fresh mesh's processes have used under 5% of a core for 2 s "
        "in a row (`bench.common.settle`: ours' warm template imports `torch._dynamo` a "
        "second after its last fork, about 1.7 s of one core, for ranks restarted later).",
        "2. The no-op on the first N ranks of a mesh of "
        f"{s.max_n}, all replies gathered: `.call().get()`, "
        "`ray.get([a.m.remote() for a in actors])`, `dview.apply_sync(f)`, Dask's "
        "`client.run(f, workers=[...])`; floor: one raw "
        'message to each of N server processes and N replies. The rows "alternating with '
        "the raw beside\" time ours' gathered call in blocks alternating with raw pings to "
        "N server processes inside ours' worker, the mesh alive (as in 1; "
        "bench/call_floor.py); where that ratio goes is in bench/results/call-floor.md. "
        f'The rows "wire floor" (up to {SMALL_MESH}) do the same gathered no-op with N server '
        "processes that speak our wire format and nothing else (bench/wire_floor.py): "
        "pickles only; + our marshal header; + an HMAC-SHA256 signature (ours until "
        "protocol 14) or instead our keyed BLAKE2b-256 one; our Codec "
        "(limits, nonce and counter, replay window): what any implementation of this "
        "protocol in Python pays, against what our runtime adds. The rows "
        '"shared-memory floor" do the same without ZeroMQ (bench/shm_floor.py): each '
        "message written into a slot of a file the processes share, its reader woken by an "
        "eventfd, no I/O thread: one byte each way, then our Codec's signed calls and "
        "results. They say what a same-machine channel without libzmq's I/O threads "
        "would leave of the floor.",
        f"3. K = {s.bcast_k} fire-and-forget broadcasts to {s.bcast_ranks} ranks (each "
        "increments a counter), then one gathered call that returns and checks the counts; "
        f"messages delivered (K × {s.bcast_ranks}) / total time.",
        "4. A call whose argument is a float32 tensor of that size and which returns its byte "
        "count, on one rank; floor: one zero-copy raw ZeroMQ send of the same bytes and a tiny "
        "ack; memcpy: `torch.clone` in the controller process (allocation included). The "
        '"beside the mesh" rows time that raw send inside ours\' worker in blocks '
        "alternating with ours' calls (as in 1), and ours' figure is from those blocks; for "
        "1 MiB also over unix sockets (ipc), the transport of a local mesh (ours' figure for "
        "that ratio is from its own alternating blocks). "
        f"To {FANOUT_RANKS} ranks: one gathered call carrying a {FANOUT_MIB} MiB tensor to "
        f"{FANOUT_RANKS} ranks of the mesh; floor: the same bytes sent zero-copy to each of "
        f"{FANOUT_RANKS} raw server processes, then their {FANOUT_RANKS} acks; rate: bytes "
        "delivered to all of them per second, alternating as in 1. Ours puts arguments of "
        "64 KiB to 64 MiB for ranks of its own host in a shared-memory arena (one copy in, "
        "one copy out by each rank, a small message on the socket: monarch_kernel.wire.arena); "
        "the floor is sockets. "
        "Rank -> rank: in a mesh of 2 local host agents × 2 ranks, rank 0 `share()`s a fresh "
        "tensor and a rank times `ref.get()` (the owner's data mapped from shared memory "
        "for a rank of its host, pulled over TCP loopback for a rank of the other host); "
        "`share()` is timed in the owner (the one copy, in place, that a same-host get then "
        "saves; `get()` sees the owner's tensor as it is at get time on every path).",
        "5. From nothing to every rank having answered a call that imports torch "
        "(`spawn_procs` + `spawn` + call; Ray: actor creation after `ray.init`, which has its "
        "own row; ipyparallel: `Cluster.start_and_connect_sync` + `apply_sync`). Cold: no "
        "pre-warmed agent (the OS file cache is warm). Pre-warmed: "
        "`get_launcher('local').prewarm(1)`, wait until its template has imported torch, then "
        f"the same. Ours and Monarch: {reps(s.ready_reps)}; Ray and ipyparallel: one start "
        "(each takes 5 s or more here). A peer that starts an interpreter per rank skips the "
        f"mesh of 16 when 4 × its 4-rank time is over the {s.ready_budget_s:.0f} s budget.",
        "7. Death: SIGKILL one rank's pid from the controller while a call waits on it; time "
        "until that call's future raises. Interrupt: while an endpoint runs `time.sleep(30)`, "
        "ours `procs.interrupt()`, ipyparallel `Client.send_signal(SIGINT)` (through its "
        "nanny), Ray `ray.cancel(ref)`; time until the future raises. Failures inside a "
        "collective (ours only; the peers have no failure policy to compare): 4 ranks with a "
        "gloo process group, grace 0.5 s. Death: one rank is SIGKILLed while all 4 loop over "
        "`all_reduce`; time until the call on all 4 raises. Raise: one rank raises before "
        "`all_reduce` while 3 enter it; time until the call raises (the grace, then the "
        "process group is aborted). Restart: `procs.restart([1])` of a live rank: kill it, "
        "start it again, re-form the process group on all 4 (new rendezvous), re-create its "
        "actor. State from a peer (`bench/peer_state.py`, through a real kernel): 4 ranks, "
        "DDP over gloo, a 100.7M-parameter MLP (6 x 4096^2) with SGD + momentum in a "
        "foreground `TrainingState` loop; rank 2 is SIGKILLed after step 4. First step done: "
        "from the kill to the first step completed after the recovery (the redone step "
        "included; one step's time is its own row); survivors resume: the controller's "
        "figure from the claimed death to the survivors leaving the step boundary. Transfer: "
        "the new rank's load of the replica's state (parameters copied into its own, momentum "
        "mapped copy-on-write from the replica's shared memory) ÷ its seconds; raw data "
        "plane: the same number of bytes, one shared tensor `read_into` a fresh tensor, "
        "between the same ranks. Disk checkpoint: the same kill in today's loop (a "
        "`torch.save` every 10 steps on rank 0); the cell fails, the mesh restarts rank 2, "
        "and the cell run again loads the checkpoint on every rank. Elastic "
        "(`bench/elastic.py`, through a real kernel): 2 ranks, DDP over gloo, a 25.2M-parameter "
        "MLP (6 x 2048^2, 100 MB) with SGD + momentum in a `--bg` `TrainingState` loop; "
        "`%mesh grow eb --ranks +2`, then `%mesh shrink eb --ranks 3`. Pause: the "
        "controller's figure from telling the ranks to hold at a step boundary until they "
        "resumed (new ranks are started and run the setup cell before it, while the loop "
        "trains on); gap: the longest time between two consecutive steps of rank 0 over "
        "the whole run; survivors restarted: pids before and after.",
        "9. Across machines (ours only, run as root): two emulated machines, Linux network "
        "namespaces with a veth each into a bridge (`tests/netns.py`). Ours: a `join` mesh of "
        "the 2 hosts × 1 rank, its host agents started in the namespaces with the commands the "
        "launcher shows, the controller in the root namespace on the bridge address; every "
        "control socket over tcp is CURVE. Round trip: `call_one().get()` of a no-op on host 0. "
        "64 MiB: as in 4 (rank -> rank), the rank on host 0 `share()`s, the rank on host 1 "
        "times `ref.get('tcp')`; by default that data-plane socket is not CURVE (signed "
        "requests, the bytes in the clear), so ours ÷ raw plain is the like-for-like ratio "
        "there; the encrypted row is a second mesh with `MONARCH_KERNEL_ENCRYPT_DATA=1` (a "
        "CURVE data socket), compared with raw CURVE. Raw "
        "ZeroMQ: `bench.raw_zmq`'s echo server in namespace host 0, a DEALER in the root "
        "namespace: a 1-byte round trip, and one zero-copy 64 MiB send plus a tiny ack; CURVE: "
        "`zmq.curve_keypair()` keys on both ends, no ZAP handler. Actor -> actor: row 11's "
        "code (bench/a2a.py) on two one-host `join` meshes, the targets on host 1, the "
        "caller on host 0; the caller's `call_one().get()` goes to the target rank's CURVE "
        "TCP peer socket, timed inside the caller's rank (checked: the controller sent the "
        "target rank nothing meanwhile), and is compared with the raw CURVE round trip "
        "(root namespace -> host 0: one veth fewer than host 0 -> host 1). Ratios "
        "come from the same worker process, one after the other.",
        "10. Engines (ours only, run as root). Ray: the test suite's two-node Ray cluster "
        "(`tests/ray_cluster.py`: the head on the bridge address, a raylet in a namespace "
        "host). Ours: `host_mesh(hosts=2, backend='ray').spawn_procs({'gpus': 1})` until an "
        "actor on both ranks answered a call that imports torch (placement group, an agent "
        "actor per bundle, join, ranks); Ray's own: a `STRICT_SPREAD` group of 2 bundles and "
        "an actor in each until both answered a no-op. Slurm: slurmctld here and a slurmd in "
        "each of 2 namespace hosts (`tests/slurm_cluster.py`); `salloc`, the `srun` step of "
        "join commands, ranks ready as above. Medians of 3 fresh starts, each stopped "
        "before the next.",
        "11. Actor to actor (ours and Monarch, the same code, bench/a2a.py): two meshes of one "
        "rank; the caller actor gets the target actor mesh as a constructor argument and "
        "times `call_one().get()` of a no-op on it inside its own rank (sync endpoint), so "
        "the controller is not on the path. Ours: the call goes to the target rank's inbox "
        "over a unix socket, the reply to the caller's reply socket (one hop each way).",
        "12. Visual debugger (ours; plain ipykernel as the peer, bench/dap_panel.py): a real "
        "kernel and a client speaking the debug protocol as JupyterLab's Debugger panel does; "
        "a gutter breakpoint inside a loop; for each `stopped` event, the time from sending "
        "`stackTrace` to the reply of the last `variables` (`scopes` of the top frame, then "
        "`variables` of every scope), then `continue`. Plain ipykernel: a local cell, "
        "debugpy. Ours: a `%%remote` cell, every rank's stop timed (4 ranks: each loop "
        "iteration; 64 ranks: one). Medians.",
    ]
    if big:
        lines[1] += (
            f" Calls to {big} ranks use a second mesh of {max(s.big_ns)}, for the systems "
            "that start that many ranks in a few seconds here."
        )
    return lines


def reps(n: int) -> str:
    if n == 1:
        return "one start"
    return f"median of {n} starts (fewer when the first ones take over 12 s in all)"


def results_json(runs: dict[str, PeerRun]) -> dict[str, Any]:
    return {
        p: {"results": r.results, "wall_s": r.wall_s, "error": r.error, "leftovers": r.leftovers}
        for p, r in runs.items()
    }
