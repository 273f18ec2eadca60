"""Running an unchanged torchrun-style script inside a rank (``%torchrun``)."""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType


class ScriptExit(Exception):
    """The script called ``sys.exit`` with a non-zero code."""


def _from_script(tb: TracebackType | None, path: str | None) -> TracebackType | None:
    """The traceback from the first frame of the user's script on (runpy's frames off)."""
    start = tb
    while start is not None:
        name = start.tb_frame.f_code.co_filename
        if (path and os.path.abspath(name) == path) or (
            not path and "runpy" not in name and "monarch_kernel" not in name
        ):
            return start
        start = start.tb_next
    return tb


def run_script(target: str, args: list[str], module: bool = False) -> None:
    """Run ``target`` (a file, or a module with ``module=True``) as ``__main__`` with
    ``sys.argv = [target, *args]``, in a fresh namespace, like torchrun would."""
    path = None if module else os.path.abspath(target)
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(f"no script {target!r} (looked in {os.getcwd()})")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [target, *args]
    if path is not None:
        sys.path.insert(0, os.path.dirname(path))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            assert path is not None  # set whenever module is False
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExit(f"{target} exited with code {exc.code}") from None
    except BaseException as exc:
        raise exc.with_traceback(_from_script(exc.__traceback__, path)) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
