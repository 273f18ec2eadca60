"""What the magics share of the notebook: its namespace and the labels of cells run on
ranks (``<remote cell N>`` in tracebacks, ``cell N`` on the dashboard)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from monarch_kernel.rank.context import UserNamespace


class Notebook:
    """The IPython shell the magics are registered with, seen as the notebook.

    It holds the state that outlives one magic call: the label counter of cells run on
    ranks and the id of the notebook cell running now (which keys ``--setup`` cells).
    """

    def __init__(self, shell: Any):
        self.shell = shell
        #: the running notebook cell's id, when the front-end sends one (JupyterLab and
        #: Notebook 7 do); set by the magics' pre_run_cell hook
        self.cell_key: str | None = None
        self._cell = 0  #: cells run on ranks so far (the ``#k`` outside a prompt)
        #: (prompt number, cells run on ranks from it so far); see :meth:`next_cell`
        self._prompt_runs: tuple[int, int] = (0, 0)

    @property
    def user_ns(self) -> UserNamespace:
        """The notebook's namespace (read when asked: IPython may replace it)."""
        return cast(UserNamespace, self.shell.user_ns)

    @property
    def hidden(self) -> Mapping[str, object]:
        """The names IPython keeps out of ``%who`` (its own, in the user namespace)."""
        return cast(Mapping[str, object], getattr(self.shell, "user_ns_hidden", {}))

    def next_cell(self) -> str:
        """The label of the next cell run on ranks: the number of the prompt it runs
        from, as the user sees it (``In [N]``, the execute reply's ``execution_count``).
        More runs from the same prompt (``%mesh --dist``'s set-up and a ``%remote`` line,
        a loop of ``%remote``) are ``N.2``, ``N.3`` ...; outside a numbered prompt ``#k``."""
        self._cell += 1
        count = prompt_number(self.shell)
        if count is None:
            return f"#{self._cell}"
        prompt, runs = self._prompt_runs
        runs = runs + 1 if prompt == count else 1
        self._prompt_runs = (count, runs)
        return f"{count}" if runs == 1 else f"{count}.{runs}"


def prompt_number(shell: Any) -> int | None:
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
