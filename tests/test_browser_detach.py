"""A restarted kernel's dashboard in real JupyterLab (Debian's Chromium, Playwright): the
old output shows a static snapshot of the mesh's last state and one line saying why,
never broken widgets, also after the page is reloaded; ``%mesh attach`` brings a live
dashboard back. Screenshot: test-artifacts/dashboard-after-restart.png (the one in docs/
is such a screenshot, copied by hand).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import nbformat
import pytest
from helpers import wait_until
from test_browser import (
    ARTIFACTS,
    CHROMIUM,
    TOKEN,
    _run_cell,
    chromium_page,
    lab,  # noqa: F401 - the fixture
    monarch_notebook,
    open_notebook,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
    pytest.mark.timeout(240),
]

REPORT = (
    "%%remote snap\nimport monarch_kernel\n"
    "for step in range(30):\n    monarch_kernel.report(step=step, loss=1.0 / (step + 1))"
)


def _notebook(path: Path) -> None:
    sources = [
        "%mesh snap --gpus 2 --detachable --keep 10m",
        REPORT,
        "%mesh attach snap",
        "%mesh stop snap",
    ]
    nbformat.write(monarch_notebook(sources), path)


def _api(base: str, path: str, method: str = "GET") -> object:
    req = urllib.request.Request(
        f"{base}{path}", method=method, headers={"Authorization": f"token {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return json.loads(body) if body else None


def _restart_kernel(base: str) -> None:
    """``Restart Kernel`` of the notebook's kernel (what the menu asks the server)."""
    sessions = _api(base, "/api/sessions")
    assert isinstance(sessions, list) and len(sessions) == 1, sessions
    _api(base, f"/api/kernels/{sessions[0]['kernel']['id']}/restart", "POST")


def test_restarted_kernels_dashboard_shows_its_last_state(lab, tmp_path):  # noqa: F811
    _notebook(tmp_path / "root" / "snap.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)  # (the fixture copies JupyterLab's log there)
    runtime = tmp_path / "runtime"
    with chromium_page(1280, 1400) as page:
        open_notebook(page, lab, "snap.ipynb")
        _run_cell(page, 0)
        page.wait_for_function(
            "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 2",
            timeout=60_000,
        )
        _run_cell(page, 1)
        cells = page.locator(".jp-Notebook .jp-Cell")
        cells.nth(1).locator(".jp-InputPrompt", has_text="[2]").wait_for(timeout=60_000)

        _restart_kernel(lab)
        first = cells.nth(0)
        why = first.locator(".mk-dash-retired")
        why.wait_for(timeout=60_000)  # the live widget became the snapshot at once
        assert "%mesh attach snap" in why.inner_text()
        page.keyboard.press("Control+s")
        saved = tmp_path / "root" / "snap.ipynb"
        wait_until(
            lambda: "mk-dash-retired" in saved.read_text(),
            timeout=30,
            what="the notebook to be saved with the snapshot",
        )

        page.reload()
        open_notebook(page, lab, "snap.ipynb")
        first = page.locator(".jp-Notebook .jp-Cell").nth(0)
        first.locator(".mk-dash-retired").wait_for(timeout=30_000)
        text = first.locator(".jp-OutputArea").inner_text()
        assert "runs on without it" in text and "%mesh attach snap" in text, text
        # the kernel retired it itself: the extension's freezing (frozen.ts) left it alone
        assert first.locator(".mk-dash-orphaned").count() == 0
        assert "rank 1" in text and "snap" in text, text  # the tiles, readable
        assert "loss" in text, text  # the metrics reported before the restart
        assert "Error displaying widget" not in page.content()
        assert first.locator(".jp-OutputArea img").count() == 0  # no broken icons
        first.screenshot(path=str(ARTIFACTS / "dashboard-after-restart.png"))

        # the mesh ran on: attaching brings a live dashboard (widgets, tiles)
        _run_cell(page, 2)
        live = page.locator(".jp-Notebook .jp-Cell").nth(2)
        live.locator(".mk-dash .mk-tile").nth(1).wait_for(timeout=60_000)
        assert "attached mesh 'snap'" in live.inner_text()
        _run_cell(page, 3)
        wait_until(
            lambda: not any(n.startswith("monarch-mesh-") for n in os.listdir(runtime)),
            timeout=60,
            what="the detached mesh to be stopped",
        )
