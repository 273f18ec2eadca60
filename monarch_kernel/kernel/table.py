"""``%mesh`` with no arguments: a table of the kernel's live meshes."""

from __future__ import annotations

import html

from monarch_kernel.controller.state.registry import MeshSummary

COLUMNS = ("mesh", "shape", "backend", "alive", "state")


class MeshTable:
    """``%mesh`` with no arguments: the live meshes (those made by ``%mesh`` and by
    ``spawn_procs`` alike), as text and as HTML."""

    def __init__(self, meshes: list[MeshSummary]):
        self.rows: list[tuple[str, ...]] = [
            (m.name, m.shape, m.backend, f"{m.alive}/{m.world}", str(m.state)) for m in meshes
        ]

    def __repr__(self) -> str:
        if not self.rows:
            return "no meshes; create one with %mesh NAME --gpus 4"
        head = COLUMNS
        widths = [max(len(str(r[i])) for r in (head, *self.rows)) for i in range(5)]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in (head, *self.rows)
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<i>no meshes; create one with <code>%mesh NAME --gpus 4</code></i>"
        head = "".join(f"<th>{h}</th>" for h in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
