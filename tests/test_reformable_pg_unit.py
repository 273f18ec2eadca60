"""How the re-formable process group words an op's failure (no processes: the text alone;
tests/test_reformable_pg.py runs the group for real)."""

from __future__ import annotations

import pickle
import re

import pytest

from monarch_kernel.rank.pg.protocol import (
    MAX_ERROR,
    MAX_MESSAGE,
    Failed,
    clip_middle,
    error_text,
)
from monarch_kernel.rank.pg.reformable import MAX_BACKEND_ERROR, PEER_GONE_HINT, failure_text

pytestmark = pytest.mark.unit

#: gloo's error when a peer closed its connection (torch 2.13), as the worker reports it.
GLOO_PEER_CLOSED = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:939. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️"
)

#: How torch passes on the error of a future that DDP's backward waits on: this prefix,
#: then the text, then a Python stack ("\n\nAt:\n...").
DDP_PREFIX = "Got the following error when running the callback: RuntimeError: "


def test_a_long_backend_error_keeps_the_whole_explanation_and_stays_bounded():
    """gloo's text with a C++ stack trace (TORCH_SHOW_CPP_STACKTRACES=1): its middle goes,
    counted; our explanation and the backend's start and end stay."""
    stack = "".join(f"\nframe #{i}: c10d::ProcessGroupGloo::run() + 0x{i:x}" for i in range(2000))
    error = GLOO_PEER_CLOSED + stack
    text = failure_text("allreduce", error)
    explanation = "allreduce failed in the process group" + PEER_GONE_HINT + ": "
    assert text.startswith(explanation + GLOO_PEER_CLOSED[:200])
    assert len(text) <= len(explanation) + MAX_BACKEND_ERROR
    match = re.search(r" \[\.\.\. ([\d,]+) characters left out \.\.\.\] ", text)
    assert match is not None, text
    head, tail = text[len(explanation) : match.start()], text[match.end() :]
    assert error.startswith(head) and error.endswith(tail)
    assert len(head) + int(match[1].replace(",", "")) + len(tail) == len(error)


def test_the_explanation_survives_a_cut_of_the_end_as_ddp_wraps_it():
    """The first 400 characters of a backward's error (what tests/scripts/reformable_group.py
    records, as a notebook's first lines show it) name the cause, however long gloo's text."""
    recorded = (DDP_PREFIX + failure_text("allreduce", GLOO_PEER_CLOSED) + "\n\nAt:\n")[:400]
    assert PEER_GONE_HINT.strip() in recorded, recorded


def test_a_short_error_is_kept_whole_and_without_the_hint_when_no_peer_went_away():
    error = "ValueError: Tensors must be contiguous"
    assert failure_text("broadcast", error) == f"broadcast failed in the process group: {error}"


@pytest.mark.parametrize("limit", [40, 41, 100, 999])
def test_clip_middle_keeps_both_ends_within_the_limit(limit):
    text = "".join(chr(ord("a") + i % 26) for i in range(12_345))
    clipped = clip_middle(text, limit)
    assert len(clipped) <= limit
    head, _, rest = clipped.partition(" [... ")
    count, _, tail = rest.partition(" characters left out ...] ")
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + int(count.replace(",", "")) + len(tail) == len(text)
    assert clip_middle(text[:limit], limit) == text[:limit]


def test_a_worker_error_of_any_length_fits_one_message():
    # The worker sends its op's failure as one pickled message, read in one recv of at
    # most MAX_MESSAGE bytes: a 200 KB C++ stack must still arrive whole and readable.

    stack = "\n".join(
        f"  frame #{i}: gloo::transport::tcp::Pair::read() + 0x{i:x}" for i in range(4000)
    )
    text = error_text(RuntimeError(GLOO_PEER_CLOSED + "\n" + stack))
    assert len(text) <= MAX_ERROR
    assert text.startswith("RuntimeError: RuntimeError: [/__w/pytorch")
    assert "characters left out" in text
    assert len(pickle.dumps(Failed(7, text), protocol=5)) < MAX_MESSAGE
    assert error_text(ValueError("short")) == "ValueError: short"
    wide = error_text(RuntimeError("\U0001f3d6" * 100_000))  # 4 bytes each in UTF-8
    assert len(pickle.dumps(Failed(7, wide), protocol=5)) < MAX_MESSAGE
