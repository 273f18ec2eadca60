"""Rank output as rich as a local cell's, through real kernels (jupyter_client): progress
bars (tqdm, ``print(..., end="\\r")``, Lightning's) update in place while a cell runs,
labelled per rank, and end as their last frame; ``display()`` of HTML, images and
matplotlib figures from ranks arrive as ``display_data``, labelled; ``display_id``
updates replace in place; the per-rank logs keep each bar's final line."""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from kernel_client import Kernel

from monarch_kernel.launchers.local import MAX_RANKS_ENV

pytestmark = pytest.mark.local

#: IOPub messages that show under a cell (not widget traffic or kernel status).
OUTPUT_TYPES = frozenset(
    ["stream", "display_data", "update_display_data", "execute_result", "error", "clear_output"]
)
#: A terminal control sequence (what must never reach the notebook as text).
JUNK = re.compile(r"\x1b\[\?|\x1b\[\d*[ABCDJK]|\r")


@pytest.fixture(scope="module")
def kernel():
    """A kernel with a 4-rank mesh ``m`` (room for a 2-rank mesh beside it)."""
    k = Kernel(env={MAX_RANKS_ENV: "6"})
    r = k.run("%mesh m --gpus 4")
    assert "ready" in r.stdout, r.stderr + r.error_text
    yield k
    k.shutdown_and_check()


@dataclass
class Run:
    """A cell's IOPub messages, each with the time it arrived."""

    messages: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)

    def of(self, *types: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, c) for t, mt, c in self.messages if mt in types]

    def notebook(self) -> list[tuple[str, Any]]:
        """What a notebook shows: consecutive streams joined (per stream name), each
        display with the data of its latest update (as JupyterLab applies them)."""
        shown: list[tuple[str, Any]] = []
        by_id: dict[str, list[int]] = {}
        for _, mt, c in self.messages:
            if mt == "stream":
                if shown and shown[-1][0] == c["name"]:
                    shown[-1] = (c["name"], shown[-1][1] + c["text"])
                else:
                    shown.append((c["name"], c["text"]))
            elif mt == "display_data":
                did = c.get("transient", {}).get("display_id")
                if did:
                    by_id.setdefault(did, []).append(len(shown))
                shown.append(("display", c))
            elif mt == "update_display_data":
                for i in by_id.get(c["transient"]["display_id"], []):
                    shown[i] = ("display", {**shown[i][1], "data": c["data"]})
        return shown


def run(k: Kernel, code: str, timeout: float = 120) -> Run:
    msg_id = k.submit(code)
    out = Run()
    deadline = time.monotonic() + timeout
    while True:
        m = k.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if m["parent_header"].get("msg_id") != msg_id:
            continue
        mt, c = m["msg_type"], m["content"]
        if mt == "status" and c["execution_state"] == "idle":
            break
        out.messages.append((time.monotonic(), mt, c))
    while True:
        reply = k.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            out.reply = reply["content"]
            assert out.reply["status"] == "ok", out.reply
            return out


def bar_updates(r: Run) -> list[tuple[float, str]]:
    """(arrival, text) of each draw of the cell's bar displays."""
    return [
        (t, c["data"]["text/plain"])
        for t, c in r.of("display_data", "update_display_data")
        if c["metadata"].get("monarch_kernel", {}).get("bars")
    ]


def no_junk(r: Run) -> None:
    for _, mt, c in r.messages:
        text = c.get("text") or c.get("data", {}).get("text/plain", "")
        assert not JUNK.search(text), (mt, text)


# -- progress bars ------------------------------------------------------------------------
def test_tqdm_on_four_ranks_updates_live_and_ends_as_labelled_bars(kernel):
    r = run(
        kernel,
        "%%remote m\nimport time\nfrom tqdm.auto import tqdm\n"
        "for i in tqdm(range(100)):\n    time.sleep(0.1)\n",
    )
    updates = bar_updates(r)
    # live: redrawn as the loop runs (many steps of its progress shown on the way, not
    # only its start and end); how often a bar is redrawn is the rank's tqdm's and the
    # batching's business, not a timed assertion's
    times = [t for t, _ in updates]
    assert times[-1] - times[0] > 8, times
    shown_steps = {int(p) for _, text in updates for p in re.findall(r"(\d+)%\|", text)}
    assert len(shown_steps - {0, 100}) >= 10, sorted(shown_steps)
    # each frame is labelled by rank (or ranks, collapsed)
    assert all(re.match(r"\[[\d, -]+\] ", line) for _, text in updates for line in text.split("\n"))
    shown = r.notebook()
    assert [kind for kind, _ in shown] == ["display"], shown  # the bars and nothing else
    final = shown[0][1]["data"]["text/plain"].split("\n")
    bar = r"100%\|█+\| 100/100 \[00:\d\d<00:00, +[\d.]+it/s\]"
    if len(final) == 1:
        assert re.fullmatch(r"\[0-3\] " + bar, final[0]), final
    else:
        ranks = [r for line in final for r in ranks_of(line.split("]")[0] + "]")]
        assert sorted(ranks) == [0, 1, 2, 3], final  # each rank's bar once
        assert all(re.fullmatch(r"\[[\d, -]+\] +" + bar, line) for line in final), final
    no_junk(r)


def ranks_of(label: str) -> list[int]:
    """The ranks a label names: ``[2]``, ``[0-1]``, ``[0, 2-3]``, ``[1]:``."""
    ranks: list[int] = []
    for part in label.strip("[]:").split(","):
        a, _, b = part.strip().partition("-")
        ranks.extend(range(int(a), int(b or a) + 1))
    return ranks


@pytest.mark.parametrize(
    "frame",
    ["print(f'\\rprogress {i}/5', end='')", "print(f'progress {i}/5', end='\\r')"],
    ids=["cr-first", "end-cr"],
)
def test_carriage_return_counter_updates_in_place_with_labels(kernel, frame):
    r = run(
        kernel,
        "%%remote m --ranks 0:2\nimport time\nfor i in range(5):\n"
        f"    {frame}\n    time.sleep(0.3)\nprint()\nprint('done')\n",
    )
    updates = bar_updates(r)
    texts = [text for _, text in updates]
    # the frames arrive as they are printed, not all with the final newline
    assert any("progress 1/5" in t for t in texts) and any("progress 3/5" in t for t in texts)
    first = next(t for t, text in updates if "progress 1/5" in text)
    assert r.messages[-1][0] - first > 0.6
    assert all(line.startswith(("[0] ", "[1] ", "[0-1] ")) for t in texts for line in t.split("\n"))
    shown = r.notebook()
    assert shown[0][0] == "display" and shown[0][1]["data"]["text/plain"] in (
        "[0-1] progress 4/5",
        "[0] progress 4/5\n[1] progress 4/5",
    )
    assert shown[1:] == [("stdout", "[0-1] done\n")], shown
    no_junk(r)


def test_rank_logs_keep_each_bars_final_line(kernel):
    run(kernel, "%mesh logs --gpus 1")
    run(
        kernel,
        "%%remote logs\nfrom tqdm import tqdm\nfor i in tqdm(range(500), mininterval=0):\n"
        "    pass\nprint('after the bar')\n",
    )
    path = run(kernel, "print(logs.runtime.logs.path(0))").of("stream")[0][1]["text"].strip()
    run(kernel, "%mesh stop logs")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert "\r" not in text
    lines = [line.rstrip() for line in text.splitlines()]
    assert any(re.fullmatch(r"100%\|█+\| 500/500 .*", line) for line in lines), lines
    assert lines.count("after the bar") == 1
    assert len(lines) < 10, lines  # not 500 frames


LIGHTNING = """%%remote lt
import time, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        time.sleep(0.05)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=8)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)
trainer.fit(Model(), data)
"""


def test_lightning_ddp_bar_updates_live_and_ends_clean(kernel):
    r = run(kernel, "%mesh lt --gpus 2")
    try:
        r = run(kernel, LIGHTNING, timeout=180)
    finally:
        run(kernel, "%mesh stop lt")
    updates = bar_updates(r)
    assert len(updates) > 10, updates  # redrawn as it trains (16 steps an epoch)
    assert updates[-1][0] - updates[0][0] > 1.0
    shown = [item for kind, item in r.notebook() if kind == "display"]
    assert len(shown) == 1, shown
    final = shown[0]["data"]["text/plain"]
    plain = re.sub(r"\x1b\[[\d;]*m", "", final)  # its colours are kept
    assert re.fullmatch(r"\[0\] Epoch 1/1 +━+ 16/16 .*loss: [\d.]+", plain), plain
    assert "fit` stopped: `max_epochs=2` reached" in "".join(
        t for k, t in r.notebook() if k != "display"
    )
    no_junk(r)


# -- rich displays --------------------------------------------------------------------------
PNG = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5E"
    "rkJggg=="
)


def test_html_image_and_figures_from_two_ranks_arrive_labelled(kernel):
    start = time.time() + 1.0  # both ranks display at this moment (so they may collapse)
    r = run(
        kernel,
        "%%remote m --ranks 0:2\nimport base64, time\n"
        f"time.sleep(max(0.0, {start!r} - time.time()))\n"
        "from IPython.display import HTML, Image, display\n"
        "from monarch_kernel.actor import current_rank\n"
        "display(HTML('<b>bold</b>'))\n"
        f"display(Image(data=base64.b64decode({PNG!r})))\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, current_rank().rank]); plt.show()\n"
        "if current_rank().rank == 1:\n    plt.figure(); plt.bar([1, 2], [3, 4])  # left open\n",
    )
    shown = r.notebook()
    displays = [(i, c) for i, (kind, c) in enumerate(shown) if kind == "display"]

    def label(i: int) -> str:  # the line above a display
        kind, text = shown[i - 1]
        assert kind == "stdout", shown[i - 1]
        return text.rsplit("\n", 2)[-2]

    def ranks_shown(items: list[tuple[int, dict[str, Any]]]) -> list[int]:
        """The ranks of these displays, each checked against its label line (identical
        displays of the two ranks are one display labelled ``[0-1]:`` when they come
        within the collapse window, else one each)."""
        ranks: list[int] = []
        for i, c in items:
            assert ranks_of(label(i)) == c["metadata"]["monarch_kernel"]["ranks"]
            ranks += ranks_of(label(i))
        return sorted(ranks)

    html = [(i, c) for i, c in displays if "text/html" in c["data"]]
    assert {c["data"]["text/html"] for _, c in html} == {"<b>bold</b>"}
    assert ranks_shown(html) == [0, 1]
    pngs = [(i, c) for i, c in displays if "image/png" in c["data"]]
    image = [(i, c) for i, c in pngs if c["data"]["image/png"] == PNG]
    assert ranks_shown(image) == [0, 1]
    figures = [(i, c) for i, c in pngs if "Figure" in c["data"]["text/plain"]]
    # two different plots (never collapsed), and the figure rank 1 left open
    assert ranks_shown(figures) == [0, 1, 1]
    for _, c in figures:
        assert base64.b64decode(c["data"]["image/png"]).startswith(b"\x89PNG")
    no_junk(r)


def test_a_display_past_the_bound_is_a_note_saying_so(kernel):
    r = run(
        kernel,
        "%%remote m --ranks 1\nimport base64\nimport monarch_kernel.rank.stdio.display as d\n"
        "from IPython.display import Image, display\n"
        "bound, d.MAX_BYTES = d.MAX_BYTES, 64  # as MONARCH_KERNEL_DISPLAY_MAX=64 would\n"
        f"try:\n    display(Image(data=base64.b64decode({PNG!r})))\n"
        "finally:\n    d.MAX_BYTES = bound\n",
    )
    displays = [c for kind, c in r.notebook() if kind == "display"]
    assert len(displays) == 1 and list(displays[0]["data"]) == ["text/plain"], displays
    note = displays[0]["data"]["text/plain"]
    assert note.startswith("[display not shown: its image/png is") and "DISPLAY_MAX" in note


def test_display_id_updates_replace_in_place(kernel):
    r = run(
        kernel,
        "%%remote m --ranks 0:2\nimport time\nfrom IPython.display import display, Markdown\n"
        "from monarch_kernel.actor import current_rank\n"
        "h = display(Markdown('step 0'), display_id='status')\n"
        "for i in range(1, 4):\n    time.sleep(0.1)\n"
        "    h.update(Markdown(f'step {i} on rank {current_rank().rank}'))\n",
    )
    updates = r.of("update_display_data")
    assert len(updates) >= 6  # three per rank
    shown = [c for kind, c in r.notebook() if kind == "display"]
    assert sorted(c["data"]["text/markdown"] for c in shown) == [
        "step 3 on rank 0",
        "step 3 on rank 1",
    ]
    assert len({c["transient"]["display_id"] for c in shown}) == 2  # one per rank


def test_bg_displays_stay_in_the_jobs_block_while_other_cells_run(kernel):
    bg = kernel.submit(
        "%%remote m --ranks 0:2 --bg\nimport time\n"
        "from IPython.display import HTML, display\n"
        "from monarch_kernel.actor import current_rank\n"
        "r = current_rank().rank\n"
        "time.sleep(1.0)  # its cell has finished by then\n"
        "display(HTML(f'<b>html of rank {r}</b>'))\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, r]); plt.show()\n"
        "h = display(HTML('step 0'), display_id='status')\n"
        "for i in range(1, 3):\n    time.sleep(0.3)\n"
        "    h.update(HTML(f'<i>step {i} of {r}</i>'))\n"
        "print('loop over', flush=True)\n"
    )
    first = kernel.collect(bg)  # the cell returns at once, the job runs on
    block = first.displays[0]["transient"]["display_id"]
    other = kernel.run("import time\ntime.sleep(1.5)\nprint('other cell')")
    assert other.stdout == "other cell\n" and not other.displays  # nothing leaked here
    kernel.wait_for_output(bg, "loop over", "done in", timeout=30)
    later = [
        m
        for m in [*kernel.other, *kernel._ahead]
        if m["parent_header"]["msg_id"] == bg and m["msg_type"] in OUTPUT_TYPES
    ]
    # after its cell finished, the job only updated its own block (a new display_data
    # for a finished cell is dropped by JupyterLab); widget traffic (comm_msg) is no
    # output, and ipykernel stamps it with the last request, which may be this one
    assert later and all(
        m["msg_type"] == "update_display_data" and m["content"]["transient"]["display_id"] == block
        for m in later
    ), [(m["msg_type"], m["content"].get("transient")) for m in later]
    final = later[-1]["content"]["data"]
    page = final["text/html"]
    assert "<b>html of rank 0</b>" in page and "<b>html of rank 1</b>" in page, page
    assert page.count('<img src="data:image/png;base64,') in (1, 2), page  # (collapsed or not)
    # each rank's display_id updated in place: only its last state is in the block
    assert "<i>step 2 of 0</i>" in page and "<i>step 2 of 1</i>" in page
    assert "step 0" not in page and "step 1 of" not in page
    assert "] loop over" in page and "done in" in page
    # the text version: the same block, displays as their text, labelled
    assert re.search(r"^\[0\]:$", final["text/plain"], re.M), final["text/plain"]
    no_junk_text = final["text/plain"] + page
    assert not JUNK.search(no_junk_text)


def test_bg_bars_update_in_the_jobs_block_while_other_cells_run(kernel):
    bg = kernel.submit(
        "%%remote m --ranks 0:2 --bg\nimport time\nfrom tqdm.auto import tqdm\n"
        "for i in tqdm(range(30), desc='bg'):\n    time.sleep(0.1)\n"
    )
    block = kernel.collect(bg).displays[0]["transient"]["display_id"]
    seen = len(kernel.other)
    other = kernel.run("import time\ntime.sleep(1.5)\nprint('other cell')")
    assert other.stdout == "other cell\n" and not other.displays  # nothing leaked here
    # while the other cell ran, the job's block was redrawn with its bars further along
    during = [
        m["content"]["data"]["text/plain"]
        for m in kernel.other[seen:]
        if m["parent_header"]["msg_id"] == bg and m["msg_type"] == "update_display_data"
    ]
    per_rank: dict[int, list[int]] = {0: [], 1: []}
    for text in during:
        for label, percent in re.findall(r"^(\[[\d, -]+\]) +bg: +(\d+)%", text, re.M):
            for rank in ranks_of(label):
                per_rank[rank].append(int(percent))
    for rank, progress in per_rank.items():  # each rank's bar further along, never back
        assert len(set(progress)) >= 3 and progress == sorted(progress), (rank, during)
    kernel.wait_for_output(bg, "done in", timeout=30)
    final = [
        m["content"]
        for m in [*kernel.other, *kernel._ahead]
        if m["parent_header"]["msg_id"] == bg and m["msg_type"] == "update_display_data"
    ][-1]
    assert final["transient"]["display_id"] == block
    bars = [line for line in final["data"]["text/plain"].split("\n") if "bg:" in line]
    assert sorted(r for line in bars for r in ranks_of(line.split("]")[0] + "]")) == [0, 1]
    assert all(re.fullmatch(r"\[[\d, -]+\] bg: 100%\|█+\| 30/30 .*", line) for line in bars), bars
    assert not JUNK.search(final["data"]["text/plain"])


SPAWNED = """from monarch_kernel.actor import Actor, endpoint, this_host
class Shower(Actor):
    @endpoint
    def show(self):
        from IPython.display import HTML, display
        display(HTML('<b>from an endpoint</b>'))
        return 1
procs = this_host().spawn_procs(per_host={"gpus": 1})
try:
    print(procs.spawn("shower", Shower).show.call_one().get())
finally:
    procs.stop()
"""


def test_endpoint_displays_of_a_mesh_made_in_the_cell_show_under_it(kernel):
    r = run(kernel, SPAWNED)
    shown = r.notebook()
    displays = [c for kind, c in shown if kind == "display"]
    assert [c["data"].get("text/html") for c in displays] == ["<b>from an endpoint</b>"], shown
    assert "[rank 0]:\n" in "".join(text for kind, text in shown if kind == "stdout"), shown
