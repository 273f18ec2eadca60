"""How far each training object got on this rank: ``opt.step()`` calls per optimizer
(torch's global optimizer step hook) and every DDP object made here (so that a re-form
can repair their reducers). Installed once, in the warm template."""

from __future__ import annotations

import weakref
from typing import Any

_steps: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: Every DistributedDataParallel object made on this rank (weakly).
ddps: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False


def install() -> None:
    """Count ``opt.step()`` per optimizer, and remember every DDP object (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def count(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        _steps[optimizer] = _steps.get(optimizer, 0) + 1

    register_optimizer_step_post_hook(count)
    original = DDP.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ddps.add(self)

    DDP.__init__ = init  # type: ignore[method-assign]
    _installed = True


def optimizer_steps(optimizer: Any) -> int:
    """How many times ``optimizer.step()`` ran on this rank (0 if never)."""
    return _steps.get(optimizer, 0)


def set_optimizer_steps(optimizer: Any, steps: int) -> None:
    """Set the ``opt.step()`` count (a copied optimizer takes its source's count)."""
    _steps[optimizer] = steps
