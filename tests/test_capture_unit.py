"""A rank's stdout batching on its own (rank/stdio/capture.py's RankStream and print): a line
after a quiet spell goes at once and wakes nothing, a line without its newline goes
once the writer is idle, a flood goes in batches that end at line ends. The sink is
a list in this process (no rank: the stream is the same object a rank's sys.stdout is).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from monarch_kernel.rank.stdio import capture
from monarch_kernel.rank.stdio.capture import IDLE_ROUNDS, RankStream, rank_print

pytestmark = pytest.mark.unit


class Sink:
    """What a stream sent, each message with the time it went."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str]] = []
        self.changed = threading.Condition()

    def __call__(self, name: str, text: str, request: str | None) -> None:
        with self.changed:
            self.sent.append((time.monotonic(), text))
            self.changed.notify_all()

    def text(self) -> str:
        return "".join(t for _, t in self.sent)

    def wait_for(self, want: str, timeout: float = 5.0) -> float:
        """When everything sent so far first made ``want`` (the whole text)."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.text() == want, timeout), self.sent
            return self.sent[-1][0]


@pytest.fixture
def stream():
    fd = os.open(os.devnull, os.O_WRONLY)
    sink = Sink()
    yield RankStream("stdout", sink, fd), sink
    os.close(fd)


def quiet(s: RankStream) -> None:
    """As if the stream had sent nothing for a while (no sleeping in tests)."""
    s._last = time.monotonic() - 1.0


def test_a_printed_line_after_a_quiet_spell_goes_at_once_and_wakes_nothing(stream):
    s, sink = stream
    rounds = capture._flusher.rounds
    for i in range(50):
        quiet(s)
        rank_print("step", i, "loss", 0.5, file=s)
        assert sink.sent[-1][1] == f"step {i} loss 0.5\n"  # sent inside the call
    assert len(sink.sent) == 50
    # nothing waited for the batching thread: it never ran a round for these lines
    assert capture._flusher.rounds == rounds
    assert not s._armed


def test_print_keeps_the_builtin_s_arguments(stream, capsys):
    s, sink = stream
    quiet(s)
    rank_print("a", 1, None, sep=None, end=None, file=s)
    quiet(s)
    rank_print(file=s)
    quiet(s)
    rank_print("x", "y", sep="-", end="!", file=s, flush=True)
    assert sink.text() == "a 1 None\n\nx-y!"
    with pytest.raises(TypeError, match="sep must be None or a string, not int"):
        rank_print("a", sep=1, file=s)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="end must be None or a string, not bytes"):
        rank_print("a", end=b"", file=s)  # type: ignore[arg-type]
    rank_print("to the real stdout")  # any other file: the built-in print
    assert capsys.readouterr().out == "to the real stdout\n"


def test_text_without_its_newline_goes_once_the_writer_is_idle(stream):
    s, sink = stream
    quiet(s)
    rounds = capture._flusher.rounds
    s.write("loading the model...")
    sink.wait_for("loading the model...")  # by itself: no newline, no flush
    # kept for its newline until the writer wrote nothing for IDLE_ROUNDS of the
    # batching thread's rounds (how long a round takes is the bench's business)
    assert capture._flusher.rounds - rounds >= IDLE_ROUNDS
    quiet(s)
    s.write(" done\n")
    assert sink.text() == "loading the model... done\n"


def test_a_bar_frame_after_a_quiet_spell_goes_at_once(stream):
    s, sink = stream
    quiet(s)
    s.write("\r 40%|####      | 4/10")
    s.flush()  # what tqdm does after each frame
    quiet(s)
    s.write("\r 50%|#####     | 5/10")  # without a flush: still at once (a frame)
    assert sink.text() == "\r 40%|####      | 4/10\r 50%|#####     | 5/10"


def test_a_flood_goes_in_batches_that_end_at_line_ends(stream):
    s, sink = stream
    n = 200_000
    expected = "".join(f"line {i} flood\n" for i in range(n))
    for i in range(n):
        s.write(f"line {i} flood")  # as CPython's print writes: the text, then the end
        s.write("\n")
    sink.wait_for(expected, timeout=30)
    assert len(sink.sent) < n / 20, len(sink.sent)  # batched, not a message a line
    cut = [t for _, t in sink.sent if not t.endswith("\n")]
    assert not cut, cut[:3]


def test_a_line_that_never_ends_goes_out_while_it_grows(stream):
    s, sink = stream  # a writer adding to one line all the time: kept HOLD_ROUNDS at most
    deadline = time.monotonic() + 10
    while not sink.sent and time.monotonic() < deadline:
        s.write(".")
    assert sink.sent and set(sink.text()) == {"."}
