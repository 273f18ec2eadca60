"""Help for the magics: plain-text ``%mesh?`` pages made from the parsers (so every
option is listed, ``--dist`` and ``--timeout`` included), and Tab completion of mesh
names, sub-commands, options and option values.

The pages are built from the same argparse parsers the magics parse with: an option
added there shows up here without a second list to keep in sync.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from monarch_kernel.controller.mesh import registry
from monarch_kernel.controller.state.records import FailurePolicy
from monarch_kernel.kernel.args import Parser, mesh_parser, remote_parser
from monarch_kernel.launchers import BACKENDS

#: ``%mesh`` sub-commands and their own options.
MESH_COMMANDS: dict[str, tuple[str, ...]] = {
    "stop": (),
    "restart": ("--ranks",),
    "setup": ("--clear",),
    "stacks": ("--ranks", "--timeout"),
    "profile": ("--steps", "--ranks", "--timeout", "--dir"),
    "grow": ("--ranks", "--gpus", "--hosts", "--timeout"),
    "shrink": ("--ranks", "--gpus", "--hosts", "--drop-ranks", "--drop-hosts", "--timeout"),
}


#: What options without a ``help=`` in their parser do (kept here, not in the parsers,
#: so this page can grow without touching the parsing code).
OPTION_HELP = {
    "--gpus": "ranks per host (CPU ranks where there are no GPUs)",
    "--hosts": "machines, one host agent each",
    "--backend": "how host agents start",
    "--env": "environment variable for every rank (repeatable)",
    "--timeout": "seconds to wait for the mesh to be ready",
    "--on-failure": "when a rank dies or fails: restart it, stop the mesh, or continue",
    "--ranks": "a slice of ranks: 0:2, 1,3 or 5",
    "--bg": "return at once; the cell runs on in the background",
    "--group-outputs": "identical lines of many ranks shown once, or per rank",
    "--out": "store the results (a ValueMesh) in this notebook variable",
}


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``(flags with metavar, help)`` of each optional argument."""
    rows = []
    for action in parser._actions:  # argparse offers no public list of its actions
        if not action.option_strings:
            continue
        flags = ", ".join(action.option_strings)
        choices = BACKENDS if "--backend" in action.option_strings else action.choices
        if action.nargs != 0:
            if choices:
                flags += " {" + ",".join(str(c) for c in choices) + "}"
            else:
                flags += " " + str(action.metavar or action.dest.upper())
        long = action.option_strings[-1]
        text = action.help or OPTION_HELP.get(long, "")
        if action.default not in (None, False, [], argparse.SUPPRESS):
            text += f"{' ' if text else ''}(default: {action.default})"
        rows.append((flags, text))
    return rows


def _table(rows: Iterable[tuple[str, str]]) -> str:
    rows = list(rows)
    width = max((len(f) for f, _ in rows), default=0)
    return "\n".join(f"  {f:<{width}}  {h}".rstrip() for f, h in rows)


MESH_HELP_HEAD = """\
Create, list, stop or restart meshes of ranks.

  %mesh NAME --gpus 4 [--hosts 2] [--backend local] [options]   create NAME (shown live)
  %mesh                                      table of the meshes
  %mesh stop NAME                            stop every rank of NAME
  %mesh restart NAME [--ranks 2,3]           restart ranks (default: the dead ones)
  %mesh setup NAME [--clear]                 the setup cells re-run on restarted ranks
  %mesh stacks NAME [--ranks 0,3] [--timeout S]   every rank's Python stacks now
  %mesh profile NAME [--steps 5] [--ranks 0,3] [--dir D]
                                             torch.profiler on the next steps of the
                                             running loop: one merged Chrome trace
  %mesh grow NAME --ranks +2 | --hosts +1    add ranks (one-host mesh) or hosts
  %mesh shrink NAME --ranks N | --hosts K    keep ranks 0..N-1 or hosts 0..K-1
  %mesh shrink NAME --drop-ranks 1,3 | --drop-hosts 1
                                             drop those, wherever they are: the
                                             survivors keep their processes and state
                                             and are renumbered in order (2,3 -> 1,2)

NAME becomes a notebook variable holding the mesh (a ProcMesh).

Options when creating:
"""

REMOTE_HELP_HEAD = """\
Run the cell on every rank of a mesh (or a slice); output streams under this cell.

  %%remote NAME                    every rank
  %%remote NAME --ranks 0:2        ranks 0 and 1 (also 1,3 or 5)
  %%remote NAME.slice(gpus=0)      a slice by dims
  %%remote NAME --bg               don't block: the cell runs on while others execute
  %remote NAME code                one line

Options:
"""

PUSH_HELP = """\
Set names in every rank's namespace (also while a --bg cell runs).

  %push NAME lr=1e-4 cfg           lr from the expression, cfg from the notebook variable

Prints what it set, e.g. "pushed to trainers (4 ranks): lr=0.0001, cfg=dict (3 items)".
"""

PULL_HELP = """\
Read names from every rank's namespace.

  %pull NAME loss                  a ValueMesh: one value per rank
  %pull NAME loss step             {"loss": ValueMesh, "step": ValueMesh}
"""


def mesh_help() -> str:
    """The ``%mesh?`` page (plain text)."""
    return MESH_HELP_HEAD + _table(_options(mesh_parser())) + "\n"


def remote_help() -> str:
    """The ``%%remote?`` page (plain text)."""
    return REMOTE_HELP_HEAD + _table(_options(remote_parser())) + "\n"


# -- completion ---------------------------------------------------------------------


def _mesh_names() -> list[str]:
    """Live meshes first, then recently stopped ones (``%mesh NAME`` re-creates)."""
    return list(dict.fromkeys([s.name for s in registry.listed()]))


def _values(parser: Parser, option: str) -> list[str] | None:
    """The values option ``option`` takes, if it has a known set (None: free text)."""
    if option == "--backend":
        return list(BACKENDS)
    if option == "--on-failure":  # free text (shrink:N), completed with the policies
        return [p.value for p in FailurePolicy]
    for action in parser._actions:
        if option in action.option_strings:
            if action.choices:
                return [str(c) for c in action.choices]
            return [] if action.nargs != 0 else None
    return None


def _flags(parser: Parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def complete(line: str, user_names: Iterable[str] = ()) -> list[str]:
    """Completions for the magic line ``line`` (up to the cursor): mesh names,
    sub-commands, options and option values; notebook names for ``%push``."""
    words = line.split()
    if not words:
        return []
    magic = words[0].lstrip("%")
    if line[-1:].isspace():
        words.append("")  # a new word starts at the cursor
    args, current = words[1:-1], words[-1]
    prev = args[-1] if args else ""
    if magic == "mesh":
        sub = args[0] if args and args[0] in MESH_COMMANDS else None
        if not args:
            return [*_mesh_names(), *MESH_COMMANDS]
        if sub is not None:
            if len(args) == 1:
                return _mesh_names()
            return list(MESH_COMMANDS[sub])
        parser = mesh_parser()
        values = _values(parser, prev)
        if values is not None:
            return values
        return _flags(parser)
    if magic in ("remote", "push", "pull"):
        if not args:
            return _mesh_names()
        if magic == "remote":
            parser = remote_parser()
            values = _values(parser, prev)
            return values if values is not None else _flags(parser)
        if magic == "push" and "=" not in current:
            return [n for n in user_names if not n.startswith("_")]
    return []


def install(shell: Any) -> None:
    """Register the completer and the help pages with IPython."""

    def completer(_shell: Any, event: Any) -> list[str]:  # IPython binds hooks as methods
        return complete(event.text_until_cursor, list(shell.user_ns))

    for key in ("%mesh", "%%remote", "%remote", "%push", "%pull"):
        shell.set_hook("complete_command", completer, str_key=key)


def set_docs(magics: type, pages: dict[str, Callable[[], str]]) -> None:
    """Give the magic methods of ``magics`` plain-text docstrings (what ``%mesh?``
    shows): reStructuredText markup reads badly in a help pager."""
    for name, page in pages.items():
        getattr(magics, name).__doc__ = page()
