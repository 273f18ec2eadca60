"""``%mesh attach NAME``, ``%mesh stop NAME`` on a detached mesh, and the detached meshes
``%mesh`` lists: the notebook's side of :mod:`monarch_kernel.controller.attach`."""

from __future__ import annotations

import html

from IPython.core.error import UsageError

from monarch_kernel.actor import ProcMesh
from monarch_kernel.actor.hosts import watch_faults
from monarch_kernel.controller.attach import AttachError, DetachedMesh, list_detached, read_file
from monarch_kernel.controller.attach import attach as attach_runtime
from monarch_kernel.controller.attach import stop_detached as stop_detached_mesh
from monarch_kernel.controller.mesh import registry
from monarch_kernel.kernel import mesh_admin
from monarch_kernel.kernel.args import Parser
from monarch_kernel.kernel.mesh_names import describe
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.remote import InputRouter
from monarch_kernel.kernel.table import MeshTable
from monarch_kernel.wire.desk import describe_duration


def check_detached_name(name: str) -> None:
    """Refuse ``%mesh NAME --detachable`` while a detached mesh of another kernel has
    that name (its attach file would be taken)."""
    if any(m.name == name for m in list_detached()):
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


def attach_mesh(notebook: Notebook, args: list[str]) -> ProcMesh:
    """``%mesh attach NAME [--force] [--from FILE]``: take the detached mesh over, bind it
    to ``NAME`` and show its dashboard."""
    p = Parser(prog="%mesh attach", add_help=False)
    p.add_argument("name", nargs="?")
    p.add_argument("--force", action="store_true", help="take it from a kernel holding it")
    p.add_argument("--from", dest="path", default=None, metavar="FILE")
    opts = p.parse_args(args)
    if opts.name is None and opts.path is None:
        raise UsageError("usage: %mesh attach NAME [--force] (%mesh lists detached meshes)")
    try:
        name = opts.name or read_file(None, opts.path).name
    except AttachError as exc:
        raise UsageError(str(exc)) from None
    held = notebook.user_ns.get(name)
    if name in notebook.user_ns and not isinstance(held, ProcMesh):
        raise UsageError(
            f"%mesh attach {name}: {name!r} already holds {describe(held)} in the notebook, "
            f"and the mesh is bound to its name; rename or del that variable first"
        )
    try:
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

    show(procs)
    return procs


def stop(args: list[str]) -> None:
    """``%mesh stop NAME [--force]``: a mesh of this kernel, or a detached one."""
    p = Parser(prog="%mesh stop", add_help=False)
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="stop it under a kernel holding it")
    opts = p.parse_args(args)
    if registry.get(opts.name) is not None or registry.stopped(opts.name) is not None:
        mesh_admin.stop_mesh([opts.name])
        return
    if not any(m.name == opts.name for m in list_detached()):
        mesh_admin.stop_mesh([opts.name])  # its "no mesh named ..." error
        return
    try:
        print(stop_detached_mesh(opts.name, force=opts.force))
    except AttachError as exc:
        raise UsageError(str(exc)) from None


DETACHED_COLUMNS = ("detached mesh", "shape", "hosts", "alive", "age", "state", "running")


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
        widths = [max(len(r[i]) for r in (DETACHED_COLUMNS, *self.rows)) for i in range(7)]
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
    if m.holder is not None:
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
        f"{m.alive}/{m.world}",
        describe_duration(m.age),
        state,
        ", ".join(m.running) or "idle",
    )


def listing() -> MeshListing:
    """What ``%mesh`` shows."""
    return MeshListing(MeshTable(registry.listed()), list_detached())
