"""The notebook contract: ``%mesh``, ``%%remote``, ``%remote``, ``%push``, ``%pull``.

Bad input (unknown mesh, bad ``--ranks``, unknown option, stopped mesh) is a one-line
``UsageError`` that says what to do; failures on ranks are one grouped error that
points at the cell's lines, never a traceback of our internals.

:class:`MeshMagics` only dispatches: each magic's work is in its own module:
``%mesh NAME`` in :mod:`monarch_kernel.kernel.mesh.create`, ``%mesh stop|restart|setup|stacks`` in
:mod:`monarch_kernel.kernel.mesh.admin`, ``%%remote``/``%torchrun`` in :mod:`.remote_cell`,
``%push``/``%pull``
in :mod:`.push_pull`; which mesh a line names in :mod:`.targets`, the notebook's
namespace and cell labels in :mod:`.notebook`.
"""

from __future__ import annotations

import shlex
import threading
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from monarch_kernel.actor import ProcMesh, ValueMesh
from monarch_kernel.controller.mesh import registry
from monarch_kernel.kernel import help as _help
from monarch_kernel.kernel import push_pull, remote_cell
from monarch_kernel.kernel.args import Parser, split_args
from monarch_kernel.kernel.hints import REMOTE_ERRORS, show_remote_error
from monarch_kernel.kernel.mesh import admin as mesh_admin
from monarch_kernel.kernel.mesh import detach as mesh_detach
from monarch_kernel.kernel.mesh import profile as mesh_profile
from monarch_kernel.kernel.mesh import resize as mesh_resize
from monarch_kernel.kernel.mesh.create import create_mesh
from monarch_kernel.kernel.mesh.names import check_mesh_name
from monarch_kernel.kernel.notebook import Notebook
from monarch_kernel.kernel.remote import InputRouter, RemoteJob
from monarch_kernel.kernel.targets import ranks_option, resolve

__all__ = ["MeshMagics", "load_ipython_extension", "split_args", "stop_all_meshes"]

#: Seconds the stop button's interrupt of a detachable mesh's ``--bg`` cells waits for a
#: shutdown request (``Restart Kernel`` interrupts first, then asks the kernel to stop).
SHUTDOWN_WINDOW = 1.0


@magics_class
class MeshMagics(Magics):
    """Magics that drive meshes of ranks from the notebook."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.notebook = Notebook(shell)
        self.jobs: list[RemoteJob] = []  #: the ``%%remote`` jobs, the running ones kept
        self.shutting_down = False  #: the kernel is shutting down (or restarting)

    def _next_cell(self) -> str:
        """The label of the next cell run on ranks; see :meth:`.Notebook.next_cell`."""
        return self.notebook.next_cell()

    def _check_name(self, name: str, force: bool) -> None:
        """Refuse a mesh name that would replace something of the notebook's; see
        :func:`monarch_kernel.kernel.mesh.names.check_mesh_name`."""
        check_mesh_name(name, force, self.notebook.user_ns, self.notebook.hidden)

    # -- %mesh -----------------------------------------------------------------------
    @line_magic
    def mesh(self, line: str) -> Any:
        """Create, list, stop or restart meshes.

        ``%mesh NAME --gpus 4 [--hosts 2] [--backend local] [--env K=V] [--detachable]``,
        ``%mesh`` (table of live meshes, and of detached ones to attach),
        ``%mesh stop NAME``, ``%mesh attach NAME [--force]``,
        ``%mesh restart NAME [--ranks 2,3]``, ``%mesh stacks NAME [--ranks 0,3]``,
        ``%mesh profile NAME [--steps 5] [--ranks 0,3]``,
        ``%mesh grow NAME --ranks +2 | --hosts +1``, ``%mesh shrink NAME --ranks 3 | --hosts 1
        | --drop-ranks 1,3 | --drop-hosts 1``.
        """
        args = shlex.split(line)
        if not args:
            return mesh_detach.listing()
        if args[0] == "stop":
            return mesh_detach.stop(args[1:])
        if args[0] == "attach":
            jobs = mesh_detach.attach_mesh(self.notebook, args[1:])
            self.jobs += jobs or []  # the stop button interrupts them too
            return jobs
        if args[0] == "restart":
            return mesh_admin.restart_mesh(args[1:])
        if args[0] == "setup":
            return mesh_admin.show_setup(args[1:])
        if args[0] == "stacks":
            return mesh_admin.show_stacks(args[1:])
        if args[0] == "profile":
            return mesh_profile.profile(args[1:])
        if args[0] in ("grow", "shrink"):
            return mesh_resize.resize_mesh(args[0], args[1:])
        return create_mesh(self.notebook, args)

    # -- %%remote / %remote ------------------------------------------------------------
    @line_cell_magic
    def remote(self, line: str, cell: str | None = None) -> Any:
        """Run code on every rank of a mesh (or a slice) in a persistent namespace.

        ``%%remote NAME [--ranks 0:2] [--bg] [--group-outputs collapse|order|rank]``;
        ``%remote NAME statement`` runs one statement. The value of the last
        expression comes back as a ValueMesh.
        """
        req = remote_cell.parse_remote(self.notebook, line, cell)
        if req is None:  # an empty cell
            return None
        job = remote_cell.start_remote(self.notebook, req)
        self.jobs = [j for j in self.jobs if not j.done()] + [job]
        if req.bg:
            return job
        return remote_cell.collect(self.notebook, req, job)

    def before_cell(self, info: Any) -> None:
        """IPython's pre_run_cell hook: remember the notebook cell's id (JupyterLab and
        Notebook 7 send one), which keys ``--setup`` cells."""
        self.notebook.cell_key = getattr(info, "cell_id", None)
        for rt in registry.live():  # meshes made with the actor API too: see InputRouter
            InputRouter.of(rt)

    def cancel_background_jobs(self, why: str) -> None:
        """Interrupt every running ``--bg`` cell (their output blocks say ``why``).

        Those on detachable meshes a moment later, unless the kernel shuts down
        meanwhile: a kernel manager interrupts the kernel before it restarts it, and
        that must not stop the training the mesh outlives the kernel for."""
        later = []
        for job in self.jobs:
            if not job.done():
                if job.procs.runtime.detach_keep:
                    later.append(job)
                else:
                    job.cancel(why)
        if later:
            timer = threading.Timer(
                SHUTDOWN_WINDOW, self._cancel_unless_shutting_down, (later, why)
            )
            timer.daemon = True
            timer.start()

    def _cancel_unless_shutting_down(self, jobs: list[RemoteJob], why: str) -> None:
        if not self.shutting_down:
            for job in jobs:
                job.cancel(why)

    # -- %debug_remote ----------------------------------------------------------------
    @line_magic
    def debug_remote(self, line: str) -> None:
        """``%debug_remote NAME [--rank R | --ranks 0:4] [--clear]``: attach to the ranks
        paused at a breakpoint nobody attached to, else a post-mortem pdb on the frame
        where each rank's last ``%%remote`` cell or endpoint failed (``--clear``: only
        release those frames). See :mod:`monarch_kernel.kernel.debug.console`."""
        from monarch_kernel.kernel.debug_remote import debug_remote

        p = Parser(prog="%debug_remote", add_help=False)
        p.add_argument("target")
        p.add_argument("--rank", "--ranks", dest="ranks", default=None)
        p.add_argument("--clear", action="store_true", help="release the kept frames")
        opts = p.parse_args(split_args(line))
        procs = resolve(self.notebook.user_ns, opts.target)
        ranks = procs.ranks()
        picked = ranks_option(opts.ranks, len(ranks))
        if picked is not None:
            ranks = [ranks[i] for i in picked]
        debug_remote(procs, ranks, self._next_cell(), opts.clear)

    # -- %torchrun --------------------------------------------------------------------
    @line_magic
    def torchrun(self, line: str) -> None:
        """``%torchrun NAME script.py args...`` or ``%torchrun NAME -m module args...``:
        run an unchanged torchrun-style script on every rank of the mesh."""
        remote_cell.torchrun(self.notebook, line)

    # -- %push / %pull ---------------------------------------------------------------
    @line_magic
    def push(self, line: str) -> None:
        """``%push NAME lr=1e-4 cfg``: set names in every rank's namespace (works while a
        ``--bg`` cell runs)."""
        push_pull.push(self.notebook.user_ns, line)

    @line_magic
    def pull(self, line: str) -> ValueMesh | dict[str, ValueMesh]:
        """``%pull NAME x [y]``: read names from every rank's namespace -> ValueMesh."""
        return push_pull.pull(self.notebook.user_ns, line)


# ``%mesh?`` and friends: plain-text pages listing every option (built from the parsers)
_help.set_docs(
    MeshMagics,
    {
        "mesh": _help.mesh_help,
        "remote": _help.remote_help,
        "push": lambda: _help.PUSH_HELP,
        "pull": lambda: _help.PULL_HELP,
    },
)


def _dashboard(procs: ProcMesh) -> Any:
    """``ProcMesh.dashboard()``: the mesh's dashboard widget."""
    from monarch_kernel.widgets import dashboard  # ipywidgets only when first used

    return dashboard(procs)


def load_ipython_extension(ipython: Any) -> MeshMagics:
    """Register the magics (``%load_ext monarch_kernel``)."""
    from monarch_kernel.actor.meshes import set_dashboard_factory
    from monarch_kernel.controller.messaging.streams import set_unrouted_display
    from monarch_kernel.kernel.channel import show_unrouted

    set_dashboard_factory(_dashboard)  # ProcMesh.dashboard(), importing ipywidgets late
    set_unrouted_display(show_unrouted)  # every mesh's endpoint displays: under the cell
    mesh_profile.install_notices()  # every mesh's straggler lines: under the running cell
    magics = MeshMagics(ipython)
    ipython.register_magics(magics)
    ipython.set_custom_exc(REMOTE_ERRORS, show_remote_error)
    ipython.user_ns.setdefault("_monarch_magics", magics)
    ipython.events.register("pre_run_cell", magics.before_cell)
    _help.install(ipython)  # Tab completion of mesh names and options
    from monarch_kernel.kernel import lab

    lab.install(ipython)  # the JupyterLab extension's Meshes sidebar and status bar item
    return magics


def stop_all_meshes() -> None:
    """Stop every live mesh of this kernel (shutdown and restart); detachable meshes
    are let go instead (they run on for a kernel to attach)."""
    from monarch_kernel.controller.detach.release import detach_all

    detach_all()
    registry.stop_all(timeout=5)
