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
