"""An interrupt cut into torch's own mode switches (``rank.torch_modes``): a trace
function raises the stop button's ``KeyboardInterrupt`` at one line of torch's real
code, as a signal landing between those two bytecodes does. Each case runs on a thread
of its own: the modes are per thread, so this process's stay as they were."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
import torch.optim.optimizer as optimizer_module

from monarch_kernel.rank.torch_modes import restore_after_interrupt, torch_modes

pytestmark = pytest.mark.unit


def _line_of(func: Callable[..., Any], text: str) -> tuple[Any, int]:
    """The code object of ``func`` and the number of its line that holds ``text``."""
    lines, first = inspect.getsourcelines(func)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, f"{text!r} in {func.__qualname__}: {hits} (torch changed?)"
    return func.__code__, hits[0]


def _cut_at(code: Any, line: int) -> Callable[[FrameType, str, Any], Any]:
    """A trace function that raises KeyboardInterrupt, once, just before ``line`` of
    ``code`` runs."""
    done = False

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal done
        if event == "line" and frame.f_lineno == line and not done:
            done = True
            raise KeyboardInterrupt
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is code and not done else None

    return tracer


def _on_a_thread(work: Callable[[], Any]) -> Any:
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if errors:
        raise errors[0]
    return out[0]


def _interrupted(code: Any, line: int, body: Callable[[], object]) -> tuple[Any, ...]:
    """Run ``body`` as user code the stop button cuts at ``line`` of ``code``; return
    the modes it left, what the rank put back, and the modes after that."""
    before = torch_modes()
    sys.settrace(_cut_at(code, line))
    try:
        body()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the cut never came: the line was not run")
    finally:
        sys.settrace(None)
    left = torch_modes()
    fixed = restore_after_interrupt(before)
    return left, fixed, torch_modes()


def _bf16_autocast_matmul(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (x @ w).float()


def test_an_optimizer_step_cut_in_its_finally_leaves_gradients_on(capfd):
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    opt = torch.optim.SGD([w], lr=0.1)
    code, line = _line_of(
        optimizer_module._use_grad_for_differentiable, "torch.set_grad_enabled(prev_grad)"
    )
    code = next(c for c in code.co_consts if getattr(c, "co_name", "") == "_use_grad")

    left, fixed, after = _on_a_thread(lambda: _interrupted(code, line, opt.step))
    assert left.grad is False  # the defect: the step's finally never turned it back on
    assert fixed == ["gradient tracking off"]
    assert (after.grad, after.autocast, after.nesting) == (True, False, 0)
    assert "left torch's gradient tracking off" in capfd.readouterr().err


#: Where a cut leaves autocast: (method, the line it is cut before, autocast on after,
#: the nesting count after, what the rank says it put back).
CUTS = {
    "enter, after turning it on": (
        "__enter__",
        "torch.set_autocast_cache_enabled(self._cache_enabled)",
        True,
        1,
        "autocast on",
    ),
    "exit, before turning it off": (
        "__exit__",
        "torch.set_autocast_enabled(self.device, self.prev)",
        True,
        0,
        "autocast on",
    ),
    "exit, before its dtype": (
        "__exit__",
        "torch.set_autocast_dtype(self.device, self.prev_fastdtype)",
        False,
        0,
        "autocast's dtype or cache setting changed",
    ),
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_an_autocast_region_cut_in_its_enter_or_exit_is_closed(capfd, cut):
    """Cut after ``__enter__`` turned autocast on, set float16 and counted the region
    (``with`` then never calls ``__exit__``), or in ``__exit__`` before it turns it off
    or puts the dtype back: autocast stays on, or a later ``torch.autocast("cpu")`` runs
    in float16. With the count left at one, the cast-weight cache is never dropped
    either, and a later region computes with weights from before a step. The dtype the
    code found (set on purpose before it, not torch's default) is the one put back."""
    method, text, on, nesting, said = CUTS[cut]
    code, line = _line_of(getattr(torch.autocast, method), text)
    w, x = torch.nn.Parameter(torch.ones(2, 2)), torch.ones(1, 2)

    def cell() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            x @ w

    def case() -> tuple[Any, ...]:
        torch.set_autocast_dtype("cpu", torch.bfloat16)  # (torch's default, set anyway)
        torch.set_autocast_dtype("cuda", torch.bfloat16)  # not the default: the user's
        left, fixed, after = _interrupted(code, line, cell)
        dtypes = torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda")
        first = _bf16_autocast_matmul(w, x)
        with torch.no_grad():  # an optimizer step
            w.add_(1.0)
        second = _bf16_autocast_matmul(w, x)
        return left, fixed, after, dtypes, first, second

    left, fixed, after, dtypes, first, second = _on_a_thread(case)
    assert (left.autocast, left.nesting) == (on, nesting)
    assert left.cpu_dtype == torch.float16  # the cut region's, left behind
    assert fixed == [said]
    assert (after.grad, after.autocast, after.nesting) == (True, False, 0)
    assert dtypes == (torch.bfloat16, torch.bfloat16)  # as the code found them
    assert first.tolist() == [[2.0, 2.0]]
    assert second.tolist() == [[4.0, 4.0]]  # the weights after the step, not a stale cast
    assert f"left torch's {said}" in capfd.readouterr().err


def test_a_count_left_open_alone_is_closed_and_the_stale_cast_is_gone():
    """The count alone left at one (autocast off): the defect is the stale cast."""

    def case() -> tuple[Any, ...]:
        w, x = torch.nn.Parameter(torch.ones(2, 2)), torch.ones(1, 2)
        before = torch_modes()
        torch.autocast_increment_nesting()  # what a region cut open leaves
        stale_first = _bf16_autocast_matmul(w, x)
        with torch.no_grad():
            w.add_(1.0)
        stale = _bf16_autocast_matmul(w, x)
        fixed = restore_after_interrupt(before)
        with torch.no_grad():
            w.add_(1.0)
        return stale_first, stale, fixed, _bf16_autocast_matmul(w, x), torch_modes()

    stale_first, stale, fixed, fresh, after = _on_a_thread(case)
    assert stale_first.tolist() == stale.tolist() == [[2.0, 2.0]]  # the defect, shown
    assert fixed == ["autocast's nesting at 1"]
    assert fresh.tolist() == [[6.0, 6.0]]
    assert (after.autocast, after.nesting) == (False, 0)


def test_autocast_is_left_open_where_other_tasks_may_be_inside_a_region():
    """An event loop's other tasks share the thread's autocast state: one suspended
    inside a region would close it later, and take the count below zero."""

    def case() -> tuple[list[str], bool]:
        before = torch_modes()
        torch.set_autocast_enabled("cpu", True)
        torch.autocast_increment_nesting()
        fixed = restore_after_interrupt(before, autocast=False)
        still = torch.is_autocast_enabled("cpu")
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cpu", False)
        return fixed, still

    assert _on_a_thread(case) == ([], True)


def test_reading_the_modes_leaves_the_nesting_count_as_it_was():
    def case() -> list[int]:
        counts = []
        for _ in range(3):
            modes = torch_modes()
            assert modes is not None
            counts.append(modes.nesting)
        with torch.autocast("cpu"):
            modes = torch_modes()
            assert modes is not None
            counts.append(modes.nesting)
        return counts

    assert _on_a_thread(case) == [0, 0, 0, 1]


def test_modes_the_code_set_on_purpose_are_not_touched_when_nothing_changed():
    def case() -> list[str]:
        torch.set_grad_enabled(False)
        before = torch_modes()
        return restore_after_interrupt(before)

    assert _on_a_thread(case) == []


def test_code_started_inside_an_autocast_region_keeps_its_autocast():
    """Nothing is known of the region's own settings: autocast is left alone."""

    def case() -> tuple[list[str], bool]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            before = torch_modes()
            torch.autocast_increment_nesting()
            fixed = restore_after_interrupt(before)
            torch.autocast_decrement_nesting()
            return fixed, torch.is_autocast_enabled("cpu")

    assert _on_a_thread(case) == ([], True)


def test_torch_imported_by_the_interrupted_code_counts_as_torchs_defaults():
    """``before`` None (no torch when the code started): nothing to put back but what
    differs from torch's defaults, and its dtypes are not taken for changed."""

    def case() -> list[str]:
        return restore_after_interrupt(None)

    assert _on_a_thread(case) == []
