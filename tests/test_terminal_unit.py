"""wire.terminal and CellOutput's bar blocks and displays on their own: what a progress
bar's frames, cursor moves and escape sequences become (no processes: text is fed by
hand, as in test_output_unit.py)."""

from __future__ import annotations

import pytest

from monarch_kernel.kernel import output
from monarch_kernel.kernel.output import CellOutput
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import HeaderError
from monarch_kernel.wire.terminal import Terminal, strip_controls

pytestmark = pytest.mark.unit

# What tqdm 4.70 wrote for `for i in tqdm(range(3))` then a nested `position=1` bar of 2
# (leave=False), then print("after") to the same stream (read from a real run).
TQDM = (
    "\r  0%|          | 0/3 [00:00<?, ?it/s]"
    "\r 67%|██████▋   | 2/3 [00:00<00:00, 19.95it/s]"
    "\r100%|██████████| 3/3 [00:00<00:00, 19.89it/s]"
    "\r100%|██████████| 3/3 [00:00<00:00, 19.89it/s]\n"
    "\n\r  0%|          | 0/2 [00:00<?, ?it/s]\x1b[A"
    "\n\r 50%|█████     | 1/2 [00:00<00:00,  9.99it/s]\x1b[A"
    "\n\r100%|██████████| 2/2 [00:00<00:00,  9.97it/s]\x1b[A"
    "\n\r                                             \x1b[A"
    "after\n"
)
# What rich 15's Progress wrote for one task with TTY_COMPATIBLE=1 (shortened bars).
RICH = (
    "\x1b[?25l\r\x1b[2Ktrain \x1b[90m━━━━\x1b[0m \x1b[35m  0%\x1b[0m"
    "\r\x1b[2Ktrain \x1b[91m━━\x1b[0m\x1b[90m━━\x1b[0m \x1b[35m 50%\x1b[0m"
    "\r\x1b[2Ktrain \x1b[92m━━━━\x1b[0m \x1b[35m100%\x1b[0m\n\x1b[?25h"
    "after\n"
)


def feed(chunks: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(committed while fed, live rows after, committed by close)."""
    term = Terminal()
    out: list[str] = []
    for chunk in chunks:
        out += term.feed(chunk)
    return out, [r.text for r in term.live()], term.close()


def test_plain_lines_are_committed_at_their_newline():
    assert feed(["hello\nwor", "ld\n", "x"]) == (["hello", "world"], ["x"], ["x"])


def test_carriage_return_replaces_the_line():
    done, live, rest = feed(["\rprogress 0/5", "\rprogress 1/5", "\rprogress 2/5"])
    assert (done, live, rest) == ([], ["progress 2/5"], ["progress 2/5"])
    # a bar's final frame and newline stay live for a line (a nested bar may come back)
    done, live, rest = feed(["\rstep 1", "\rstep 2\n", "next\n", "more\n", "end\n"])
    assert done + rest == ["step 2", "next", "more", "end"]


def test_frames_printed_before_their_carriage_return_are_kept():
    # print(f"progress {i}/5", end="\r"): each frame comes before its \r
    term = Terminal()
    for i in range(3):
        assert term.feed(f"progress {i}/5\r") == []
        (row,) = term.live()
        assert row.text == f"progress {i}/5" and row.returned  # a frame, not a partial line
    assert term.feed("\n") + term.feed("done\n") + term.close() == ["progress 2/5", "done"]
    # lines ending in \r\n are lines
    assert feed(["a\r\nb\r\n"]) == (["a", "b"], [], [])


# What tqdm 4.70 writes for a bar at position 1 with nothing at position 0 (as every bar
# is drawn once TQDM_POSITION=-1 is in the environment, which lightning_sdk's import
# sets): down a row, the frame, back up. The row it starts on is committed (a blank
# line) before the cursor comes back up to it.
POSITION_1 = ["\n", "\rtrain 0/80", "\x1b[A"] + [
    part for i in range(1, 11) for part in ("\n", f"\rtrain {i}/80", "\x1b[A")
]


@pytest.mark.parametrize("size", [None, 1])
def test_a_bar_drawn_below_the_cursor_stays_one_row(size):
    text = "".join(POSITION_1)
    chunks = POSITION_1 if size is None else list(text)
    done, live, _ = feed(chunks)
    assert done == [""]  # the row above the bar
    assert live == ["train 10/80"]  # redrawn in place, not one row per frame


@pytest.mark.parametrize("size", [None, 1, 7])
def test_nested_tqdm_bars_end_as_their_final_frames(size):
    chunks = [TQDM] if size is None else [TQDM[i : i + size] for i in range(0, len(TQDM), size)]
    done, live, rest = feed(chunks)
    assert [line.rstrip() for line in done + rest] == [
        "100%|██████████| 3/3 [00:00<00:00, 19.89it/s]",
        "after",
        "",
    ][: len(done + rest)]
    assert "\r" not in "".join(done + rest)


@pytest.mark.parametrize("size", [None, 3])
def test_rich_progress_keeps_colours_and_drops_cursor_controls(size):
    chunks = [RICH] if size is None else [RICH[i : i + size] for i in range(0, len(RICH), size)]
    done, live, rest = feed(chunks)
    lines = done + rest
    assert lines == [
        "train \x1b[92m━━━━\x1b[0m \x1b[35m100%\x1b[0m",
        "after",
    ]
    assert strip_controls(lines[0]) == "train ━━━━ 100%"


def test_strip_controls_gives_each_lines_last_frame():
    assert strip_controls("a\rb\rc\nx\x1b[?25l\x1b[1my\x1b[0m") == "c\nxy"


def test_the_display_header_checks_its_op():
    h = {"k": K.DISPLAY, "r": 1, "i": None, "op": "paint", "di": None}
    with pytest.raises(HeaderError):
        H.Display.decode(h)


# -- CellOutput: bar blocks ----------------------------------------------------------------


@pytest.fixture
def cell(monkeypatch):
    """``cell(ranks)`` -> (CellOutput, streams, displays); no minimum time between bar
    redraws or messages, and off the background flusher (only the test emits)."""
    monkeypatch.setattr(output, "EMIT_BURST", 10**9)
    monkeypatch.setattr(output, "BAR_INTERVAL", 0.0)

    def make(ranks=(0, 1, 2, 3), label=True):
        streams: list[tuple[str, str]] = []
        displays: list[tuple[dict, dict, str | None, bool]] = []
        out = CellOutput(
            lambda n, t: streams.append((n, t)),
            list(ranks),
            "collapse",
            label,
            "",
            lambda d, m, i, u: displays.append((d, m, i, u)),
        )
        output._active.discard(out)
        return out, streams, displays

    return make


def notebook(displays: list[tuple[dict, dict, str | None, bool]]) -> list[str]:
    """What a notebook shows of the displays: each display's latest text, in order."""
    shown: dict[str, str] = {}
    order: list[str] = []
    for data, _, did, update in displays:
        key = did or str(len(order))
        if not update:
            order.append(key)
        shown[key] = data.get("text/plain", "")
    return [shown[k] for k in order]


def test_each_ranks_bar_is_one_labelled_line_updated_in_place(cell):
    out, streams, displays = cell()
    for i in range(3):
        for r in range(4):
            out.feed(r, "stderr", f"\rstep {i} rank {r}")
            out.flush()
    assert notebook(displays) == [
        "[0] step 2 rank 0\n[1] step 2 rank 1\n[2] step 2 rank 2\n[3] step 2 rank 3"
    ]
    assert displays[0][3] is False and all(d[3] for d in displays[1:])  # then updates
    assert streams == []


def test_identical_frames_collapse_and_the_last_frame_stays(cell):
    out, streams, displays = cell()
    for i in range(3):
        for r in range(4):
            out.feed(r, "stderr", f"\r{i}/3")
        out.flush()
    for r in range(4):
        out.feed(r, "stderr", "\r3/3\n")
    out.close()
    assert notebook(displays) == ["[0-3] 3/3"]
    assert streams == []


def test_other_lines_go_on_around_a_bar(cell):
    out, streams, displays = cell(ranks=(0, 1))
    out.feed(0, "stderr", "\r 10%")
    out.flush()
    out.feed(1, "stdout", "loss 1\n")
    out.feed(0, "stderr", "\r 20%")
    out.feed(1, "stdout", "loss 2\n")
    out.close()
    assert notebook(displays) == ["[0]  20%"]
    assert "".join(t for _, t in streams) == "[1] loss 1\n[1] loss 2\n"


def test_a_new_bar_after_the_last_one_ended_opens_a_new_block(cell):
    out, streams, displays = cell(ranks=(0,), label=False)
    out.feed(0, "stderr", "\repoch 1: 50%")
    out.flush()
    out.feed(0, "stderr", "\repoch 1: 100%\n")
    out.feed(0, "stdout", "validation done\n")
    out.flush()
    out.feed(0, "stderr", "x\ny\n")  # two more lines: epoch 1's bar line is final
    out.flush()
    out.feed(0, "stderr", "\repoch 2: 50%")
    out.flush()
    out.close()
    assert notebook(displays) == ["epoch 1: 100%", "epoch 2: 50%"]
    assert streams == [("stdout", "validation done\n"), ("stderr", "x\ny\n")]


def test_bars_below_the_cursor_are_one_line_per_rank_whatever_the_pace(cell):
    """Four ranks draw a bar at position 1; rank 3 runs ahead. Each rank is on one line
    (before: every rank's first frame stayed behind as a line of its own, so rank 3 was
    in a collapsed ``[0-3]`` line and on a line of its own)."""
    out, streams, displays = cell()
    for rank in range(4):
        for part in POSITION_1[:3]:
            out.feed(rank, "stderr", part)
    out.flush()
    for part in POSITION_1[3:]:
        out.feed(3, "stderr", part)
        out.flush()
    assert notebook(displays) == ["[0] train 0/80\n[1] train 0/80\n[2] train 0/80\n[3] train 10/80"]
    assert streams == [("stderr", "[0-3] \n")]  # the blank row above the bars


def test_a_bar_whose_frames_differed_stays_split_while_it_runs(cell):
    out, streams, displays = cell(ranks=(0, 1))
    drawn: list[str] = []
    for frames in (("a", "a"), ("b", "c"), ("d", "d"), ("e", "e\n")):
        for rank, frame in enumerate(frames):
            out.feed(rank, "stderr", "\r" + frame)
        out.flush()
        drawn.append(notebook(displays)[0])
    out.close()
    # one line while identical; once split, a line per rank until the bar ends (the
    # block does not jump between one and two lines with every frame)
    assert drawn == ["[0-1] a", "[0] b\n[1] c", "[0] d\n[1] d", "[0] e\n[1] e"]
    assert notebook(displays) == ["[0-1] e"]  # the final frames, the same: one line


def test_a_frame_before_its_carriage_return_is_drawn_at_once(cell):
    out, streams, displays = cell(ranks=(0, 1))
    for r in (0, 1):  # print(f"step {i}", end="\r"): no newline to wait for
        out.feed(r, "stdout", "step 1\r")
    out.flush()  # at once: not held back as a line without its newline
    assert notebook(displays) == ["[0-1] step 1"]
    out.feed(1, "stdout", "step 2\r")
    out.flush()
    assert notebook(displays) == ["[0] step 1\n[1] step 2"]  # each rank's own line
    out.feed(0, "stdout", "step 2\r\n")
    out.feed(1, "stdout", "\n")
    out.close()
    assert notebook(displays) == ["[0-1] step 2"] and streams == []


def test_plain_lines_never_open_a_block(cell):
    out, streams, displays = cell(ranks=(0,))
    out.feed(0, "stdout", "a\nb\n")
    out.flush()
    out.close()
    assert displays == []
    assert streams == [("stdout", "[0] a\n[0] b\n")]


# -- CellOutput: displays ------------------------------------------------------------------


def test_identical_displays_of_all_ranks_are_one_labelled_display(cell):
    out, streams, displays = cell(ranks=(0, 1))
    html = {"text/html": "<b>x</b>", "text/plain": "<HTML>"}
    out.show(0, "display", html, {}, None, b"k")
    assert displays == []  # waits for rank 1's copy (the collapse window)
    out.show(1, "display", html, {}, None, b"k")
    assert streams == [("stdout", "[0-1]:\n")]
    assert len(displays) == 1 and displays[0][0] == html
    assert displays[0][1]["monarch_kernel"] == {"ranks": [0, 1]}


def test_display_id_updates_replace_each_ranks_own_display(cell):
    out, streams, displays = cell(ranks=(0, 1))
    for r in (0, 1):
        out.show(r, "display", {"text/plain": f"r{r} 0"}, {}, "p", bytes([r]))
    for r in (0, 1):
        out.show(r, "update", {"text/plain": f"r{r} 1"}, {}, "p", bytes([r]))
    out.close()
    assert notebook(displays) == ["r0 1", "r1 1"]
    assert {d[2] for d in displays} == {"p-r0", "p-r1"}


def test_clear_output_then_display_replaces_that_ranks_last_display(cell):
    out, streams, displays = cell(ranks=(0, 1))
    out.show(0, "display", {"text/plain": "frame 0"}, {}, None, b"0")
    out.show(1, "display", {"text/plain": "other"}, {}, None, b"1")
    out.show(0, "clear_wait", {}, {}, None, b"")
    out.show(0, "display", {"text/plain": "frame 1"}, {}, None, b"2")
    out.close()
    assert notebook(displays) == ["frame 1", "other"]
