"""torch.distributed in a notebook: re-running the init cell must be harmless.

Installed in the warm template before any rank is forked, so user code that does
``dist.init_process_group()`` (with or without arguments) a second time keeps the
existing process group instead of failing.
"""

from __future__ import annotations

import functools
from typing import Any


def install_idempotent_init() -> None:
    """Make ``torch.distributed.init_process_group`` a no-op when already initialised."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    original = dist.init_process_group
    if getattr(original, "__monarch_idempotent__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return None  # the notebook twist: re-running the init cell keeps the group
        return original(*args, **kwargs)

    init_process_group.__monarch_idempotent__ = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group
    # `from torch.distributed import init_process_group` binds through the package too
    import torch.distributed.distributed_c10d as c10d

    c10d.init_process_group = init_process_group
