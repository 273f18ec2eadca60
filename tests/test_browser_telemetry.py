"""Where the time goes, in a real JupyterLab (Debian's Chromium through Playwright): a
4-rank DDP loop whose rank 2 loads its data 30 ms slower per step draws a stacked bar
per rank (rank 2's data segment the long one, the others' wait in collectives), the
straggler line on the dashboard and under the running cell, and the step-time heat
map. Uses the JupyterLab fixture of ``test_browser.py``; the screenshot goes to
test-artifacts/telemetry-dashboard.png.
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

LOOP = """%%remote wt
import os, time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
RANK = int(os.environ["RANK"])
ddp = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
class Batches(Dataset):
    def __len__(self):
        return 150
    def __getitem__(self, i):
        if RANK == 2:
            time.sleep(0.03)
        return torch.randn(8)
for x in DataLoader(Batches(), batch_size=None):
    opt.zero_grad()
    ddp(x[None]).sum().backward()
    opt.step()
"""

ROWS = ".mk-dash .mk-step-row"


def _segment_width(page, rank: int, category: str) -> float:
    return float(
        page.evaluate(
            f"(() => {{ const s = document.querySelector("
            f"'{ROWS}[data-rank=\"{rank}\"] .mk-seg-{category}');"
            " return s ? s.getBoundingClientRect().width : 0; })()"
        )
    )


def test_step_view_and_straggler_in_jupyterlab(jupyterlab):  # noqa: F811
    ARTIFACTS.mkdir(exist_ok=True)
    upload_notebook(jupyterlab, "steps.ipynb", ["%mesh wt --gpus 4 --dist", LOOP, "%mesh stop wt"])
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1300, "height": 1400})
        try:
            open_notebook(page, jupyterlab, "steps.ipynb")
            _run_cell(page, 0)
            page.locator(".mk-dash .mk-head", has_text="4/4 alive").first.wait_for(timeout=120_000)
            _run_cell(page, 1)
            page.wait_for_function(
                f"document.querySelectorAll({ROWS!r}).length === 4", timeout=60_000
            )
            straggler = page.locator(".mk-dash .mk-straggler").first
            straggler.wait_for(timeout=60_000)
            assert straggler.inner_text().startswith(
                "rank 2 (host-0) is the straggler: data loading"
            ), straggler.inner_text()
            # under the running cell too (its output area), while it runs
            out = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea")
            wait_until(
                lambda: "rank 2 (host-0) is the straggler" in out.inner_text(),
                timeout=30,
                what="the straggler line under the cell",
                detail=out.inner_text,
            )
            # rank 2's bar: the long data segment; the others': the long wait
            wait_until(
                lambda: _segment_width(page, 2, "data") > 3 * _segment_width(page, 0, "data"),
                timeout=30,
                what="rank 2's data segment to be the long one",
            )
            # (waited for, as the data segment is: on a loaded 2-core machine the ranks'
            # process-group workers wait for a CPU too, and a bar sampled then showed every
            # rank's comm alike, 340 px against 338)
            wait_until(
                lambda: _segment_width(page, 0, "comm") > 3 * _segment_width(page, 2, "comm"),
                timeout=30,
                what="rank 0's wait in collectives to be the long one",
                detail=lambda: (
                    f"comm: rank 0 {_segment_width(page, 0, 'comm')} px, "
                    f"rank 2 {_segment_width(page, 2, 'comm')} px"
                ),
            )
            heat = page.locator(".mk-dash img.mk-step-heat").first
            assert heat.evaluate("i => i.complete && i.naturalWidth > 0")
            view = page.locator(".mk-dash .mk-steps-view").first
            view.scroll_into_view_if_needed()
            view.screenshot(path=str(ARTIFACTS / "telemetry-dashboard.png"))
            page.screenshot(path=str(ARTIFACTS / "telemetry-page.png"), full_page=False)
            page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-InputPrompt").filter(
                has_text="[2]"
            ).wait_for(timeout=120_000)
            _run_cell(page, 2)
            page.locator(".jp-OutputArea", has_text="stopped").first.wait_for(timeout=60_000)
        finally:
            browser.close()
