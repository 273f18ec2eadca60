"""Parsing magic lines: argparse that raises UsageError, and bracket-aware splitting."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, NoReturn

from IPython.core.error import UsageError

from monarch_kernel.controller.lifecycle.failures import DEFAULT_GRACE
from monarch_kernel.controller.state.records import FailurePolicy, parse_policy
from monarch_kernel.kernel.output import MODES

#: How alike (difflib's ratio) an unknown option and a real one must be to suggest it:
#: ``--gpu``/``--gpus`` are 0.91, ``--frobnicate``/``--force`` 0.63.
SUGGEST_CUTOFF = 0.75


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, takes options only as
    written (no prefixes: ``--gpu`` is not ``--gpus``), and names the closest option to
    one it does not know."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UsageError(f"{self.prog}: {self._suggest(message)}. Usage: {usage}")

    def _suggest(self, message: str) -> str:
        """argparse's ``unrecognized arguments: ...`` said per argument, with the
        closest option to each unknown one ("did you mean --gpus?")."""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown is None:
            return message
        options = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        parts = []
        for token in unknown.group(1).split():
            if not token.startswith("-"):
                parts.append(f"unexpected argument {token!r}")
                continue
            name = token.split("=", 1)[0]
            longer = [o for o in options if o.startswith(name)]  # a prefix: no longer taken
            close = longer if len(longer) == 1 else []
            close = close or difflib.get_close_matches(name, options, n=1, cutoff=SUGGEST_CUTOFF)
            parts.append(
                f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else "")
            )
        return ", ".join(parts)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise UsageError(message or self.format_usage())


#: ``%mesh`` options handed to the backend's launcher (each backend refuses the ones it
#: does not take, naming them).
ENGINE_OPTIONS = ("bind", "advertise", "address", "partition", "time", "account", "machine")


def mesh_parser() -> Parser:
    """``%mesh NAME --gpus N ...``."""
    p = Parser(prog="%mesh", add_help=False)
    p.add_argument("name")
    p.add_argument("--gpus", type=int, default=None, help="ranks per host")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--backend", default="local")
    p.add_argument("--bind", default=None, help="join backend: address to listen on (default: all)")
    p.add_argument(
        "--advertise",
        default=None,
        help="join backend: address the hosts connect to (default: this machine's address "
        "on its default route)",
    )
    p.add_argument("--address", default=None, help="ray backend: the cluster (default: auto)")
    p.add_argument("--partition", default=None, help="slurm backend: partition to allocate in")
    p.add_argument("--time", default=None, help="slurm backend: time limit of the allocation")
    p.add_argument("--account", default=None, help="slurm backend: account to charge")
    p.add_argument(
        "--machine", default=None, help="lightning backend: machine type (e.g. H100_X_8)"
    )
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--dist", action="store_true", help="init_process_group on every rank")
    p.add_argument(
        "--on-failure",
        default=FailurePolicy.RESTART.value,
        type=_policy,
        metavar="{" + ",".join(policy.value for policy in FailurePolicy) + "[:N]}",
        help="when a rank dies or fails: restart it, stop the mesh, continue, or shrink "
        "the mesh without it (shrink:N: not below N ranks)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        help="seconds before survivors of a failure are released",
    )
    p.add_argument("--force", action="store_true", help="replace a notebook variable of that name")
    p.add_argument(
        "--replace",
        action="store_true",
        help="stop a running mesh of that name and start this one anew (its ranks' state is "
        "lost); without it a running mesh is kept when asked for as it runs, else refused",
    )
    p.add_argument(
        "--detachable",
        action="store_true",
        help="the ranks outlive this kernel; another kernel takes them over with %%mesh attach",
    )
    p.add_argument(
        "--keep",
        default=None,
        metavar="DURATION",
        help="--detachable: how long the ranks run on without a kernel (e.g. 30m, 2h; default 2h)",
    )
    return p


def _policy(text: str) -> str:
    """``--on-failure``: a policy name, or ``shrink:N``."""
    try:
        parse_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def remote_parser() -> Parser:
    """``%%remote TARGET [--ranks] [--bg] ...``."""
    p = Parser(prog="%%remote", add_help=False)
    p.add_argument("target")
    p.add_argument("--ranks", default=None)
    p.add_argument("--bg", action="store_true")
    p.add_argument("--group-outputs", default="collapse", choices=MODES)
    p.add_argument("-o", "--out", default=None, metavar="NAME")
    p.add_argument("--setup", action="store_true", help="re-run this cell on restarted ranks")
    return p


_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def split_args(text: str) -> list[str]:
    """Split on whitespace outside brackets and quotes: ``a=[1, 2] b`` -> 2 tokens.

    Brackets must pair up (``(]`` and ``) (`` are errors), quotes must close.
    """
    out: list[str] = []
    cur: list[str] = []
    expected: list[str] = []  # the closing brackets still owed, innermost last
    quote = ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _CLOSERS:
            expected.append(_CLOSERS[ch])
        elif ch in ")]}":
            if not expected or expected.pop() != ch:
                raise UsageError(f"unbalanced quotes or brackets in {text!r}")
        elif ch.isspace() and not expected:
            if cur:
                out.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if quote or expected:
        raise UsageError(f"unbalanced quotes or brackets in {text!r}")
    if cur:
        out.append("".join(cur))
    return out
