"""The hang doctor's view: ranks grouped by identical stacks, the odd ones out marked.

``%mesh stacks NAME`` returns a :class:`StacksView` (displayed as HTML in a notebook,
as text elsewhere); the dashboard's Stacks button shows the same HTML. A hang usually
reads as one big group (every rank waiting in the same collective) and one small group
(the rank that never got there): the small groups are highlighted.

Library frames (monarch_kernel's own, ZeroMQ) are collapsed, the standard library and
installed packages dimmed, so the user's own frames stand out. Helper threads of
monarch_kernel itself (control, output capture) are counted, not shown, and left out of
the comparison.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.lifecycle.stacks import collect_stacks
from monarch_kernel.wire.stacks import Frame, RankStacks, ThreadStack

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

__all__ = ["StackGroup", "StacksView", "group_stacks", "mesh_stacks"]

#: Groups shown in full; on a big mesh where ranks are everywhere, the rest are listed
#: by their ranks only (the smallest groups, i.e. the oddest, are shown first after the
#: biggest one, so nothing odd is hidden behind the common case).
MAX_GROUPS = 12
ODD = "#dc2626"  # border of a group that differs from the biggest one
SAME = "#9ca3af"
esc = html.escape


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose stacks are the same (``stacks``: the first one's). ``odd``: smaller
    than the biggest group."""

    ranks: tuple[int, ...]
    stacks: RankStacks
    odd: bool
    sources: tuple[str, ...]  #: how its ranks' stacks were taken (python, faulthandler)


def signature(rs: RankStacks) -> tuple[object, ...]:
    """What two ranks must share to be in one group: every thread's frames (file, line,
    function), thread names and idents left out; monarch_kernel's helper threads left
    out; ranks without stacks compare by their error."""
    if not rs.threads:
        return ("error", rs.error or rs.source)
    # sorted by hash, not repr: only an order that is the same for equal sets of keys is
    # needed, and repr of every frame of 256 ranks was most of the grouping's time
    return tuple(sorted((t.key for t in rs.threads if not t.internal), key=hash))


def group_stacks(stacks: Sequence[RankStacks]) -> list[StackGroup]:
    """Group ranks with identical stacks; biggest group first (then lowest rank).

    The odd ones out are the groups smaller than the biggest group *with stacks*, and
    every group without (dead, or silent past the timeout): on an overloaded machine
    most ranks may not answer in time, and the few that did are not odd for that."""
    by_sig: dict[tuple[object, ...], list[RankStacks]] = {}
    for rs in stacks:
        by_sig.setdefault(signature(rs), []).append(rs)
    members = sorted(
        by_sig.values(), key=lambda g: (not g[0].threads, -len(g), min(rs.rank for rs in g))
    )
    answered = [len(g) for g in members if g[0].threads]
    reference = max(answered) if answered else max((len(g) for g in members), default=0)
    return [
        StackGroup(
            tuple(sorted(rs.rank for rs in g)),
            min(g, key=lambda rs: rs.rank),
            len(g) < reference or bool(answered and not g[0].threads),
            tuple(sorted({rs.source for rs in g})),
        )
        for g in members
    ]


def _dim(f: Frame) -> bool:
    """Standard library and installed packages: shown, but quieter than user code."""
    name = f.filename.replace("\\", "/")
    return (
        "/site-packages/" in name
        or "/dist-packages/" in name
        or name.startswith("<frozen")
        or "/lib/python3" in name
    )


#: Start-up frames of every process and thread: as uninteresting as library frames.
_STARTUP = {"runpy": None, "threading": {"_bootstrap", "_bootstrap_inner", "run"}}


def _plumbing(f: Frame) -> bool:
    """monarch_kernel, ZeroMQ, or the start of a process (runpy) or thread."""
    if f.library:
        return True
    name = f.filename.replace("\\", "/")
    module = name.rsplit("/", 1)[-1].removesuffix(".py").removeprefix("<frozen ").rstrip(">")
    if module not in _STARTUP:
        return False
    functions = _STARTUP[module]
    return functions is None or f.function in functions


def _runs(frames: tuple[Frame, ...]) -> list[tuple[str, list[Frame]]]:
    """Frames outermost first in runs: ``("lib", [...])`` for plumbing (monarch_kernel,
    ZeroMQ, process and thread start-up; collapsed), ``("frame", [f])`` otherwise. The
    innermost frame is always shown, even a library one (that is where the thread is)."""
    out: list[tuple[str, list[Frame]]] = []
    for i, f in enumerate(frames):
        if _plumbing(f) and i < len(frames) - 1:
            if out and out[-1][0] == "lib":
                out[-1][1].append(f)
            else:
                out.append(("lib", [f]))
        else:
            out.append(("frame", [f]))
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _source_note(sources: tuple[str, ...]) -> str:
    if "faulthandler" in sources:
        return (
            "via faulthandler: the rank did not answer from Python "
            "(C code holding the GIL?); its main thread only, no thread names"
        )
    return ""


class StacksView:
    """What ``%mesh stacks`` shows: ``_repr_html_`` in a notebook, text otherwise.

    ``groups`` (:func:`group_stacks`) and ``stacks`` (one :class:`RankStacks` per rank)
    are there for code that wants the data.
    """

    def __init__(
        self,
        mesh: str,
        stacks: Sequence[RankStacks],
        elapsed: float = 0.0,
        taken: float | None = None,
    ):
        self.mesh = mesh
        self.stacks = list(stacks)
        self.elapsed = elapsed
        self.taken = time.time() if taken is None else taken
        self.groups = group_stacks(self.stacks)

    @property
    def odd_ranks(self) -> list[int]:
        """The ranks of every group smaller than the biggest one."""
        return sorted(r for g in self.groups if g.odd for r in g.ranks)

    def _title(self) -> str:
        n = len(self.stacks)
        when = time.strftime("%H:%M:%S", time.localtime(self.taken))
        return (
            f"stacks of mesh {self.mesh!r}: {_plural(n, 'rank')} in "
            f"{_plural(len(self.groups), 'group')} (at {when}, took {_took(self.elapsed)})"
        )

    def summary(self) -> str:
        """``odd ranks out: 3, 200 (2 of 256)``, or that every rank has the same stacks
        (empty for one rank)."""
        n = len(self.stacks)
        if n < 2:
            return ""
        odd = self.odd_ranks
        if not odd:
            if len(self.groups) == 1:
                return f"all {n} ranks have the same stacks"
            return f"{len(self.groups)} groups of the same size"
        return f"odd ranks out: {format_ranks(odd)} ({len(odd)} of {n})"

    def shown_groups(self) -> tuple[list[StackGroup], list[StackGroup]]:
        """The groups shown in full (the biggest, then the smallest first: the odd ranks
        out matter most) and those only listed (at most :data:`MAX_GROUPS` in full)."""
        if len(self.groups) <= MAX_GROUPS:
            return self.groups, []
        first, rest = self.groups[0], self.groups[1:]
        rest = sorted(rest, key=lambda g: (len(g.ranks), g.ranks[0]))
        return [first, *rest[: MAX_GROUPS - 1]], rest[MAX_GROUPS - 1 :]

    def _more_text(self, more: list[StackGroup]) -> str:
        ranks = sorted(r for g in more for r in g.ranks)
        return f"+{_plural(len(more), 'more group')} (ranks {format_ranks(ranks)})"

    def _heading(self, g: StackGroup) -> str:
        n, total = len(g.ranks), len(self.stacks)
        word = "ranks" if n > 1 else "rank"
        text = f"{word} {format_ranks(list(g.ranks))} ({n} of {total})"
        if n == 1:
            rs = g.stacks
            where = ", ".join(x for x in (rs.host, f"pid {rs.pid}" if rs.pid else "") if x)
            if where:
                text += f" [{where}]"
        return text

    # -- text ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        lines = [self._title()]
        if self.summary():
            lines.append(self.summary())
        groups, more = self.shown_groups()
        for g in groups:
            lines.append("")
            lines.append(self._heading(g) + ("  << odd one out" if g.odd else ""))
            note = _source_note(g.sources)
            if note:
                lines.append(f"  ({note})")
            rs = g.stacks
            if rs.error:
                lines.extend("  " + ln for ln in rs.error.splitlines())
            shown = [t for t in rs.threads if not t.internal]
            for t in shown:
                lines.extend(self._thread_text(t))
            hidden = len(rs.threads) - len(shown)
            if hidden:
                lines.append(f"  (+{_plural(hidden, 'monarch_kernel thread')}, not shown)")
        if more:
            lines += ["", self._more_text(more)]
        return "\n".join(lines)

    @staticmethod
    def _thread_text(t: ThreadStack) -> list[str]:
        if t.idle:
            return [f"  {t.name}: idle (waiting for work)"]
        out = [f"  {t.name}:"]
        if not t.frames:
            out.append("    (no Python frames)")
        for kind, frames in _runs(t.frames):
            if kind == "lib":
                out.append(f"    ... {_plural(len(frames), 'internal frame')}")
                continue
            f = frames[0]
            out.append(f'    File "{f.filename}", line {f.lineno}, in {f.function}')
            if f.line:
                out.append(f"        {f.line}")
        return out

    # -- HTML ----------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        parts = [
            '<div class="mk-stacks" style="font-family:var(--jp-ui-font-family,sans-serif);'
            'font-size:12px;color:#111827">',
            f'<div style="font-weight:bold;margin:2px 0 6px">{esc(self._title())}</div>',
        ]
        if self.summary():
            color = ODD if self.odd_ranks else SAME
            parts.append(
                f'<div class="mk-stacks-summary" style="margin:0 0 4px;color:{color}">'
                f"{esc(self.summary())}</div>"
            )
        groups, more = self.shown_groups()
        for g in groups:
            parts.append(self._group_html(g))
        if more:
            parts.append(f'<div style="color:#6b7280">{esc(self._more_text(more))}</div>')
        parts.append("</div>")
        return "".join(parts)

    def _group_html(self, g: StackGroup) -> str:
        color = ODD if g.odd else SAME
        label = (
            f' <span style="background:{ODD};color:white;border-radius:3px;padding:0 5px;'
            'font-size:11px">odd one out</span>'
            if g.odd
            else ""
        )
        out = [
            f'<div class="mk-stack-group{" mk-odd" if g.odd else ""}" style="border-left:4px '
            f'solid {color};padding:2px 0 2px 8px;margin:6px 0">',
            f"<div><b>{esc(self._heading(g))}</b>{label}</div>",
        ]
        note = _source_note(g.sources)
        if note:
            out.append(f'<div style="color:#6b7280;font-size:11px">{esc(note)}</div>')
        rs = g.stacks
        if rs.error:
            out.append(
                f'<pre style="color:{ODD};margin:2px 0;white-space:pre-wrap">{esc(rs.error)}</pre>'
            )
        shown = [t for t in rs.threads if not t.internal]
        for t in shown:
            out.append(self._thread_html(t))
        hidden = [t for t in rs.threads if t.internal]
        if hidden:
            inner = "".join(self._thread_html(t) for t in hidden)
            out.append(
                '<details style="color:#6b7280;font-size:11px"><summary>'
                f"+{esc(_plural(len(hidden), 'monarch_kernel thread'))}</summary>{inner}</details>"
            )
        out.append("</div>")
        return "".join(out)

    @staticmethod
    def _thread_html(t: ThreadStack) -> str:
        if t.idle:
            return (
                f'<div style="margin:2px 0"><b>{esc(t.name)}</b>: '
                '<span style="color:#16a34a">idle (waiting for work)</span></div>'
            )
        rows = []
        for kind, frames in _runs(t.frames):
            if kind == "lib":
                inner = "".join(
                    f"<div>{esc(_frame_text(f))}</div>" for f in frames
                )  # expandable, for the curious
                rows.append(
                    '<details style="color:#9ca3af"><summary>… '
                    f"{esc(_plural(len(frames), 'internal frame'))}</summary>"
                    f"{inner}</details>"
                )
                continue
            f = frames[0]
            style = "color:#6b7280" if _dim(f) or f.library else "font-weight:bold"
            line = (
                '<div style="padding-left:2em;color:#374151;font-weight:normal">'
                f"{esc(f.line)}</div>"
                if f.line
                else ""
            )
            rows.append(f'<div style="{style}">{esc(_frame_text(f))}{line}</div>')
        if not t.frames:
            rows.append('<div style="color:#6b7280">(no Python frames)</div>')
        return (
            f'<div style="margin:2px 0"><b>{esc(t.name)}</b>:'
            '<div style="font-family:var(--jp-code-font-family,monospace);font-size:11px;'
            f'padding-left:1em;white-space:pre-wrap">{"".join(rows)}</div></div>'
        )


def _took(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f}s"


def _frame_text(f: Frame) -> str:
    return f'File "{f.filename}", line {f.lineno}, in {f.function}'


def mesh_stacks(
    runtime: MeshRuntime, ranks: Sequence[int] | None = None, timeout: float = 1.0
) -> StacksView:
    """Collect the stacks of ``ranks`` (default: all) of a mesh now, as a view."""
    t0 = time.monotonic()
    if ranks is None:
        ranks = list(range(runtime.world))
    stacks = collect_stacks(runtime, ranks, timeout)
    return StacksView(runtime.name, stacks, time.monotonic() - t0)
