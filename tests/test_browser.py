"""The dashboard in a real browser: JupyterLab started here, Debian's Chromium driven by
Playwright. A notebook makes a 4-rank mesh and runs a ``--bg`` loop calling ``report()``;
the dashboard's tiles and loss chart must be visible and change. A rank killed
mid-training shows up as dead (with its last output) while the others train on; the
restart button brings it back, and the Interrupt button stops a busy foreground cell
(comms over subshells). Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import WaitTimeout, wait_until
from kernel_client import ensure_kernelspec

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
#: The prebuilt JupyterLab extension (``make setup`` builds it from labextension/).
LABEXT = ROOT / "monarch_kernel" / "labextension"
TOKEN = "monarch-browser-test"

playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium"),
    pytest.mark.timeout(240),
]

LOOP = """%%remote demo --bg
import math, random, time, monarch_kernel
from monarch_kernel.actor import current_rank
r = current_rank().rank
for step in range(160):
    loss = 2.0 * math.exp(-step / 45) + 0.05 * r + 0.03 * random.random()
    monarch_kernel.report(step=step, loss=loss, lr=1e-3 * (1 - step / 200))
    if step % 40 == 0:
        print(f"step {step} loss {loss:.3f}", flush=True)
    time.sleep(0.06)
"""


KILL = """import os, signal
os.kill(demo.runtime.ranks[3].pid, signal.SIGKILL)  # as if the OOM killer struck rank 3
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def monarch_notebook(sources: list[str]) -> nbformat.NotebookNode:
    """A notebook of the ``monarch`` kernel with one code cell per source."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "monarch", "display_name": "Monarch", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return nb


def upload_notebook(base: str, name: str, sources: list[str]) -> None:
    """Put a notebook of ``sources`` into the server's root through its contents API."""
    content = monarch_notebook(sources)
    body = json.dumps({"type": "notebook", "format": "json", "content": content}).encode()
    req = urllib.request.Request(
        f"{base}/api/contents/{name}",
        data=body,
        method="PUT",
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=10)


def _notebook(path: Path) -> None:
    sources = [
        "%mesh demo --gpus 4 --on-failure continue",
        LOOP,
        KILL,
        "%%remote demo\nimport time\ntime.sleep(60)",
    ]
    nbformat.write(monarch_notebook(sources), path)


def _sidebar_notebook(path: Path) -> None:
    sources = [
        "%mesh side --gpus 2 --on-failure continue",
        # two runs, the second starting again at step 0
        "%%remote side\nimport os, monarch_kernel\nr = int(os.environ['RANK'])\n"
        "for run in range(2):\n    for step in range(20):\n"
        "        monarch_kernel.report(step=step, loss=1.0 / (step + 1) + run + 0.3 * r)",
        # many ranks are drawn as their mean with a min/max band (here from 2 on)
        "side.dashboard().live_charts['metric:loss'].max_lines = 1",
        "import os, signal\nos.kill(side.runtime.ranks[1].pid, signal.SIGKILL)",
        "%mesh stop side",
    ]
    nbformat.write(monarch_notebook(sources), path)


def lab_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a JupyterLab that loads our prebuilt extension from this checkout
    (through JUPYTER_PATH: nothing is installed into the shared environment)."""
    if not (LABEXT / "package.json").exists():
        pytest.fail("the JupyterLab extension is not built: run `make setup`")
    data = tmp_path / "jupyter-data"
    (data / "labextensions").mkdir(parents=True, exist_ok=True)
    link = data / "labextensions" / "monarch-kernel-labextension"
    if not link.exists():
        link.symlink_to(LABEXT, target_is_directory=True)
    old = os.environ.get("JUPYTER_PATH")
    return {
        **os.environ,
        "JUPYTER_PATH": str(data) + (os.pathsep + old if old else ""),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a fresh notebook; shut down after."""
    ensure_kernelspec()
    root = tmp_path / "root"
    root.mkdir()
    _notebook(root / "demo.ipynb")
    _sidebar_notebook(root / "sidebar.ipynb")
    settings = tmp_path / "settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(
        json.dumps(
            {
                "@jupyterlab/apputils-extension:notification": {
                    "fetchNews": "false",
                    "checkForUpdates": False,
                }
            }
        )
    )
    # Other packages' extensions in this environment (ipyparallel's, from the bench extra)
    # are not under test: switch them off, server side and in the page.
    labconfig = tmp_path / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"ipyparallel-labextension": True}})
    )
    port = _free_port()
    env = lab_env(tmp_path)
    # JupyterLab writes to its own copy of the descriptor: ours is closed at once
    with open(tmp_path / "lab.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter",
                "lab",
                "--no-browser",
                "--allow-root",
                "--ip",
                "127.0.0.1",
                f"--port={port}",
                f"--IdentityProvider.token={TOKEN}",
                f"--ServerApp.root_dir={root}",
                f"--LabApp.app_settings_dir={settings}",
                f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
                "--ServerApp.terminals_enabled=False",
                "--ServerApp.jpserver_extensions",
                "ipyparallel=False",
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if proc.poll() is not None:
            raise WaitTimeout(f"JupyterLab exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
            return True
        except OSError:
            return False

    try:
        wait_until(answers, timeout=60, interval=0.2, what="JupyterLab to answer")
    except WaitTimeout as exc:
        pytest.fail(f"JupyterLab did not start ({exc}):\n" + (tmp_path / "lab.log").read_text())
    yield base
    req = urllib.request.Request(
        f"{base}/api/shutdown", method="POST", headers={"Authorization": f"token {TOKEN}"}
    )
    try:
        urllib.request.urlopen(req, timeout=10)
        proc.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        proc.terminate()
        proc.wait(10)
    shutil.copy(tmp_path / "lab.log", ARTIFACTS / "lab.log")


@contextlib.contextmanager
def chromium_page(width: int, height: int) -> Iterator[Any]:
    """A page of Debian's Chromium (through Playwright) of ``width`` × ``height``; the
    browser is closed after."""
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def open_notebook(page, base: str, name: str) -> None:
    """Open notebook ``name`` of the server at ``base`` and wait until its kernel is
    attached (the toolbar says idle before that, and Shift+Enter is then dropped: the
    status bar's "| Idle" is what counts)."""
    page.goto(f"{base}/lab/tree/{name}?token={TOKEN}")
    page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle")).first.wait_for(
        timeout=60_000
    )


def _run_cell(page, index: int) -> None:
    """Run cell ``index`` with Shift+Enter, making sure it is the active cell first
    (outputs above it may still be growing and move it)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    for _ in range(10):
        cell.scroll_into_view_if_needed()
        cell.locator(".cm-content").click()
        if "jp-mod-active" in (cell.get_attribute("class") or ""):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"could not activate cell {index}")
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text()
    page.keyboard.press("Shift+Enter")
    # "[ ]:" -> "[*]:" (or a number)
    wait_until(lambda: prompt.inner_text() != before, timeout=10, what=f"cell {index} to start")


def _tiles(page) -> list[str]:
    return page.locator(".mk-dash .mk-tile").all_inner_texts()


LOSS = '.mk-dash .mk-uplot[data-chart="metric:loss"]'

#: The colours an element shows, as RGBA bytes: a 1x1 canvas paints the computed CSS
#: colour (whatever syntax the browser computes it to, color-mix included).
COLORS_JS = """(el) => {
  const cs = getComputedStyle(el);
  const ctx = document.createElement('canvas').getContext('2d', {willReadFrequently: true});
  const rgba = (c) => { ctx.clearRect(0, 0, 1, 1); ctx.fillStyle = c; ctx.fillRect(0, 0, 1, 1);
                        return Array.from(ctx.getImageData(0, 0, 1, 1).data); };
  return {fg: rgba(cs.color), bg: rgba(cs.backgroundColor), raw: [cs.color, cs.backgroundColor]};
}"""


#: The theme's colour variables, as the page computes them now.
THEME_VARS_JS = """() => {
  const cs = getComputedStyle(document.body);
  return ['--jp-layout-color0', '--jp-layout-color1', '--jp-layout-color2',
          '--jp-ui-font-color0', '--jp-ui-font-color1', '--jp-content-font-color0',
          '--jp-border-color0', '--jp-border-color1'
         ].map((v) => cs.getPropertyValue(v).trim()).join('|');
}"""


def _luminance(rgb: list[int]) -> float:
    def lin(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(fg: list[int], bg: list[int]) -> float:
    """WCAG contrast ratio of two opaque colours."""
    a, b = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def _last_step(page) -> float:
    chart = page.locator(LOSS).first
    if chart.count() == 0:
        return -1.0
    last = chart.get_attribute("data-last-x") or ""
    return float(last) if last else -1.0


def test_dashboard_in_jupyterlab(lab):
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1800})
        try:
            open_notebook(page, lab, "demo.ipynb")
            _run_cell(page, 0)
            dash = page.locator(".mk-dash").first
            dash.wait_for(timeout=30_000)
            page.locator(".mk-dash .mk-tile").nth(3).wait_for(timeout=30_000)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 4",
                timeout=30_000,
            )
            # the header comes in the same update as the tiles, as a message of its own
            # after theirs: the page may show the tiles a moment before it
            page.wait_for_function(
                "document.querySelector('.mk-dash .mk-head').innerText.includes('4/4 alive')",
                timeout=10_000,
            )
            tiles_idle = _tiles(page)
            assert all("idle" in t and "pid" in t for t in tiles_idle), tiles_idle
            page.screenshot(path=str(ARTIFACTS / "dashboard-ready.png"))

            _run_cell(page, 1)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-busy').length === 4",
                timeout=30_000,
            )
            page.wait_for_function(
                f"(document.querySelector('{LOSS}') || {{dataset: {{}}}}).dataset.series === '4'",
                timeout=30_000,
            )
            # the chart moves on while training: each time, wait for its next step
            steps, tile_texts = [_last_step(page)], [_tiles(page)]
            for _ in range(3):
                page.wait_for_function(
                    f"Number(document.querySelector('{LOSS}').dataset.lastX || -1) > {steps[-1]}",
                    timeout=30_000,
                )
                steps.append(_last_step(page))
                tile_texts.append(_tiles(page))
            assert len(set(steps)) == 4 and steps == sorted(steps), steps
            assert tile_texts[0] != tile_texts[-1], "tiles did not change while training"
            assert all("busy" in t and "step" in t for t in tile_texts[-1]), tile_texts[-1]
            chart = page.locator(LOSS)
            assert chart.is_visible() and chart.get_attribute("data-series") == "4"
            # tick labels on both axes
            assert chart.locator(".u-axis").count() == 2
            page.screenshot(path=str(ARTIFACTS / "page-training.png"))

            # Rank 3 is killed mid-training: its tile and the errors panel say so at once,
            # the other ranks train on.
            _run_cell(page, 2)
            page.locator(".mk-dash .mk-tile.mk-s-dead").wait_for(timeout=15_000)
            assert "SIGKILL" in page.locator(".mk-dash .mk-tile").nth(3).inner_text()
            errors = page.locator(".mk-dash .mk-errors")
            errors.locator("summary", has_text="died: killed by SIGKILL").wait_for(timeout=5000)
            assert "step 0 loss" in errors.inner_text()  # its last output lines
            # the header is a message of its own, just after the tiles' of the same tick
            page.locator(".mk-dash .mk-head", has_text="3/4").wait_for(timeout=5_000)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-busy').length === 3",
                timeout=5_000,
            )
            # Select a rank: its recent output shows up.
            page.locator(".mk-dash .mk-tile").nth(1).click()
            page.locator(".mk-dash .mk-detail", has_text="rank 1").wait_for(timeout=10_000)
            page.locator(".mk-dash .mk-detail pre", has_text="loss").first.wait_for(timeout=10_000)
            time.sleep(1.0)  # let the charts move on a little past the death
            dash.screenshot(path=str(ARTIFACTS / "dashboard-training.png"))

            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 3",
                timeout=60_000,
            )
            page.wait_for_function(  # charts refresh at most twice a second
                f"document.querySelector('{LOSS}').dataset.lastX === '159'", timeout=10_000
            )
            # The loss chart: log scale, and a value per rank under the pointer.
            chart.locator("button.mk-scale").click()
            page.wait_for_function(
                f"document.querySelector('{LOSS} button.mk-scale').dataset.scale === 'log'",
                timeout=5_000,
            )
            box = chart.locator(".u-over").bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] / 2)
            readout = chart.locator(".mk-readout")
            page.wait_for_function(
                f"document.querySelector('{LOSS} .mk-readout').dataset.hover === '1'",
                timeout=5_000,
            )
            assert re.search(r"step \d+: r0 [\d.]+", readout.inner_text()), readout.inner_text()
            # drag to zoom into steps ~40-120; a double-click shows the whole run again
            full = chart.get_attribute("data-x-range")
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + box["width"] * 0.25, y)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] * 0.75, y, steps=5)
            page.mouse.up()
            page.wait_for_function(
                f"document.querySelector('{LOSS}').dataset.xRange !== {full!r}", timeout=5_000
            )
            lo, hi = (float(v) for v in chart.get_attribute("data-x-range").split(".."))
            assert 20 < lo < hi < 140, (lo, hi)
            page.mouse.dblclick(box["x"] + box["width"] / 2, y)
            page.wait_for_function(
                f"document.querySelector('{LOSS}').dataset.xRange === {full!r}", timeout=5_000
            )
            dash.screenshot(path=str(ARTIFACTS / "dashboard-done.png"))
            page.locator(".mk-dash .mk-tile").nth(3).click()  # select it: "Restart rank 3"
            page.locator(".mk-dash button", has_text="Restart rank 3").click()
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-idle').length === 4",
                timeout=60_000,
            )
            page.locator(".mk-dash .mk-status", has_text="restarted ranks 3").wait_for(timeout=5000)

            # A busy foreground cell; the dashboard's Interrupt button still works.
            _run_cell(page, 3)
            page.wait_for_function(
                "document.querySelectorAll('.mk-dash .mk-tile.mk-s-busy').length === 4",
                timeout=30_000,
            )
            t0 = time.monotonic()
            page.locator(".mk-dash button", has_text="Interrupt").click()
            busy_cell = page.locator(".jp-Notebook .jp-Cell").nth(3)
            busy_cell.locator(".jp-OutputArea", has_text="KeyboardInterrupt").wait_for(
                timeout=15_000
            )
            assert time.monotonic() - t0 < 10
            page.locator(".mk-dash .mk-status", has_text="interrupt sent").wait_for(timeout=5000)
            page.screenshot(path=str(ARTIFACTS / "page-interrupted.png"))

            # Dark themes: tile text and panes stay legible (WCAG AA: contrast >= 4.5:1).
            for theme, shot in (
                ("JupyterLab Dark", "dashboard-dark.png"),
                ("JupyterLab Dark High Contrast", "dashboard-high-contrast.png"),
            ):
                before = page.evaluate(THEME_VARS_JS)
                page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
                page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Theme$")).hover()
                item = page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{theme}$"))
                item.click()
                page.wait_for_function(
                    f"document.body.dataset.jpThemeName === {theme!r}", timeout=15_000
                )
                # its CSS applies: the theme's colour variables are no longer the last one's
                page.wait_for_function(f"({THEME_VARS_JS})() !== {before!r}", timeout=15_000)
                for i in range(4):
                    tile = page.locator(".mk-dash .mk-tile").nth(i)
                    c = tile.evaluate(COLORS_JS)
                    ratio = contrast(c["fg"], c["bg"])
                    assert c["bg"][3] == 255 and ratio >= 4.5, (theme, i, ratio, c)
                for pane in (".mk-dash .mk-errors pre", ".mk-dash .mk-detail pre"):
                    c = page.locator(pane).first.evaluate(COLORS_JS)
                    assert contrast(c["fg"], c["bg"]) >= 4.5, (theme, pane, c)
                dash.screenshot(path=str(ARTIFACTS / shot))
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "failure.png"))
            raise
        finally:
            browser.close()


def test_labextension_is_listed_enabled(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"],
        env=lab_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert re.search(r"monarch-kernel-labextension v\S+ .*enabled.*OK", text), text


def _status(page) -> str:
    return page.locator(".mk-lab-status").inner_text()


def test_sidebar_and_status_bar_follow_a_mesh(lab):
    """The Meshes sidebar and the status bar item, fed over the kernel's comm: a mesh
    appears when created, turns red when a rank is killed, goes when stopped."""
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        console: list[str] = []  # kept with the screenshots when the test fails
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        try:
            open_notebook(page, lab, "sidebar.ipynb")
            status = page.locator(".mk-lab-status")
            status.wait_for(timeout=30_000)
            page.wait_for_function(
                "document.querySelector('.mk-lab-status').textContent.includes('no meshes')",
                timeout=30_000,
            )
            _run_cell(page, 0)
            page.wait_for_function(
                "document.querySelector('.mk-lab-status').textContent.includes('side 2/2')",
                timeout=30_000,
            )
            assert re.search(r"⬢ side 2/2 · [\d.]+ [KMG]?B/s", _status(page)), _status(page)
            status.click()  # opens the sidebar
            mesh = page.locator('.mk-lab-sidebar .mk-lab-mesh[data-mesh="side"]')
            mesh.wait_for(timeout=10_000)
            page.wait_for_function(
                "document.querySelectorAll('.mk-lab-mesh .mk-lab-rank.mk-lab-s-idle').length === 2",
                timeout=10_000,
            )
            assert "gpus=2 · local" in mesh.inner_text()
            assert "mk-lab-bad" not in (status.get_attribute("class") or "")

            # A run that starts again at step 0 is a new line, not joined to the old one.
            _run_cell(page, 1)
            page.wait_for_function(
                f"(document.querySelector('{LOSS}') || {{dataset: {{}}}}).dataset.series === '4'",
                timeout=20_000,
            )
            legend = page.locator(f"{LOSS} .mk-readout").inner_text()
            assert "r0 run 1" in legend and "r0 run 2" in legend, legend
            page.screenshot(path=str(ARTIFACTS / "sidebar-running.png"))
            _run_cell(page, 2)
            page.wait_for_function(
                f"document.querySelector('{LOSS} .mk-readout').textContent.includes('mean of 2')",
                timeout=10_000,
            )
            legend = page.locator(f"{LOSS} .mk-readout").inner_text()
            assert legend == "mean of 2 · max · min", legend
            assert page.locator(f"{LOSS}").get_attribute("data-series") == "3"
            page.locator(LOSS).screenshot(path=str(ARTIFACTS / "chart-band.png"))

            _run_cell(page, 3)  # rank 1 killed: red in the grid and in the status bar
            page.locator(".mk-lab-mesh .mk-lab-rank.mk-lab-s-dead").wait_for(timeout=10_000)
            page.locator(".mk-lab-status.mk-lab-bad").wait_for(timeout=10_000)
            assert "side 1/2" in _status(page)
            page.screenshot(path=str(ARTIFACTS / "sidebar-dead.png"))
            # the sidebar's button restarts it: green again, the status bar no longer red
            mesh.locator("button", has_text="Restart dead").click()
            page.wait_for_function(
                "document.querySelectorAll('.mk-lab-mesh .mk-lab-rank.mk-lab-s-idle').length === 2",
                timeout=30_000,
            )
            page.wait_for_function(
                "!document.querySelector('.mk-lab-status').classList.contains('mk-lab-bad')",
                timeout=10_000,
            )
            assert "side 2/2" in _status(page)
            page.locator(".mk-lab-notice", has_text="restarted ranks 1").wait_for(timeout=10_000)

            # its Dashboard button shows the dashboard in a new cell below the active one
            # (the stop cell, index 4, stays where it is: the new cell goes below it)
            heads = page.locator(".mk-dash .mk-head b", has_text="side")
            before = heads.count()
            mesh.locator("button", has_text="Dashboard").click()
            wait_until(lambda: heads.count() == before + 1, timeout=20, what="a new dashboard")
            only = re.compile(r"^side\.dashboard\(\)$")
            new_cell = page.locator(".jp-Cell .cm-content", has_text=only)
            assert new_cell.count() == 1

            _run_cell(page, 4)  # stopped: the mesh leaves the sidebar and the status bar
            mesh.wait_for(state="detached", timeout=15_000)
            page.wait_for_function(
                "document.querySelector('.mk-lab-status').textContent.includes('no meshes')",
                timeout=10_000,
            )
            page.screenshot(path=str(ARTIFACTS / "sidebar-stopped.png"))
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "failure-sidebar.png"))
            (ARTIFACTS / "failure-sidebar-console.txt").write_text("\n".join(console))
            raise
        finally:
            browser.close()
