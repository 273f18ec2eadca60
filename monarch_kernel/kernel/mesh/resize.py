"""``%mesh grow NAME --ranks +2`` and ``%mesh shrink NAME --ranks 3``: resize a live mesh.

``--gpus`` is another name for ``--ranks`` (ranks per host, on a one-host mesh);
``--hosts +K`` / ``--hosts K`` add or keep whole hosts. ``%mesh shrink NAME
--drop-ranks 1,3`` / ``--drop-hosts 1`` drop those ranks or hosts wherever they are:
the survivors are renumbered in their old order. See
:mod:`monarch_kernel.controller.elastic.resize` for what happens to the ranks.
"""

from __future__ import annotations

from IPython.core.error import UsageError

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.elastic.plan import ResizeError
from monarch_kernel.kernel.args import Parser
from monarch_kernel.kernel.targets import existing, stopped_error


def _parser(verb: str) -> Parser:
    p = Parser(prog=f"%mesh {verb}", add_help=False)
    p.add_argument("name")
    p.add_argument("--ranks", default=None, metavar="+N" if verb == "grow" else "N")
    p.add_argument("--gpus", default=None, metavar="+N" if verb == "grow" else "N")
    p.add_argument("--hosts", default=None, metavar="+K" if verb == "grow" else "K")
    if verb == "shrink":
        p.add_argument("--drop-ranks", default=None, metavar="R,R")
        p.add_argument("--drop-hosts", default=None, metavar="H,H")
    p.add_argument("--timeout", type=float, default=120.0)
    return p


def resize_mesh(verb: str, args: list[str]) -> None:
    """``%mesh grow|shrink NAME ...``: print what was done (one line)."""
    opts = _parser(verb).parse_args(args)
    if opts.ranks is not None and opts.gpus is not None:
        raise UsageError(f"%mesh {verb}: give --ranks or --gpus (the same thing), not both")
    ranks = opts.ranks if opts.ranks is not None else opts.gpus
    procs = existing(opts.name)
    if procs.stopped:
        raise stopped_error(opts.name)
    try:
        if verb == "grow":
            report = procs.grow(ranks, opts.hosts, opts.timeout)
        else:
            report = procs.shrink(
                ranks,
                opts.hosts,
                opts.timeout,
                drop_ranks=opts.drop_ranks,
                drop_hosts=opts.drop_hosts,
            )
    except (ResizeError, MeshStartError) as exc:
        raise UsageError(f"%mesh {verb} {opts.name}: {exc}") from None
    print(report.describe())
