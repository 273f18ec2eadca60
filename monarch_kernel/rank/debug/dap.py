"""The rank's side of the notebook's visual debugger (the Debug Adapter Protocol).

A :class:`DapPdb` is the rank's bdb-based pdb (:class:`~monarch_kernel.rank.debug.debugger.
RankPdb`) reached through the same prompts: where a text debugger sends pdb's output with
each prompt, this one sends a JSON :class:`PausedState` (its stack, and the answer to the
last query), and besides pdb's commands (``c``, ``n``, ``s``, ``r``) it takes queries,
a line :data:`QUERY_MARK` + JSON (``scopes``, ``variables``, ``evaluate``), answered with
the next prompt. The kernel maps the ids of every rank into one DAP session
(:mod:`monarch_kernel.kernel.debug.relay`); the ids here are the rank's own: a frame is its
index in pdb's stack, a variables reference an index into this pause's table.

Gutter breakpoints in cells the notebook ran itself (where actor classes are defined)
reach the rank as :class:`EndpointBreaks` (the control kind ``dap_breaks``): while there
are some, every endpoint call runs armed with them.
"""

from __future__ import annotations

import base64
import json
import linecache
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from monarch_kernel.rank.debug.dap_values import Values
from monarch_kernel.rank.debug.debugger import RankDebugger, RankPdb, describe_where
from monarch_kernel.rank.errors import _user_tb
from monarch_kernel.rank.inbox import Handler
from monarch_kernel.wire import Message, loads
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K

#: A prompt's answer that is a query (JSON follows), not a pdb command.
QUERY_MARK = "\x1edap "
#: This debugger's prompt: how the kernel tells its prompts from pdb's text ones.
PROMPT = "(dap) "
#: A frame id is the pause's number and the frame's index in pdb's stack (below 2**10);
#: the kernel tags it with the rank in 24 bits.
FRAME_BITS = 10
MAX_PAUSES = 1 << (24 - FRAME_BITS)
#: Most modules listed by one ``modules`` answer.
MAX_MODULES = 1000


class DapPdb(RankPdb):
    """pdb whose prompts carry JSON state and answer DAP queries (module docstring)."""

    def __init__(self, owner: RankDebugger, post_mortem: bool = False) -> None:
        super().__init__(owner, post_mortem=post_mortem)
        self.prompt = PROMPT
        self._values = Values()
        self._reply: dict[str, Any] | None = None
        self._exception = ""
        self._pause = 0

    def arm(self, breaks: dict[str, list[int]], frame: FrameType) -> None:
        """Trace the code run below ``frame``, stopping only at the lines of ``breaks``
        (file -> lines; those that hold code); this request is the visual debugger's."""
        self._owner.dap = DapPdb
        self._owner.used = True
        self.reset()
        for filename, lines in breaks.items():
            for n in lines:
                self.set_break(filename, n)  # (a line without code: an error string)
        self.botframe = frame
        # as after ``continue``: stop at breakpoints only (bdb's own way to say it)
        self._set_stopinfo(frame, None, -1)  # type: ignore[attr-defined]
        sys.settrace(self.trace_dispatch)

    def stop_at_failure(self, exc: BaseException) -> None:
        """Stop post-mortem in the frames of ``exc`` (an exception breakpoint)."""
        tb = _user_tb(exc.__traceback__) or exc.__traceback__
        self._exception = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.reset()
        try:
            self.interaction(None, tb)
        finally:
            self._owner.resumed("done")

    # -- prompts -----------------------------------------------------------------------
    def prompt_text(self) -> str:
        text = super().prompt_text()  # (pdb's own lines: not shown by the panel)
        reply, self._reply = self._reply, None
        frame = self.curframe
        state = {
            "where": describe_where(frame, frame.f_lineno) if frame is not None else "?",
            "stack": self._stack(),
            "reply": reply,
            "text": text[-2000:],
            "exception": self._exception,
        }
        return json.dumps(state)

    def _stack(self) -> list[dict[str, Any]]:
        """The user's frames, innermost first (the rank's own machinery left out)."""
        frames = []
        start = 0
        for i, (frame, _) in enumerate(self.stack):  # the rank's call into user code
            module = str(frame.f_globals.get("__name__", ""))
            if frame.f_code.co_name == "run_user" and module.startswith("monarch_kernel."):
                start = i + 1
        for i in range(len(self.stack) - 1, start - 1, -1):
            frame, line = self.stack[i]
            code = frame.f_code
            frames.append(
                {
                    "id": self._pause << FRAME_BITS | i,
                    "name": code.co_name,
                    "file": code.co_filename,
                    "line": line,
                }
            )
        return frames

    def precmd(self, line: str) -> str:
        if line.startswith(QUERY_MARK):
            return line  # (pdb would split a JSON string at ';;')
        return str(super().precmd(line))

    def onecmd(self, line: str) -> bool:
        if not line.startswith(QUERY_MARK):
            self._values.clear()  # the rank runs on: this pause's references end
            # new frame ids for the next pause: a front end refreshes a frame's scopes
            # only when its id changes
            self._pause = (self._pause + 1) % MAX_PAUSES
            return bool(super().onecmd(line))
        try:
            query = json.loads(line[len(QUERY_MARK) :])
            self._reply = {"body": self._answer(query["command"], query.get("arguments", {}))}
        except Exception as exc:  # a bad expression, a stale reference: said in the panel
            self._reply = {"error": f"{type(exc).__name__}: {exc}"}
        return False

    # -- queries -----------------------------------------------------------------------
    def _frame(self, frame_id: int) -> FrameType:
        index = frame_id & ((1 << FRAME_BITS) - 1)
        if frame_id >> FRAME_BITS != self._pause or not 0 <= index < len(self.stack):
            raise LookupError(f"no frame {index} on this rank's stack (it ran on?)")
        return self.stack[index][0]

    def _answer(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        values = self._values
        if command == "scopes":
            frame = self._frame(int(args["frameId"]))
            scopes = []
            if frame.f_locals is not frame.f_globals:
                scopes.append(("Locals", values.ref(dict(frame.f_locals))))
            scopes.append(("Globals", values.ref(values.user_globals(frame.f_globals))))
            return {
                "scopes": [
                    {"name": n, "variablesReference": r, "expensive": False} for n, r in scopes
                ]
            }
        if command == "variables":
            return {"variables": values.children(int(args["variablesReference"]))}
        if command == "evaluate":
            frame = self._frame(int(args["frameId"]))
            return values.evaluate(str(args["expression"]), frame)
        if command == "copyToGlobals":  # the value itself, for the notebook's namespace
            frame = self._frame(int(args["srcFrameId"]))
            value = eval(str(args["srcVariableName"]), frame.f_globals, frame.f_locals)
            return {"pickled": base64.b64encode(pickle.dumps(value)).decode()}
        if command == "modules":
            start, count = int(args.get("startModule", 0)), args.get("moduleCount")
            return loaded_modules(start, int(count) if count else MAX_MODULES)
        raise ValueError(f"the rank's debugger does not answer {command!r}")


def loaded_modules(start: int, count: int) -> dict[str, Any]:
    """DAP's ``modules`` body: the Python modules this rank loaded from files, as
    ``{id, name, path}``, from ``start``, at most ``count`` (and :data:`MAX_MODULES`)."""
    listed = []
    for name, module in sorted(sys.modules.copy().items()):
        path = getattr(getattr(module, "__spec__", None), "origin", None)
        if isinstance(path, str) and path.endswith(".py"):
            listed.append({"id": name, "name": name, "path": path})
    shown = listed[max(0, start) :][: max(0, min(count, MAX_MODULES))]
    return {"modules": shown, "totalModules": len(listed)}


@dataclass
class EndpointBreaks:
    """The visual debugger's breakpoints in the notebook's own cells, on this rank.

    ``handlers`` are the rank's main-thread handlers: while there are breakpoints, the
    ``call`` handler is one that arms a :class:`DapPdb` first (no cost otherwise).
    """

    debugger: RankDebugger
    handlers: dict[str, Handler]
    call: Handler
    reply: Callable[[str, object, str], None]
    table: dict[str, list[int]] = field(default_factory=dict)

    def on_control(self, msg: Message) -> None:
        """DAP_BREAKS (control thread): the pickled ``{path: (lines, source)}``, all of
        them (replacing the last); the source goes to linecache (bdb checks the lines,
        and the file may exist only on the kernel's machine). Replies the paths."""
        got: dict[str, tuple[list[int], str]] = loads(msg.payload, msg.buffers, "breakpoints")
        for path, (_, source) in got.items():
            lines = source.splitlines(True)
            linecache.cache[path] = (len(source), None, lines, path)
        self.table = {path: [int(n) for n in lines] for path, (lines, _) in got.items() if lines}
        self.handlers[K.CALL] = self.armed_call if self.table else self.call
        request = msg.header.get("i")
        if isinstance(request, str):
            self.reply(request, sorted(self.table), "dap_breaks")

    def armed_call(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """CALL with the breakpoints armed (the trace ends with the request)."""
        table = self.table
        if table:
            DapPdb(self.debugger).arm(table, sys._getframe())
        self.call(msg, hdr, request)
