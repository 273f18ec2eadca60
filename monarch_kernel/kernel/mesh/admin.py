"""``%mesh stop|restart|setup|stacks NAME``: what the notebook does to a mesh it made.

Each takes the words after the subcommand (``args``) and names the mesh as registered,
not by an expression (see :func:`~.targets.existing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.detach.release import recipe_changed
from monarch_kernel.controller.mesh import registry
from monarch_kernel.kernel.args import Parser
from monarch_kernel.kernel.hints import notebook_text, notebook_words
from monarch_kernel.kernel.targets import existing, ranks_option, stopped_error

if TYPE_CHECKING:
    from monarch_kernel.widgets.stacks_view import StacksView


def stop_mesh(args: list[str]) -> None:
    """``%mesh stop NAME``: stop it (saying so when it already is)."""
    if len(args) != 1:
        raise UsageError("usage: %mesh stop NAME")
    name = args[0]
    if registry.get(name) is None and registry.stopped(name) is not None:
        print(f"mesh {name!r} is already stopped")
        return
    existing(name).stop()
    print(f"mesh {name!r} stopped")


def restart_mesh(args: list[str]) -> None:
    """``%mesh restart NAME [--ranks 2,3]``: restart all its ranks, or some."""
    p = Parser(prog="%mesh restart", add_help=False)
    p.add_argument("name")
    p.add_argument("--ranks", default=None)
    opts = p.parse_args(args)
    mesh = existing(opts.name)
    if mesh.stopped:
        raise stopped_error(opts.name)
    ranks = ranks_option(opts.ranks, len(mesh))
    try:
        report = mesh.restart(ranks)
    except MeshStartError as exc:
        raise UsageError(f"%mesh restart {opts.name}: {notebook_text(exc)}") from None
    print(notebook_words(report.describe(opts.name)))


def show_setup(args: list[str]) -> None:
    """``%mesh setup NAME [--clear]``: the setup cells re-run on restarted ranks."""
    p = Parser(prog="%mesh setup", add_help=False)
    p.add_argument("name")
    p.add_argument("--clear", action="store_true")
    opts = p.parse_args(args)
    rt = existing(opts.name).runtime
    if opts.clear:
        gone = rt.forget_setup()
        recipe_changed(rt)
        print(f"mesh {opts.name!r}: forgot {len(gone)} setup cell(s)")
        return
    if not rt.setup_cells:
        print(f"mesh {opts.name!r} has no setup cells (register one with %%remote NAME --setup)")
        return
    for cell in rt.setup_cells:
        first = cell.code.strip().splitlines()[0] if cell.code.strip() else ""
        print(f"cell {cell.label}: {first[:70]}")


def show_stacks(args: list[str]) -> StacksView:
    """``%mesh stacks NAME [--ranks 0,3]``: every thread's Python stack on each rank
    now, ranks with identical stacks grouped, the odd ones out highlighted."""
    p = Parser(prog="%mesh stacks", add_help=False)
    p.add_argument("name")
    p.add_argument("--ranks", default=None)
    p.add_argument("--timeout", type=float, default=1.0)
    opts = p.parse_args(args)
    mesh = existing(opts.name)
    if mesh.stopped:
        raise UsageError(f"mesh {opts.name!r} is stopped; there are no stacks to show")
    ranks = ranks_option(opts.ranks, len(mesh))
    from monarch_kernel.widgets.stacks_view import mesh_stacks  # ipywidgets: late

    return mesh_stacks(mesh.runtime, ranks, opts.timeout)
