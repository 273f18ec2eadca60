"""What ``%mesh NAME`` may bind: the name check that keeps a mesh from replacing
something of the notebook's."""

from __future__ import annotations

import builtins
import keyword
import re
from collections.abc import Mapping
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.actor import ProcMesh

#: Names IPython itself keeps in the notebook's namespace: a mesh bound to one of them
#: breaks the notebook (``get_ipython`` is what every magic line calls), so ``%mesh``
#: never takes them, ``--force`` or not. Besides these: the shell's ``user_ns_hidden``.
IPYTHON_NAMES = frozenset({"get_ipython", "In", "Out", "exit", "quit", "display", "open"})
#: IPython's history and output-cache names: ``_``, ``__``, ``___``, ``_i``, ``_ii``,
#: ``_iii``, ``_iN``, ``_N``, ``_ih``, ``_oh``, ``_dh``, and dunders (``__name__`` ...).
_IPYTHON_NAME = re.compile(r"_{1,3}|_i{1,3}|_i?\d+|_[ido]h|__\w+__")


def check_identifier(name: str) -> None:
    """A mesh name is a Python identifier (it becomes a notebook variable)."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"mesh name {name!r} must be a Python identifier (e.g. trainers)")


def check_mesh_name(
    name: str, force: bool, ns: Mapping[str, object], hidden: Mapping[str, object]
) -> None:
    """Refuse a mesh name that would replace something of the notebook's (namespace
    ``ns``, IPython's ``hidden`` names): IPython's own names always, a Python builtin or a
    variable that holds something other than a mesh unless ``force``. A name that holds
    a mesh (running or stopped) is fine."""
    if name in IPYTHON_NAMES or name in hidden or _IPYTHON_NAME.fullmatch(name):
        raise UsageError(
            f"%mesh {name}: {name!r} is one of IPython's own names; a mesh bound to it "
            "would break the notebook. Pick another mesh name"
        )
    if name in ns:
        value = ns[name]
        if isinstance(value, ProcMesh) or force:
            return
        raise UsageError(
            f"%mesh {name}: {name!r} already holds {describe(value)} in the notebook; "
            "pick another mesh name, or add --force to replace it"
        )
    if name in vars(builtins) and not force:
        raise UsageError(
            f"%mesh {name}: {name!r} is a Python builtin, which a mesh of that name "
            "would hide in the notebook; pick another mesh name, or add --force"
        )


def describe(value: Any) -> str:
    """``a list``, ``an int``, ``the module numpy``: what a notebook name holds."""
    if value is None:
        return "None"
    if isinstance(value, type(builtins)):
        return f"the module {value.__name__}"
    kind = type(value).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
