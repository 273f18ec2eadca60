"""A SIGKILLed kernel's dashboard in real JupyterLab (Debian's Chromium, Playwright).

The kernel cannot retire its dashboards (retire.py) when it is killed: the JupyterLab
extension (labextension/src/frozen.ts) replaces them in the notebook with the snapshot it
captured from the page, under one line saying why, once JupyterLab has restarted the
kernel; saved, the snapshot survives a reload; ``%mesh attach`` brings a live dashboard
back. A kernel killed while no page shows its notebook leaves a dashboard with no view to
capture: opened again, it shows the kernel's own static fallback under that line.
Screenshot: test-artifacts/dashboard-after-kill.png (the one in docs/ is such a screenshot,
copied by hand).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import nbformat
import psutil
import pytest
from helpers import wait_until
from test_browser import (
    ARTIFACTS,
    CHROMIUM,
    _run_cell,
    chromium_page,
    lab,  # noqa: F401 - the fixture
    monarch_notebook,
    open_notebook,
)
from test_browser_detach import _api

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
    pytest.mark.timeout(240),
]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
LOSS = '.mk-dash .mk-uplot[data-chart="metric:loss"]'
FROZEN_LOSS = '.mk-dash-frozen .mk-uplot[data-chart="metric:loss"]'
REPORT = (
    "%%remote killed\nimport monarch_kernel\n"
    "for step in range(30):\n    monarch_kernel.report(step=step, loss=1.0 / (step + 1))"
)

#: Whether every image in the element loaded (a broken one has no natural width).
IMAGES_OK_JS = (
    "(el) => [...el.querySelectorAll('img')].every(i => i.complete && i.naturalWidth > 0)"
)


def _notebook(path: Path) -> None:
    sources = [
        "%mesh killed --gpus 2 --detachable --keep 10m",
        REPORT,
        "%mesh attach killed",
        "%mesh stop killed",
    ]
    nbformat.write(monarch_notebook(sources), path)


def _kernel_processes(base: str) -> list[psutil.Process]:
    """The live processes of the notebook's kernel (started with its connection file)."""
    sessions = _api(base, "/api/sessions")
    assert isinstance(sessions, list) and len(sessions) == 1, sessions
    connection = f"kernel-{sessions[0]['kernel']['id']}.json"
    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE
        and any(arg.endswith(connection) for arg in p.info["cmdline"] or [])
    ]


def _kill_kernel(base: str) -> int:
    """SIGKILL the notebook's kernel (what the out-of-memory killer does: no goodbye);
    its pid."""
    (proc,) = _kernel_processes(base)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return proc.pid


def _stop_detached(runtime: Path) -> None:
    """End the host agents this test's kernels left detached (a failed test only: the
    test stops its mesh with ``%mesh stop``), found by the runtime dir they inherited."""
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd = " ".join(p.info["cmdline"] or [])
        env = p.info["environ"] or {}
        if "monarch_kernel.host" in cmd and env.get("JUPYTER_RUNTIME_DIR") == str(runtime):
            p.terminate()


def _outputs(saved: Path, cell: int) -> list[dict]:
    """Cell ``cell``'s outputs in the saved notebook (none while it is being written)."""
    try:
        return json.loads(saved.read_text())["cells"][cell]["outputs"]
    except json.JSONDecodeError:
        return []


def test_killed_kernels_dashboard_shows_a_static_snapshot(lab, tmp_path):  # noqa: F811
    _notebook(tmp_path / "root" / "killed.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)  # (the fixture copies JupyterLab's log there)
    runtime = tmp_path / "runtime"
    saved = tmp_path / "root" / "killed.ipynb"
    try:
        with chromium_page(1280, 1400) as page:
            open_notebook(page, lab, "killed.ipynb")
            _run_cell(page, 0)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 2",
                timeout=60_000,
            )
            _run_cell(page, 1)
            cells = page.locator(".jp-Notebook .jp-Cell")
            cells.nth(1).locator(".jp-InputPrompt", has_text="[2]").wait_for(timeout=60_000)
            first = cells.nth(0)
            first.locator(f"{LOSS} canvas").first.wait_for(timeout=60_000)  # the metrics arrived
            # the dashboard's own update after the cell (its tiles idle again) came too: the
            # cell's prompt can show before it (a CI run killed the kernel in between and
            # froze rank 1 as busy)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 2",
                timeout=60_000,
            )

            _kill_kernel(lab)
            # JupyterLab's server restarts it (same kernel id); then the extension freezes
            # the dashboard in the notebook model
            why = first.locator(".mk-dash-orphaned")
            why.wait_for(timeout=90_000)
            line = why.inner_text()
            assert "died at" in line and "%mesh attach killed" in line, line
            output = first.locator(".jp-OutputArea")
            text = output.inner_text()
            assert "killed" in text and "rank 1 · idle" in text, text  # header, the tiles' text
            assert output.locator(".mk-dash-frozen .mk-tile").count() == 2
            # the charts, as images (the loss chart too: the metrics before the kill)
            assert output.locator(f"{FROZEN_LOSS} img").count() >= 1
            assert output.evaluate(IMAGES_OK_JS)
            assert "Error displaying widget" not in page.content()
            # JupyterLab's own notice of the restart: out of the screenshot's way
            if page.locator(".jp-Dialog").count():
                page.locator(".jp-Dialog .jp-mod-accept").click()
                page.locator(".jp-Dialog").wait_for(state="detached", timeout=10_000)
            first.screenshot(path=str(ARTIFACTS / "dashboard-after-kill.png"))

            page.keyboard.press("Control+s")
            wait_until(
                lambda: "mk-dash-orphaned" in saved.read_text(),
                timeout=30,
                what="the notebook to be saved with the snapshot",
            )
            assert WIDGET_MIME not in json.dumps(_outputs(saved, 0))

            page.reload()
            open_notebook(page, lab, "killed.ipynb")
            first = page.locator(".jp-Notebook .jp-Cell").nth(0)
            first.locator(".mk-dash-orphaned").wait_for(timeout=30_000)
            output = first.locator(".jp-OutputArea")
            text = output.inner_text()
            assert "died at" in text and "%mesh attach killed" in text, text
            assert output.locator(".mk-dash-frozen .mk-tile").count() == 2
            assert output.locator(f"{FROZEN_LOSS} img").count() >= 1
            assert output.evaluate(IMAGES_OK_JS)  # no broken icons
            assert "Error displaying widget" not in page.content()

            # the detachable mesh ran on without its kernel: attaching shows it live
            _run_cell(page, 2)
            live = page.locator(".jp-Notebook .jp-Cell").nth(2)
            live.locator(".mk-dash .mk-tile").nth(1).wait_for(timeout=60_000)
            assert "attached mesh 'killed'" in live.inner_text()
            page.keyboard.press("Control+s")
            wait_until(
                lambda: WIDGET_MIME in json.dumps(_outputs(saved, 2)),
                timeout=30,
                what="the notebook to be saved with the live dashboard",
            )

            # the kernel dies while no page shows the notebook: opened again, the dashboard
            # it left has no live view to capture: the kernel's own static fallback is shown
            page.goto("about:blank")
            old = _kill_kernel(lab)
            wait_until(
                lambda: [p.pid for p in _kernel_processes(lab) if p.pid != old],
                timeout=60,
                what="the server to restart the kernel",
            )
            open_notebook(page, lab, "killed.ipynb")
            cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
            line = cell.locator(".mk-dash-orphaned")
            line.wait_for(timeout=60_000)
            why = line.inner_text()
            # "died at": the page opened while the server was still restarting it
            assert "is gone" in why or "died at" in why, why
            assert "%mesh attach killed" in why, why
            text = cell.locator(".jp-OutputArea").inner_text()
            assert cell.locator(".mk-dash-static").count() == 1, text  # the kernel's fallback
            assert "rank 1" in text and "killed" in text, text
            assert "Error displaying widget" not in page.content()

            _run_cell(page, 2)  # attached again from the third kernel
            cell.locator(".mk-dash .mk-tile").nth(1).wait_for(timeout=60_000)
            _run_cell(page, 3)
            wait_until(
                lambda: not any(n.startswith("monarch-mesh-") for n in os.listdir(runtime)),
                timeout=60,
                what="the detached mesh to be stopped",
            )
    finally:
        _stop_detached(runtime)  # (nothing left when the test passed)
