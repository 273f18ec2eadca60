"""Actor classes used by the tests (importable by ranks through sys.path)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from monarch_kernel.actor import Actor, current_rank, current_size, endpoint


class Counter(Actor):
    def __init__(self, start: int = 0):
        self.v = start
        self.log: list[int] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.v += by
        return self.v

    @endpoint
    def value(self) -> int:
        return self.v

    @endpoint
    def record(self, i: int, payload=None) -> None:
        self.log.append(i)

    @endpoint
    def get_log(self) -> list[int]:
        return self.log

    @endpoint
    def hold_while(self, path: str) -> None:
        """Keeps this actor busy (its later calls wait in its line) while ``path`` exists."""
        print(f"holding while {path} exists", flush=True)
        while os.path.exists(path):
            time.sleep(0.01)


class Worker(Actor):
    @endpoint
    def whoami(self) -> dict:
        p = current_rank()
        return {
            "coords": dict(p),
            "rank": p.rank,
            "size": current_size(),
            "pid": os.getpid(),
            "env": {
                k: os.environ.get(k)
                for k in (
                    "RANK",
                    "LOCAL_RANK",
                    "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE",
                    "GROUP_RANK",
                    "TORCHELASTIC_RUN_ID",
                    "MASTER_PORT",
                )
            },
        }

    @endpoint
    def say(self, text: str) -> None:
        print(f"{text} from {current_rank().rank}")

    @endpoint
    def say_fd(self, text: str) -> None:
        os.write(1, f"{text} via fd\n".encode())
        os.write(2, f"{text} via fd2\n".encode())

    @endpoint
    def fail_on(self, ranks: list[int]) -> int:
        if current_rank().rank in ranks:
            shape_hint = [1, 2, 3]  # noqa: F841 - shows up in the error report
            raise ValueError(f"bad input on rank {current_rank().rank % 1}")
        return current_rank().rank

    @endpoint
    def tensor_fail(self):
        import torch

        a = torch.ones(2, 3)
        b = torch.ones(4, 5)
        return a @ b

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def checksum(self, t) -> float:
        return float(t.double().sum())

    @endpoint
    def make_tensor(self, n: int):
        import torch

        return torch.arange(n, dtype=torch.float32)

    @endpoint
    def unpicklable(self):
        return threading.Lock()

    @endpoint
    def sleep(self, seconds: float, note: str = "") -> str:
        # The line tells a test that the call has started on this rank.
        print(f"sleeping {note}".rstrip(), flush=True)
        time.sleep(seconds)
        return "slept"

    @endpoint
    def die(self, how: str) -> None:
        print(f"about to die by {how}")
        sys_stdout_flush()
        if how == "exit":
            os._exit(7)
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
        if how == "kill":
            os.kill(os.getpid(), 9)

    @endpoint
    def exit_silently(self) -> None:
        os._exit(3)  # silently

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def sys_stdout_flush() -> None:
    import sys

    sys.stdout.flush()


class AsyncActor(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    async def bump(self, delay: float = 0.0) -> int:
        await asyncio.sleep(delay)
        self.n += 1
        return self.n


class BadInit(Actor):
    def __init__(self, fail_rank: int):
        if current_rank().rank == fail_rank:
            raise RuntimeError("constructor refused")

    @endpoint
    def ok(self) -> int:
        return current_rank().rank


class DataActor(Actor):
    """Shares tensors and pulls them from other ranks over the data plane."""

    def __init__(self):
        self.kept = {}

    @endpoint
    def share_arange(self, n: int):
        import torch

        import monarch_kernel

        t = torch.arange(n, dtype=torch.float32) + current_rank().rank
        return monarch_kernel.share(t)

    @endpoint
    def pull(self, ref, transport: str = "auto") -> tuple[float, list[int]]:
        t = ref.get(transport)
        return float(t.double().sum()), list(t.shape)

    @endpoint
    def counters(self) -> dict:
        from monarch_kernel.rank.dataplane.plane import counters

        return counters()

    @endpoint
    def release(self, ref) -> None:
        ref.release()


class ShmWriter(Actor):
    """Pulls a shared tensor through shared memory and writes to its copy."""

    @endpoint
    def pull_and_bump(self, ref) -> float:
        t = ref.get("shm")
        t += 1  # a private copy-on-write mapping: the owner's data must not change
        return float(t.double().sum())


class Batched(Actor):
    """Records what it is sent, and says how its rank's inbox received it (how many wire
    messages, how many calls came inside ``batch`` messages)."""

    def __init__(self) -> None:
        self.log: list[int] = []

    @endpoint
    def record(self, i: int) -> None:
        self.log.append(i)

    @endpoint
    def shout(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    def record_blob(self, i: int, blob: object) -> None:
        """Records ``i`` (``blob``: a large argument, to send the call another way)."""
        self.log.append(i)

    @endpoint
    def blob(self, n: int) -> bytes:
        """A large result of ``n`` bytes, not all alike."""
        return bytes(range(256)) * (n // 256) + b"!" * (n % 256)

    @endpoint
    def get_log(self) -> list[int]:
        log, self.log = self.log, []
        return log

    @endpoint
    def inbox_counts(self) -> dict[str, int]:
        from monarch_kernel.rank.inbox import inbox_counts

        return dict(inbox_counts)


class HeldAtInit(Actor):
    """Its constructor waits while the file ``hold`` exists (after creating ``hold``
    + ``.entered``): a restart that re-creates it stays in that step until the test
    lets it go."""

    def __init__(self, hold: str):
        if os.path.exists(hold):
            open(hold + ".entered", "w").close()
            while os.path.exists(hold):
                time.sleep(0.01)

    @endpoint
    def pid(self) -> int:
        return os.getpid()
