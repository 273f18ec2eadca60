"""The notebook contract: ``%mesh``, ``%%remote``, ``%remote``, ``%push``, ``%pull``.

Bad input (unknown mesh, bad ``--ranks``, unknown option, stopped mesh) is a one-line
``UsageError`` that says what to do; failures on ranks are one grouped error that
points at the cell's lines, never a traceback of our internals.
"""

from __future__ import annotations

import builtins
import keyword
import os
import re
import reprlib
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from monarch_kernel.actor import ActorMesh, ProcMesh, ValueMesh
from monarch_kernel.actor.hosts import HostMesh, host_mesh
from monarch_kernel.actor.meshes import procs_of
from monarch_kernel.calls.errors import ActorError, MeshStartError
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.controller.records import MeshPhase, SetupCell
from monarch_kernel.kernel import help as _help
from monarch_kernel.kernel.args import (
    ENGINE_OPTIONS,
    Parser,
    mesh_parser,
    remote_parser,
    split_args,
)
from monarch_kernel.kernel.channel import CellChannel, LiveText
from monarch_kernel.kernel.hints import (
    REMOTE_ERRORS,
    notebook_text,
    notebook_words,
    show_remote_error,
)
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.kernel.remote import InputRouter, RemoteJob
from monarch_kernel.kernel.table import MeshTable
from monarch_kernel.shape import Shape, SliceError, parse_ranks

__all__ = ["MeshMagics", "load_ipython_extension", "split_args", "stop_all_meshes"]

INIT_DIST = "import torch.distributed as _mk_dist\n_mk_dist.init_process_group()\n"

#: Names IPython itself keeps in the notebook's namespace: a mesh bound to one of them
#: breaks the notebook (``get_ipython`` is what every magic line calls), so ``%mesh``
#: never takes them, ``--force`` or not. Besides these: the shell's ``user_ns_hidden``.
IPYTHON_NAMES = frozenset({"get_ipython", "In", "Out", "exit", "quit", "display", "open"})
#: IPython's history and output-cache names: ``_``, ``__``, ``___``, ``_i``, ``_ii``,
#: ``_iii``, ``_iN``, ``_N``, ``_ih``, ``_oh``, ``_dh``, and dunders (``__name__`` ...).
_IPYTHON_NAME = re.compile(r"_{1,3}|_i{1,3}|_i?\d+|_[ido]h|__\w+__")


@magics_class
class MeshMagics(Magics):
    """Magics that drive meshes of ranks from the notebook."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.jobs: list[RemoteJob] = []
        self._cell_key: str | None = None  #: the running notebook cell's id, if sent
        self._cell = 0

    # -- helpers -------------------------------------------------------------------
    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None  # magics are always registered with a shell
        return cast(dict[str, Any], self.shell.user_ns)

    def _resolve(self, target: str) -> ProcMesh:
        """``NAME`` or an expression such as ``NAME.slice(gpus=0)`` -> a ProcMesh view."""
        ns = self._user_ns
        if target.isidentifier() and target not in ns:
            raise UsageError(f"no mesh named {target!r}; {self._live_hint()}")
        try:
            obj = eval(target, ns)  # the user's own expression
        except SliceError as exc:
            raise UsageError(f"bad slice {target!r}: {exc}") from None
        except Exception as exc:
            raise UsageError(f"cannot evaluate mesh {target!r}: {exc}") from None
        if isinstance(obj, ActorMesh):
            obj = procs_of(obj)
        if not isinstance(obj, ProcMesh):
            raise UsageError(
                f"{target!r} is a {type(obj).__name__}, not a mesh; {self._live_hint()}"
            )
        if obj.runtime.state in ("stopped", "stopping"):
            raise UsageError(
                f"mesh {obj.name!r} is stopped; create it again with %mesh {obj.name} --gpus N"
            )
        return obj

    def _live_hint(self) -> str:
        live = registry.names()
        if live:
            return f"live meshes: {', '.join(live)}"
        return "create one with %mesh NAME --gpus 4"

    #: (prompt number, cells run on ranks from it so far); see :meth:`_next_cell`.
    _prompt_runs: tuple[int, int] = (0, 0)

    def _next_cell(self) -> str:
        """The label of the next cell run on ranks (``<remote cell N>`` in tracebacks,
        ``cell N`` on the dashboard): the number of the prompt it runs from, as the user
        sees it (``In [N]``, the execute reply's ``execution_count``). More runs from
        the same prompt (``%mesh --dist``'s set-up and a ``%remote`` line, a loop of
        ``%remote``) are ``N.2``, ``N.3`` ...; outside a numbered prompt ``#k``."""
        self._cell += 1
        count = _prompt_number(self.shell)
        if count is None:
            return f"#{self._cell}"
        prompt, runs = self._prompt_runs
        runs = runs + 1 if prompt == count else 1
        self._prompt_runs = (count, runs)
        return f"{count}" if runs == 1 else f"{count}.{runs}"

    def _check_name(self, name: str, force: bool) -> None:
        """Refuse a mesh name that would replace something of the notebook's: IPython's
        own names always, a Python builtin or a variable that holds something other than
        a mesh unless ``force``. A name that holds a mesh (running or stopped) is fine."""
        assert self.shell is not None
        hidden = getattr(self.shell, "user_ns_hidden", {})
        if name in IPYTHON_NAMES or name in hidden or _IPYTHON_NAME.fullmatch(name):
            raise UsageError(
                f"%mesh {name}: {name!r} is one of IPython's own names; a mesh bound to it "
                "would break the notebook. Pick another mesh name"
            )
        ns = self._user_ns
        if name in ns:
            value = ns[name]
            if isinstance(value, ProcMesh) or force:
                return
            raise UsageError(
                f"%mesh {name}: {name!r} already holds {_describe(value)} in the notebook; "
                "pick another mesh name, or add --force to replace it"
            )
        if name in vars(builtins) and not force:
            raise UsageError(
                f"%mesh {name}: {name!r} is a Python builtin, which a mesh of that name "
                "would hide in the notebook; pick another mesh name, or add --force"
            )

    # -- %mesh -----------------------------------------------------------------------
    @line_magic
    def mesh(self, line: str) -> Any:
        """Create, list, stop or restart meshes.

        ``%mesh NAME --gpus 4 [--hosts 2] [--backend local] [--env K=V]``,
        ``%mesh`` (table of live meshes), ``%mesh stop NAME``,
        ``%mesh restart NAME [--ranks 2,3]``, ``%mesh stacks NAME [--ranks 0,3]``.
        """
        args = shlex.split(line)
        if not args:
            return MeshTable(registry.listed())
        if args[0] == "stop":
            if len(args) != 2:
                raise UsageError("usage: %mesh stop NAME")
            if registry.get(args[1]) is None and registry.stopped(args[1]) is not None:
                print(f"mesh {args[1]!r} is already stopped")
                return None
            self._existing(args[1]).stop()
            print(f"mesh {args[1]!r} stopped")
            return None
        if args[0] == "restart":
            return self._restart(args[1:])
        if args[0] == "setup":
            return self._setup(args[1:])
        if args[0] == "stacks":
            return self._stacks(args[1:])
        return self._create(args)

    def _existing(self, name: str) -> ProcMesh:
        runtime = registry.get(name)
        if runtime is None:
            if registry.stopped(name) is not None:
                raise UsageError(
                    f"mesh {name!r} is stopped; create it again with %mesh {name} --gpus N"
                )
            raise UsageError(f"no mesh named {name!r}; {self._live_hint()}")
        return ProcMesh(runtime)

    def _setup(self, args: list[str]) -> None:
        """``%mesh setup NAME [--clear]``: the setup cells re-run on restarted ranks."""
        p = Parser(prog="%mesh setup", add_help=False)
        p.add_argument("name")
        p.add_argument("--clear", action="store_true")
        opts = p.parse_args(args)
        rt = self._existing(opts.name).runtime
        if opts.clear:
            gone = rt.forget_setup()
            print(f"mesh {opts.name!r}: forgot {len(gone)} setup cell(s)")
            return
        if not rt.setup_cells:
            print(
                f"mesh {opts.name!r} has no setup cells (register one with %%remote NAME --setup)"
            )
            return
        for cell in rt.setup_cells:
            first = cell.code.strip().splitlines()[0] if cell.code.strip() else ""
            print(f"cell {cell.label}: {first[:70]}")

    def _restart(self, args: list[str]) -> None:
        p = Parser(prog="%mesh restart", add_help=False)
        p.add_argument("name")
        p.add_argument("--ranks", default=None)
        opts = p.parse_args(args)
        mesh = self._existing(opts.name)
        if mesh.stopped:
            raise UsageError(
                f"mesh {opts.name!r} is stopped; create it again with %mesh {opts.name} --gpus N"
            )
        ranks = _ranks_option(opts.ranks, len(mesh))
        try:
            report = mesh.restart(ranks)
        except MeshStartError as exc:
            raise UsageError(f"%mesh restart {opts.name}: {notebook_text(exc)}") from None
        print(notebook_words(report.describe(opts.name)))

    def _stacks(self, args: list[str]) -> Any:
        """``%mesh stacks NAME [--ranks 0,3]``: every thread's Python stack on each rank
        now, ranks with identical stacks grouped, the odd ones out highlighted."""
        p = Parser(prog="%mesh stacks", add_help=False)
        p.add_argument("name")
        p.add_argument("--ranks", default=None)
        p.add_argument("--timeout", type=float, default=1.0)
        opts = p.parse_args(args)
        mesh = self._existing(opts.name)
        if mesh.stopped:
            raise UsageError(f"mesh {opts.name!r} is stopped; there are no stacks to show")
        ranks = _ranks_option(opts.ranks, len(mesh))
        from monarch_kernel.widgets.stacks_view import mesh_stacks  # ipywidgets: late

        return mesh_stacks(mesh.runtime, ranks, opts.timeout)

    def _create(self, args: list[str]) -> None:
        opts = mesh_parser().parse_args(args)
        name = opts.name
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"mesh name {name!r} must be a Python identifier (e.g. trainers)")
        self._check_name(name, opts.force)
        if opts.gpus is None:
            raise UsageError(f"how many ranks? e.g. %mesh {name} --gpus 4")
        if opts.gpus < 1 or opts.hosts < 1:
            raise UsageError("--gpus and --hosts must be at least 1")
        env = {}
        for item in opts.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--env takes KEY=VALUE, got {item!r}")
            env[key] = value
        old_runtime = registry.get(name)
        old = ProcMesh(old_runtime) if old_runtime is not None else None
        if old is not None and not old.stopped:
            same = (
                old.extent
                == Shape.from_extent(
                    ({"hosts": opts.hosts} if opts.hosts > 1 else {}) | {"gpus": opts.gpus}
                ).extent
                and old.runtime.env == env
            )
            if same:
                print(f"mesh {name!r} is already running (%mesh restart {name} to restart it)")
                self._user_ns[name] = old
                from monarch_kernel.widgets import show

                show(old)
                return
        try:
            options = {k: v for k in ENGINE_OPTIONS if (v := getattr(opts, k))}
            # join: the one-line command per host and "2/4 hosts joined" print here
            hosts = host_mesh(hosts=opts.hosts, backend=opts.backend, **options)
            # before the mesh of this name is replaced: a refused one leaves it running
            _check_capacity(hosts, opts.hosts * opts.gpus, replacing=old_runtime)
        except ValueError as exc:
            raise UsageError(f"%mesh {name}: {exc}") from None
        if old is not None:
            old.stop()  # the same name with another shape: this one replaces it
        from monarch_kernel.widgets import refresh, show  # ipywidgets: imported late

        shown: list[ProcMesh] = []

        def show_while_starting(procs: ProcMesh) -> None:
            show(procs)  # the dashboard shows the ranks start (or fail to)
            shown.append(procs)

        t0 = time.monotonic()
        try:
            with _interrupt_once():
                procs = hosts.spawn_procs(
                    {"gpus": opts.gpus},
                    name=name,
                    env=env,
                    timeout=opts.timeout,
                    on_starting=show_while_starting,
                    on_failure=opts.on_failure,
                    grace=opts.grace,
                )
        except ValueError as exc:  # bad options, or another thread took the name meanwhile
            raise UsageError(f"%mesh {name}: {exc}") from None
        except KeyboardInterrupt:  # the stop button: spawn_procs stopped what it started
            for p in shown:
                p.stop()  # idempotent; in case the interrupt came before spawn_procs' own
            raise MeshStartError(
                f"mesh {name!r}: start interrupted; the ranks and host agents it had "
                "started are stopped"
            ) from None
        finally:
            for p in shown:
                refresh(p)
        self._user_ns[name] = procs
        InputRouter.of(procs.runtime)  # parks breakpoints of endpoints for %debug_remote
        print(
            f"mesh {name!r}: {procs.shape.describe()} ({opts.backend}) ready in "
            f"{time.monotonic() - t0:.2f}s"
        )
        if opts.backend == "local" and os.environ.get("LIGHTNING_CLOUD_SPACE_ID"):
            print(
                f"mesh {name!r} runs on this Lightning Studio's own machine; an idle Studio "
                "goes to sleep and that ends the mesh (keep it active while you use it)"
            )
        if opts.dist:
            self._run_on(procs, INIT_DIST)
            print(f"mesh {name!r}: torch.distributed process group initialised")
        return

    def _run_on(self, procs: ProcMesh, code: str) -> ValueMesh:
        """Run ``code`` on every rank with output under the current cell; wait for it."""
        label = procs.runtime.world > 1
        logs = procs.runtime.logs.directory
        output = CellOutput(CellChannel().stream, procs.ranks(), "collapse", label, logs)
        job = RemoteJob(procs, code, self._next_cell(), output)
        job.start()
        return job.wait()

    # -- %%remote / %remote ------------------------------------------------------------
    @line_cell_magic
    def remote(self, line: str, cell: str | None = None) -> Any:
        """Run code on every rank of a mesh (or a slice) in a persistent namespace.

        ``%%remote NAME [--ranks 0:2] [--bg] [--group-outputs collapse|order|rank]``;
        ``%remote NAME statement`` runs one statement. The value of the last
        expression comes back as a ValueMesh.
        """
        header = [f"%%remote {line}"]
        if cell is None:
            parts = line.strip().split(None, 1)
            if len(parts) < 2:
                raise UsageError("usage: %remote NAME statement (or %%remote NAME as a cell)")
            line, cell, header = parts[0], parts[1], []
        opts = remote_parser().parse_args(split_args(line))
        procs = self._resolve(opts.target)
        ranks, shape = procs.ranks(), procs.shape
        if opts.setup and (opts.ranks is not None or opts.bg or len(ranks) != procs.runtime.world):
            raise UsageError(
                "%%remote --setup runs on the whole mesh, in the foreground (it is re-run on "
                "restarted ranks); drop --ranks/--bg or the slice"
            )
        picked = _ranks_option(opts.ranks, len(ranks))
        if picked is not None:
            procs, ranks, shape = _select(procs, picked)
        if not cell.strip():
            return None
        _wait_for_recovery(procs)
        channel = CellChannel()
        label = procs.runtime.world > 1
        cell_id = self._next_cell()
        logs = procs.runtime.logs.directory
        if opts.bg:
            live = LiveText(channel, f"[bg cell {cell_id} on {procs.name}: running]", logs)
            output = CellOutput(live.emit, ranks, opts.group_outputs, label, logs)
            job = RemoteJob(
                procs,
                cell,
                cell_id,
                output,
                ranks,
                shape,
                on_finished=lambda j: _report_bg(j, live, opts.out, self.shell),
                header=header,
            )
        else:
            output = CellOutput(channel.stream, ranks, opts.group_outputs, label, logs)
            job = RemoteJob(procs, cell, cell_id, output, ranks, shape, header=header)
        try:
            job.start()
        except REMOTE_ERRORS:
            output.close()
            raise
        self.jobs = [j for j in self.jobs if not j.done()] + [job]
        if opts.bg:
            return job
        values = job.wait()
        if opts.setup:
            _remember_setup(procs, cell, cell_id, header, self._cell_key)
        if opts.out:
            self._user_ns[opts.out] = values
        if all(v is None for v in values.values()):
            return None
        return values

    def before_cell(self, info: Any) -> None:
        """IPython's pre_run_cell hook: remember the notebook cell's id (JupyterLab and
        Notebook 7 send one), which keys ``--setup`` cells."""
        self._cell_key = getattr(info, "cell_id", None)
        for rt in registry.live():  # meshes made with the actor API too: see InputRouter
            InputRouter.of(rt)

    def cancel_background_jobs(self, why: str) -> None:
        """Interrupt every running ``--bg`` cell (their output blocks say ``why``)."""
        for job in self.jobs:
            if not job.done():
                job.cancel(why)

    # -- %debug_remote ----------------------------------------------------------------
    @line_magic
    def debug_remote(self, line: str) -> None:
        """``%debug_remote NAME [--rank R | --ranks 0:4] [--clear]``: attach to the ranks
        paused at a breakpoint nobody attached to, else a post-mortem pdb on the frame
        where each rank's last ``%%remote`` cell or endpoint failed (``--clear``: only
        release those frames). See :mod:`monarch_kernel.kernel.debug`."""
        from monarch_kernel.kernel.debug_remote import debug_remote

        p = Parser(prog="%debug_remote", add_help=False)
        p.add_argument("target")
        p.add_argument("--rank", "--ranks", dest="ranks", default=None)
        p.add_argument("--clear", action="store_true", help="release the kept frames")
        opts = p.parse_args(split_args(line))
        procs = self._resolve(opts.target)
        ranks = procs.ranks()
        picked = _ranks_option(opts.ranks, len(ranks))
        if picked is not None:
            ranks = [ranks[i] for i in picked]
        debug_remote(procs, ranks, self._next_cell(), opts.clear)

    # -- %torchrun --------------------------------------------------------------------
    @line_magic
    def torchrun(self, line: str) -> None:
        """``%torchrun NAME script.py args...`` or ``%torchrun NAME -m module args...``:
        run an unchanged torchrun-style script on every rank of the mesh."""
        tokens = shlex.split(line)
        if len(tokens) < 2:
            raise UsageError(
                "usage: %torchrun NAME script.py [args ...] or %torchrun NAME -m module [args ...]"
            )
        procs = self._resolve(tokens[0])
        module = tokens[1] == "-m"
        rest = tokens[2:] if module else tokens[1:]
        if not rest:
            raise UsageError("%torchrun: -m needs a module name")
        target, args = rest[0], rest[1:]
        code = (
            "from monarch_kernel.rank.scripts import run_script as _mk_run_script\n"
            f"_mk_run_script({target!r}, {args!r}, module={module!r})\n"
        )
        self._run_on(procs, code)

    # -- %push / %pull ---------------------------------------------------------------
    @line_magic
    def push(self, line: str) -> None:
        """``%push NAME lr=1e-4 cfg``: set names in every rank's namespace (works while a
        ``--bg`` cell runs)."""
        tokens = split_args(line)
        if len(tokens) < 2:
            raise UsageError("usage: %push NAME var=expr [other_var ...]")
        procs = self._resolve(tokens[0])
        values = {}
        ns = self._user_ns
        for tok in tokens[1:]:
            name, sep, expr = tok.partition("=")
            if not name.isidentifier():
                raise UsageError(f"%push takes name=expression or a variable name, got {tok!r}")
            try:
                values[name] = eval(expr, ns) if sep else ns[name]
            except KeyError:
                raise UsageError(f"name {name!r} is not defined in the notebook") from None
            except Exception as exc:
                raise UsageError(f"cannot evaluate {expr!r}: {exc!r}") from None
        procs.push(**values)
        # say what was set: a silent success reads like nothing happened
        what = ", ".join(f"{k}={reprlib.repr(v)}" for k, v in values.items())
        print(f"pushed to {tokens[0]} ({len(procs)} ranks): {what}")

    @line_magic
    def pull(self, line: str) -> ValueMesh | dict[str, ValueMesh]:
        """``%pull NAME x [y]``: read names from every rank's namespace -> ValueMesh."""
        tokens = split_args(line)
        if len(tokens) < 2:
            raise UsageError("usage: %pull NAME variable [variable ...]")
        procs = self._resolve(tokens[0])
        for name in tokens[1:]:
            if not name.isidentifier():
                raise UsageError(f"%pull takes variable names, got {name!r}")
        try:
            return procs.pull(*tokens[1:])
        except ActorError as exc:
            first = exc.failures[0]
            raise UsageError(
                f"%pull failed on ranks {exc.ranks}: {first['message']}; "
                "define it there with %%remote or %push first"
            ) from None


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


def _prompt_number(shell: Any) -> int | None:
    """The number of the prompt running now, as shown (``In [N]``), or None outside one.

    Not ``shell.execution_count``: IPython 9 increments that when a cell starts (8 did
    when it ended), so inside a cell it is one ahead. The running cell's ExecutionResult,
    which the display hook holds while the cell runs, has the number shown; a cell run
    without history (``silent``, ``store_history=False``) gets none.
    """
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    if result is None or not result.info.store_history:
        return None
    count = result.execution_count
    return count if isinstance(count, int) else None


def _describe(value: Any) -> str:
    """``a list``, ``an int``, ``the module numpy``: what a notebook name holds."""
    if value is None:
        return "None"
    if isinstance(value, type(builtins)):
        return f"the module {value.__name__}"
    kind = type(value).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def _check_capacity(hosts: HostMesh, ranks: int, replacing: MeshRuntime | None) -> None:
    """``hosts.launcher.check_capacity`` for a new mesh of ``ranks`` ranks that replaces
    ``replacing`` (whose ranks will be gone by then); as ``spawn_procs`` checks it."""
    running = sum(
        m.world for m in registry.live() if m.launcher is hosts.launcher and m is not replacing
    )
    hosts.launcher.check_capacity(ranks, running)


@contextmanager
def _interrupt_once() -> Iterator[None]:
    """The first Ctrl-C (the notebook's stop button) raises KeyboardInterrupt as usual;
    further ones are ignored until the block ends, so that pressing stop again while an
    interrupted mesh start stops what it started cannot leave half of it running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ranks_option(spec: str | None, size: int) -> list[int] | None:
    """A ``--ranks`` value as flat positions ``< size`` (None when not given); a bad one is
    a one-line UsageError."""
    if spec is None:
        return None
    try:
        return parse_ranks(spec, size)
    except SliceError as exc:
        raise UsageError(str(exc)) from None


def _select(procs: ProcMesh, picked: list[int]) -> tuple[ProcMesh, list[int], Shape]:
    """The ranks at flat positions ``picked`` of ``procs``, as a slice where possible.

    An evenly spaced pick of a one-dim mesh stays a slice (values keep their coordinates);
    anything else becomes a ``ranks`` dim over the picked ranks.
    """
    step = picked[1] - picked[0] if len(picked) > 1 else 1
    regular = all(b - a == step for a, b in zip(picked, picked[1:]))
    if len(procs.shape.labels) == 1 and regular:
        view = procs.slice(**{procs.shape.labels[0]: slice(picked[0], picked[-1] + 1, step)})
        return view, view.ranks(), view.shape
    ranks = [procs.ranks()[i] for i in picked]
    return procs, ranks, Shape(("ranks",), (len(ranks),))


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
        print(f"mesh {procs.name!r}: setup cell {label} replaces its earlier version")
        return
    rt.remember_setup(cell)
    print(f"mesh {procs.name!r}: setup cell {label} registered (re-run on restarted ranks)")


def _report_bg(job: RemoteJob, live: LiveText, out: str | None, shell: Any) -> None:
    took = (job.finished or time.time()) - job.started
    try:
        values = job.future.get()
    except BaseException as exc:  # shown under the cell
        if job.cancelled:
            title = f"cancelled after {took:.1f}s ({job.cancelled})"
        else:
            title = f"failed after {took:.1f}s"
        live.set_title(f"[bg cell {job.cell} on {job.procs.name}: {title}]")
        live.emit("stderr", notebook_text(exc))
        return
    if out:
        shell.user_ns[out] = values
    live.set_title(f"[bg cell {job.cell} on {job.procs.name}: done in {took:.1f}s]")
    if not all(v is None for v in values.values()):
        live.emit("stdout", repr(values))


def _dashboard(procs: ProcMesh) -> Any:
    from monarch_kernel.widgets import dashboard  # ipywidgets only when first used

    return dashboard(procs)


def load_ipython_extension(ipython: Any) -> MeshMagics:
    """Register the magics (``%load_ext monarch_kernel``)."""
    from monarch_kernel.actor.meshes import set_dashboard_factory

    set_dashboard_factory(_dashboard)  # ProcMesh.dashboard(), importing ipywidgets late
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
    """Stop every live mesh of this kernel (shutdown and restart)."""
    registry.stop_all(timeout=5)
