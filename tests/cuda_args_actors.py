"""Actors of ``tests/test_cuda_args.py``: a rank that calls another rank of its machine
with large tensors, and the one it calls, both with host shared memory in CUDA's place
(``tests/ipc_host_memory.py``: to the data plane a CPU tensor is then "on the device")."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from monarch_kernel.actor import Actor, endpoint

MiB = 1 << 20
BIG = MiB // 4 + 8  # float32 values: just over 1 MiB (cuda_args.MIN_BYTES)
#: What the other side sees of the tensors sent by both test modules (but ``big``,
#: which each sets its own way): (sum, requires_grad, type, shape) per key.
SEEN = {
    "param": (float(BIG), True, "Parameter", (BIG,)),
    "grad": (2.0 * BIG, True, "Tensor", (BIG,)),
    "strided": (float(BIG), False, "Tensor", (BIG,)),
    "small": (16.0, False, "Tensor", (16,)),
}
HANDLES = 4  # every tensor but the small one goes as a handle


def sample_value() -> dict[str, Any]:
    """A big tensor, a big Parameter, a big tensor that requires grad, a strided view and
    a small tensor (what the receiver sees of them: ``SEEN``, and ``big``'s sum)."""
    return {
        "big": torch.arange(BIG, dtype=torch.float32),
        "param": torch.nn.Parameter(torch.ones(BIG)),
        "grad": torch.full((BIG,), 2.0, requires_grad=True),
        "strided": torch.ones(2 * BIG)[::2],
        "small": torch.ones(16),
    }


def _not_here() -> None:
    raise RuntimeError("this value cannot be unpickled on the receiver")


class NotHere:
    """Pickles anywhere, unpickles nowhere."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _not_here, ()


class Taker(Actor):
    """A receiver in the notebook's own process (``this_proc()``): no device change there."""

    @endpoint
    def take(self, value: Any) -> dict[str, Any]:
        return {k: (float(v.detach().sum()), tuple(v.shape)) for k, v in value.items()}


class ArgPeer(Actor):
    def __init__(self) -> None:
        from ipc_host_memory import HostMemory

        from monarch_kernel.rank.dataplane import cuda_ipc

        cuda_ipc.device = HostMemory()

    # -- the receiver -------------------------------------------------------------------
    @endpoint
    def take(self, value: Any) -> dict[str, Any]:
        """What arrived: per key, the sum, requires_grad and whether it is a Parameter."""
        return {
            k: (float(v.detach().sum()), v.requires_grad, type(v).__name__, tuple(v.shape))
            for k, v in value.items()
        }

    @endpoint
    def take_and_fail(self, value: Any) -> None:
        raise ValueError(f"refused {len(value)} tensors")

    @endpoint
    def take_and_die(self, value: Any) -> None:
        os._exit(3)

    @endpoint
    def take_and_wait(self, value: Any, path: str) -> float:
        """Hold this actor until ``path`` exists (at most a minute), then answer."""
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return float(value["big"].sum())

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    # -- the caller ---------------------------------------------------------------------
    @endpoint
    def send(self, other: Any, how: str) -> dict[str, Any]:
        """Call ``other`` (an actor mesh of ArgPeer on one rank) ``how``, with a big
        tensor (changed in place right after the call is sent: the receiver must see it as
        it was), a big Parameter, a big tensor that requires grad, a strided view, a
        small tensor; then say what the receiver saw and what this rank's data plane
        did."""
        from monarch_kernel.rank.dataplane.common import counters_
        from monarch_kernel.rank.dataplane.plane import server

        value = sample_value()
        big = value["big"]
        before = counters_["ipc_arguments"]
        shared_before = len(server().tensors)
        if how == "call_one":
            future = other.take.call_one(value)
        elif how == "notebook":
            future = other.take.call_one({"big": value["big"], "small": value["small"]})
        elif how == "call":
            future = other.take.call(value)
        elif how == "choose":
            future = other.take.choose(value)
        elif how == "stream":
            future = next(iter(other.take.stream(value)))
        elif how == "broadcast":
            other.take.broadcast(value)
            other.pid.call_one().get(timeout=60)  # in order after it: it has been run
            future = None
        elif how == "unread":  # the receiver fails to unpickle before it reaches the tensors
            future = other.take.call_one({"first": NotHere(), **value})
        elif how == "fails":
            future = other.take_and_fail.call_one(value)
        elif how == "dies":
            future = other.take_and_die.call_one(value)
        else:
            raise ValueError(how)
        big.add_(1.0)  # after the call was sent: not what the receiver must see
        sent = counters_["ipc_arguments"] - before
        seen: Any = None
        if future is not None:
            try:
                seen = future.get(timeout=60)
            except Exception as exc:
                seen = f"{type(exc).__name__}: {exc}"
            if how == "call" and not isinstance(seen, str):
                seen = seen.values()[0]
        deadline = time.monotonic() + 30
        while len(server().tensors) > shared_before and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"seen": seen, "handles": sent, "left": len(server().tensors) - shared_before}

    @endpoint
    def send_while_running(self, other: Any, path: str) -> dict[str, Any]:
        """Call ``other.take_and_wait``: is the copy dropped while the endpoint still
        runs (its receiver said it has it)? Then let it finish."""
        from monarch_kernel.rank.dataplane.plane import server

        shared_before = len(server().tensors)
        future = other.take_and_wait.call_one({"big": torch.ones(BIG)}, path)
        deadline = time.monotonic() + 30
        while len(server().tensors) > shared_before and time.monotonic() < deadline:
            time.sleep(0.02)
        dropped = len(server().tensors) == shared_before
        running = not future.done()
        with open(path, "w"):
            pass
        return {"dropped": dropped, "running": running, "seen": future.get(timeout=60)}

    @endpoint
    def bytes_in(self) -> int:
        from monarch_kernel.rank.dataplane.common import counters_

        return counters_["bytes_in"]
