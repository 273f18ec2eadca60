"""One breakpoint session in a real JupyterLab (Debian's Chromium through Playwright): a
``%%remote`` cell calls ``breakpoint()`` on rank 0; the cell says where the rank stopped,
JupyterLab's own input box shows the rank's pdb prompt, ``p x`` prints the variable and
``c`` lets the cell finish. Uses the JupyterLab fixture of ``test_browser.py``.
"""

from __future__ import annotations

from helpers import wait_until
from test_browser import (  # noqa: F401 - pytestmark and the fixture are used by pytest
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    _run_cell,
    open_notebook,
    playwright_sync,
    pytestmark,
    upload_notebook,
)
from test_browser import lab as jupyterlab  # noqa: F401 - the fixture, by this name

CELL = """%%remote dbg --ranks 0
x = 41
breakpoint()
y = x + 1
print("y is", y)
"""


def _upload(base: str, name: str) -> None:
    """Put a notebook into the server's root through its contents API."""
    upload_notebook(
        base,
        name,
        [
            "%mesh dbg --gpus 2",
            CELL,
            "%mesh stop dbg",
        ],
    )


def _answer(page, text: str) -> None:
    """Type ``text`` into the pdb prompt JupyterLab shows and press Enter."""
    box = page.locator(".jp-Stdin-input").last
    box.wait_for(timeout=30_000)
    box.fill(text)
    box.press("Enter")


def test_one_breakpoint_session_in_jupyterlab(jupyterlab):  # noqa: F811 - the fixture
    lab = jupyterlab  # the server's base URL
    ARTIFACTS.mkdir(exist_ok=True)
    _upload(lab, "debug.ipynb")
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        try:
            open_notebook(page, lab, "debug.ipynb")
            _run_cell(page, 0)
            page.locator(".mk-dash").first.wait_for(timeout=60_000)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 2",
                timeout=60_000,
            )
            _run_cell(page, 1)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            out = cell.locator(".jp-OutputArea")
            wait_until(
                lambda: "stopped at cell line" in out.inner_text(),
                timeout=30,
                what="the cell to say where rank 0 stopped",
            )
            prompt = page.locator(".jp-Stdin-prompt").last
            prompt.wait_for(timeout=30_000)
            assert "rank 0" in prompt.inner_text() and "(Pdb)" in prompt.inner_text()
            _answer(page, "p x")
            wait_until(lambda: "41" in out.inner_text(), timeout=30, what="p x to print 41")
            page.screenshot(path=str(ARTIFACTS / "debugger-breakpoint.png"))
            _answer(page, "c")
            wait_until(lambda: "y is 42" in out.inner_text(), timeout=30, what="the cell to end")
            _run_cell(page, 2)
            wait_until(
                lambda: "stopped" in page.locator(".jp-Notebook .jp-Cell").nth(2).inner_text(),
                timeout=30,
                what="the mesh to stop",
            )
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "debugger-failure.png"))
            raise
        finally:
            browser.close()
