"""The kernel's visual debugger for ``%%remote`` cells: DAP requests that concern ranks.

JupyterLab's Debugger panel speaks the Debug Adapter Protocol through ``debug_request``
(control channel) and ``debug_event`` (IOPub). ipykernel answers it for the kernel's own
process (debugpy); :class:`RemoteDebugger` answers first what concerns the ranks: gutter
breakpoints of a dumped ``%%remote`` cell (kept here and sent with the cell, never given to
debugpy, where they would stop the magic's own line), and every request naming a rank's
thread, frame or variables reference (:mod:`monarch_kernel.kernel.debug.relay`). Replies
that list state (``threads``, ``debugInfo``) get the ranks' part added.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from monarch_kernel.kernel.debug.endpoints import EndpointBreakpoints
from monarch_kernel.kernel.debug.relay import (
    RUN_COMMANDS,
    DapRelay,
    RankNotPaused,
    is_tagged,
    tag,
    thread_id,
    untag,
)

_current: RemoteDebugger | None = None


def current() -> RemoteDebugger | None:
    """The kernel's remote debugger while the notebook's debugger is on, else None."""
    debugger = _current
    return debugger if debugger is not None and debugger.started() else None


def is_remote_cell(code: str) -> bool:
    """Whether a cell's source is a ``%%remote`` cell (its first line, as IPython reads)."""
    return code.lstrip().startswith("%%remote")


def response(request: dict[str, Any], body: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "seq": 0,
        "type": "response",
        "request_seq": request.get("seq", 0),
        "success": True,
        "command": request.get("command", ""),
        "body": body or {},
    }


def failure(request: dict[str, Any], message: str) -> dict[str, Any]:
    reply = response(request)
    reply.update(success=False, message=message)
    return reply


class RemoteDebugger:
    """Answers the DAP requests about ranks (module docstring).

    ``started()`` tells whether the front end's debugger is on (ipykernel's state);
    ``cell_path(code)`` is the dumped file of a cell's source (JupyterLab's hash);
    ``kernel_stopped()`` whether the kernel's own code is stopped (debugpy's threads).
    """

    def __init__(
        self,
        publish: Callable[[dict[str, Any]], None],
        started: Callable[[], bool],
        cell_path: Callable[[str], str],
        user_ns: dict[str, Any] | None = None,
        kernel_stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        global _current
        self.relay = DapRelay(publish)
        self.started = started
        self.cell_path = cell_path
        #: Whether the kernel's own debugger (debugpy) has a stopped thread.
        self.kernel_stopped = kernel_stopped
        #: dumped cell path -> its gutter breakpoints (cell lines, ``%%remote`` is 1)
        self.breakpoints: dict[str, list[int]] = {}
        #: The source of the cell the shell runs now.
        self.current_code = ""
        #: The exception filters set (any: a failing rank stops post-mortem).
        self.exception_filters: list[str] = []
        #: The notebook's namespace (``copyToGlobals`` copies a rank's value into it).
        self.user_ns = user_ns if user_ns is not None else {}
        #: Breakpoints in the kernel's own cells, for the endpoints they define.
        self.endpoints = EndpointBreakpoints()
        self._deferred: Callable[[], object] | None = None
        _current = self

    def take_deferred(self) -> Callable[[], object] | None:
        """What must run once the last reply is sent (ranks told to run on)."""
        deferred, self._deferred = self._deferred, None
        return deferred

    # -- the cell being run ---------------------------------------------------------
    def breaks_for_current_cell(self) -> tuple[str, list[int]]:
        """The running cell's dumped path and its breakpoints."""
        path = self.cell_path(self.current_code)
        return path, list(self.breakpoints.get(path, []))

    # -- requests -------------------------------------------------------------------
    def handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The reply to a request about ranks; None for the kernel's own debugger."""
        command = request.get("command", "")
        args = request.get("arguments") or {}
        try:
            if command == "setBreakpoints":
                return self._set_breakpoints(request, args)
            if command == "disconnect":
                self.relay.run_on(self.relay.paused_keys(), "c")
                self.breakpoints.clear()
                self.exception_filters = []
                self.endpoints.clear()
                self.endpoints.sync()
                return None
            if command == "setExceptionBreakpoints":  # (debugpy gets them too)
                self.exception_filters = list(args.get("filters") or [])
                return None
            if command == "threads" and self.relay.paused_keys():
                # the kernel's own threads run the waiting cell (none is stopped): only
                # the ranks' are listed, without asking debugpy (tens of ms)
                return self.after(request, response(request, {"threads": []}))
            if command == "pause" and is_tagged(args.get("threadId")):
                return failure(
                    request,
                    "pausing a running rank is not supported: set a gutter breakpoint in "
                    "the %%remote cell or call breakpoint() there, then run it again",
                )
            if command == "richInspectVariables" and is_tagged(args.get("frameId")):
                return self._rich_inspect(request, args)
            if command == "copyToGlobals" and is_tagged(args.get("srcFrameId")):
                return self._copy_to_globals(request, args)
            if command == "modules":
                return self._modules(request, args)
            if command == "continue" and self._continues_every_rank(args):
                shown = self.relay.shown_key()
                if shown is not None:  # (else they ran on meanwhile: debugpy's)
                    return self._run_on(request, shown)
            key = {"stackTrace": "threadId", "scopes": "frameId"}.get(command, "")
            key = key or {"variables": "variablesReference", "evaluate": "frameId"}.get(command, "")
            if command in RUN_COMMANDS:
                key = "threadId"
            if not key or not is_tagged(args.get(key)):
                return None
            who, local = untag(int(args[key]))
            if command == "stackTrace":
                return response(request, self._stack_trace(who))
            if command in RUN_COMMANDS:
                return self._run_on(request, who)
            if command == "variables":
                body = self.relay.query(who, command, {"variablesReference": local})
                for v in body.get("variables", []):
                    v["variablesReference"] = self._tag_ref(who, v.get("variablesReference"))
                return response(request, body)
            body = self.relay.query(who, command, {**args, key: local})
            for item in body.get("scopes", [body]):
                item["variablesReference"] = self._tag_ref(who, item.get("variablesReference"))
            return response(request, body)
        except (RankNotPaused, TimeoutError, ValueError) as exc:
            return failure(request, str(exc))

    def after(self, request: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        """The kernel's own reply, with the ranks' part added."""
        command = request.get("command", "")
        if command == "threads" and not any(
            str(t.get("name", "")).startswith("rank ")
            for t in (reply or {}).get("body", {}).get("threads", [])
        ):
            reply = reply or response(request, {"threads": []})
            threads = reply.setdefault("body", {}).setdefault("threads", [])
            for key in self.relay.paused_keys():
                threads.append({"id": thread_id(key), "name": self.relay.thread_name(key)})
        elif command == "modules" and "success" not in reply:
            # (ipykernel 7.4 answers the kernel's own modules with a bare body)
            reply = response(request, reply.get("body", {}))
        elif command == "debugInfo" and reply.get("success"):
            body = reply.setdefault("body", {})
            listed = body.setdefault("breakpoints", [])
            for path, lines in self.breakpoints.items():
                listed.append({"source": path, "breakpoints": [{"line": n} for n in lines]})
            stopped = body.setdefault("stoppedThreads", [])
            stopped.extend(thread_id(r) for r in self.relay.paused_keys())
        return reply

    def _set_breakpoints(
        self, request: dict[str, Any], args: dict[str, Any]
    ) -> dict[str, Any] | None:
        path = str((args.get("source") or {}).get("path", ""))
        if not path:
            return None
        if not _dumped_remote_cell(path):
            # the kernel's own cell: debugpy's, and the ranks' for the endpoints it defines
            self.endpoints.set(path, [int(b["line"]) for b in args.get("breakpoints") or []])
            self.endpoints.sync()
            return None
        lines = [int(b["line"]) for b in args.get("breakpoints") or []]
        self.breakpoints[path] = lines
        if not lines:
            self.breakpoints.pop(path)
        listed = [{"verified": True, "line": n, "source": {"path": path}} for n in lines]
        return response(request, {"breakpoints": listed})

    def _continues_every_rank(self, args: dict[str, Any]) -> bool:
        """A ``continue`` naming no rank's thread while ranks are paused and the kernel's
        own code is not: JupyterLab's Continue button sends the thread id it has *after*
        forgetting the stopped one (``1`` when none is left), so the ranks are meant."""
        if is_tagged(args.get("threadId")) or not self.relay.paused_keys():
            return False
        return not self.kernel_stopped()

    def _modules(self, request: dict[str, Any], args: dict[str, Any]) -> dict[str, Any] | None:
        """The modules of a paused rank: the one ``threadId`` names (an argument of ours),
        else the one JupyterLab shows; None (the kernel's own) when no rank is paused."""
        thread = args.get("threadId")
        if isinstance(thread, int) and is_tagged(thread):
            who = untag(thread)[0]
        else:
            shown = self.relay.shown_key()
            if shown is None or self.kernel_stopped():
                return None
            who = shown
        query: dict[str, Any] = {k: args[k] for k in ("startModule", "moduleCount") if k in args}
        return response(request, self.relay.query(who, "modules", query))

    def _stack_trace(self, who: int) -> dict[str, Any]:
        frames = []
        for f in self.relay.stack_of(who):
            path = f["file"]
            path = self.relay.cell_paths.get(path, path)
            frames.append(
                {
                    "id": tag(who, f["id"]),
                    "name": f["name"],
                    "line": f["line"],
                    "column": 1,
                    "source": {"path": path, "name": os.path.basename(path)},
                }
            )
        return {"stackFrames": frames, "totalFrames": len(frames)}

    def _run_on(self, request: dict[str, Any], who: int) -> dict[str, Any]:
        """``continue`` resumes every paused rank (JupyterLab resumes only the thread it
        shows); ``next``/``stepIn``/``stepOut`` that rank alone."""
        command = RUN_COMMANDS[request["command"]]
        everyone = command == "c"
        paused = self.relay.paused_keys()
        keys = paused if everyone else [who]
        if who not in paused:
            raise RankNotPaused(f"{self.relay.thread_name(who)} is not paused (it ran on)")
        # Sent once the reply is out (``take_deferred``): JupyterLab marks the thread as
        # running when the reply comes, so a step's ``stopped`` must come after it; a
        # ``continue`` is followed by a ``continued`` event (JupyterLab's overlay goes).
        self._deferred = lambda: self.relay.run_on(keys, command)
        return response(request, {"allThreadsContinued": everyone} if everyone else {})

    def _rich_inspect(self, request: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        """A variable of a rank's frame, as text (the rank's objects stay there)."""
        who, frame = untag(int(args["frameId"]))
        name = str(args.get("variableName", ""))
        got = self.relay.query(who, "evaluate", {"expression": name, "frameId": frame})
        return response(request, {"data": {"text/plain": got["result"]}, "metadata": {}})

    def _copy_to_globals(self, request: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        """A rank's variable copied into the notebook's namespace (pickled by the rank)."""
        import base64
        import pickle

        who, frame = untag(int(args["srcFrameId"]))
        query = {"srcVariableName": args["srcVariableName"], "srcFrameId": frame}
        got = self.relay.query(who, "copyToGlobals", query)
        self.user_ns[str(args["dstVariableName"])] = pickle.loads(base64.b64decode(got["pickled"]))
        return response(request)

    @staticmethod
    def _tag_ref(who: int, ref: object) -> int:
        return tag(who, ref) if isinstance(ref, int) and ref > 0 else 0


def _dumped_remote_cell(path: str) -> bool:
    """Whether ``path`` is a dumped cell whose source is a ``%%remote`` cell."""
    try:
        with open(path, encoding="utf-8") as f:
            return is_remote_cell(f.read(4096))
    except OSError:
        return False
