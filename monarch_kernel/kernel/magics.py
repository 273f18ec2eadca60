"""The notebook contract: ``%mesh``, ``%%remote``, ``%remote``, ``%push``, ``%pull``.

Bad input (unknown mesh, bad ``--ranks``, unknown option, stopped mesh) is a one-line
``UsageError`` that says what to do; failures on ranks are one grouped error that
points at the cell's lines, never a traceback of our internals.
"""

from __future__ import annotations

import argparse
import html
import keyword
import shlex
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from monarch_kernel.actor import ActorMesh, ProcMesh, ValueMesh, host_mesh
from monarch_kernel.controller.errors import (
    ActorError,
    MeshStartError,
    MeshStoppedError,
    RankDiedError,
)
from monarch_kernel.kernel.channel import CellChannel, LiveText
from monarch_kernel.kernel.output import MODES, CellOutput
from monarch_kernel.kernel.remote import RemoteJob
from monarch_kernel.shape import Shape, SliceError, parse_ranks
from monarch_kernel.wire.serialize import SerializationError

INIT_DIST = "import torch.distributed as _mk_dist\n_mk_dist.init_process_group()\n"

#: Errors shown as their message only (no local traceback of our internals).
REMOTE_ERRORS = (ActorError, RankDiedError, MeshStoppedError, MeshStartError, SerializationError)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UsageError(f"{self.prog}: {message}. Usage: {usage}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message or self.format_usage())


def _mesh_parser() -> _Parser:
    p = _Parser(prog="%mesh", add_help=False)
    p.add_argument("name")
    p.add_argument("--gpus", type=int, default=None, help="ranks per host")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--backend", default="local")
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--dist", action="store_true", help="init_process_group on every rank")
    return p


def _remote_parser() -> _Parser:
    p = _Parser(prog="%%remote", add_help=False)
    p.add_argument("target")
    p.add_argument("--ranks", default=None)
    p.add_argument("--bg", action="store_true")
    p.add_argument("--group-outputs", default="collapse", choices=MODES)
    p.add_argument("-o", "--out", default=None, metavar="NAME")
    return p


def split_args(text: str) -> list[str]:
    """Split on whitespace outside brackets and quotes: ``a=[1, 2] b`` -> 2 tokens."""
    out, cur, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch.isspace() and depth == 0:
            if cur:
                out.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if quote or depth:
        raise UsageError(f"unbalanced quotes or brackets in {text!r}")
    if cur:
        out.append("".join(cur))
    return out


@magics_class
class MeshMagics(Magics):
    """Magics that drive meshes of ranks from the notebook."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.meshes: dict[str, ProcMesh] = {}
        self.jobs: list[RemoteJob] = []
        self._cell = 0

    # -- helpers -------------------------------------------------------------------
    def _resolve(self, target: str) -> ProcMesh:
        """``NAME`` or an expression such as ``NAME.slice(gpus=0)`` -> a ProcMesh view."""
        ns = self.shell.user_ns
        if target.isidentifier() and target not in ns:
            raise UsageError(f"no mesh named {target!r}; {self._live_hint()}")
        try:
            obj = eval(target, ns)  # noqa: S307 - the user's own expression
        except SliceError as exc:
            raise UsageError(f"bad slice {target!r}: {exc}") from None
        except Exception as exc:
            raise UsageError(f"cannot evaluate mesh {target!r}: {exc}") from None
        if isinstance(obj, ActorMesh):
            obj = ProcMesh(obj._runtime, obj.shape)
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
        live = [n for n, m in self.meshes.items() if not m.stopped]
        if live:
            return f"live meshes: {', '.join(live)}"
        return "create one with %mesh NAME --gpus 4"

    def _next_cell(self) -> str:
        count = getattr(self.shell, "execution_count", None)
        self._cell += 1
        return f"{count}" if count else f"#{self._cell}"

    # -- %mesh -----------------------------------------------------------------------
    @line_magic
    def mesh(self, line: str) -> Any:
        """Create, list, stop or restart meshes.

        ``%mesh NAME --gpus 4 [--hosts 2] [--backend local] [--env K=V]``,
        ``%mesh`` (table of live meshes), ``%mesh stop NAME``,
        ``%mesh restart NAME [--ranks 2,3]``.
        """
        args = shlex.split(line)
        if not args:
            return MeshTable(self.meshes)
        if args[0] == "stop":
            if len(args) != 2:
                raise UsageError("usage: %mesh stop NAME")
            self._existing(args[1]).stop()
            print(f"mesh {args[1]!r} stopped")
            return None
        if args[0] == "restart":
            return self._restart(args[1:])
        return self._create(args)

    def _existing(self, name: str) -> ProcMesh:
        mesh = self.meshes.get(name)
        if mesh is None:
            raise UsageError(f"no mesh named {name!r}; {self._live_hint()}")
        return mesh

    def _restart(self, args: list[str]) -> None:
        p = _Parser(prog="%mesh restart", add_help=False)
        p.add_argument("name")
        p.add_argument("--ranks", default=None)
        opts = p.parse_args(args)
        mesh = self._existing(opts.name)
        if mesh.stopped:
            raise UsageError(
                f"mesh {opts.name!r} is stopped; create it again with %mesh {opts.name} --gpus N"
            )
        ranks = None
        if opts.ranks is not None:
            try:
                ranks = parse_ranks(opts.ranks, len(mesh))
            except SliceError as exc:
                raise UsageError(str(exc)) from None
        t0 = time.monotonic()
        mesh.restart(ranks)
        which = "dead ranks" if ranks is None else f"ranks {opts.ranks}"
        print(f"mesh {opts.name!r}: restarted {which} in {time.monotonic() - t0:.2f}s")

    def _create(self, args: list[str]) -> None:
        opts = _mesh_parser().parse_args(args)
        name = opts.name
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"mesh name {name!r} must be a Python identifier (e.g. trainers)")
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
        old = self.meshes.get(name)
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
                self.shell.user_ns[name] = old
                from monarch_kernel.widgets import show

                show(old)
                return None
            old.stop()
        try:
            hosts = host_mesh(hosts=opts.hosts, backend=opts.backend)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        from monarch_kernel.widgets import spawn_with_dashboard  # ipywidgets: imported late

        t0 = time.monotonic()
        procs = spawn_with_dashboard(  # shows the dashboard while the ranks start
            hosts, {"gpus": opts.gpus}, name=name, env=env, timeout=opts.timeout
        )
        self.meshes[name] = procs
        self.shell.user_ns[name] = procs
        print(
            f"mesh {name!r}: {procs.shape.describe()} ({opts.backend}) ready in "
            f"{time.monotonic() - t0:.2f}s"
        )
        if opts.dist:
            self._run_on(procs, INIT_DIST)
            print(f"mesh {name!r}: torch.distributed process group initialised")
        return None

    def _run_on(self, procs: ProcMesh, code: str) -> ValueMesh:
        """Run ``code`` on every rank with output under the current cell; wait for it."""
        label = procs.runtime.world > 1
        output = CellOutput(CellChannel().stream, procs.ranks(), "collapse", label)
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
        opts = _remote_parser().parse_args(split_args(line))
        procs = self._resolve(opts.target)
        ranks, shape = procs.ranks(), procs.shape
        if opts.ranks is not None:
            try:
                picked = parse_ranks(opts.ranks, len(ranks))
            except SliceError as exc:
                raise UsageError(str(exc)) from None
            procs, ranks, shape = _select(procs, picked)
        if not cell.strip():
            return None
        channel = CellChannel()
        label = procs.runtime.world > 1
        cell_id = self._next_cell()
        if opts.bg:
            live = LiveText(channel, f"[bg cell {cell_id} on {procs.name}: running]")
            output = CellOutput(live.emit, ranks, opts.group_outputs, label)
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
            output = CellOutput(channel.stream, ranks, opts.group_outputs, label)
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
        if opts.out:
            self.shell.user_ns[opts.out] = values
        if all(v is None for v in values.values()):
            return None
        return values

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
        ns = self.shell.user_ns
        for tok in tokens[1:]:
            name, sep, expr = tok.partition("=")
            if not name.isidentifier():
                raise UsageError(f"%push takes name=expression or a variable name, got {tok!r}")
            try:
                values[name] = eval(expr, ns) if sep else ns[name]  # noqa: S307
            except KeyError:
                raise UsageError(f"name {name!r} is not defined in the notebook") from None
            except Exception as exc:
                raise UsageError(f"cannot evaluate {expr!r}: {exc!r}") from None
        procs.push(**values)

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


def _report_bg(job: RemoteJob, live: LiveText, out: str | None, shell: Any) -> None:
    took = (job.finished or time.time()) - job.started
    try:
        values = job.future.get()
    except BaseException as exc:  # noqa: BLE001 - shown under the cell
        live.set_title(f"[bg cell {job.cell} on {job.procs.name}: failed after {took:.1f}s]")
        live.emit("stderr", str(exc))
        return
    if out:
        shell.user_ns[out] = values
    live.set_title(f"[bg cell {job.cell} on {job.procs.name}: done in {took:.1f}s]")
    if not all(v is None for v in values.values()):
        live.emit("stdout", repr(values))


class MeshTable:
    """``%mesh`` with no arguments: the live meshes."""

    def __init__(self, meshes: dict[str, ProcMesh]):
        self.rows = []
        for name, m in meshes.items():
            rt = m.runtime
            alive = sum(1 for r in rt.ranks if r.alive)
            self.rows.append(
                (
                    name,
                    m.shape.describe(),
                    getattr(rt, "backend", "local"),
                    f"{alive}/{rt.world}",
                    rt.state,
                )
            )

    def __repr__(self) -> str:
        if not self.rows:
            return "no meshes; create one with %mesh NAME --gpus 4"
        head = ("mesh", "shape", "backend", "alive", "state")
        widths = [max(len(str(r[i])) for r in (head, *self.rows)) for i in range(5)]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in (head, *self.rows)
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<i>no meshes; create one with <code>%mesh NAME --gpus 4</code></i>"
        head = "".join(f"<th>{h}</th>" for h in ("mesh", "shape", "backend", "alive", "state"))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _show_remote_error(
    shell: Any, etype: type, evalue: BaseException, tb: Any, tb_offset: Any = None
) -> list[str]:
    """Show a remote failure as its grouped message only."""
    stb = [
        f"{etype.__name__}: {line}" if i == 0 else line
        for i, line in enumerate(str(evalue).split("\n"))
    ]
    shell._showtraceback(etype, evalue, stb)
    return stb


def _dashboard(procs: ProcMesh) -> Any:
    from monarch_kernel.widgets import dashboard  # ipywidgets only when first used

    return dashboard(procs)


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics (``%load_ext monarch_kernel``)."""
    from monarch_kernel.actor import meshes

    meshes.dashboard_hook = meshes.dashboard_hook or _dashboard  # ProcMesh.dashboard()
    magics = MeshMagics(ipython)
    ipython.register_magics(magics)
    ipython.set_custom_exc(REMOTE_ERRORS, _show_remote_error)
    ipython.user_ns.setdefault("_monarch_magics", magics)


def stop_all_meshes() -> None:
    from monarch_kernel.controller.mesh import live_meshes

    for mesh in live_meshes():
        try:
            mesh.stop(timeout=5)
        except Exception:  # pragma: no cover - best effort on shutdown
            pass
