"""The live mesh dashboard: ipywidgets over the kernel's comm channel.

One :class:`Dashboard` per mesh (``dashboard(procs)`` returns the same one each time, so
showing it again in another cell is a second view of the same widget models).

Threads:

* controller threads call :meth:`MeshState.on_event` (a deque append, nothing more);
* the dashboard's updater thread wakes every ``interval`` seconds (0.25 s: at most four
  updates a second), folds the queued events in, renders each part and sends only the
  widgets whose value changed (each widget's changes as one comm message);
* button clicks (Cancel included) arrive on whichever thread the kernel handles the comm
  message on: a subshell thread when the frontend sends comms over subshells (JupyterLab
  >= 4.4 with ipykernel >= 7), so they work while a cell is busy; else the main thread,
  after the running cell. They only record the request; slow actions (restart, stop, cancel)
  run on a worker thread (:mod:`~monarch_kernel.widgets.actions`).

This module assembles the parts and runs the updater; each part owns its widgets and
sends its own changes: :mod:`~monarch_kernel.widgets.tile_grid`,
:mod:`~monarch_kernel.widgets.action_bar`, :mod:`~monarch_kernel.widgets.job_rows` and
:mod:`~monarch_kernel.widgets.chart_area`; their HTML comes from
:mod:`~monarch_kernel.widgets.render` and :mod:`~monarch_kernel.widgets.panes`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from monarch_kernel.controller.state.records import MeshPhase
from monarch_kernel.widgets import compact, panes, render, theme
from monarch_kernel.widgets.action_bar import ActionBar, BarView
from monarch_kernel.widgets.actions import MeshActions
from monarch_kernel.widgets.chart_area import ChartArea
from monarch_kernel.widgets.delta import put
from monarch_kernel.widgets.display import Display
from monarch_kernel.widgets.heat_grid import HeatGrid
from monarch_kernel.widgets.job_rows import JobRows
from monarch_kernel.widgets.snapshot import snapshot_html, snapshot_text
from monarch_kernel.widgets.state import MeshState
from monarch_kernel.widgets.step_view import StepView
from monarch_kernel.widgets.tile_grid import TileGrid
from monarch_kernel.widgets.views import TileView
from monarch_kernel.wire.jsontypes import MimeBundle

if TYPE_CHECKING:
    from monarch_kernel.controller.mesh import MeshRuntime

log = logging.getLogger("monarch_kernel.widgets")

UPDATE_INTERVAL = 0.25  # seconds between two updates: at most 4 updates a second


class Dashboard(W.VBox):
    """Live view of one process mesh: header, buttons, running jobs (each with a Cancel
    button), rank tiles, charts, errors and recoveries.

    Create it with :func:`monarch_kernel.widgets.dashboard`; display it like any widget.
    Frontends without widget support show a static HTML snapshot instead.

    Its parts, top to bottom: the style sheet, :attr:`header`, :attr:`hosts_html`
    (machines still joining), the :class:`ActionBar`, the :class:`JobRows`,
    :attr:`stacks_html`, the :class:`TileGrid` with the selected rank's :attr:`detail`
    beside it, the :class:`ChartArea` and the incident area (:attr:`errors`).
    """

    def __init__(self, runtime: MeshRuntime, interval: float = UPDATE_INTERVAL, start: bool = True):
        self.runtime = runtime
        self.state = MeshState(runtime)
        self.interval = interval
        self.selected: int | None = None
        self.status = ""
        self.flushes = 0
        self.flush_times: deque[float] = deque(maxlen=4096)
        self.messages = 0  # widget updates sent (one comm message each)
        self.cpu_seconds = 0.0  # CPU time spent in updates (all threads that ran them)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._displays: list[Display] = []
        self._retired = False  # its displays show a static snapshot now (see .retire)
        self._last_sample = 0.0
        self._last_flush = 0.0
        self._last_tiles = 0.0
        self._marked: int | None = None  # the tile shown as selected
        self._error_key = -1
        self._recoveries_seen = 0
        self._resizes_seen = 0
        self._phase_seen = runtime.state
        self._views: list[TileView] = []  # what each tile shows (empty before the first tick)
        self.compact = runtime.world > render.FULL_TILES_MAX
        #: A heat-map grid (one small cell per rank) instead of tiles: chosen once, when
        #: the dashboard is made (a mesh that grows past the threshold keeps its tiles).
        self.heat = compact.use_grid(runtime.world)
        self.columns = (
            compact.grid_columns(runtime.world, (list(runtime.shape.sizes) or [1])[-1])
            if self.heat
            else render.grid_columns(self.state)
        )
        self.tile_text_period = max(1.0, runtime.world / 32)  # compact tiles: seconds between texts
        self.actions = MeshActions(runtime, self.state, self._set_status, self._put_stacks)
        super().__init__(self._build())
        self.add_class("mk-dash")
        self.state.attach()
        self._tick()
        self._thread = threading.Thread(
            target=self._run, name=f"mk-dashboard-{runtime.name}", daemon=True
        )
        if start:
            self._thread.start()

    def _build(self) -> list[W.Widget]:
        """Make the parts; returns the dashboard's children, top to bottom."""
        self.grid: TileGrid | HeatGrid = (
            HeatGrid(self.columns, self.select, self.cell_detail)
            if self.heat
            else TileGrid(self.runtime.world, self.columns, self.compact, self.select)
        )
        self.bar = ActionBar()
        self.bar.interrupt_button.on_click(lambda _b: self.interrupt())
        self.bar.stacks_button.on_click(lambda _b: self.show_stacks())
        self.bar.restart_button.on_click(lambda _b: self.restart())
        self.bar.stop_button.on_click(lambda _b: self.stop())
        self.jobs = JobRows(self._cancel_slot)
        self.chart_area = ChartArea(self.state, self._lock, aggregate=self.heat)
        #: Where the time goes: per-rank step breakdown, straggler, step-time heat map.
        self.step_view = StepView(getattr(self.runtime, "telemetry", None))
        # the parts' widgets under the names the tests, benches and notebooks read
        self.tiles = self.grid.tiles
        self.job_labels = self.jobs.labels
        self.cancel_buttons = self.jobs.cancel_buttons
        self.jobs_box = self.jobs.box
        self.charts = self.chart_area.charts
        self.charts_box = self.chart_area.box
        self.live_charts = self.chart_area.live_charts
        self.header = W.HTML()
        self.hosts_html = W.HTML()  # machines still joining (join and engine backends)
        self.stacks_html = W.HTML()  # filled by the Stacks button
        self.detail = W.HTML(layout=W.Layout(flex="1 1 320px", min_width="300px"))
        self.errors = W.HTML()
        body = W.Box(
            [self.grid.box, self.detail],
            layout=W.Layout(display="flex", flex_flow="row wrap", align_items="flex-start"),
        )
        return [
            W.HTML(theme.CSS),
            self.header,
            self.hosts_html,
            self.bar.box,
            self.jobs.box,
            self.stacks_html,
            body,
            self.step_view.html,
            self.chart_area.box,
            self.chart_area.charts,
            self.errors,
        ]

    # -- display -------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> MimeBundle | None:
        data: MimeBundle | None = super()._repr_mimebundle_(**kwargs)
        if data is None:
            return None
        html, text = self.snapshot()
        data["text/html"] = html
        data["text/plain"] = text
        return data

    def snapshot(self, charts: bool = True) -> tuple[str, str]:
        """Static ``(html, text)`` views of the current state (for non-widget frontends)."""
        with self._lock:
            views = self._views
            return (
                snapshot_html(self.state, views, self.columns, charts, grid=self.heat),
                snapshot_text(self.state, views, grid=self.heat),
            )

    def retire(self, bundle: MimeBundle) -> bool:
        """Replace every display of this dashboard with ``bundle`` (static: its kernel
        is going away, see :mod:`.retire`); nothing re-sends the widget after. False
        if it was never displayed."""
        self._retired = True
        for d in self._displays:
            try:
                d.update(bundle)
            except Exception:  # a closed kernel channel: nothing to do
                pass
        return bool(self._displays)

    def show(self) -> None:
        """Display the dashboard under the current cell (its fallback is refreshed when
        the mesh finishes starting and when it stops)."""
        from IPython.display import display

        display_id = f"mk-dash-{id(self):x}-{len(self._displays)}"
        display(self, display_id=display_id)
        self._displays.append(Display(display_id))

    def refresh(self) -> None:
        """Update now and refresh the displays' static fallback (the kernel calls this,
        through :func:`monarch_kernel.widgets.refresh`, once the mesh started or failed)."""
        self.update()
        self.refresh_displays()

    def refresh_displays(self) -> None:
        """Re-send the displays made by :meth:`show` (updates their static fallback)."""
        if not self._displays or self.comm is None or self._retired:
            return
        data = self._repr_mimebundle_()
        if data is None:
            return
        for d in self._displays:
            try:
                d.update(data)
            except Exception:  # a closed kernel channel: nothing to do
                pass

    # -- actions (any thread) --------------------------------------------------------
    def select(self, rank: int | None) -> None:
        """Show ``rank``'s recent output and last error (``None``: clear; again: toggle)."""
        self.selected = None if rank == self.selected else rank
        self._wake.set()

    def cell_detail(self, rank: int) -> str:
        """What hovering rank ``rank``'s grid cell shows (any thread)."""
        with self._lock:
            if not 0 <= rank < self.runtime.world:
                return "no such rank"
            return render.cell_detail(self.state, self.state.tile(rank))

    def _set_status(self, text: str) -> None:
        self.status = f"{time.strftime('%H:%M:%S')} {text}"
        self._wake.set()

    def _put_stacks(self, html: str) -> None:
        with self._lock:
            put(self.stacks_html, value=html)

    def interrupt(self) -> None:
        """Send SIGINT to every live rank (KeyboardInterrupt in their user code)."""
        self.actions.interrupt()

    def _cancel_slot(self, slot: int) -> None:
        """The Cancel button of row ``slot``: cancel the job it shows."""
        rid = self.jobs.slots[slot]
        if rid is None:
            self._set_status("that job had finished")
            return
        self.cancel(rid)

    def cancel(self, request_id: str) -> None:
        """Cancel a running job (a ``%%remote`` cell, ``--bg`` ones included, or an
        actor call): interrupt it on the ranks still running it and skip it where it has
        not started yet (``MeshRuntime.cancel_request``), on a worker thread; the status
        line says what was done."""
        self.actions.cancel(request_id)

    def show_stacks(self) -> None:
        """Show every rank's Python stacks now, grouped, under the buttons (collected on
        a worker thread, in about a second at most; see ``%mesh stacks``)."""
        self.actions.show_stacks()

    def restart(self, ranks: list[int] | None = None) -> None:
        """Restart ``ranks`` (default: the selected rank if it is dead, else every dead
        rank) on a worker thread."""
        self.actions.restart(ranks, self.selected)

    def stop(self, confirm: bool = True) -> None:
        """Stop the mesh; from the button the first click asks for a second one."""
        self.actions.stop(confirm)

    # -- the updater -----------------------------------------------------------------
    def _run(self) -> None:
        final = False
        while not self._closed:
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.update()
            except Exception:  # never let the dashboard thread die
                log.exception("dashboard update failed")
            if self.runtime.state is MeshPhase.STOPPED:
                if final:
                    break
                final = True  # one more round for events still in flight
        self.state.detach()
        if not self._closed:
            self.refresh_displays()

    def update(self) -> None:
        """Bring the widgets up to date now; waits out the throttle (at most one update
        per ``interval``) first."""
        with self._lock:
            wait = self._last_flush + self.interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._tick()

    def _tick(self) -> None:
        with self._lock:
            cpu0 = time.thread_time()
            try:
                self._tick_locked()
            finally:
                self.cpu_seconds += time.thread_time() - cpu0

    def _tick_locked(self) -> None:
        st = self.state
        st.drain()
        self._note_phase()
        now = time.monotonic()
        if now - self._last_sample >= 1.0:
            self._last_sample = now
            st.sample()
        views, sent = self._put_tiles(now)
        sent += put(self.header, value=render.header_html(st, views))
        sent += put(self.hosts_html, value=render.hosts_html(self.runtime))
        sel = self.selected
        sent += put(
            self.detail,
            value=panes.detail_html(st, sel, views[sel] if sel is not None else None),
        )
        sent += self.chart_area.put(now)
        sent += self.step_view.put(now)
        if st.error_version != self._error_key:
            self._error_key = st.error_version
            sent += put(self.errors, value=panes.errors_html(st))
        sent += self.jobs.put(st, st.running.view(now) if st.running.jobs else [])
        stopped = self.runtime.state.ended
        confirming = self.actions.confirming(now)
        sent += self.bar.put(BarView.of(views, stopped, sel, confirming, self.status))
        if sent:
            self._last_flush = time.monotonic()
            self.flushes += 1
            self.messages += sent
            self.flush_times.append(time.time())

    def _put_tiles(self, now: float) -> tuple[list[TileView], int]:
        """Update the tiles that changed; returns what every tile shows and the
        messages sent."""
        st = self.state
        # Big meshes: a tile's colour follows its state at once, its text (step, last
        # heard) every second or two; that keeps 64 tiles to ~32 messages a second.
        full = not self.compact or now - self._last_tiles >= self.tile_text_period
        if full:
            self._last_tiles = now
        marked = {self.selected, self._marked}  # selection moved: both tiles change
        self._marked = self.selected
        old_views = self._views
        views: list[TileView] = []
        sent = 0
        grid = self.grid
        grid.resize(self.runtime.world)  # the mesh may have grown or shrunk
        tiles = grid if isinstance(grid, TileGrid) else None
        for r in range(self.runtime.world):
            view = old_views[r] if r < len(old_views) else None
            if full or view is None or r in marked or view.state != st.tile_state(r):
                view = st.tile(r, now)
                if tiles is not None:
                    sent += tiles.put(r, view, self.selected)
            views.append(view)
        if isinstance(grid, HeatGrid):  # the whole mesh in one short string, if it changed
            sent += grid.put(compact.encode(v.state for v in views), self.selected)
        self._views = views
        return views, sent

    def _note_phase(self) -> None:
        """Say in the status line when the mesh starts recovering and what a recovery
        did (one the Restart button asked for says so itself)."""
        st = self.state
        if st.mesh_state is not self._phase_seen:
            self._phase_seen = st.mesh_state
            if st.mesh_state is MeshPhase.RECOVERING:
                self._set_status("recovering: restarting ranks…")
        if st.recovery_count > self._recoveries_seen:
            self._recoveries_seen = st.recovery_count
            self._set_status(st.recoveries[0].summary)
        if st.resize_count > self._resizes_seen:  # grown or shrunk: what was done
            self._resizes_seen = st.resize_count
            self._set_status(st.resize_text)

    # -- teardown --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed dashboard shows nothing more)."""
        return self._closed

    def close(self) -> None:
        """Stop updating and close every widget model (the mesh keeps running)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self.state.detach()
        if _dashboards.get(self.runtime) is self:
            del _dashboards[self.runtime]
        for w in self._parts():
            w.close()
        super().close()

    def _parts(self) -> list[W.Widget]:
        """Every widget model of the dashboard except the dashboard itself."""
        seen: dict[int, W.Widget] = {}
        stack: list[W.Widget] = [self]
        while stack:
            w = stack.pop()
            subs = (
                *getattr(w, "children", ()),
                getattr(w, "layout", None),
                getattr(w, "style", None),
            )
            for sub in subs:
                if isinstance(sub, W.Widget) and id(sub) not in seen and sub is not self:
                    seen[id(sub)] = sub
                    stack.append(sub)
        return list(seen.values())

    def __repr__(self) -> str:
        rt = self.runtime
        return f"<Dashboard of mesh {rt.name!r} {rt.shape.describe()} ({rt.state})>"


#: The one open dashboard of each mesh. Weak keys: the map itself keeps no mesh alive
#: (an open dashboard does, through its widgets, until it is closed).
_dashboards: weakref.WeakKeyDictionary[MeshRuntime, Dashboard] = weakref.WeakKeyDictionary()
_dashboards_lock = threading.Lock()


def dashboard_of(runtime: MeshRuntime) -> Dashboard:
    """``runtime``'s dashboard: the open one, else a new one."""
    with _dashboards_lock:
        dash = _dashboards.get(runtime)
        if dash is None or dash.closed:
            dash = _dashboards[runtime] = Dashboard(runtime)
        return dash


def open_dashboards() -> list[Dashboard]:
    """Every open dashboard of this process."""
    with _dashboards_lock:
        return [d for d in list(_dashboards.values()) if not d.closed]


def existing(runtime: MeshRuntime) -> Dashboard | None:
    """``runtime``'s open dashboard, if it has one (never creates one)."""
    dash = _dashboards.get(runtime)
    return None if dash is None or dash.closed else dash
