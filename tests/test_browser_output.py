"""Rank output in a real JupyterLab (Debian's Chromium through Playwright): a ``%%remote``
cell runs a tqdm loop on 4 ranks; in the middle of the loop and at its end the cell shows
bars redrawn in place, one labelled line per rank (or one line for ranks whose frames are
the same), without escape sequences, each bar further along at the end; a matplotlib
figure drawn on rank 1 shows as an image under its cell. Uses the JupyterLab fixture of
``test_browser.py``; screenshots go to test-artifacts/.
"""

from __future__ import annotations

import re

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

BARS = """%%remote out
import time
from tqdm.auto import tqdm
for i in tqdm(range(80), desc="train"):
    time.sleep(0.1)
"""

FIGURE = """%%remote out --ranks 1
import matplotlib.pyplot as plt
plt.plot([0, 1, 2, 3], [0, 1, 4, 9])
plt.title("rank 1 figure")
plt.show()
"""

#: A bar line: its rank label (``[2]``, ``[0-3]``, ``[0, 2-3]``; padded to the block's widest
#: label, so the bars line up) and the bar's text.
BAR = re.compile(r"^\[(?P<ranks>[\d, -]+)\] +(?P<bar>train:\s+\d+%\|.*)$")
#: What a terminal control left in the page would look like.
JUNK = re.compile(r"\x1b|\r|\[\?25[lh]|\[\d*[ABJK]\b")


def _upload(base: str, name: str) -> None:
    """Put a notebook into the server's root through its contents API."""
    upload_notebook(
        base,
        name,
        [
            "%mesh out --gpus 4",
            BARS,
            FIGURE,
            "%mesh stop out",
        ],
    )


def _ranks(label: str) -> list[int]:
    out: list[int] = []
    for part in label.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _bars(text: str) -> dict[int, str]:
    """Each rank's bar in a cell's output text (a collapsed line counts for its ranks)."""
    bars: dict[int, str] = {}
    for line in text.splitlines():
        m = BAR.match(line.strip())
        if m:
            for r in _ranks(m["ranks"]):
                assert r not in bars, f"rank {r} has two bars:\n{text}"
                bars[r] = m["bar"]
    return bars


def _percent(bar: str) -> int:
    return int(re.search(r"(\d+)%", bar)[1])  # type: ignore[index]


def test_bars_and_a_figure_from_ranks_in_jupyterlab(jupyterlab):  # noqa: F811 - the fixture
    lab = jupyterlab  # the server's base URL
    ARTIFACTS.mkdir(exist_ok=True)
    _upload(lab, "output.ipynb")
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1200})
        try:
            open_notebook(page, lab, "output.ipynb")
            _run_cell(page, 0)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 4",
                timeout=60_000,
            )
            cells = page.locator(".jp-Notebook .jp-Cell")
            bars_out = cells.nth(1).locator(".jp-OutputArea")

            # The middle of the loop: every rank's bar is on screen, part way.
            _run_cell(page, 1)
            mid: dict[int, str] = {}

            def part_way() -> bool:
                nonlocal mid
                mid = _bars(bars_out.inner_text())
                return sorted(mid) == [0, 1, 2, 3] and all(
                    20 <= _percent(b) <= 70 for b in mid.values()
                )

            wait_until(part_way, timeout=60, interval=0.1, what="4 bars part way")
            cells.nth(1).screenshot(path=str(ARTIFACTS / "bars-middle.png"))
            text = bars_out.inner_text()
            assert not JUNK.search(text), repr(text)
            assert len(text.strip().splitlines()) <= 4, text  # bars only, one line each

            # The end: the same lines, now at 100%, the cell done.
            prompt = cells.nth(1).locator(".jp-InputPrompt")
            wait_until(
                lambda: re.search(r"\[\d+\]", prompt.inner_text()) is not None,
                timeout=60,
                what="the bar cell to finish",
            )
            text = bars_out.inner_text()
            end = _bars(text)
            cells.nth(1).screenshot(path=str(ARTIFACTS / "bars-end.png"))
            assert sorted(end) == [0, 1, 2, 3], text
            assert all(_percent(b) == 100 and "80/80" in b for b in end.values()), end
            assert all(end[r] != mid[r] for r in range(4)), (mid, end)
            assert not JUNK.search(text), repr(text)
            assert len(text.strip().splitlines()) <= 4, text

            # A figure from rank 1: an image in its cell's output area, labelled.
            _run_cell(page, 2)
            fig_out = cells.nth(2).locator(".jp-OutputArea")
            img = fig_out.locator("img")
            img.wait_for(timeout=60_000)
            wait_until(
                lambda: img.evaluate("i => i.complete && i.naturalWidth > 100"),
                timeout=30,
                what="the figure to load",
            )
            assert img.get_attribute("src").startswith("data:image/png;base64,")
            assert "[1]:" in fig_out.inner_text()
            cells.nth(2).screenshot(path=str(ARTIFACTS / "figure-rank1.png"))

            _run_cell(page, 3)
            wait_until(
                lambda: "stopped" in cells.nth(3).inner_text(),
                timeout=30,
                what="the mesh to stop",
            )
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "output-failure.png"))
            raise
        finally:
            browser.close()
