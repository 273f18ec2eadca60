"""Actor classes of the Monarch-parity tests (importable by ranks through sys.path)."""

from __future__ import annotations

import os
from typing import Any

from monarch_kernel.actor import Actor, current_rank, endpoint
from monarch_kernel.actor import concurrent_endpoint as endpoint_concurrent


class Generator(Actor):
    """Produces values; asks its trainer for weights (calls back across meshes)."""

    def __init__(self) -> None:
        self.version = 0
        self.trainer: Any = None

    @endpoint
    def attach(self, trainer) -> str:
        self.trainer = trainer
        # The same mesh class as in the notebook, over the rank-side requester.
        return f"{type(trainer).__name__}/{type(trainer._requester).__name__}"

    @endpoint
    def generate(self, x: int) -> dict:
        return {"rank": current_rank().rank, "pid": os.getpid(), "y": x * 10 + self.version}

    @endpoint
    def refresh(self) -> int:
        self.version = self.trainer.weights_version.call_one().get()
        return self.version

    @endpoint
    def fail(self, msg: str) -> None:
        try:
            raise KeyError(msg)
        except KeyError as exc:
            raise ValueError("generation failed") from exc

    @endpoint
    def crash(self) -> None:
        os._exit(7)

    @endpoint
    def share_ones(self, n: int):
        import torch

        import monarch_kernel

        self.kept = torch.ones(n)
        return monarch_kernel.share(self.kept)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class AsyncTrainer(Actor):
    """Awaits its generators (an actor's endpoints are all sync or all async)."""

    def __init__(self, generators) -> None:
        self.generators = generators

    @endpoint
    async def step_async(self, x: int) -> list:
        vm = await self.generators.generate.call(x)
        return [v["y"] for v in vm.values()]


class Trainer(Actor):
    """Holds generators (an ActorMesh given to its constructor) and drives them."""

    def __init__(self, generators) -> None:
        self.generators = generators
        self.version = 1

    @endpoint
    def weights_version(self) -> int:
        return self.version

    @endpoint
    def step(self, x: int) -> list:
        self.version += 1
        return [v["y"] for v in self.generators.generate.call(x).get().values()]

    @endpoint
    def one(self, x: int) -> dict:
        return self.generators.slice(gpus=1).generate.call_one(x).get()

    @endpoint
    def stream(self, x: int) -> list:
        return sorted(f.get()["y"] for f in self.generators.generate.stream(x))

    @endpoint
    def choose(self, x: int) -> int:
        return self.generators.generate.choose(x).get()["y"]

    @endpoint
    def broadcast(self) -> None:
        self.generators.refresh.broadcast()

    @endpoint
    def wire_back(self, me) -> list:
        """Give the generators a reference to ``me`` (this trainer mesh) and make
        them call back into it."""
        return self.generators.attach.call(me).get().values()

    @endpoint
    def refresh_all(self) -> list:
        return self.generators.refresh.call().get().values()

    @endpoint
    def failing(self) -> str:
        try:
            self.generators.fail.call("boom").get()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    @endpoint
    def call_crashing(self) -> str:
        try:
            self.generators.slice(gpus=0).crash.call_one().get(timeout=10)
        except Exception as exc:
            return type(exc).__name__
        return "no error"

    @endpoint
    def spawn_on(self, procs) -> list:
        helpers = procs.spawn("helpers", Generator)
        out = helpers.generate.call(1).get().values()
        helpers.stop().get()
        return [v["y"] for v in out]

    @endpoint
    def pull_weights(self, n: int, transport: str = "auto") -> float:
        """Rank-to-rank tensor across meshes: a generator shares, this trainer pulls."""
        ref = self.generators.slice(gpus=0).share_ones.call_one(n).get()
        return float(ref.get(transport).sum())

    @endpoint
    def dims(self) -> dict:
        g = self.generators
        return {"len": len(g), "size": g.size(), "extent": g.extent}

    @endpoint
    def ping_pong(self, n: int) -> int:
        total = 0
        gen = self.generators.slice(gpus=0)
        for i in range(n):
            total += gen.generate.call_one(i).get()["y"]
        return total


class Introspect(Actor):
    """context(), current_actor_name(), this_proc(), explicit response ports."""

    def __init__(self, start: int = 0) -> None:
        from monarch_kernel.actor import current_actor_name

        self.born_as = current_actor_name()
        self.v = start

    @endpoint
    def who(self) -> dict:
        from monarch_kernel.actor import context, current_actor_name

        ctx = context()
        return {
            "name": current_actor_name(),
            "born_as": self.born_as,
            "rank": ctx.actor_instance.rank.rank,
            "message_rank": dict(ctx.message_rank),
        }

    @endpoint
    def value(self) -> int:
        return self.v

    @endpoint
    def child(self) -> list:
        """Spawn a child on this very process and call it (inline, no deadlock)."""
        from monarch_kernel.actor import this_proc

        kid = this_proc().spawn("kid", Introspect, 41)
        v = kid.value.call_one().get()
        vm = kid.value.call().get()
        return [v, vm.values(), os.getpid() == kid.pid_of.call_one().get()]

    @endpoint
    def pid_of(self) -> int:
        return os.getpid()

    @endpoint(explicit_response_port=True)
    def later(self, port, x: int) -> None:
        import threading
        import time

        def answer() -> None:
            time.sleep(0.05)
            if x < 0:
                port.exception(ValueError(f"negative: {x}"))
            else:
                port.send(x * 2)

        threading.Thread(target=answer).start()

    @endpoint
    def send_to(self, port, n: int) -> None:
        for i in range(n):
            port.send((current_rank().rank, i))


class Supervisor(Actor):
    """A level of a supervision tree: owns the child mesh it spawns on given procs."""

    def __init__(self, handles: bool) -> None:
        self.handles = handles
        self.seen: list[dict] = []
        self.child: Any = None

    def __supervise__(self, failure) -> bool:
        self.seen.append(
            {
                "actor": failure.actor_name,
                "type": failure.failure.get("type"),
                "mesh": failure.mesh_name,
                "message": failure.failure["message"],
                "path": list(failure.path),
            }
        )
        return self.handles

    @endpoint
    def spawn_child(self, procs, handles: bool, grand_procs=None, grand_handles=False) -> str:
        self.child = procs.spawn("sup_child", Supervisor, handles)
        if grand_procs is not None:
            self.child.spawn_child.call(grand_procs, grand_handles).get()
        return "ok"

    @endpoint
    def stop_child(self) -> str:
        self.child.stop().get(timeout=30)
        return "stopped"

    @endpoint
    def break_child(self) -> None:
        self.child.boom.broadcast()  # nobody waits: the failure goes to supervision

    @endpoint
    def break_grandchild(self) -> None:
        self.child.break_child.call().get()

    @endpoint
    def boom(self) -> None:
        raise RuntimeError("leaf failed")

    @endpoint
    def die(self) -> None:
        os._exit(9)

    @endpoint
    def kill_child(self) -> None:
        self.child.die.broadcast()

    @endpoint
    def spawn_bad(self, procs) -> str:
        bad = procs.spawn("bad_child", BadChild)  # returns, as Monarch's
        try:
            bad.ping.call().get()
        except Exception as exc:
            return type(exc).__name__
        return "called"

    @endpoint
    def seen_failures(self) -> list:
        return self.seen

    @endpoint
    def child_seen(self) -> list:
        return self.child.seen_failures.call().get().values()


class Concurrent(Actor):
    """Concurrent endpoints: a later call finishes while an earlier one still awaits."""

    def __init__(self) -> None:
        import asyncio

        self.gate: asyncio.Event | None = None
        self.asyncio = asyncio

    @endpoint_concurrent
    async def wait_gate(self) -> str:
        if self.gate is None:
            self.gate = self.asyncio.Event()
        await self.gate.wait()
        return "released"

    @endpoint_concurrent
    async def open_gate(self) -> str:
        while self.gate is None:
            await self.asyncio.sleep(0.01)
        self.gate.set()
        return "opened"

    @endpoint_concurrent
    async def fails(self) -> None:
        raise ValueError("async boom")


class BadChild(Actor):
    def __init__(self) -> None:
        raise OSError("no such dataset")

    @endpoint
    def ping(self) -> None: ...


class Stopper(Actor):
    @endpoint
    def stop_mesh(self, procs) -> str:
        procs.stop().get(timeout=30)
        return "stopped"


class PingPong(Actor):
    """Monarch's ping-pong pattern: async endpoints, each mesh holds the other, and a
    rank talks to the rank at its own coordinates (``slice(**current_rank())``)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.got: list[str] = []

    @endpoint
    async def init(self, other) -> None:
        self.peer = other.slice(**current_rank())
        self.me = current_rank().rank

    @endpoint
    async def send(self, msg: str) -> None:
        await self.peer.recv.call(f"{self.label}:{self.me} says {msg}")

    @endpoint
    async def recv(self, msg: str) -> None:
        self.got.append(msg)

    @endpoint
    async def received(self) -> list:
        return self.got


class Relay(Actor):
    """Bounces a message between two meshes, each hop awaiting the next: the chain only
    ends if a rank keeps serving calls while its endpoint awaits."""

    def __init__(self) -> None:
        self.mine = None
        self.count = 0

    @endpoint
    async def remember(self, mine) -> None:
        self.mine = mine

    @endpoint
    async def bounce(self, ttl: int, back) -> None:
        self.count += 1
        if ttl:
            await back.bounce.call(ttl - 1, self.mine)

    @endpoint
    async def seen(self) -> int:
        return self.count


class Registry(Actor):
    """A singleton that actors look up with get_or_spawn_controller."""

    def __init__(self) -> None:
        self.items: list = []

    @endpoint
    def add(self, item) -> list:
        self.items.append(item)
        return list(self.items)


class Registrant(Actor):
    @endpoint
    def register(self) -> list:
        from monarch_kernel.actor import get_or_spawn_controller

        registry = get_or_spawn_controller("registry", Registry).get()
        return registry.add.call_one(current_rank().rank).get()
