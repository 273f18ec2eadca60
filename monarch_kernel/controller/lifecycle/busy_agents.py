"""A silent host agent that still gets work done is busy, not frozen.

The controller counts a host as lost after a silence (:mod:`.silence`), and its ranks
die with it. On an overloaded machine (a thousand ranks on two cores) an agent of this
machine can go that long without a heartbeat while it works through a backlog (its
ranks all starting their actors at once): a false alarm that costs the user the host's
ranks. A frozen agent (stopped, deadlocked, swapped out for good) gets no CPU; a busy
one does. So for an agent whose process the controller started (its launcher knows
its pid), while the agent is silent the controller samples the CPU time of its main
thread (``/proc/<pid>/schedstat``, nanoseconds), and past the silence bound gives it
more time for as long as that keeps growing, up to :data:`MAX_BUSY_SILENCE`.

Invariant: an agent that gets no CPU is lost exactly when it was before (its sample is
taken at half the bound, so the comparison at the bound sees no growth); one that does
is lost at :data:`MAX_BUSY_SILENCE` at the latest. Agents on other machines are judged
by their silence alone.
"""

from __future__ import annotations

#: Seconds of silence after which even an agent that keeps using CPU counts as lost
#: (a loop that spins without ever reaching its heartbeat).
MAX_BUSY_SILENCE = 60.0
#: CPU time (ns) an agent must have used since the last look to count as working.
MIN_PROGRESS_NS = 1_000_000


def main_thread_cpu_ns(pid: int) -> int | None:
    """Nanoseconds process ``pid``'s main thread has run on a CPU (None: unknown)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class BusyAgents:
    """Per host (by slot), the agent's CPU time at the last look while it was silent."""

    def __init__(self) -> None:
        self._cpu: dict[int, int] = {}

    def watch(self, slot: int, pid: int | None, silence: float, allowed: float) -> None:
        """Each supervision tick: take host ``slot``'s first sample once its silence
        passed half of ``allowed``; forget it once the host is heard again."""
        if pid is None or silence <= allowed / 2:
            self._cpu.pop(slot, None)
        elif slot not in self._cpu:
            cpu = main_thread_cpu_ns(pid)
            if cpu is not None:
                self._cpu[slot] = cpu

    def working(self, slot: int, pid: int | None, silence: float) -> bool:
        """Host ``slot``'s agent is silent past its bound: whether it ran since the last
        look (then it is given until the next one)."""
        before = self._cpu.get(slot)
        if pid is None or before is None or silence >= MAX_BUSY_SILENCE:
            return False
        now = main_thread_cpu_ns(pid)
        if now is None or now - before < MIN_PROGRESS_NS:
            return False
        self._cpu[slot] = now
        return True

    def forget(self, slot: int) -> None:
        """Host ``slot`` was lost, restarted or removed."""
        self._cpu.pop(slot, None)


__all__ = ["MAX_BUSY_SILENCE", "BusyAgents", "main_thread_cpu_ns"]
