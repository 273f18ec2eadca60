"""How long a host agent may stay silent before it counts as lost: an adaptive bound.

A host agent sends something (a heartbeat, its ranks' stats or replies) about twice a
second. On a quiet machine, a silence of ``hb_timeout`` (2.5 s) means the agent froze,
crashed or was cut off. On an overloaded one (a thousand ranks on two cores, a node
swapping) the same agent's messages come seconds apart while it is perfectly alive, and
a fixed bound declares it lost and kills its ranks: a false alarm that costs the user a
mesh. So, as accrual failure detectors do, the bound follows what this host's own
arrivals have been like lately: at least ``hb_timeout``, else :data:`FACTOR` times the
longest of its last :data:`WINDOW` gaps, and never more than :data:`MAX_SILENCE`.

Invariant: a host whose messages stop altogether (frozen, crashed, partitioned) records
no new gap, so its bound is what its recent past allowed: detection stays within
``max(hb_timeout, FACTOR × longest recent gap)``, and within :data:`MAX_SILENCE` at worst.
A stall of the controller itself (``supervision.STALL``) moves every host's last message
time to its end, which counts as a long gap: after an overload the bound stays generous
for a while, as it should.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: A host counts as lost after this many times its longest recent gap between messages.
FACTOR = 4.0
#: Gaps remembered per host (about WINDOW / 2 seconds of a healthy agent's messages).
WINDOW = 32
#: Seconds of silence after which a host is lost, however jittery it was.
MAX_SILENCE = 20.0


@dataclass
class _Arrivals:
    last: float
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))


class SilenceBound:
    """Per host (by slot), the silence after which it counts as lost."""

    def __init__(self, floor: float):
        """``floor``: the bound on a quiet machine (the mesh's ``hb_timeout``)."""
        self.floor = floor
        self._hosts: dict[int, _Arrivals] = {}

    def seen(self, slot: int, last_seen: float) -> None:
        """Note host ``slot``'s latest message time (read on each supervision tick)."""
        got = self._hosts.get(slot)
        if got is None:
            self._hosts[slot] = _Arrivals(last_seen)
        elif last_seen > got.last:
            got.gaps.append(last_seen - got.last)
            got.last = last_seen

    def longest_gap(self, slot: int) -> float:
        """The longest of host ``slot``'s recent gaps between messages (0: none yet)."""
        got = self._hosts.get(slot)
        return max(got.gaps) if got is not None and got.gaps else 0.0

    def allowed(self, slot: int) -> float:
        """Seconds of silence host ``slot`` may have before it counts as lost."""
        return min(MAX_SILENCE, max(self.floor, FACTOR * self.longest_gap(slot)))

    def forget(self, slot: int) -> None:
        """Host ``slot`` was restarted or removed: its history no longer applies."""
        self._hosts.pop(slot, None)
