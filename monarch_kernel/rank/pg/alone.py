"""A restarted rank's first process group: itself alone, ready to join the others'.

When the mesh re-forms its process group around a restarted rank, the other ranks
re-form their groups in place (``distributed.reform_process_group``). A group that the
restarted rank made directly at the new rendezvous would be of another kind (plain gloo)
or meet them under another name, and wait forever; so it first makes a group alone, of
the kind ``init_process_group`` makes here (the re-formable one on CPU), and re-forms
that one like the others.
"""

from __future__ import annotations

from typing import Any

#: The store of the group alone (kept while the group lives).
_store: Any = None


def form_alone(backend: str | None = None) -> None:
    """Make a default process group of this rank alone (a world of one), of the kind
    ``init_process_group(backend)`` makes (``gloo`` when None: the re-formable CPU one;
    ``nccl``: the re-formable NCCL one)."""
    global _store
    from datetime import timedelta

    import torch.distributed as dist

    _store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60))
    dist.init_process_group(backend or "gloo", store=_store, rank=0, world_size=1)
