"""JupyterLab's Debugger panel on a ``%%remote`` cell, in a real JupyterLab (Debian's
Chromium through Playwright): turn the debugger on, click the gutter on a line of the cell
that only rank 1 runs, run it; the Callstack panel shows rank 1's frame and the Variables
panel a tensor's shape; the Callstack toolbar's Next steps rank 1 (its variables refresh)
and its Continue runs the cell to its end. The screenshot goes to
``test-artifacts/debugger-panel.png`` (``docs/debugger-panel.png`` is one such, copied by
hand). Uses the JupyterLab fixture of ``test_browser.py``."""

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

#: Line 6 (the %%remote line is 1) runs on rank 1 only.
CELL = """%%remote dbg
import os, torch
rank = int(os.environ["RANK"])
t = torch.ones(3, 5) * rank
if rank == 1:
    x = rank + 1
    x = x * 10
print("rank", rank, "done")"""


def _upload(base: str, name: str) -> None:
    upload_notebook(
        base,
        name,
        ["%mesh dbg --gpus 2", CELL],
    )


def _cell_finished(cell) -> bool:
    """Whether the cell's prompt shows its execution count (``[*]`` while it runs)."""
    return "*" not in cell.locator(".jp-InputPrompt").inner_text()


def _click_gutter(page, cell, line: int) -> None:
    """Click the breakpoint gutter of the cell's editor beside line ``line`` (1-based)."""
    gutter = cell.locator(".cm-breakpoint-gutter").first.bounding_box()
    row = cell.locator(".cm-line").nth(line - 1).bounding_box()
    assert gutter and row, "the cell's editor has no breakpoint gutter"
    page.mouse.click(gutter["x"] + gutter["width"] / 2, row["y"] + row["height"] / 2)


def test_gutter_breakpoint_in_a_remote_cell_shows_in_the_panel(jupyterlab):  # noqa: F811
    lab = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    _upload(lab, "panel.ipynb")
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            open_notebook(page, lab, "panel.ipynb")
            _run_cell(page, 0)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 2",
                timeout=60_000,
            )
            page.locator(".jp-DebuggerBugButton").first.click()
            page.locator(".jp-DebuggerCallstack").first.wait_for(timeout=30_000)
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            cell.scroll_into_view_if_needed()
            _click_gutter(page, cell, 6)
            page.locator(".jp-DebuggerBreakpoint").first.wait_for(timeout=10_000)
            _run_cell(page, 1)
            frames = page.locator(".jp-DebuggerCallstackFrame")
            frames.first.wait_for(timeout=60_000)
            variables = page.locator(".jp-DebuggerVariables")
            wait_until(
                lambda: "[3, 5]" in variables.inner_text(),
                timeout=30,
                what="the Variables panel to show the tensor's shape",
                detail=lambda: variables.inner_text(),
            )
            assert "rank" in variables.inner_text()
            assert "run_user" not in frames.all_inner_texts()[-1]  # the rank's own frames: hidden
            assert frames.first.inner_text().split()[0] == "<module>"
            page.screenshot(path=str(ARTIFACTS / "debugger-panel.png"))
            # the Callstack panel's own toolbar buttons (jp-button; the paused overlay on
            # the notebook has plain buttons of the same titles)
            page.locator("jp-button[title^='Next']").first.click()
            wait_until(
                lambda: "x" in [r.split()[0] for r in variables.inner_text().splitlines() if r],
                timeout=30,
                what="rank 1 to step past line 6 (x is shown)",
                detail=lambda: variables.inner_text(),
            )
            assert frames.first.inner_text().endswith(":7")  # the cell line it stopped on
            continue_button = page.locator("jp-button[title^='Continue']").first
            wait_until(continue_button.is_enabled, timeout=10, what="Continue to be enabled")
            continue_button.click()
            out = cell.locator(".jp-OutputArea")
            wait_until(
                lambda: "rank 1 done" in out.inner_text() and _cell_finished(cell),
                timeout=30,
                what="Continue to run the cell to its end",
                detail=lambda: out.inner_text(),
            )
            assert "rank 0 done" in out.inner_text() and "Interrupt" not in out.inner_text()
            wait_until(
                lambda: frames.count() == 0,
                timeout=10,
                what="the Callstack panel to empty once the ranks ran on",
            )
            wait_until(
                lambda: page.locator(".jp-DebuggerPausedOverlay").count() == 0,
                timeout=10,
                what="the 'Paused in Debugger' overlay to go",
            )
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "debugger-panel-failure.png"))
            raise
        finally:
            browser.close()
