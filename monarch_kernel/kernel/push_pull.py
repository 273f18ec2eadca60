"""``%push`` and ``%pull``: names copied between the notebook and every rank's namespace."""

from __future__ import annotations

import reprlib

from IPython.core.error import UsageError

from monarch_kernel.actor import ValueMesh
from monarch_kernel.calls.errors import ActorError
from monarch_kernel.kernel.args import split_args
from monarch_kernel.kernel.targets import resolve
from monarch_kernel.rank.context import UserNamespace


def push(ns: UserNamespace, line: str) -> None:
    """``%push NAME lr=1e-4 cfg``: set names in every rank's namespace, each an
    expression or a variable of the notebook's namespace ``ns``."""
    tokens = split_args(line)
    if len(tokens) < 2:
        raise UsageError("usage: %push NAME var=expr [other_var ...]")
    procs = resolve(ns, tokens[0])
    values = _values(ns, tokens[1:])
    procs.push(**values)
    # say what was set: a silent success reads like nothing happened
    what = ", ".join(f"{k}={reprlib.repr(v)}" for k, v in values.items())
    print(f"pushed to {tokens[0]} ({len(procs)} ranks): {what}")


def _values(ns: UserNamespace, tokens: list[str]) -> dict[str, object]:
    """``name=expression`` and ``name`` tokens, evaluated in ``ns``."""
    values = {}
    for tok in tokens:
        name, sep, expr = tok.partition("=")
        if not name.isidentifier():
            raise UsageError(f"%push takes name=expression or a variable name, got {tok!r}")
        try:
            values[name] = eval(expr, ns) if sep else ns[name]
        except KeyError:
            raise UsageError(f"name {name!r} is not defined in the notebook") from None
        except Exception as exc:
            raise UsageError(f"cannot evaluate {expr!r}: {exc!r}") from None
    return values


def pull(ns: UserNamespace, line: str) -> ValueMesh | dict[str, ValueMesh]:
    """``%pull NAME x [y]``: read names from every rank's namespace -> ValueMesh (a dict
    of them for several names)."""
    tokens = split_args(line)
    if len(tokens) < 2:
        raise UsageError("usage: %pull NAME variable [variable ...]")
    procs = resolve(ns, tokens[0])
    for name in tokens[1:]:
        if not name.isidentifier():
            raise UsageError(f"%pull takes variable names, got {name!r}")
    try:
        return procs.pull(*tokens[1:])
    except ActorError as exc:
        first = exc.failures[0]
        raise UsageError(
            f"%pull failed on ranks {exc.ranks}: {first['message']}; "
            "define it there with %%remote or %push first"
        ) from None
