"""Python stacks of a rank's threads: what ``%mesh stacks`` shows (the hang doctor).

Two ways a rank's stacks are taken, both ending as the same values:

* :func:`capture_stacks`, on the rank's control thread (``stacks`` control message):
  ``sys._current_frames()`` with thread names and source lines. Needs the GIL, so it
  answers while the main thread runs Python, sleeps or waits in C code that released
  the GIL (a collective, I/O), but not while C code holds the GIL;
* ``faulthandler`` (``dump_stacks`` to the host agent): the agent sends the rank's
  main thread :data:`STACKS_SIGNAL`, whose handler (:func:`faulthandler.register`,
  written in C, signal-safe) writes that thread's stack to the rank's stacks file
  (:func:`stacks_path`), which the agent reads back with :func:`parse_faulthandler`.
  Works even while the rank is stuck in C code holding the GIL; the main thread only
  (see :mod:`monarch_kernel.host.stacks` for why), no thread names and no source
  lines.

Everything here is plain frozen dataclasses of str/int, cheap to pickle; frames are
outermost first, like :mod:`traceback`.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from functools import lru_cache

#: The signal a rank dumps its stacks on (faulthandler, registered at rank start). A
#: real-time signal: SIGUSR1/SIGUSR2 are taken by SLURM pre-emption notices and by
#: torch's fatal-signal stack printer.
STACKS_SIGNAL: int = int(getattr(signal, "SIGRTMIN", signal.SIGUSR2)) + (
    4 if hasattr(signal, "SIGRTMIN") else 0
)

#: Where the rank's own code lives, and the other libraries it runs on: their frames
#: are plumbing to a user, shown collapsed.
_LIBRARY = ("/monarch_kernel/", "/zmq/")


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a stack. ``line`` is the stripped source line ('' if unknown)."""

    filename: str
    lineno: int
    function: str
    line: str = ""

    @property
    def library(self) -> bool:
        """A frame of monarch_kernel itself or of ZeroMQ (not the user's concern)."""
        return _library_file(self.filename)

    @property
    def key(self) -> tuple[str, int, str]:
        """What identifies the frame when stacks are compared across ranks."""
        return (self.filename, self.lineno, self.function)

    def __reduce__(self) -> tuple[type[Frame], tuple[str, int, str, str]]:
        # Pickled as a constructor call: a frozen, slotted dataclass otherwise unpickles
        # through a Python-level __setstate__ that looks its fields up for every frame,
        # which made unpickling 256 ranks' stacks most of ``%mesh stacks``' time.
        return (Frame, (self.filename, self.lineno, self.function, self.line))


#: The innermost own frames of a main thread that waits for work: the receive loop, or
#: its wait for a message of the socket or the same-machine lane (``rank.lane``).
_IDLE = frozenset({("rank/inbox.py", "run"), ("rank/inbox.py", "_next_message")})


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread's stack, outermost frame first. ``main``: the rank's main thread
    (the one that runs cells and endpoints)."""

    name: str
    ident: int
    main: bool
    frames: tuple[Frame, ...]

    @property
    def idle(self) -> bool:
        """The main thread waits for work in the rank's receive loop."""
        return self.main and _innermost_own(self.frames) in _IDLE

    @property
    def internal(self) -> bool:
        """A helper thread of monarch_kernel itself (control, output capture), recognised
        by its frames: nothing but threading start-up and library frames."""
        if self.main or not self.frames:
            return False
        return all(f.library or _is_thread_bootstrap(f) for f in self.frames) and any(
            f.library for f in self.frames
        )

    @property
    def key(self) -> tuple[object, ...]:
        """What identifies the stack across ranks (idents and names left out)."""
        if self.idle:
            return (self.main, "idle")
        return (self.main, tuple(f.key for f in self.frames))

    def __reduce__(
        self,
    ) -> tuple[type[ThreadStack], tuple[str, int, bool, tuple[Frame, ...]]]:
        return (ThreadStack, (self.name, self.ident, self.main, self.frames))  # see Frame's


@dataclass(frozen=True, slots=True)
class RankStacks:
    """Every thread's stack of one rank, as the controller collected them.

    ``source``: ``python`` (the rank's control thread answered), ``faulthandler`` (its
    host agent made it dump them: the rank did not answer in Python) or ``none`` (no
    stacks: ``error`` says why, e.g. the rank is dead or did not answer in time).
    """

    rank: int
    host: str
    pid: int | None
    threads: tuple[ThreadStack, ...]
    source: str
    error: str | None = None


def _innermost_own(frames: tuple[Frame, ...]) -> tuple[str, str] | None:
    """``(path under monarch_kernel/, function)`` of the innermost frame that is not in
    the wire layer or ZeroMQ (the receive call), or None."""
    for f in reversed(frames):
        name = f.filename.replace("\\", "/")
        if "/zmq/" in name or "/monarch_kernel/wire/" in name:
            continue
        _, sep, rest = name.rpartition("/monarch_kernel/")
        return (rest, f.function) if sep else None
    return None


def _is_thread_bootstrap(f: Frame) -> bool:
    return _bootstrap_file(f.filename)


# Both asked for every frame of every rank when stacks are grouped: a few distinct file
# names, so cached by name.
@lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    name = filename.replace("\\", "/")
    return any(part in name for part in _LIBRARY)


@lru_cache(maxsize=4096)
def _bootstrap_file(filename: str) -> bool:
    return filename.replace("\\", "/").endswith("/threading.py")


# -- in the rank, from Python ------------------------------------------------------------


def capture_stacks(skip_ident: int | None = None) -> tuple[ThreadStack, ...]:
    """Every Python thread's stack now (main thread first), but ``skip_ident``'s (the
    capturing thread's own)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        frames = tuple(
            Frame(s.filename, s.lineno or 0, s.name, (s.line or "").strip())
            for s in traceback.extract_stack(frame)
        )
        del frame
        name = names.get(ident) or f"thread 0x{ident:x}"
        out.append(ThreadStack(name, ident, ident == main_ident, frames))
    out.sort(key=lambda t: (not t.main, t.name, t.ident))
    return tuple(out)


# -- from faulthandler's text ------------------------------------------------------------

_THREAD = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)"
    r"(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):\s*$"
)
#: The first line of faulthandler's dump of the thread the signal ran on.
DUMP_HEADER = "Stack (most recent call first):"
_OWN_STACK = re.compile("^" + re.escape(DUMP_HEADER) + r"\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?+) in (?P<func>.*?)\s*$')


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """The threads of a ``faulthandler`` dump, main thread first.

    Two formats. The host agent's dump (:mod:`monarch_kernel.host.stacks`) is of the
    rank's main thread only, by that thread itself: :data:`DUMP_HEADER` then its
    frames, once per signal (the first is taken: the agent signals twice, and only the
    first is sure to be whole); faulthandler gives no thread id there (``ident`` is 0).
    A dump of every thread (``all_threads=True``) has per thread ``Thread 0x... (most
    recent call first):`` (``Current thread`` for the one the signal ran on) and its
    frames. Frames are ``  File "f", line N in func`` lines, innermost first; ``  ...``
    where it cut a deep stack short. Lines it cannot read are skipped. faulthandler
    names no thread: in a dump of every thread the main thread is the one whose stack
    does not start in ``threading`` (the others were started by it), else the last one
    listed (the oldest).
    """
    threads: list[tuple[int, str, list[Frame]]] = []
    own = False  # a "Stack" dump: the signalled (main) thread's own stack
    for raw in text.splitlines():
        m = _THREAD.match(raw)
        if m:
            ident = int(m.group("ident"), 16)
            threads.append((ident, m.group("name") or f"thread 0x{ident:x}", []))
            continue
        if _OWN_STACK.match(raw):
            own = True
            threads.append((0, "MainThread", []))
            continue
        m = _FRAME.match(raw)
        if m and threads:
            line = m.group("line")
            threads[-1][2].append(
                Frame(m.group("file"), int(line) if line.isdigit() else 0, m.group("func"))
            )
    stacks = [(ident, name, tuple(reversed(frames))) for ident, name, frames in threads]
    if own:  # one stack per signal; the agent signals twice: the first is whole
        ident, name, frames = stacks[0]
        return (ThreadStack(name, ident, True, frames),)
    roots = [i for i, (_, _, f) in enumerate(stacks) if f and not _is_thread_bootstrap(f[0])]
    main = roots[0] if len(roots) == 1 else len(stacks) - 1
    out = [
        ThreadStack("MainThread" if i == main else name, ident, i == main, frames)
        for i, (ident, name, frames) in enumerate(stacks)
    ]
    out.sort(key=lambda t: not t.main)
    return tuple(out)


def stacks_path(log_path: str, pid: int) -> str:
    """The file rank ``pid`` (whose log is ``log_path``) dumps its stacks to. It exists
    only once that process registered the dump signal: the host agent signals a rank
    only when it does (the signal's default action would kill it)."""
    return f"{log_path}.{pid}.stacks"
