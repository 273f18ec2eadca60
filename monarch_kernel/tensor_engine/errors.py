"""The errors of the tensor engine: :class:`RemoteException` (an op failed on a rank),
:class:`CellReport` (failed ops nothing fetched, shown when a notebook cell ends) and the
``TypeError`` raised at an op with bad arguments (Monarch's codes)."""

from __future__ import annotations

import linecache
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire.tensor_ops import RankError

#: A frame of the controller where an op was issued: ``(filename, line, function)``.
Frame = tuple[str, int, str]


class RemoteException(Exception):
    """An op failed on a rank; raised by the fetch of a value that depends on it.

    ``rank``: the rank where it failed first; ``seq``: the op's sequence number;
    ``worker_error_string``: the rank's traceback; ``controller_frames``: where the op
    was issued in the notebook (``(filename, line, function)``, outermost first);
    ``error_type`` / ``message``: the rank's exception."""

    def __init__(self, error: RankError, controller_frames: Sequence[Frame]):
        self.rank = error.rank
        self.seq = error.seq
        self.error_type = error.error_type
        self.message = error.message
        self.worker_error_string = error.traceback
        self.controller_frames = list(controller_frames)
        super().__init__(self._text())

    def _text(self) -> str:
        lines = [
            f"A tensor-engine op failed on rank {self.rank}: {self.error_type}: {self.message}"
        ]
        if self.controller_frames:
            lines.append("Where the op was issued on the controller (most recent call last):")
            lines.extend(_where(self.controller_frames))
        if self.worker_error_string:
            lines.append(f"Traceback on rank {self.rank}:")
            lines.append(self.worker_error_string.rstrip())
        return "\n".join(lines)


def _where(frames: Sequence[Frame]) -> list[str]:
    """``frames`` as traceback lines; a notebook cell's as IPython names it
    (``Cell In[3], line 4``), and the frames outside the first cell's (IPython's own)
    left out."""
    names = _cell_names(frames)
    if names:
        first = min(i for i, f in enumerate(frames) if f[0] in names)
        frames = frames[first:]
    lines = []
    for filename, lineno, name in frames:
        cell = names.get(filename)
        if cell is not None:
            lines.append(
                f"  {cell}, line {lineno}" + ("" if name == "<module>" else f", in {name}")
            )
        else:
            lines.append(f'  File "{filename}", line {lineno}, in {name}')
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {source}")
    return lines


def _cell_names(frames: Sequence[Frame]) -> dict[str, str]:
    """The frames' files that are notebook cells -> ``Cell In[N]`` (empty outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell: Any = get_ipython()
    namer = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if namer is None:
        return {}
    names = {}
    for filename, _, _ in frames:
        label = namer(filename)
        if label:
            names[filename] = f"{label[0]} {label[1]}"
    return names


@dataclass(frozen=True)
class Unfetched:
    """An op that failed on ``ranks`` and that no fetch raised: ``error`` is the lowest
    rank's."""

    error: RemoteException
    ranks: tuple[int, ...]


@dataclass
class CellReport:
    """What a notebook cell's end shows: the failed ops nothing fetched (oldest first),
    and ``more``: how many failures the ranks left out (past what they keep)."""

    unfetched: list[Unfetched]
    more: int

    def text(self) -> str:
        """A warning block for under the cell ('' when there is nothing to show)."""
        if not self.unfetched and not self.more:
            return ""
        blocks = []
        for u in self.unfetched:
            where = "rank" if len(u.ranks) == 1 else "ranks"
            ranks = ", ".join(map(str, u.ranks))
            blocks.append(
                f"Warning: a tensor-engine op failed on {where} {ranks} and nothing fetched "
                f"its result (fetching a value that depends on it raises):\n"
                f"RemoteException: {u.error}"
            )
        if self.more:
            blocks.append(
                f"Warning: {self.more} more op failures on the ranks are not shown "
                "(a rank keeps the first 64 between two cell ends)."
            )
        return "\n\n".join(blocks) + "\n"


def bad_arguments(code: str, detail: str) -> TypeError:
    """Monarch's error for an op whose arguments cannot run on a mesh (``code``:
    ``LOCAL_TENSOR``, ``WRONG_MESH``, ``DROPPED`` ...)."""
    return TypeError(f"Incorrect arguments to monarch operation: {code}: {detail}")
