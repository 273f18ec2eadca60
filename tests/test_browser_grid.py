"""A 64-rank mesh (4 host agents × 16, the heat-map threshold) in a real JupyterLab
(Debian's Chromium through Playwright): the dashboard draws one small cell per rank
instead of tiles, an error on 3 ranks turns their cells to the error colour and is one
grouped entry, hovering a cell shows that rank's host, last line and error, clicking
it selects the rank; the Meshes sidebar draws the same mesh as heat-map rows; the dark
theme keeps the cells' colours apart. Uses the JupyterLab fixture of
``test_browser.py``; screenshots go to test-artifacts/.
"""

from __future__ import annotations

import re

from helpers import wait_until
from test_browser import (  # noqa: F401 - pytestmark and the fixture are used by pytest
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    COLORS_JS,
    _run_cell,
    contrast,
    open_notebook,
    playwright_sync,
    pytestmark,
    upload_notebook,
)
from test_browser import lab as jupyterlab  # noqa: F401 - the fixture, by this name

HOSTS, PER_HOST = 4, 16
WORLD = HOSTS * PER_HOST
CELLS = ".mk-dash .mk-heat .mk-cell"

ERROR = """%%remote big
import os
rank = int(os.environ['RANK'])
print(f'rank {rank} loaded its shard', flush=True)
if rank in (3, 4, 9):
    raise ValueError('bad shard')
"""


#: An element's top border colour as RGBA bytes (as ``COLORS_JS`` does for text and fill).
BORDER_JS = """(el) => {
  const ctx = document.createElement('canvas').getContext('2d', {willReadFrequently: true});
  ctx.fillStyle = getComputedStyle(el).borderTopColor; ctx.fillRect(0, 0, 1, 1);
  return Array.from(ctx.getImageData(0, 0, 1, 1).data);
}"""


def _count(page, selector: str) -> int:
    return int(page.evaluate(f"document.querySelectorAll({selector!r}).length"))


def _wait_count(page, selector: str, n: int, timeout: float = 60_000) -> None:
    page.wait_for_function(
        f"document.querySelectorAll({selector!r}).length === {n}", timeout=timeout
    )


def test_dashboard_and_sidebar_draw_a_big_mesh_as_a_grid(jupyterlab):  # noqa: F811
    ARTIFACTS.mkdir(exist_ok=True)
    upload_notebook(
        jupyterlab,
        "grid.ipynb",
        [
            f"%mesh big --gpus {PER_HOST} --hosts {HOSTS} --on-failure continue",
            ERROR,
            "%mesh stop big",
        ],
    )
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        console: list[str] = []
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        try:
            open_notebook(page, jupyterlab, "grid.ipynb")
            _run_cell(page, 0)
            # one cell per rank, all idle once the mesh is up; no tiles
            _wait_count(page, f"{CELLS}.mk-s-idle", WORLD, timeout=180_000)
            assert _count(page, ".mk-dash .mk-tile") == 0
            # the header comes in the same tick as the cells, as a message of its own
            # just after theirs (CI once read it between the two: "49/64 alive")
            head = page.locator(".mk-dash .mk-head").first
            wait_until(
                lambda: f"{WORLD}/{WORLD} alive" in head.inner_text(),
                timeout=10,
                what="the header's alive count",
                detail=head.inner_text,
            )

            _run_cell(page, 1)
            _wait_count(page, f"{CELLS}.mk-s-error", 3)
            errored = page.evaluate(
                f"[...document.querySelectorAll('{CELLS}.mk-s-error')].map(c => c.dataset.rank)"
            )
            assert errored == ["3", "4", "9"], errored
            errors = page.locator(".mk-dash .mk-errors").first
            errors.wait_for(timeout=10_000)
            # the errors list fills when the failed call's report is in, which may be a
            # moment after the cells turned red (each rank's state comes as it fails)
            wait_until(
                lambda: "ValueError: bad shard — ranks 3-4, 9" in errors.inner_text(),
                timeout=30,
                what="the dashboard's grouped error",
                detail=errors.inner_text,
            )
            # error and idle cells are told apart by more than a hue (the dot)
            err, idle = (
                page.locator(f'{CELLS}[data-rank="{r}"]').evaluate(COLORS_JS) for r in (9, 10)
            )
            assert err["raw"] != idle["raw"], (err, idle)

            # hover: that rank's details, asked of the kernel. The notebook's layout may
            # still move under a resting pointer (outputs growing above), which hovers
            # another cell or leaves the grid (the box hides): each try moves the pointer
            # off the grid, hovers rank 9 afresh (a new ask) and waits a while for its
            # details. The box is read in one step in the page: a box hidden between a
            # visibility check and a read would otherwise block the read.
            tip = page.locator(".mk-heat-tip:not([hidden])").first  # the hovered view's
            nine_shown = (
                "() => [...document.querySelectorAll('.mk-heat-tip:not([hidden])')]"
                ".map(t => t.innerText).find(t => t.startsWith('rank 9 ')"
                " && t.includes('last error: ValueError')) || null"
            )

            def hovered_nine() -> str:
                page.mouse.move(1, 1)
                page.locator(f'{CELLS}[data-rank="9"]').hover()
                try:
                    return str(page.wait_for_function(nine_shown, timeout=3_000).json_value())
                except playwright_sync.TimeoutError:
                    return ""

            text = wait_until(hovered_nine, timeout=60, interval=0.2, what="rank 9's hover box")
            assert text.startswith("rank 9 · error"), text
            assert "last line: rank 9 loaded its shard" in text and "pid " in text, text

            # the box is on top: what is at its middle is the box itself. Hovered again
            # first: the pointer may rest over another cell by now (layout moved).
            def on_top() -> bool:
                if not hovered_nine():
                    return False
                try:
                    return bool(
                        tip.evaluate(
                            "t => { const b = t.getBoundingClientRect();"
                            " t.style.pointerEvents = 'auto';"
                            " const top = document.elementFromPoint(b.x + b.width / 2,"
                            " b.y + b.height / 2);"
                            " t.style.pointerEvents = ''; return top === t; }",
                            timeout=5_000,
                        )
                    )
                except playwright_sync.Error:  # the box went (hidden again): hover again
                    return False

            wait_until(on_top, timeout=30, interval=0.2, what="rank 9's hover box on top")
            box = page.locator(".mk-dash .mk-heat").first.bounding_box()
            assert box is not None
            page.screenshot(  # the grid and the hover box below it
                path=str(ARTIFACTS / "dashboard-grid-hover.png"),
                clip={"x": box["x"] - 4, "y": box["y"] - 4, "width": 640, "height": 220},
            )
            # click: the rank is selected and its output shown beside the grid
            page.locator(f'{CELLS}[data-rank="9"]').click()
            page.locator(f'{CELLS}.mk-selected[data-rank="9"]').wait_for(timeout=15_000)
            page.locator(".mk-dash .mk-detail", has_text="rank 9 loaded its shard").wait_for(
                timeout=10_000
            )
            page.screenshot(path=str(ARTIFACTS / "dashboard-grid.png"))

            # the sidebar: the same mesh as heat-map rows, one a host
            page.locator(".mk-lab-status").click()
            _wait_count(page, ".mk-lab-heat .mk-lab-rank", WORLD)
            _wait_count(page, ".mk-lab-heat .mk-lab-host", HOSTS)
            cell = page.locator('.mk-lab-heat .mk-lab-rank[data-rank="17"]')
            assert re.match(r"rank 17: idle · ", cell.get_attribute("title") or "")
            assert cell.inner_text() == ""  # no numbers in a heat map
            page.screenshot(path=str(ARTIFACTS / "sidebar-grid.png"))

            # dark themes: the cells take the theme's state colours
            for theme, shot in (
                ("JupyterLab Dark", "dashboard-grid-dark.png"),
                ("JupyterLab Dark High Contrast", "dashboard-grid-high-contrast.png"),
            ):
                page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
                page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
                item = page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{theme}$"))
                item.click()
                page.wait_for_function(
                    f"document.body.dataset.jpThemeName === {theme!r}", timeout=15_000
                )
                # the theme's variables have applied once the dashboard's text turned light
                page.wait_for_function(
                    "(() => { const m = getComputedStyle(document.querySelector('.mk-dash'))"
                    ".color.match(/\\d+/g); return m && Number(m[0]) > 150; })()",
                    timeout=15_000,
                )
                ground = page.locator(".mk-heat-tip").first.evaluate(COLORS_JS)["bg"]
                idle = page.locator(f'{CELLS}[data-rank="10"]').evaluate(COLORS_JS)
                assert idle["bg"][3] == 255 and contrast(idle["bg"], ground) >= 1.5, (
                    theme,
                    idle,
                    ground,
                )
                # an error cell: its colour is its border (a dot in the middle), apart too
                err = page.locator(f'{CELLS}[data-rank="3"]').evaluate(BORDER_JS)
                assert contrast(err, ground) >= 1.5 and err != idle["bg"], (theme, err, idle)
                page.locator(".mk-dash .mk-heat").first.screenshot(path=str(ARTIFACTS / shot))

            _run_cell(page, 2)
            _wait_count(page, f"{CELLS}.mk-s-stopped", WORLD, timeout=120_000)
            assert not console, console
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "dashboard-grid-failed.png"))
            raise
        finally:
            browser.close()
