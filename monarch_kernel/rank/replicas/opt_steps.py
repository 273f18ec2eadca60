"""How far each training object got on this rank: ``opt.step()`` calls per optimizer
(torch's global optimizer step hooks), whether its last ``opt.step()`` was cut short
partway (the stop button inside it: some parameters and moments updated, the others
not), and every DDP object made here (so that a re-form can repair their reducers).
Installed once, in the warm template."""

from __future__ import annotations

import weakref
from typing import Any

_steps: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: Optimizers whose last ``step()`` started and did not return (interrupted, or raised).
_cut_short: weakref.WeakSet[Any] = weakref.WeakSet()
#: Every DistributedDataParallel object made on this rank (weakly).
ddps: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False


def install() -> None:
    """Count ``opt.step()`` per optimizer, note the ones cut short, and remember every
    DDP object (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def begin(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        _cut_short.add(optimizer)  # until the step returns

    def count(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        _cut_short.discard(optimizer)
        _steps[optimizer] = _steps.get(optimizer, 0) + 1

    register_optimizer_step_pre_hook(begin)
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


def step_cut_short(optimizer: Any) -> bool:
    """Whether the last ``optimizer.step()`` on this rank started and did not finish (an
    interrupt or an error inside it): its parameters and state may be partly updated."""
    return optimizer in _cut_short


def set_step_cut_short(optimizer: Any, cut_short: bool) -> None:
    """Mark the optimizer's state as a step cut short or not (a copied optimizer takes
    its source's mark)."""
    if cut_short:
        _cut_short.add(optimizer)
    else:
        _cut_short.discard(optimizer)
