"""The Future of endpoint calls on its own: completion, get(), finish, callbacks, await."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers import wait_until

from monarch_kernel.calls.future import Future

pytestmark = pytest.mark.unit


def complete_soon(fn, *args) -> threading.Thread:
    """Run ``fn(*args)`` in another thread (as the controller's I/O thread would)."""
    t = threading.Thread(target=fn, args=args)
    t.start()
    return t


# -- completion and get() -------------------------------------------------------------


def test_set_result_then_get():
    fut: Future[int] = Future()
    assert not fut.done() and repr(fut) == "<Future pending>"
    assert fut.set_result(7) is True
    assert fut.done() and repr(fut) == "<Future done>"
    assert fut.get() == 7 and fut.get(timeout=0) == 7 and fut.result() == 7
    assert fut.exception() is None


def test_only_the_first_completion_counts():
    fut: Future[str] = Future()
    assert fut.set_result("first")
    assert fut.set_result("second") is False
    assert fut.set_exception(RuntimeError("late")) is False
    assert fut.get() == "first"


def test_set_exception_is_raised_by_get_and_returned_by_exception():
    fut: Future[int] = Future()
    error = ValueError("remote failure")
    assert fut.set_exception(error) is True
    assert fut.done()
    for _ in range(2):
        with pytest.raises(ValueError, match="remote failure") as err:
            fut.get()
        assert err.value is error
    assert fut.exception() is error
    assert fut.set_result(1) is False


def test_get_times_out_and_the_call_goes_on():
    fut: Future[str] = Future()
    with pytest.raises(TimeoutError, match=r"no result within 0.05s; the call is still running"):
        fut.get(timeout=0.05)
    with pytest.raises(TimeoutError):
        fut.get(timeout=0)
    with pytest.raises(TimeoutError):  # exception() does not swallow a timeout
        fut.exception(timeout=0.01)
    assert not fut.done()
    fut.set_result("late but fine")  # the reply still arrives ...
    assert fut.get(timeout=0.05) == "late but fine"  # ... and get() again returns it


def test_get_blocked_in_another_thread_is_woken_by_completion():
    fut: Future[int] = Future()
    got: list[object] = []
    t = complete_soon(lambda: got.append(fut.get(timeout=30)))
    # wait until that thread is really blocked in get() before completing
    wait_until(lambda: fut._blocked, timeout=5, interval=0.001, what="a thread blocked in get()")
    fut.set_result(42)
    t.join(5)
    assert not t.is_alive() and got == [42]


def test_get_times_out_then_wakes_a_later_waiter():
    fut: Future[int] = Future()
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.01)  # leaves its own (timed-out) wait behind
    complete_soon(fut.set_result, 3).join(5)
    assert fut.get(timeout=1) == 3


# -- finish ---------------------------------------------------------------------------


def test_finish_runs_once_in_the_getting_thread_and_not_on_completion():
    calls: list[tuple[object, str]] = []

    def finish(raw):
        calls.append((raw, threading.current_thread().name))
        return {"value": raw * 2}

    fut: Future[dict] = Future(finish)
    complete_soon(fut.set_result, 21).join(5)
    assert calls == []  # not in the thread that completed it
    first = fut.get()
    assert first == {"value": 42}
    assert fut.get() is first and fut.result() is first
    assert calls == [(21, threading.current_thread().name)]


def test_finish_runs_once_when_many_threads_get_at_once():
    count = 0
    release = threading.Event()

    def finish(raw):
        nonlocal count
        count += 1
        release.wait(5)
        return raw + 1

    fut: Future[int] = Future(finish)
    fut.set_result(1)
    results: list[int] = []
    threads = [complete_soon(lambda: results.append(fut.get())) for _ in range(8)]
    release.set()
    for t in threads:
        t.join(5)
    assert results == [2] * 8 and count == 1


def test_finish_exception_is_the_result_and_raised_every_time():
    calls = 0

    def finish(raw):
        nonlocal calls
        calls += 1
        raise KeyError(f"cannot unpickle {raw}")

    fut: Future[int] = Future(finish)
    fut.set_result("blob")
    errors = []
    for _ in range(3):
        with pytest.raises(KeyError, match="cannot unpickle blob") as err:
            fut.get()
        errors.append(err.value)
    assert calls == 1 and errors[0] is errors[1] is errors[2]
    assert fut.exception() is errors[0]


def test_finish_is_skipped_for_a_failed_call():
    fut: Future[int] = Future(lambda raw: pytest.fail("finish ran for a failed call"))
    fut.set_exception(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        fut.get()


def test_ctrl_c_inside_finish_is_not_the_calls_result():
    attempts = 0

    def finish(raw):
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise KeyboardInterrupt
        return raw

    fut: Future[str] = Future(finish)
    fut.set_result("ok")
    with pytest.raises(KeyboardInterrupt):
        fut.get()
    assert fut.get() == "ok" and attempts == 2  # the next get() finishes it


# -- callbacks --------------------------------------------------------------------------


def test_callbacks_added_before_completion_run_once_in_order_on_completion():
    fut: Future[int] = Future()
    seen: list[tuple[str, Future, str]] = []
    fut.add_done_callback(lambda f: seen.append(("a", f, threading.current_thread().name)))
    fut.add_done_callback(lambda f: seen.append(("b", f, threading.current_thread().name)))
    assert seen == []
    t = threading.Thread(target=fut.set_result, args=(1,), name="completer")
    t.start()
    t.join(5)
    assert seen == [("a", fut, "completer"), ("b", fut, "completer")]
    fut.set_result(2)  # ignored: no second round of callbacks
    assert len(seen) == 2


def test_callback_added_after_completion_runs_at_once():
    fut: Future[int] = Future()
    fut.set_exception(ValueError("x"))
    seen: list[Future] = []
    fut.add_done_callback(seen.append)
    assert seen == [fut]
    assert isinstance(seen[0].exception(), ValueError)


# -- the waiter hook ----------------------------------------------------------------------


def test_waiter_is_called_by_get_and_may_complete_the_future():
    calls: list[tuple[Future, float | None]] = []

    def waiter(f: Future, timeout: float | None) -> None:
        calls.append((f, timeout))
        f.set_result("received by the waiting thread")

    fut: Future[str] = Future(waiter=waiter)
    assert fut.get(timeout=3) == "received by the waiting thread"
    assert calls == [(fut, 3)]
    assert fut.get() == "received by the waiting thread" and len(calls) == 1  # done: no call


def test_waiter_that_receives_nothing_still_times_out():
    calls: list[float | None] = []
    fut: Future[int] = Future(waiter=lambda f, timeout: calls.append(timeout))
    with pytest.raises(TimeoutError):
        fut.get(timeout=0.02)
    assert calls == [0.02]


def test_add_done_callback_asks_the_waiter_to_make_sure_replies_are_read():
    calls: list[float | None] = []
    fut: Future[int] = Future(waiter=lambda f, timeout: calls.append(timeout))
    fut.add_done_callback(lambda f: None)
    assert calls == [0]  # timeout=0: only make sure some thread receives replies
    fut.set_result(1)
    fut.add_done_callback(lambda f: None)
    assert calls == [0]  # already done: nothing to wait for


# -- await ---------------------------------------------------------------------------------


def test_await_completed_from_another_thread():
    fut: Future[str] = Future(lambda raw: raw.upper())
    awaiting = False

    async def waits() -> str:
        nonlocal awaiting
        awaiting = True
        return await fut

    async def main() -> str:
        task = asyncio.ensure_future(waits())
        await asyncio.sleep(0)  # the task runs up to its await of fut
        assert awaiting and not task.done()
        complete_soon(fut.set_result, "from the io thread")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == "FROM THE IO THREAD"


def test_await_a_failed_future_raises_and_a_done_one_returns_at_once():
    failed: Future[int] = Future()
    done: Future[int] = Future()
    done.set_result(5)

    async def main() -> int:
        complete_soon(failed.set_exception, ZeroDivisionError("remote"))
        with pytest.raises(ZeroDivisionError, match="remote"):
            await failed
        return await done

    assert asyncio.run(main()) == 5
