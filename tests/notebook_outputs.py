"""Stored outputs for the tutorial notebooks: ``make notebooks`` re-executes them through
the tests that check them, and each test keeps what it executed (after its assertions
passed) as the notebook's stored outputs, which the documentation site renders.

Only with ``MONARCH_KERNEL_KEEP_NOTEBOOK_OUTPUTS=1`` (``make notebooks``): an ordinary
test run reads the notebooks and writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat

#: Set by ``make notebooks``.
KEEP_ENV = "MONARCH_KERNEL_KEEP_NOTEBOOK_OUTPUTS"


def keep_outputs(nb: nbformat.NotebookNode, path: Path) -> None:
    """Write the executed ``nb`` over ``path`` when asked to (``KEEP_ENV``): its outputs
    become the stored ones; the per-cell timing nbclient records is dropped (it changes at
    every run and means nothing to a reader)."""
    if os.environ.get(KEEP_ENV) != "1":
        return
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)  # no widget state is kept (the pages show snapshots)
    nbformat.write(nb, path)


def cell_text(cell: nbformat.NotebookNode) -> str:
    """A code cell's outputs as text, read as JupyterLab shows them: consecutive stream
    outputs of one name are one text (ipykernel may send one printed line as two stream
    messages, when its 200 ms flush timer fires between the writes of one ``print``;
    JupyterLab joins them again), other outputs are separated by a newline."""
    parts: list[str] = []
    last_stream: str | None = None
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            if last_stream == out.name:
                parts[-1] += out.text
            else:
                parts.append(out.text)
            last_stream = out.name
            continue
        last_stream = None
        if out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "\n".join(parts)
