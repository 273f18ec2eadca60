"""The running-jobs rows: a fixed pool of rows (hidden when unused), each with a Cancel
button. A job keeps its row while it runs, so rows do not move under the pointer; each
row's Cancel cancels the job shown in it."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as W

from monarch_kernel.widgets import panes
from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.display import prefer_frontend_subshell
from monarch_kernel.widgets.jobs import MAX_JOBS
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.views import JobView


class JobRows:
    """:data:`~monarch_kernel.widgets.jobs.MAX_JOBS` rows under a title line."""

    def __init__(self, on_cancel: Callable[[int], None]) -> None:
        self.title = W.HTML()
        self.labels: list[W.HTML] = []
        self.cancel_buttons: list[W.Button] = []
        self.rows: list[W.HBox] = []
        #: row -> the request id of the job it shows (None: a free row)
        self.slots: list[str | None] = [None] * MAX_JOBS
        for i in range(MAX_JOBS):
            label = W.HTML()
            cancel = W.Button(
                description="Cancel",
                icon="times",
                tooltip="Interrupt this job on the ranks still running it",
                layout=W.Layout(width="auto", flex="0 0 auto"),
            )
            cancel.on_click(lambda _b, i=i: on_cancel(i))
            prefer_frontend_subshell(cancel)
            self.labels.append(label)
            self.cancel_buttons.append(cancel)
            self.rows.append(
                W.HBox([label, cancel], layout=W.Layout(display="none", align_items="center"))
            )
        self.box = W.VBox(
            [self.title, *self.rows], layout=W.Layout(display="none", margin="0 0 2px")
        )

    def _place(self, shown: list[JobView]) -> None:
        """Free the rows of jobs no longer shown; new jobs take free rows."""
        listed = {job.request for job in shown}
        slots = self.slots
        for i, rid in enumerate(slots):
            if rid is not None and rid not in listed:
                slots[i] = None
        placed = set(slots)
        for job in shown:
            if job.request not in placed:
                slots[slots.index(None)] = job.request

    def put(self, st: MeshState, shown: list[JobView]) -> int:
        """Show the running jobs ``shown`` (each keeps its row while it is listed);
        returns the messages sent."""
        self._place(shown)
        by_id = {job.request: job for job in shown}
        sent = put(self.title, value=panes.jobs_title_html(st, shown))
        sent += put(self.box.layout, display="flex" if shown else "none")
        for i, rid in enumerate(self.slots):
            row = self.rows[i]
            if rid is None or rid not in by_id:
                sent += put(row.layout, display="none")
                sent += put(self.labels[i], value="")
                sent += put(self.cancel_buttons[i], disabled=True)
                continue
            job = by_id[rid]
            sent += put(self.labels[i], value=panes.job_html(job))
            sent += put(  # still enabled while cancelling: a second try may help
                self.cancel_buttons[i],
                disabled=False,
                tooltip=f"Cancel {job.what}: interrupt it on the {job.ranks.split(' (')[0]} "
                "still running it",
            )
            sent += put(row.layout, display="flex")
        return sent
