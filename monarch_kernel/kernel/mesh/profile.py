"""``%mesh profile NAME [--steps N] [--ranks ...]`` and the straggler line under the
running cell.

``%mesh profile`` runs ``torch.profiler`` on the chosen ranks for the next ``N`` steps
of their training loop (started at a step boundary, stopped after ``N`` steps), merges
their traces onto one time axis (``controller.telemetry.traces``), writes one Chrome /
Perfetto trace next to the notebook (or in ``MONARCH_KERNEL_PROFILE_DIR``) and prints a
summary: the top ops of each rank and the rank that waited most in collectives.

A loop already running (``%%remote NAME --bg``, or an actor loop) is profiled at once
and the magic waits for it; on an idle mesh the profile is *armed* for the next cell's
steps and the summary appears under whichever cell runs when it is done.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.controller.telemetry.steps import set_notice_hook
from monarch_kernel.controller.telemetry.stragglers import StragglerNotice
from monarch_kernel.controller.telemetry.traces import (
    MergedTrace,
    ProfileGather,
    disarm,
    first_profiled_step,
    merge,
    request_profile,
    steps_label,
)
from monarch_kernel.kernel.args import Parser
from monarch_kernel.kernel.channel import CellChannel
from monarch_kernel.kernel.targets import existing, ranks_option

#: Where traces go when ``MONARCH_KERNEL_PROFILE_DIR`` is not set: the kernel's working
#: directory, which is the notebook's.
DIR_ENV = "MONARCH_KERNEL_PROFILE_DIR"
#: Ops per rank in the summary.
SUMMARY_OPS = 5
#: Seconds a running loop's profile waits for every rank's steps to reach the controller
#: (they come in batches every 0.1 s): with them the ranks start at one step number;
#: without (steps longer than this), at the first step boundary after a moment, which
#: only a rank's step ending within that moment's jitter could put a step apart.
STEPS_WAIT = 3.0


def show_straggler(mesh: str, notice: StragglerNotice) -> None:
    """A straggler notice as one line under the cell running now (the hook of
    :func:`~monarch_kernel.controller.telemetry.steps.set_notice_hook`)."""
    CellChannel().stream("stderr", f"{notice.line()}\n")


def install_notices() -> None:
    """Show every mesh's straggler notices under the running cell."""
    set_notice_hook(show_straggler)


def profile(args: list[str]) -> None:
    """``%mesh profile NAME [--steps N] [--ranks 0,3] [--timeout S] [--dir D]``."""
    p = Parser(prog="%mesh profile", add_help=False)
    p.add_argument("name")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--dir", default=None)
    opts = p.parse_args(args)
    if opts.steps < 1:
        raise UsageError("%mesh profile: --steps must be at least 1")
    mesh = existing(opts.name)
    if mesh.stopped:
        raise UsageError(f"mesh {opts.name!r} is stopped; there is nothing to profile")
    runtime: Any = mesh.runtime
    ranks = ranks_option(opts.ranks, len(mesh)) or list(range(len(mesh)))
    where = Path(opts.dir or os.environ.get(DIR_ENV) or os.getcwd())
    busy = any(runtime.ranks[r].outstanding for r in ranks)
    start_step = first_profiled_step(_await_latest_steps(runtime, ranks)) if busy else 0
    gather = request_profile(runtime, ranks, opts.name, opts.steps, busy, start_step)
    label = ", ".join(map(str, ranks))
    if not busy:
        print(f"profiling armed on ranks {label}: the next {opts.steps} steps of the next cell")
        threading.Thread(
            target=_finish_later,
            args=(runtime, gather, opts.name, where, opts.timeout),
            name="mk-profile",
            daemon=True,
        ).start()
        return
    print(f"profiling ranks {label} for {opts.steps} steps of the running loop ...")
    try:
        if not gather.done.wait(opts.timeout):
            disarm(runtime, ranks)
            raise UsageError(f"%mesh profile: ranks did not run {opts.steps} steps in time")
    except KeyboardInterrupt:
        disarm(runtime, ranks)
        raise
    _show(_write(gather, opts.name, where), gather, CellChannel())


def _await_latest_steps(runtime: Any, ranks: list[int]) -> list[tuple[int, float]]:
    """:func:`_latest_steps`, waited for up to :data:`STEPS_WAIT` (a loop started by the
    cell before has not shown its first steps yet)."""
    deadline = time.monotonic() + STEPS_WAIT
    while not (latest := _latest_steps(runtime, ranks)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        runtime.telemetry.wait_for_steps(left)
    return latest


def _latest_steps(runtime: Any, ranks: list[int]) -> list[tuple[int, float]]:
    """Each rank's latest step of the running loop seen by the controller (number, wall
    time); empty unless every rank has shown one lately, all within a few steps (the
    same loop)."""
    latest = []
    now = time.time()
    for rank in ranks:
        recent = runtime.telemetry.recent(rank)
        # a step more than a second (plus its own length) old: of another loop, or none
        if not recent or now - recent[-1].end > 1.0 + recent[-1].wall:
            return []
        latest.append((recent[-1].step, recent[-1].wall))
    steps = [n for n, _ in latest]
    return latest if max(steps) - min(steps) <= 3 else []


def _finish_later(
    runtime: Any, gather: ProfileGather, name: str, where: Path, timeout: float
) -> None:
    if not gather.done.wait(timeout):
        disarm(runtime, gather.ranks)
        return
    _show(_write(gather, name, where), gather, CellChannel())


def _write(gather: ProfileGather, name: str, where: Path) -> tuple[Path, MergedTrace]:
    merged = merge(gather)
    where.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = where / f"{name}-profile-{stamp}.json"
    path.write_text(json.dumps(merged.trace))
    return path, merged


def summary(merged: MergedTrace, gather: ProfileGather, path: Path) -> str:
    """The summary table printed under the cell."""
    labels = {r: steps_label(t) for r, t in gather.traces.items() if t.first_step}
    which = ""
    if len(set(labels.values())) == 1:
        which = f", {next(iter(labels.values()))}"
    elif labels:  # a rank that got the order late started later: say so
        which = ", " + "; ".join(f"rank {r}: {label}" for r, label in sorted(labels.items()))
    lines = [f"trace: {path}  ({len(merged.ranks)} ranks{which}, {merged.span_ms:.0f} ms)"]
    lines.append("open it in chrome://tracing or ui.perfetto.dev (a process per rank)")
    width = max([len(r.name) for rows in merged.top_ops.values() for r in rows[:SUMMARY_OPS]] + [4])
    width = min(width, 60)
    for rank in merged.ranks:
        lines.append(f"rank {rank}: top ops by self CPU time")
        for row in merged.top_ops[rank][:SUMMARY_OPS]:
            name = row.name if len(row.name) <= width else row.name[: width - 1] + "…"
            lines.append(f"  {name.ljust(width)}  {row.self_ms:9.2f} ms  {row.calls:6d} calls")
    if merged.waited:
        worst = max(merged.waited, key=merged.waited.__getitem__)
        lines.append(f"rank {worst} waited most: {merged.waited[worst]:.1f} ms/step in collectives")
    for rank, why in sorted(gather.errors.items()):
        lines.append(f"rank {rank}: no trace ({why})")
    return "\n".join(lines) + "\n"


def _show(written: tuple[Path, MergedTrace], gather: ProfileGather, channel: CellChannel) -> None:
    path, merged = written
    channel.stream("stdout", summary(merged, gather, path))
    try:
        from IPython.display import FileLink

        link = FileLink(os.path.relpath(path) if path.is_relative_to(os.getcwd()) else str(path))
        channel.display({"text/plain": repr(link), "text/html": link._repr_html_()})
    except Exception:  # the link is a convenience; the path is printed above
        pass
