"""``%mesh attach NAME``, ``%mesh stop NAME`` on a detached mesh, and the detached meshes
``%mesh`` lists: the notebook's side of :mod:`monarch_kernel.controller.detach.attach`."""

from __future__ import annotations

import html
import os

from IPython.core.error import UsageError

from monarch_kernel.actor import ActorMesh, ProcMesh
from monarch_kernel.actor.attach import actor_meshes
from monarch_kernel.actor.hosts import watch_faults
from monarch_kernel.controller.attach_file import JobRecord
from monarch_kernel.controller.detach.attach import (
    AttachError,
    DetachedMesh,
    find_detached,
    list_detached,
    read_file,
)
from monarch_kernel.controller.detach.attach import attach as attach_runtime
from monarch_kernel.controller.detach.attach import stop_detached as stop_detached_mesh
from monarch_kernel.controller.detach.takeover import WELCOME_TIMEOUT, Attached, Welcome
from monarch_kernel.controller.mesh import registry
from monarch_kernel.kernel.args import Parser
from monarch_kernel.kernel.channel import CellChannel, LiveText
from monarch_kernel.kernel.mesh import admin as mesh_admin
from monarch_kernel.kernel.mesh.names import describe
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.kernel.remote import InputRouter, RemoteJob
from monarch_kernel.kernel.remote_cell import report_bg, show_failing
from monarch_kernel.kernel.table import MeshTable
from monarch_kernel.shape import Shape
from monarch_kernel.wire.desk import describe_duration


def check_detached_name(name: str) -> None:
    """Refuse ``%mesh NAME --detachable`` while a detached mesh of another kernel has
    that name (its attach file would be taken)."""
    if find_detached(name) is not None:
        raise UsageError(
            f"a detached mesh is already named {name!r}: attach it with %mesh attach {name}, "
            f"stop it with %mesh stop {name}, or choose another name"
        )


def detachable_note(procs: ProcMesh) -> str:
    """What ``%mesh NAME --detachable`` adds to its "ready" line."""
    keep = describe_duration(procs.runtime.detach_keep)
    return (
        f"mesh {procs.runtime.name!r} is detachable: its ranks keep running for {keep} "
        f"after this kernel ends; take it over from a new kernel with "
        f"%mesh attach {procs.runtime.name}"
    )


def attach_mesh(notebook: Notebook, args: list[str]) -> list[RemoteJob] | None:
    """``%mesh attach NAME [--force] [--from FILE]``: take the detached mesh over, bind
    it (and its actor meshes) to their names, show its dashboard with the metric
    history, what the ranks printed meanwhile, and each ``--bg`` cell still running
    (their jobs: the magic's value)."""
    p = Parser(prog="%mesh attach", add_help=False)
    p.add_argument("name", nargs="?")
    p.add_argument("--force", action="store_true", help="take it from a kernel holding it")
    p.add_argument("--from", dest="path", default=None, metavar="FILE")
    opts = p.parse_args(args)
    if opts.name is None and opts.path is None:
        raise UsageError(
            "usage: %mesh attach NAME [--force] [--from FILE] (%mesh lists detached meshes)"
        )
    try:
        name = opts.name or read_file(None, opts.path).name
        _check_free(notebook, name)
        attached = attach_runtime(opts.name, path=opts.path, force=opts.force)
    except AttachError as exc:
        raise UsageError(str(exc)) from None
    runtime = attached.runtime
    watch_faults(runtime)
    procs = ProcMesh(runtime)
    notebook.user_ns[runtime.name] = procs
    InputRouter.of(runtime)
    print(attached.describe())
    from monarch_kernel.widgets import show  # ipywidgets: imported late

    show(procs)  # before the history comes back: it charts all of it
    jobs = [_resume(notebook, procs, attached, job) for job in attached.jobs]
    welcome = attached.finish()
    _print_welcome(procs, attached, welcome)
    _bind_actors(notebook, procs)
    return jobs or None


def _check_free(notebook: Notebook, name: str) -> None:
    held = notebook.user_ns.get(name)
    if name in notebook.user_ns and not isinstance(held, ProcMesh):
        raise UsageError(
            f"%mesh attach {name}: {name!r} already holds {describe(held)} in the notebook, "
            f"and the mesh is bound to its name; rename or del that variable first"
        )


def _resume(notebook: Notebook, procs: ProcMesh, attached: Attached, job: JobRecord) -> RemoteJob:
    """The handle of a cell the earlier kernel left running, with a live output block."""
    rt = procs.runtime
    logs = rt.logs.directory
    title = f"[bg cell {job.cell} on {procs.name}: running (started before the attach)]"
    live = LiveText(CellChannel(), title, logs)
    output = CellOutput(live.emit, job.ranks, "collapse", rt.world > 1, logs)
    every = job.ranks == procs.ranks()
    shape = procs.shape if every else Shape(("ranks",), (len(job.ranks),))
    remote = RemoteJob(
        procs,
        "",
        job.cell,
        output,
        job.ranks,
        shape,
        on_finished=lambda j: report_bg(j, live, None, notebook),
    )
    remote.on_failing = lambda j: show_failing(j, live)
    return remote.resume(attached, job)


def _print_welcome(procs: ProcMesh, attached: Attached, welcome: Welcome) -> None:
    """What the ranks printed while no kernel was attached, and what is missing."""
    if welcome.printed:
        folder = {os.path.dirname(attached.log_of(r)) for r in welcome.printed}
        print(
            f"printed while no kernel was attached (last lines; whole logs in {', '.join(folder)}):"
        )
        for rank, lines in sorted(welcome.printed.items()):
            for line in lines:
                print(f"[{rank}] {line}")
    if welcome.silent:
        print(
            f"rank(s) {', '.join(map(str, welcome.silent))} did not answer within "
            f"{WELCOME_TIMEOUT:.0f}s: their metric history is charted when they do "
            "(a rank busy in native code answers late)"
        )


def _bind_actors(notebook: Notebook, procs: ProcMesh) -> None:
    """Bind the mesh's actor meshes to their names where those are free."""
    handles = actor_meshes(procs)
    bound = []
    for name, handle in handles.items():
        current = notebook.user_ns.get(name)
        if name.isidentifier() and (current is None or isinstance(current, ActorMesh)):
            notebook.user_ns[name] = handle
            bound.append(name)
    if handles:
        names = ", ".join(f"{n} (bound)" if n in bound else n for n in handles)
        print(f"actor meshes back: {names}")


def stop(args: list[str]) -> None:
    """``%mesh stop NAME [--force]``: a mesh of this kernel, or a detached one."""
    p = Parser(prog="%mesh stop", add_help=False)
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="stop it under a kernel holding it")
    opts = p.parse_args(args)
    if registry.get(opts.name) is not None or registry.stopped(opts.name) is not None:
        mesh_admin.stop_mesh([opts.name])
        return
    if find_detached(opts.name) is None:
        mesh_admin.stop_mesh([opts.name])  # its "no mesh named ..." error
        return
    try:
        print(stop_detached_mesh(opts.name, force=opts.force))
    except AttachError as exc:
        raise UsageError(str(exc)) from None


DETACHED_COLUMNS = (
    "detached mesh", "shape", "hosts", "alive", "age", "state", "running", "backend",
)  # fmt: skip


class MeshListing:
    """``%mesh`` with no arguments: this kernel's meshes, then the detached meshes of
    this user that it can attach (with age, hosts and what runs on them)."""

    def __init__(self, table: MeshTable, detached: list[DetachedMesh]):
        self.table = table
        self.rows = [_row(m) for m in detached]

    def __repr__(self) -> str:
        text = repr(self.table)
        if not self.rows:
            return text
        widths = [
            max(len(r[i]) for r in (DETACHED_COLUMNS, *self.rows))
            for i in range(len(DETACHED_COLUMNS))
        ]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in (DETACHED_COLUMNS, *self.rows)
        ]
        return text + "\n\n" + "\n".join(lines) + "\n(attach one with %mesh attach NAME)"

    def _repr_html_(self) -> str:
        out = self.table._repr_html_()
        if not self.rows:
            return out
        head = "".join(f"<th>{h}</th>" for h in DETACHED_COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        return (
            f"{out}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            "<i>attach one with <code>%mesh attach NAME</code></i>"
        )


def _row(m: DetachedMesh) -> tuple[str, ...]:
    if not m.answered:
        state = "not answering (the machine is overloaded, or its agent is stopped)"
    elif m.holder is not None:
        state = f"held by {m.holder.describe()}"
    elif m.detached_for is not None:
        left = f", stops in {describe_duration(m.keep_left)}" if m.keep_left is not None else ""
        state = f"detached {describe_duration(m.detached_for)} ago{left}"
    else:
        state = "detached"
    return (
        m.name,
        m.shape,
        str(m.hosts),
        f"{m.alive}/{m.world}" if m.answered else f"?/{m.world}",
        describe_duration(m.age),
        state,
        ", ".join(m.running) or "idle",
        m.backend,
    )


def listing() -> MeshListing:
    """What ``%mesh`` shows."""
    return MeshListing(MeshTable(registry.listed()), list_detached())
