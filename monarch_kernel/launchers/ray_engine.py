"""The ``ray`` backend: Ray only reserves the machines and starts the join command.

``%mesh NAME --backend ray --hosts H --gpus G [--address auto|ADDR]`` connects to a
running Ray cluster (never starts one), reserves a placement group with one bundle per
host (``{"GPU": G}`` on a cluster with GPUs, ``{"CPU": 1}`` otherwise; ``STRICT_SPREAD``
so each host is its own node, ``PACK`` for one host), and starts one small actor per
bundle that runs the host agent (``python -m monarch_kernel.host --join URL``, its
token in the environment). From then on it is the join backend's code path.

Cleanup: releasing the allocation kills the actors and removes the placement group; the
agent dies with its actor (parent-death signal, ``MONARCH_KERNEL_PARENT_PID``) and the
ranks with their agent. If the kernel dies, Ray removes the actors and placement groups
its driver owned, and the agents also exit when the controller falls silent.

A ``--detachable`` mesh's group and actors are detached instead (they outlive the
kernel) and release themselves once the mesh's agents end: see :mod:`.ray_agent`; the
attach file records their names (:meth:`RayAllocation.reservation`).

Ray is an optional extra (``pip install monarch_kernel[ray]``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from monarch_kernel.launchers.base import HostConfig, address_towards
from monarch_kernel.launchers.engine import Allocation, EngineLauncher, JoinCommand
from monarch_kernel.launchers.ray_agent import AgentRunner
from monarch_kernel.launchers.reservation import Reservation

__all__ = ["NAMESPACE", "AgentRunner", "RayAllocation", "RayLauncher"]

#: Seconds to wait for the placement group before the start fails, naming what is short.
PLACEMENT_TIMEOUT = 30.0
#: Seconds between polls of the actors (exit codes, a lost node).
POLL_INTERVAL = 1.0
#: Ray namespace of our actors and placement groups.
NAMESPACE = "monarch_kernel"
#: The label every Ray node has: its id (bundle label selectors can exclude nodes by it).
NODE_ID_LABEL = "ray.io/node-id"


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "the ray backend needs Ray: pip install 'monarch_kernel[ray]' (or pip install ray)"
        ) from None
    return ray


def _probe(address: str, timeout: float = 3.0) -> None:
    """Fail fast when nothing listens at a ``HOST:PORT`` address (``ray.init`` would
    retry for minutes)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ValueError(
            f"no Ray cluster at {address!r} ({exc.strerror or exc}); start one with "
            "`ray start --head` or pass --address HOST:PORT (the head's GCS address)"
        ) from None


@dataclass
class _Machine:
    """What we know of one bundle's agent."""

    status: str = "placing"
    addr: str = ""
    failed: str | None = None


class RayAllocation(Allocation):
    """A placement group and one agent actor per bundle."""

    def __init__(
        self,
        ray: ModuleType,
        pg: Any,
        actors: list[Any],
        refs: list[Any],
        label: str,
        mesh: str = "",
        nodes: frozenset[str] = frozenset(),
        kept: Reservation | None = None,
    ):
        self._ray = ray
        self._pg = pg
        self._actors = actors
        self._label = label
        #: The mesh it serves and the Ray nodes (ids) its bundles are on.
        self.mesh = mesh
        self.nodes = nodes
        #: A detachable mesh's detached group and actors, by name (None: not detached).
        self.kept = kept
        self._machines = [_Machine("starting the agent actor") for _ in actors]
        self._released = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(refs,), name="mk-ray-watch", daemon=True
        )
        self._thread.start()

    def status(self, i: int) -> str:
        return self._machines[i].status

    def reservation(self) -> Reservation | None:
        return self.kept

    def failure(self) -> str | None:
        failed = [(i, m.failed) for i, m in enumerate(self._machines) if m.failed]
        if not failed:
            return None
        return "\n".join(f"Ray bundle {i}: {why}" for i, why in failed)

    def _fail(self, i: int, why: str) -> None:
        m = self._machines[i]
        m.failed = m.failed or why
        m.status = why

    def _watch(self, refs: list[Any]) -> None:
        ray = self._ray
        for i, ref in enumerate(refs):
            try:
                addr, hostname, pid = ray.get(ref, timeout=PLACEMENT_TIMEOUT)
            except Exception as exc:  # the actor could not start (node lost, env broken)
                self._fail(i, f"the agent actor failed to start: {exc}")
                continue
            m = self._machines[i]
            m.addr = addr
            m.status = f"agent pid {pid} started on Ray node {addr} ({hostname}); joining"
        while not self._released.wait(POLL_INTERVAL) and ray.is_initialized():
            for i, actor in enumerate(self._actors):
                if self._machines[i].failed:
                    continue
                try:
                    code, tail = ray.get(actor.poll.remote(), timeout=10)
                except Exception as exc:
                    if not self._released.is_set():
                        where = self._machines[i].addr or "?"
                        self._fail(i, f"the agent actor on Ray node {where} died: {exc}")
                    continue
                if code is not None:
                    self._fail(i, f"the host agent exited with code {code}:\n{tail}".rstrip())

    def release(self) -> None:
        if self._released.is_set():
            return
        self._released.set()
        ray = self._ray
        if not ray.is_initialized():
            return  # disconnected: Ray removed what this driver owned (and a call now
            # would start a local Ray instance)
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=5)
            except Exception:
                pass  # the node is gone, or the actor is: kill it anyway
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self._pg)

    def __repr__(self) -> str:
        return f"RayAllocation({self._label})"


@dataclass
class RayLauncher(EngineLauncher):
    """Reserves hosts on a running Ray cluster (see the module docstring)."""

    address: str | None = None
    name: str = "ray"
    per_host_tokens: bool = True

    def __post_init__(self) -> None:
        self.ray = self._connect()
        if self.advertise is None and self.bind in ("0.0.0.0", "*", "::", ""):
            # The nodes most likely reach us the way we reach the head node.
            head = self.ray.get_runtime_context().gcs_address.rpartition(":")[0]
            self.advertise = address_towards(head)
        super().__post_init__()

    def _connect(self) -> ModuleType:
        ray = _ray()
        address = self.address or os.environ.get("RAY_ADDRESS") or "auto"
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if address != "auto" and address.removeprefix("ray://") != current:
                raise ValueError(
                    f"this kernel is connected to the Ray cluster at {current}; it cannot "
                    f"also use {address!r} (restart the kernel to switch clusters)"
                )
            return ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        _probe(address)
        try:
            # Never start a cluster here: "auto" finds a running one or fails.
            ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=False,
            )
        except Exception as exc:  # ConnectionError, or a RuntimeError naming the address
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"no Ray cluster at {address!r} ({first}); start one with `ray start --head` "
                "or pass --address HOST:PORT (the head's GCS address)"
            ) from None
        return ray

    def _nodes(self) -> list[dict[str, float]]:
        return [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]

    def _bundle(self, gpus: int, hosts: int) -> dict[str, float]:
        """The resources one host reserves; a clear error when no node can hold them."""
        nodes = self._nodes()
        if len(nodes) < hosts:
            raise ValueError(
                f"--hosts {hosts} needs {hosts} Ray nodes (one host per node) but the cluster "
                f"has {len(nodes)} alive; add nodes (ray start --address ...) or ask for fewer"
            )
        most = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
        if most == 0:
            return {"CPU": 1.0}  # a CPU cluster: the agent's ranks are ordinary processes
        if gpus > most:
            raise ValueError(
                f"--gpus {gpus} per host is more than any Ray node has (at most {most:g} GPUs); "
                "ask for fewer GPUs per host and more hosts"
            )
        return {"GPU": float(gpus)}

    def _used_nodes(self, mesh: str) -> frozenset[str]:
        """The Ray nodes that hold hosts of ``mesh`` already (a grow adds hosts)."""
        with self._lock:
            allocs = [a for a in self._holders if isinstance(a, RayAllocation)]
        return frozenset().union(*(a.nodes for a in allocs if a.mesh == mesh))

    def _check_free_nodes(self, hosts: int, used: frozenset[str]) -> None:
        """A grow's new hosts each need a node none of the mesh's hosts is on."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        free = [n for n in alive if n["NodeID"] not in used]
        if len(free) < hosts:
            raise ValueError(
                f"{hosts} more host(s) need {hosts} Ray node(s) this mesh does not use yet "
                f"(one host per node), but {len(used)} of the cluster's {len(alive)} alive "
                f"nodes hold its hosts and {len(free)} are left; add nodes to the cluster "
                "(ray start --address ...) or grow by fewer hosts"
            )

    def allocate(self, command: JoinCommand, configs: list[HostConfig]) -> Allocation:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        hosts = len(configs)
        used = self._used_nodes(command.mesh) if min(command.hosts) > 0 else frozenset()
        if used:
            self._check_free_nodes(hosts, used)
        bundle = self._bundle(configs[0].ranks, hosts)
        label = f"mk-{command.mesh}-" + "-".join(str(h) for h in command.hosts)
        strategy = "STRICT_SPREAD" if hosts > 1 else "PACK"
        # New hosts of a mesh that grows go on nodes none of its hosts is on yet.
        selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(used))})"}] * hosts if used else None
        detached = command.keep > 0  # a detachable mesh's reservation outlives us
        lifetime = "detached" if detached else None
        if detached:  # the group's name must be unique in the namespace
            label += f"-{time.time_ns() % 10**9:09d}"
        pg = placement_group(
            [dict(bundle) for _ in range(hosts)],
            strategy=strategy,
            name=label,
            lifetime=lifetime,
            bundle_label_selector=selector,
        )
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT)
        if not ready:
            ray.util.remove_placement_group(pg)
            free = ray.available_resources()
            raise ValueError(
                f"Ray could not place {hosts} x {bundle} ({strategy}) within "
                f"{PLACEMENT_TIMEOUT:.0f}s; free in the cluster now: "
                + ", ".join(f"{k}={v:g}" for k, v in sorted(free.items()) if "_group_" not in k)
            )
        runner = ray.remote(num_cpus=0, max_restarts=0)(AgentRunner)
        passthrough = {k: v for k in ("PYTHONPATH",) if (v := os.environ.get(k))}
        namespace = ray.get_runtime_context().namespace
        names = [f"{label}-{i}-{time.monotonic_ns()}" for i in range(hosts)]
        kept = None
        if detached:
            gcs = ray.get_runtime_context().gcs_address
            kept = Reservation("ray", label, gcs, namespace, names)
        keeper = {"group": label, "namespace": namespace, "actors": names} if detached else None
        actors, refs = [], []
        for i in range(hosts):
            actor = runner.options(
                name=names[i],
                namespace=namespace,
                lifetime=lifetime,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i
                ),
            ).remote()
            actors.append(actor)
            env = {**passthrough, **command.env(i)}
            refs.append(actor.start.remote(command.argv, env, keeper))
        placed = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        nodes = frozenset(str(n) for n in placed.values())
        return RayAllocation(ray, pg, actors, refs, label, command.mesh, nodes, kept)
