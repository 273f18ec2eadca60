"""Actor classes of tests/test_parity_api.py (importable by ranks through sys.path)."""

from __future__ import annotations

import os
from typing import Any

from monarch_kernel.actor import Actor, Channel, Port, current_rank, endpoint


class Sender(Actor):
    """Sends to ports it is given; opens ranked channels of its own."""

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def send_values(self, port: Port[int], n: int) -> None:
        """``n`` values, ``100 * global rank + i``, to ``port``."""
        for i in range(n):
            port.send(100 * current_rank().rank + i)

    @endpoint
    def fail_to(self, port: Port[int], msg: str) -> None:
        port.exception(ValueError(msg))

    @endpoint
    def collect_ranked(self, peers: Any, n: int) -> list[tuple[int, int]]:
        """Open a ranked channel on this rank, have ``peers`` send to it, return what
        arrived (sorted)."""
        port, receiver = Channel[int].open_ranked()
        peers.send_values.call(port, 1).get()
        return sorted(receiver.recv().get(timeout=10) for _ in range(n))
