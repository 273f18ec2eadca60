"""What a failed or interrupted ``%%remote`` cell says, in one voice.

A rank that died in a cell handled by the failure policy: one message that says what
died, why, what was done (restarted, re-formed), what state was lost where, and what
the other ranks of the cell did because of it (:func:`death_text`). The stop button:
one line per group of ranks saying where they were, no traceback (:func:`interrupt_text`).

Pure text from plain data: :mod:`monarch_kernel.kernel.remote` gathers the data.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import DeathInfo, format_ranks, released_by_abort
from monarch_kernel.controller.state.records import RecoveryReport
from monarch_kernel.wire.reports import FailureReport

#: Output lines of the dead rank repeated in the message (its whole output is above it,
#: and in its log).
TAIL_LINES = 5
#: Names of the cell's variables the death message names (then "and the others").
NAMED = 2

_CELL_FRAME = re.compile(r'^\s*File "<remote cell ([^>]+)>", line (\d+), in (\S+)\s*$')


def assigned_names(code: str) -> list[str]:
    """The top-level names ``code`` (a cell) binds, the plain assignments first (``step
    = 0``, ``model = ...``), then loop targets, imports, functions and classes; empty
    when it does not parse (a cell with magics)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    first: list[str] = []
    later: list[str] = []

    def names(target: ast.AST, into: list[str]) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                into.append(node.id)

    def visit(body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    names(t, first)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                names(stmt.target, first)
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                names(stmt.target, later)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                later.extend((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                later.append(stmt.name)
                continue  # their bodies bind nothing at the top level
            for inner in ("body", "orelse", "finalbody"):
                visit(getattr(stmt, inner, None) or [])
            for handler in getattr(stmt, "handlers", None) or []:
                visit(handler.body)

    visit(tree.body)
    return [n for n in dict.fromkeys(first + later) if n != "_"]


@dataclass
class Death:
    """What is known of a death that failed a cell, once the policy acted on it."""

    death: DeathInfo
    mesh: str
    cell: str
    policy: str  #: ``restart``, ``stop``, ``continue``, ``shrink``
    restarted: bool = False  #: it runs again (restarted by the policy)
    #: The restart that brought it back, when known (what it re-formed and re-ran).
    report: RecoveryReport | None = None
    restarting: bool = False  #: still restarting when the message was made
    error: str | None = None  #: why the restart failed
    names: list[str] = field(default_factory=list)  #: variables the cell binds
    world: int = 0  #: ranks of the mesh
    #: The other ranks of the cell the policy released (rank -> how: ``interrupted``).
    released: dict[int, str] = field(default_factory=dict)
    #: Other ranks of the cell that failed because of the death (rank -> their error).
    consequences: dict[int, str] = field(default_factory=dict)
    heard: bool = False  #: the dead rank showed output in the cell (lines or bars)


def death_text(d: Death) -> str:
    """The one message of a death the failure policy handled (see the module doc)."""
    rank = d.death.rank
    where = f"rank {rank} of mesh {d.mesh!r} (host {d.death.host}, pid {d.death.pid})"
    head = f"{where} died ({d.death.how}) in cell {d.cell}"
    report = d.report
    lost = ""
    if d.error is not None:
        head += f"; the restart (policy: {d.policy}) failed: {d.error}"
    elif d.restarted:
        head += f"; restarted (policy: {d.policy})"
        if report is not None:
            others = [r for r in report.restarted if r != rank]
            head += f" in {report.seconds:.2f}s"
            if others:
                head += f", with rank(s) {format_ranks(others)}"
            if report.process_group:
                head += f"; process group ({report.process_group}) re-formed"
            if report.actors:
                head += f"; actor(s) {', '.join(report.actors)} re-created"
        lost = _lost(d, report)
    elif d.restarting:
        head += f"; restarting (policy: {d.policy}): the next cell waits for it"
        lost = _lost(d, None)
    elif d.policy == "stop":
        head += "; the mesh was stopped (policy: stop)"
    else:
        head += (
            f"; left dead (policy: {d.policy}): restart it with "
            f"%mesh restart {d.mesh} --ranks {rank}"
        )
    lines = [head + "."]
    if lost:
        lines.append(lost)
    peers = _peers(d)
    if peers:
        lines.append(peers)
    if report is not None and report.replicas:
        lines.append(report.replicas)
    if report is not None:
        lines.extend(f"problem: {p}" for p in report.problems)
    if d.death.tail:
        lines.append(f"last output lines of rank {rank}:")
        lines.extend("  " + line for line in d.death.tail[-TAIL_LINES:])
    elif not d.heard and not d.death.reason:
        lines.append(f"(rank {rank} printed nothing in cell {d.cell})")
    return "\n".join(lines)


def _lost(d: Death, report: RecoveryReport | None) -> str:
    """What the restart lost, where, and how to keep it."""
    rank = d.death.rank
    restarted = sorted({rank, *(report.restarted if report is not None else ())})
    setup = "set-up cells re-ran" if report is None or report.setup_cells else "no set-up cells"
    if report is not None and report.peer_state:
        return report.peer_state
    named = [f"`{n}`" for n in d.names[:NAMED]]
    if len(named) == 2:
        what = f"{named[0]}, {named[1]} and the other variables of the cell are"
    elif named:
        what = f"{named[0]} and the other variables of the cell are"
    else:
        what = "the variables of the cell are"
    who = format_ranks(restarted)
    text = (
        f"Its namespace is new ({setup}): {what} lost on rank {who} — declare them in a "
        "`TrainingState` (monarch_kernel.training) to keep them"
    )
    kept = [r for r in range(d.world) if r not in restarted]
    if kept:
        text += f"; {_ranks(kept)} kept theirs"
    return text + "."


def _peers(d: Death) -> str:
    """What the death did to the other ranks of the cell, as its consequence."""
    parts = []
    by_how: dict[str, list[int]] = {}
    for r, how in sorted(d.released.items()):
        by_how.setdefault(how, []).append(r)
    for how, ranks in by_how.items():  # how: ``interrupted``, ``released by ...``
        verb = "were" if len(ranks) > 1 else "was"
        parts.append(f"{_ranks(ranks)}, still running the cell, {verb} {how}")
    by_error: dict[str, list[int]] = {}
    for r, error in sorted(d.consequences.items()):
        by_error.setdefault(error, []).append(r)
    for error, ranks in by_error.items():
        parts.append(f"{_ranks(ranks)} failed too ({error})")
    if not parts:
        return ""
    return f"Because rank {d.death.rank} died, " + "; ".join(parts) + "."


def _ranks(ranks: list[int]) -> str:
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {format_ranks(ranks)}"


# -- the stop button ---------------------------------------------------------------------
def place(report: FailureReport) -> str:
    """Where a rank was when it failed: the deepest line of a cell in its traceback
    (``cell 5, line 3: time.sleep(1)``), else its innermost line of user code."""
    lines = str(report.get("traceback") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _CELL_FRAME.match(lines[i])
        if m:
            cell, line, func = m.groups()
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            inside = f" in {func}" if func != "<module>" else ""
            return f"cell {cell}, line {line}{inside}: {code}" if code else f"cell {cell}"
    src = report.get("line")
    if not src:
        return ""
    at = f"{src.get('file', '?')}:{src.get('line', 0)} in {src.get('func', '?')}"
    source = src.get("code")
    return f"{at}: {source}" if source else at


def interrupt_lines(
    failures: Sequence[FailureReport], ranks: Sequence[int], total: int, finished: Sequence[int]
) -> list[str]:
    """One line per group of ranks of an interrupted cell: where they were (ranks at the
    same place on one line), which had finished it already."""
    groups: dict[str, list[int]] = {}
    for f in failures:
        rank = int(f.get("rank", -1))
        if rank not in ranks:
            continue
        kind = str(f.get("type", ""))
        message = str(f.get("message") or "").split("\n", 1)[0]
        at = place(f)
        if kind == "KeyboardInterrupt":
            what = "KeyboardInterrupt"
        elif released_by_abort(f):  # also as the RuntimeError torch's C++ made of it
            what = "interrupted in a collective (process group aborted)"
        else:
            what = f"{kind}: {message}" if message else kind
        text = f"{what} at {at}" if at else what
        groups.setdefault(text, [])
        if rank not in groups[text]:
            groups[text].append(rank)
    lines = [f"{_ranks(rs)} of {total}: {text}" for text, rs in groups.items()]
    done = [r for r in finished if r in ranks]
    if done:
        lines.append(f"{_ranks(done)} of {total}: had finished it")
    return lines
