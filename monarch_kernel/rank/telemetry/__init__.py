"""Step telemetry in the rank: per-step time by category, stragglers' raw data, and
``%mesh profile`` (``torch.profiler`` over the running loop's next steps).

:func:`install` (called once by the rank at start) hooks torch where a training step
shows without any change to the user's code: the optimizer's global step hooks bound
a step, the data loader's ``__next__`` is timed, and the re-formable process group
reports its collectives (:mod:`.clock`). Finished steps go to the controller in
batches from a thread of their own (:mod:`.sender`); ``profile`` control messages arm
the profiler (:mod:`.profile`).

Off (``MONARCH_KERNEL_TELEMETRY=0``, e.g. ``%mesh NAME --env MONARCH_KERNEL_TELEMETRY=0``)
nothing is hooked and nothing is measured.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch_kernel.rank.telemetry.clock import StepClock
from monarch_kernel.rank.telemetry.profile import ProfileRun, Profiling
from monarch_kernel.rank.telemetry.sender import Send, StepSender
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Message
from monarch_kernel.wire.steps import ProfileOrder, RankTrace

__all__ = ["ENV", "Telemetry", "enabled", "install", "installed"]

log = logging.getLogger("monarch_kernel.rank")

#: The environment variable that turns step telemetry off (``0``) in ranks.
ENV = "MONARCH_KERNEL_TELEMETRY"


def enabled() -> bool:
    """Whether step telemetry is on for this rank (on unless ``MONARCH_KERNEL_TELEMETRY=0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass
class Telemetry:
    """The rank's telemetry parts, once installed."""

    clock: StepClock
    sender: StepSender
    profiling: Profiling
    #: Undo the hooks (tests, the benchmark's "off" rows in one process).
    remove: Callable[[], None]


_installed: Telemetry | None = None


def installed() -> Telemetry | None:
    """The rank's telemetry, or None (off, or not a rank)."""
    return _installed


Reply = Callable[[str, Any, str], None]


def install(
    slot: int,
    send: Send,
    reply: Reply,
    control_handlers: dict[str, Callable[[Message], None]] | None = None,
) -> Telemetry | None:
    """Hook torch for step telemetry (nothing when off or without torch).

    ``send(header, payload)``: how steps leave the rank (through the host agent's
    fan-in where there is one); ``reply(request, value, what)``: answer a request
    (the profile's trace); ``control_handlers``: the control thread's table, which
    gets the ``profile`` kind."""
    global _installed
    if _installed is not None or not enabled():
        return _installed
    try:
        import torch.optim.optimizer as optimizer
        from torch.utils.data import dataloader
    except Exception as exc:  # no torch: nothing to measure
        log.debug("step telemetry off: %r", exc)
        return None
    from monarch_kernel.rank.pg import watch

    sender = StepSender(send, slot)
    clock = StepClock(sender.put)
    profiling = Profiling()
    clock.on_step = profiling.on_step
    pre = optimizer.register_optimizer_step_pre_hook(clock.optimizer_started)
    post = optimizer.register_optimizer_step_post_hook(clock.optimizer_stepped)
    iterator: Any = dataloader._BaseDataLoaderIter
    original_next = iterator.__next__

    def timed_next(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original_next(self)
        finally:
            clock.data(t0, time.perf_counter())

    iterator.__next__ = timed_next
    watch.op_watch = clock

    def remove() -> None:
        global _installed
        pre.remove()
        post.remove()
        iterator.__next__ = original_next
        if watch.op_watch is clock:
            watch.op_watch = None
        _installed = None

    def on_profile(msg: Message) -> None:
        request = H.ControlRequest.decode(msg.header).request
        order: ProfileOrder = pickle.loads(msg.payload)
        if request is None:
            return
        if order.steps <= 0:  # disarm
            profiling.arm_none()
            reply(request, None, "profile")
            return

        def answer(trace: RankTrace) -> None:
            reply(request, trace, "profile trace")

        profiling.arm(ProfileRun(order, slot, answer))

    if control_handlers is not None:
        control_handlers[K.PROFILE] = on_profile
    _installed = Telemetry(clock, sender, profiling, remove)
    return _installed
