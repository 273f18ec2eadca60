"""Futures returned by endpoint adverbs: ``.get(timeout=)``, ``await``, callbacks."""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

T = TypeVar("T")

_PENDING = object()
#: Guards completion and the callback lists of all futures (held for a few bytecodes).
_state_lock = threading.Lock()

#: ``waiter(future, timeout)``: lets the thread that waits on a future receive its
#: reply itself (see ``MeshRuntime.wait_for``); returns when the future is done, when
#: ``timeout`` passed, or when another thread is receiving for it. ``timeout=0`` only
#: makes sure that some thread receives replies.
Waiter = Callable[["Future[Any]", "float | None"], None]


class Future(Generic[T]):
    """The result of a remote call, completed by whichever thread receives its reply.

    ``finish`` (optional) turns the raw completion value into the user-visible result
    (unpickling, building a ValueMesh, raising a grouped error); it runs once, in the
    thread that first asks for the result, never while replies are being handled.
    """

    __slots__ = (
        "_lock",
        "_done",
        "_raw",
        "_error",
        "_value",
        "_finish",
        "_callbacks",
        "_blocked",
        "_waiter",
        "_driver",
        "__weakref__",  # (a Gather holds the future it handed out weakly)
    )

    def __init__(self, finish: Callable[[Any], T] | None = None, waiter: Waiter | None = None):
        self._lock = threading.Lock()  # runs ``finish`` once
        self._done = False
        self._raw: Any = None
        self._error: BaseException | None = None
        self._value: Any = _PENDING
        self._finish = finish
        self._callbacks: list[Callable[[Future[T]], None]] | None = None
        # One held lock per thread blocked in get(), released on completion. (A fresh
        # lock per wait, as in threading.Condition: a Ctrl-C that lands just after an
        # acquire can then only leak that waiter's own lock.)
        self._blocked: list[Any] | None = None
        self._waiter = waiter
        self._driver: Generator[Any, None, T] | None = None

    # -- completion ----------------------------------------------------------------
    def _complete(self, raw: Any = None, error: BaseException | None = None) -> bool:
        with _state_lock:
            if self._done:
                return False
            self._raw, self._error = raw, error
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            blocked, self._blocked = self._blocked, None
        if blocked:
            for lock in blocked:
                lock.release()
        if callbacks:
            for cb in callbacks:
                cb(self)
        return True

    def set_result(self, value: Any) -> bool:
        return self._complete(raw=value)

    def set_exception(self, error: BaseException) -> bool:
        return self._complete(error=error)

    # -- user side ------------------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def get(self, timeout: float | None = None) -> T:
        """Block until the result is there; raise the remote error if the call failed.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first (the call goes on).
        """
        if not self._done:
            self._wait(timeout)
        if self._value is _PENDING and self._error is None:
            with self._lock:
                if self._value is _PENDING and self._error is None:
                    try:
                        self._value = self._finish(self._raw) if self._finish else self._raw
                    except Exception as exc:  # a Ctrl-C in here is not the call's result
                        self._error = exc
                    # What it was made from is not needed any more: the replies (their
                    # bytes; copies other ranks keep for an unread one) go with it.
                    self._raw = self._finish = None
        if self._error is not None:
            raise self._error
        return cast(T, self._value)

    result = get

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._waiter is not None:
            self._waiter(self, timeout)
        with _state_lock:
            if self._done:
                return
            lock = threading.Lock()
            lock.acquire()
            if self._blocked is None:
                self._blocked = []
            self._blocked.append(lock)
        left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not lock.acquire(timeout=left):
            raise TimeoutError(
                f"no result within {timeout}s; the call is still running "
                "(call .get() again to keep waiting)"
            )

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:
            return exc
        return None

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        with _state_lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                pending = True
            else:
                pending = False
        if not pending:
            fn(self)
        elif self._waiter is not None:
            self._waiter(self, 0)  # nobody may block in get(): make sure replies are read

    def __await__(self) -> Generator[Any, None, T]:
        if not self.done():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Future[T]) -> None:
                def resolve() -> None:
                    if not waiter.done():
                        waiter.set_result(None)

                loop.call_soon_threadsafe(resolve)

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.get()

    # -- Monarch's constructors --------------------------------------------------------
    @classmethod
    def _from_coro(cls, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """A future of ``coro``'s result (Monarch's ``Future._from_coro``): the coroutine
        runs at once on this process's background event loop (a daemon thread)."""
        fut: Future[T] = cls()

        def done(task: concurrent.futures.Future[T]) -> None:
            exc = task.exception()
            if exc is None:
                fut.set_result(task.result())
            else:
                fut.set_exception(exc)

        asyncio.run_coroutine_threadsafe(coro, _background_loop()).add_done_callback(done)
        return fut

    @classmethod
    def _resolved(cls, value: T) -> Future[T]:
        """A future already completed with ``value``."""
        fut: Future[T] = cls()
        fut.set_result(value)
        return fut

    # -- the coroutine protocol: asyncio.run(fut), asyncio.create_task(fut) ---------------
    # Monarch's async methods (``logging_option``, ...) are coroutines; the futures that
    # stand for them here can be driven the same way.

    def _step(self, how: Callable[[Generator[Any, None, T]], Any]) -> Any:
        if self._driver is None:
            self._driver = self.__await__()
        try:
            return how(self._driver)
        except BaseException:  # done (StopIteration) or failed: the next drive starts anew
            self._driver = None
            raise

    def send(self, value: Any) -> Any:
        """Drive the future as a coroutine (what an event loop's task does)."""
        return self._step(lambda d: d.send(value))

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        exc = typ if val is None else val
        return self._step(lambda d: d.throw(exc))

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Future {state}>"


collections.abc.Coroutine.register(Future)

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for :meth:`Future._from_coro`, on a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="mk-future-loop", daemon=True).start()
        return _loop


def after_all(futures: Sequence[Future[Any]], fn: Callable[[], object]) -> None:
    """Call ``fn()`` once, when every one of ``futures`` has completed (at once when
    there are none), on the thread that completes the last of them."""
    if not futures:
        fn()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for future in futures:
        future.add_done_callback(one_done)


def then(fut: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    """A future of ``fn(fut's value)`` (``fut``'s error, if it fails); ``fn`` runs in the
    thread that asks for the result."""
    out: Future[T] = Future(lambda done: fn(done.get()))

    def done(f: Future[Any]) -> None:
        out.set_result(f)

    fut.add_done_callback(done)
    return out


class PortLike(Protocol):
    """Where :func:`forward_to_port` delivers (``actor.channels.Port``): a value, or an
    exception."""

    def send(self, value: Any) -> None: ...

    def exception(self, exc: BaseException) -> None: ...


def check_port(port: object) -> None:
    """Raise ``TypeError`` unless ``port`` takes values and exceptions (a ``Port``)."""
    if not callable(getattr(port, "send", None)) or not callable(getattr(port, "exception", None)):
        raise TypeError(f"port must be a Port (from Channel.open()), got {port!r}")


def forward_to_port(futures: Iterable[Future[Any]], port: PortLike) -> None:
    """As each of ``futures`` completes, send its value to ``port`` (its exception with
    ``port.exception``)."""

    def forward(fut: Future[Any]) -> None:
        try:
            value = fut.get()
        except Exception as exc:
            port.exception(exc)
        else:
            port.send(value)

    for fut in futures:
        fut.add_done_callback(forward)
