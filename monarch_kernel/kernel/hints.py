"""How remote failures look in the notebook: the grouped message, with magic hints.

The controller and the actor API say what to do in Python terms
(``ProcMesh.restart(ranks=[2])``); in the notebook the magic is the natural remedy, so
this layer rewrites the advice (the controller never mentions magics).
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import Any

from monarch_kernel.calls.errors import (
    ActorError,
    MeshStartError,
    MeshStoppedError,
    RankDiedError,
)
from monarch_kernel.kernel.remote import RemoteInterrupted
from monarch_kernel.wire.serialize import SerializationError

#: Errors shown as their message only (no local traceback of our internals).
REMOTE_ERRORS = (
    ActorError,
    RankDiedError,
    MeshStoppedError,
    MeshStartError,
    SerializationError,
    RemoteInterrupted,
)

_RESTART_API = re.compile(r"Restart it with ProcMesh\.restart\(ranks=\[(\d+)\]\)\.")
_STOPPED = re.compile(r"mesh '(\w+)' is stopped; create a new mesh")


_POLICY = re.compile(r"on_failure='(\w+)'")


def notebook_words(text: str) -> str:
    """Python-API terms of a controller message in the notebook's: the magics' flags."""
    return _POLICY.sub(r"--on-failure \1", text).replace("setup cells", "%%remote --setup cells")


def notebook_text(error: BaseException) -> str:
    """``str(error)`` with Python-API remedies replaced by the magics that do the same."""
    text = notebook_words(str(error))
    if isinstance(error, RankDiedError) and error.mesh:
        name = error.mesh
        text = _RESTART_API.sub(
            lambda m: (
                f"Restart it with %mesh restart {name} --ranks {m.group(1)} "
                f"(or {name}.restart([{m.group(1)}]))."
            ),
            text,
        )
    elif isinstance(error, MeshStoppedError):
        text = _STOPPED.sub(
            lambda m: (
                f"mesh {m.group(1)!r} is stopped; create it again with %mesh {m.group(1)} --gpus N"
            ),
            text,
        )
    return text


def show_remote_error(
    shell: Any,
    etype: type[BaseException],
    evalue: BaseException,
    tb: TracebackType | None,
    tb_offset: int | None = None,
) -> list[str]:
    """IPython custom exception handler: a remote failure as its grouped message only."""
    stb = [
        f"{etype.__name__}: {line}" if i == 0 else line
        for i, line in enumerate(notebook_text(evalue).split("\n"))
    ]
    shell._showtraceback(etype, evalue, stb)
    return stb
