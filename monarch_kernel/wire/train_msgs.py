"""The payloads of ``train`` messages (see :mod:`.kinds`): orders the
controller gives a rank parked at a training step boundary, and what ranks tell it
about their training. Plain picklable records, shared by both processes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Order:
    """What the controller tells a parked (or restarted) rank.

    ``op``: ``reform`` (join the process group's new rendezvous ``addr:port``; with
    ``defer`` its subgroups wait for ``subgroups``: form them at ``addr:port``),
    ``offer`` (share this rank's state; reply: an :class:`Offered`), ``load`` (take
    the state ``offer``), ``resume`` (go on: the failed step is redone), ``raise``
    (fail the step's error, ``why`` says why there is no recovery), ``expect`` (a
    restarted rank: load ``offer`` at the first step of ``request``), ``hold`` (a
    resize: park at the next step boundary), ``world`` (the mesh is now of dims
    ``labels`` with extent ``sizes``, and ``ranks`` maps the slot of each rank that a
    shrink renumbered to its new rank: a survivor of a resize, before ``reform``).
    """

    op: str
    request: str  #: the training request (cell) it is about
    addr: str = ""
    port: int = 0
    offer: bytes = b""  #: a pickled ``rank.training.parts.StateOffer`` (opaque here)
    why: str = ""
    labels: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    ranks: tuple[tuple[int, int], ...] = ()  #: (slot, new rank) of renumbered ranks
    defer: bool = False  #: ``reform``: leave the subgroups for ``subgroups``


@dataclass(frozen=True)
class Offered:
    """A replica's answer to ``offer``: its state as handles (``blob``, opaque to the
    controller, which only passes it on) and what it holds."""

    source: int
    step: int
    nbytes: int
    blob: bytes


@dataclass(frozen=True)
class Notice:
    """What a rank tells the controller about its training.

    ``event``: ``active`` (it runs steps of a TrainingState in ``request``),
    ``parked`` (waiting at the boundary of ``step``; ``has_state``: whether it holds a
    usable state; ``error``: the failure that stopped it), ``loaded`` (took a
    replica's state: ``nbytes`` in ``seconds`` from ``source``) or ``load_failed``.
    ``replicas``: the ranks that hold the same state as this one (an HSDP model's
    shards are the same across its replicate dim only); empty: every rank does.
    """

    event: str
    request: str
    step: int
    has_state: bool = True
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    source: int = -1
    time: float = field(default_factory=time.time)
    replicas: tuple[int, ...] = ()
