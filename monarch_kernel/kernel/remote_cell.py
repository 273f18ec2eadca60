"""``%%remote``, ``%remote`` and ``%torchrun``: code from the notebook run on ranks.

A ``%%remote`` run is three steps, which the magic calls in order: :func:`parse_remote`
(the line -> a :class:`RemoteRequest`, every usage error raised here),
:func:`start_remote` (a started :class:`~.remote.RemoteJob` whose output goes under the
cell, or into a live block for ``--bg``) and, in the foreground, :func:`collect` (its
values, ``--setup`` and ``-o`` applied). The job machinery itself is in
:mod:`monarch_kernel.kernel.remote`.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from IPython.core.error import UsageError

from monarch_kernel.actor import ProcMesh, ValueMesh
from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.controller.detach.release import recipe_changed
from monarch_kernel.controller.state.records import MeshPhase, SetupCell
from monarch_kernel.kernel.args import remote_parser, split_args
from monarch_kernel.kernel.channel import CellChannel, LiveText
from monarch_kernel.kernel.hints import REMOTE_ERRORS, notebook_text, notebook_words
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.kernel.remote import RemoteJob
from monarch_kernel.kernel.targets import Selection, ranks_option, resolve


def run_on(notebook: Notebook, procs: ProcMesh, code: str) -> ValueMesh:
    """Run ``code`` on every rank with output under the current cell; wait for it."""
    label = procs.runtime.world > 1
    logs = procs.runtime.logs.directory
    channel = CellChannel()
    output = CellOutput(channel.stream, procs.ranks(), "collapse", label, logs, channel.show)
    job = RemoteJob(procs, code, notebook.next_cell(), output)
    job.start()
    return job.wait()


# -- %%remote / %remote ----------------------------------------------------------------
@dataclass(frozen=True)
class RemoteRequest:
    """A parsed ``%%remote`` (or ``%remote``) run: where, what, and how."""

    where: Selection
    code: str
    #: the magic line, shown above the cell in tracebacks (none for a ``%remote`` line,
    #: whose statement is the line itself)
    header: list[str]
    bg: bool
    setup: bool
    out: str | None  #: ``-o NAME``: the notebook variable that gets the values
    group_outputs: str


def parse_remote(notebook: Notebook, line: str, cell: str | None) -> RemoteRequest | None:
    """The request of ``%%remote line`` with body ``cell`` (``cell`` None: ``%remote NAME
    statement``); None for an empty cell, once the line was checked."""
    header = [f"%%remote {line}"]
    if cell is None:
        parts = line.strip().split(None, 1)
        if len(parts) < 2:
            raise UsageError("usage: %remote NAME statement (or %%remote NAME as a cell)")
        line, cell, header = parts[0], parts[1], []
    opts = remote_parser().parse_args(split_args(line))
    where = Selection.whole(resolve(notebook.user_ns, opts.target))
    if opts.setup and (
        opts.ranks is not None or opts.bg or len(where.ranks) != where.procs.runtime.world
    ):
        raise UsageError(
            "%%remote --setup runs on the whole mesh, in the foreground (it is re-run on "
            "restarted ranks); drop --ranks/--bg or the slice"
        )
    picked = ranks_option(opts.ranks, len(where.ranks))
    if picked is not None:
        where = where.pick(picked)
    if not cell.strip():
        return None
    return RemoteRequest(where, cell, header, opts.bg, opts.setup, opts.out, opts.group_outputs)


def start_remote(notebook: Notebook, req: RemoteRequest) -> RemoteJob:
    """Start the request's job (after a restart of failed ranks it waits for, if any).

    A ``--bg`` job writes into a live output block that says how it ended, and sets
    ``-o NAME`` itself when it finishes.
    """
    procs, ranks, shape = req.where.procs, req.where.ranks, req.where.shape
    _wait_for_recovery(procs)
    channel = CellChannel()
    label = procs.runtime.world > 1
    cell_id = notebook.next_cell()
    logs = procs.runtime.logs.directory
    if req.bg:
        live = LiveText(channel, f"[bg cell {cell_id} on {procs.name}: running]", logs)
        output = CellOutput(live.emit, ranks, req.group_outputs, label, logs, live.show)
        job = RemoteJob(
            procs,
            req.code,
            cell_id,
            output,
            ranks,
            shape,
            on_finished=lambda j: report_bg(j, live, req.out, notebook),
            header=req.header,
        )
        job.on_failing = lambda j: show_failing(j, live)
    else:
        output = CellOutput(channel.stream, ranks, req.group_outputs, label, logs, channel.show)
        job = RemoteJob(procs, req.code, cell_id, output, ranks, shape, header=req.header)
    try:
        job.start()
    except REMOTE_ERRORS:
        output.close()
        raise
    return job


def collect(notebook: Notebook, req: RemoteRequest, job: RemoteJob) -> ValueMesh | None:
    """Wait for a foreground job: its values (None when every rank's is None), after
    registering a ``--setup`` cell and binding ``-o NAME``."""
    values = job.wait()
    if req.setup:
        _remember_setup(req.where.procs, req.code, job.cell, req.header, notebook.cell_key)
    if req.out:
        notebook.user_ns[req.out] = values
    if all(v is None for v in values.values()):
        return None
    return values


def _wait_for_recovery(procs: ProcMesh) -> None:
    """Say so when a cell waits for the mesh to restart ranks after a failure."""
    rt = procs.runtime
    if rt.state is not MeshPhase.RECOVERING:
        return
    print(f"mesh {procs.name!r} is restarting ranks after a failure; this cell waits for it")
    before = rt.last_recovery
    rt.wait_recovered()
    if rt.recovery_error is not None:
        print(f"mesh {procs.name!r}: the restart failed: {notebook_words(rt.recovery_error)}")
    elif rt.last_recovery is not None and rt.last_recovery is not before:
        print(notebook_words(rt.last_recovery.describe(procs.name)))


def _remember_setup(
    procs: ProcMesh, code: str, label: str, header: list[str], key: str | None
) -> None:
    """Register a ``--setup`` cell to re-run on restarts. ``key``: the notebook cell's id
    when the front-end sends one: running an edited setup cell again replaces it."""
    rt = procs.runtime
    if any(c.code == code for c in rt.setup_cells):
        return
    cell = SetupCell(code, label, tuple(header), key)
    if key is not None and any(c.key == key for c in rt.setup_cells):
        rt.setup_cells = [cell if c.key == key else c for c in rt.setup_cells]
        recipe_changed(rt)
        print(f"mesh {procs.name!r}: setup cell {label} replaces its earlier version")
        return
    rt.remember_setup(cell)
    recipe_changed(rt)
    print(f"mesh {procs.name!r}: setup cell {label} registered (re-run on restarted ranks)")


def show_failing(job: RemoteJob, live: LiveText) -> None:
    """A ``--bg`` job's rank failed while the others still run it: its title says so."""
    live.set_title(f"[bg cell {job.cell} on {job.procs.name}: {job.state}]")


def report_bg(job: RemoteJob, live: LiveText, out: str | None, notebook: Notebook) -> None:
    """A ``--bg`` job ended: its block's title says how, and shows its values or error."""
    took = (job.finished or time.time()) - job.started
    try:
        values = job.future.get()
    except BaseException as exc:  # shown under the cell
        if isinstance(exc, RankDiedError):  # said once, after the restart
            exc = job.death_error(exc)
        if job.cancelled:
            title = f"cancelled after {took:.1f}s ({job.cancelled})"
        else:
            title = f"failed after {took:.1f}s"
        live.set_title(f"[bg cell {job.cell} on {job.procs.name}: {title}]")
        live.emit("stderr", notebook_text(exc))
        return
    if out:
        notebook.user_ns[out] = values
    live.set_title(f"[bg cell {job.cell} on {job.procs.name}: done in {took:.1f}s]")
    if not all(v is None for v in values.values()):
        live.emit("stdout", repr(values))


# -- %torchrun -------------------------------------------------------------------------
def torchrun(notebook: Notebook, line: str) -> None:
    """``%torchrun NAME script.py args...`` or ``%torchrun NAME -m module args...``."""
    tokens = shlex.split(line)
    if len(tokens) < 2:
        raise UsageError(
            "usage: %torchrun NAME script.py [args ...] or %torchrun NAME -m module [args ...]"
        )
    procs = resolve(notebook.user_ns, tokens[0])
    module = tokens[1] == "-m"
    rest = tokens[2:] if module else tokens[1:]
    if not rest:
        raise UsageError("%torchrun: -m needs a module name")
    target, args = rest[0], rest[1:]
    code = (
        "from monarch_kernel.rank.scripts import run_script as _mk_run_script\n"
        f"_mk_run_script({target!r}, {args!r}, module={module!r})\n"
    )
    run_on(notebook, procs, code)
