"""Futures returned by endpoint adverbs: ``.get(timeout=)``, ``await``, callbacks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_PENDING = object()


class Future(Generic[T]):
    """The result of a remote call, completed from the controller's I/O thread.

    ``finish`` (optional) turns the raw completion value into the user-visible result
    (unpickling, building a ValueMesh, raising a grouped error); it runs once, in the
    thread that first asks for the result, never on the I/O thread.
    """

    __slots__ = ("_event", "_raw", "_error", "_value", "_finish", "_callbacks", "_lock")

    def __init__(self, finish: Callable[[Any], T] | None = None):
        self._event = threading.Event()
        self._raw: Any = None
        self._error: BaseException | None = None
        self._value: Any = _PENDING
        self._finish = finish
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self._lock = threading.Lock()

    # -- completion (I/O thread) -------------------------------------------------------
    def _complete(self, raw: Any = None, error: BaseException | None = None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._raw, self._error = raw, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def set_result(self, value: Any) -> bool:
        return self._complete(raw=value)

    def set_exception(self, error: BaseException) -> bool:
        return self._complete(error=error)

    # -- user side ------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def get(self, timeout: float | None = None) -> T:
        """Block until the result is there; raise the remote error if the call failed.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first (the call goes on).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"no result within {timeout}s; the call is still running "
                "(call .get() again to keep waiting)"
            )
        if self._error is not None:
            raise self._error
        if self._value is _PENDING:
            with self._lock:
                if self._value is _PENDING:
                    try:
                        self._value = self._finish(self._raw) if self._finish else self._raw
                    except BaseException as exc:
                        self._error = exc
                        raise
        if self._error is not None:
            raise self._error
        return self._value

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001
            return exc
        return None

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self):
        if not self.done():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Future) -> None:
                loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Future {state}>"
