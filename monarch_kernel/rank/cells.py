"""Running a notebook cell's code inside a rank (``%%remote``).

The cell runs in the rank's persistent namespace, like a notebook per rank. If its last
statement is an expression, its value is the result. Top-level ``await`` works.
Tracebacks point at the cell's own line numbers.
"""

from __future__ import annotations

import ast
import linecache
import sys
from typing import Any

from monarch_kernel.rank import oom
from monarch_kernel.rank.actors import UserCode
from monarch_kernel.rank.context import UserNamespace
from monarch_kernel.rank.debug.dap import DapPdb
from monarch_kernel.rank.debug.debugger import RankDebugger
from monarch_kernel.rank.outbox import Outbox
from monarch_kernel.rank.stdio import capture, display
from monarch_kernel.wire import Message, loads
from monarch_kernel.wire import headers as H


def cell_filename(cell: str) -> str:
    return f"<remote cell {cell}>"


def compile_cell(code: str, filename: str, first_line: int = 1) -> tuple[Any, Any]:
    """Code objects for the body and (if the last statement is an expression) its value.

    ``first_line`` is the cell line the code starts on (2 under a ``%%remote`` line).
    """
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    tree = ast.parse(code, filename, "exec")
    ast.increment_lineno(tree, first_line - 1)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last_expr = tree.body.pop()
        assert isinstance(last_expr, ast.Expr)
        last = ast.Expression(last_expr.value)
    body = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
    value = compile(last, filename, "eval", flags=flags, dont_inherit=True) if last else None
    return body, value


class Cells:
    """The handlers of ``exec`` (a ``%%remote`` cell) and ``debug`` (post-mortem pdb)."""

    def __init__(
        self, namespace: UserNamespace, debugger: RankDebugger, user: UserCode, outbox: Outbox
    ):
        self.namespace = namespace
        self.debugger = debugger
        self.user = user
        self.outbox = outbox

    def exec(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """EXEC: run a ``%%remote`` cell in the rank's namespace."""
        spec = loads(msg.payload, msg.buffers, "cell")
        code: str = spec["code"]
        header: list[str] = spec.get("header", [])  # the magic's line(s) above the code
        filename = cell_filename(spec.get("cell", "?"))
        # Register the source as the user sees the cell, so tracebacks show its lines.
        lines = [h + "\n" for h in header] + code.splitlines(True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        ns = self.namespace
        self.debugger.last_failure = None  # a new cell releases the last failure's frames
        try:
            body, value = compile_cell(code, filename, len(header) + 1)
            breaks = spec.get("dap")  # the notebook's visual debugger is on: its breakpoints
            if breaks is not None:
                DapPdb(self.debugger).arm({filename: [int(n) for n in breaks]}, sys._getframe())
            self.user.run_user(eval, body, ns)
            result = self.user.run_user(eval, value, ns) if value is not None else None
        except (Exception, KeyboardInterrupt) as exc:  # to the caller; SystemExit ends the
            # rank (like a script: sys.exit(n) exits with n, see ``rank.forked``)
            if spec.get("dap_exc") and not isinstance(exc, KeyboardInterrupt):
                DapPdb(self.debugger, post_mortem=True).stop_at_failure(exc)  # the panel's
            self.debugger.keep_failure(exc)  # for %debug_remote (post-mortem)
            # Out of GPU memory: the report reads the failing frames and the GPU's memory
            # as they are, then the memory those frames hold is given back (the
            # namespace stays, see ``oom.release``).
            note = self._oom_report(exc)
            self.outbox.reply_error(request, exc, "the cell", note or "")
            if note is not None:
                self._oom_release(exc)
            return
        finally:
            # Figures the cell left open are shown (as the inline backend does); complete
            # lines are already sent; send partial ones (and what C code wrote to fd 1/2)
            # before the result, so no output trails the cell's value.
            try:
                display.after_cell()
            except Exception as exc:  # a figure that fails to draw: say so, go on
                print(
                    f"monarch_kernel: showing the cell's figures failed: {exc!r}", file=sys.stderr
                )
            sys.stdout.flush()
            sys.stderr.flush()
            capture.flush_fds()
        if request:
            # The same text on every rank: the controller groups identical failures.
            self.outbox.reply(request, result, "value of the cell's last expression", "the cell")

    def _oom_report(self, exc: BaseException) -> str | None:
        if oom.find_oom(exc) is None:
            return None
        try:
            return oom.explain(exc, self.outbox.rank)
        except Exception as err:  # never hide the user's error behind ours
            return f"(monarch_kernel: the out-of-memory report failed: {err!r})\n"

    def _oom_release(self, exc: BaseException) -> None:
        try:
            oom.release(exc, self.namespace)
        except Exception as err:
            print(f"monarch_kernel: releasing GPU memory failed: {err!r}", file=sys.stderr)

    def debug(self, msg: Message, hdr: H.Ordered, request: str | None) -> None:
        """DEBUG: a post-mortem pdb on the last failure (``x``: only release it)."""
        assert isinstance(hdr, H.Debug)
        debugger = self.debugger
        if hdr.release_only:
            had = debugger.last_failure is not None
            debugger.last_failure = None
            result: Any = had
        else:
            try:
                result = self.user.run_user(debugger.post_mortem)
            except (Exception, KeyboardInterrupt) as exc:  # interrupted, or pdb failed
                self.outbox.reply_error(request, exc, "the post-mortem debugger")
                return
        if request:
            self.outbox.reply(request, result, "debug")
