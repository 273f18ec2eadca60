"""The ``ray`` backend: Ray only reserves the machines and starts the join command.

``%mesh NAME --backend ray --hosts H --gpus G [--address auto|ADDR]`` connects to a
running Ray cluster (never starts one), reserves one placement group per host, each of
one bundle (``{"GPU": G}`` on a cluster with GPUs, ``{"CPU": 1}`` otherwise), and starts
one small actor in each that runs the host agent (``python -m monarch_kernel.host --join
URL``, its token in the environment). From then on it is the join backend's code path.

The groups are placed one after another, each with a bundle label selector that
excludes the nodes the mesh's other hosts are on (``ray.io/node-id`` ``!in(...)``): each
host is on a node of its own, as one ``STRICT_SPREAD`` group would place them, but every
host's reservation can be freed alone, so a shrink gives the removed hosts' nodes back
to the cluster at once (:meth:`RayAllocation.release_machine`). The bundles are all the
same, so placing them greedily finds N nodes whenever N such nodes are free. A start
that cannot be placed within :func:`placement_timeout` (the ``ray_placement_timeout``
setting) removes the groups it placed.

Cleanup: releasing a host kills its actor and removes its group; the agent dies with
its actor (parent-death signal, ``MONARCH_KERNEL_PARENT_PID``) and the ranks with their
agent. If the kernel dies, Ray removes the actors and placement groups its driver owned,
and the agents also exit when the controller falls silent.

A ``--detachable`` mesh's groups and actors are detached instead (they outlive the
kernel) and each releases itself once its agent ends: see :mod:`.ray_agent`; the attach
file records each host's group and actor by name (:meth:`RayAllocation.reservation`).

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

from monarch_kernel import config
from monarch_kernel.launchers.base import HostConfig, address_towards
from monarch_kernel.launchers.engine import Allocation, EngineLauncher, JoinCommand
from monarch_kernel.launchers.ray_agent import AgentRunner
from monarch_kernel.launchers.reservation import Reservation

__all__ = ["NAMESPACE", "AgentRunner", "RayAllocation", "RayLauncher"]


def placement_timeout() -> float:
    """Seconds a start waits for its placement groups (all of them) before it fails,
    naming what is short: the configured ``ray_placement_timeout`` (default 30 s)."""
    return config.seconds(config.get("ray_placement_timeout"))


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
class _HostGroup:
    """One host's reservation: a one-bundle placement group on a node of its own, the
    agent actor in it, and what we know of that agent."""

    pg: Any
    name: str  #: the group's name
    node: str = ""  #: the Ray node (id) it is on
    actor: Any = None
    actor_name: str = ""
    status: str = "starting the agent actor"
    addr: str = ""
    failed: str | None = None
    #: Freed already (a shrink took its host, or the whole allocation was released).
    released: bool = False


class RayAllocation(Allocation):
    """One placement group and one agent actor per host (see the module docstring)."""

    def __init__(
        self,
        ray: ModuleType,
        groups: list[_HostGroup],
        refs: list[Any],
        label: str,
        mesh: str = "",
        kept: list[Reservation] | None = None,
    ):
        self._ray = ray
        self._groups = groups
        self._label = label
        #: The mesh it serves.
        self.mesh = mesh
        #: A detachable mesh's detached groups and actors, by name, one record per host
        #: (None: not detached).
        self.kept = kept
        self._released = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, args=(refs,), name="mk-ray-watch", daemon=True
        )
        self._thread.start()

    @property
    def nodes(self) -> frozenset[str]:
        """The Ray nodes (ids) its hosts still hold (a grow adds hosts elsewhere)."""
        return frozenset(g.node for g in self._groups if not g.released)

    def status(self, i: int) -> str:
        return self._groups[i].status

    def reservation(self, i: int = 0) -> Reservation | None:
        return self.kept[i] if self.kept is not None else None

    def failure(self) -> str | None:
        failed = [(g.name, g.failed) for g in self._groups if g.failed and not g.released]
        if not failed:
            return None
        return "\n".join(f"Ray placement group {name}: {why}" for name, why in failed)

    def _fail(self, group: _HostGroup, why: str) -> None:
        group.failed = group.failed or why
        group.status = why

    def _watch(self, refs: list[Any]) -> None:
        ray = self._ray
        for group, ref in zip(self._groups, refs):
            try:
                addr, hostname, pid = ray.get(ref, timeout=placement_timeout())
            except Exception as exc:  # the actor could not start (node lost, env broken)
                if not group.released:
                    self._fail(group, f"the agent actor failed to start: {exc}")
                continue
            group.addr = addr
            group.status = f"agent pid {pid} started on Ray node {addr} ({hostname}); joining"
        while not self._released.wait(POLL_INTERVAL) and ray.is_initialized():
            for group in self._groups:
                if group.failed or group.released:
                    continue
                try:
                    code, tail = ray.get(group.actor.poll.remote(), timeout=10)
                except Exception as exc:
                    if not (self._released.is_set() or group.released):
                        where = group.addr or "?"
                        self._fail(group, f"the agent actor on Ray node {where} died: {exc}")
                    continue
                if code is not None:
                    self._fail(group, f"the host agent exited with code {code}:\n{tail}".rstrip())

    def release_machine(self, i: int) -> None:
        """A shrink took host ``i``: stop its agent, kill its actor, remove its group
        (its node's resources are the cluster's again)."""
        group = self._groups[i]
        if group.released or self._released.is_set():
            return
        group.released = True
        self._free([group])

    def release(self) -> None:
        if self._released.is_set():
            return
        self._released.set()
        left = [g for g in self._groups if not g.released]
        for group in left:
            group.released = True
        self._free(left)

    def _free(self, groups: list[_HostGroup]) -> None:
        if self._ray.is_initialized():  # else Ray removed what this driver owned (and a
            # call now would start a local Ray instance)
            _free_groups(self._ray, groups)

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
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        hosts = len(configs)
        used = self._used_nodes(command.mesh) if min(command.hosts) > 0 else frozenset()
        if used:
            self._check_free_nodes(hosts, used)
        bundle = self._bundle(configs[0].ranks, hosts)
        label = f"mk-{command.mesh}-" + "-".join(str(h) for h in command.hosts)
        detached = command.keep > 0  # a detachable mesh's reservation outlives us
        lifetime = "detached" if detached else None
        # a detached group's name must be unique in the namespace (it outlives us)
        unique = f"-{time.time_ns() % 10**9:09d}" if detached else ""
        names = [f"mk-{command.mesh}-{h}{unique}" for h in command.hosts]
        groups = _place(ray, bundle, names, used, lifetime)
        runner = ray.remote(num_cpus=0, max_restarts=0)(AgentRunner)
        passthrough = {k: v for k in ("PYTHONPATH",) if (v := os.environ.get(k))}
        namespace = ray.get_runtime_context().namespace
        refs = []
        try:
            for i, group in enumerate(groups):
                group.actor_name = f"{group.name}-agent-{time.monotonic_ns()}"
                keeper = None
                if detached:  # its keeper removes the group once the agent ended
                    keeper = {"group": group.name, "namespace": namespace}
                    keeper["actors"] = [group.actor_name]
                group.actor = runner.options(
                    name=group.actor_name,
                    namespace=namespace,
                    lifetime=lifetime,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group.pg, placement_group_bundle_index=0
                    ),
                ).remote()
                env = {**passthrough, **command.env(i)}
                refs.append(group.actor.start.remote(command.argv, env, keeper))
        except BaseException:
            _free_groups(ray, groups)
            raise
        kept = None
        if detached:
            gcs = ray.get_runtime_context().gcs_address
            kept = [Reservation("ray", g.name, gcs, namespace, [g.actor_name]) for g in groups]
        return RayAllocation(ray, groups, refs, label, command.mesh, kept)


def _place(
    ray: ModuleType,
    bundle: dict[str, float],
    names: list[str],
    used: frozenset[str],
    lifetime: str | None,
) -> list[_HostGroup]:
    """One placement group of one ``bundle`` per name, placed one after another, each on
    a node that neither the ones before nor ``used`` (the mesh's other hosts) are on.
    ValueError, with every group placed so far removed, when one is not placed within
    :func:`placement_timeout` (all of them together)."""
    from ray.util.placement_group import placement_group

    limit = placement_timeout()
    deadline = time.monotonic() + limit
    taken = set(used)
    groups: list[_HostGroup] = []
    try:
        for name in names:
            selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(taken))})"}] if taken else None
            pg = placement_group(
                [dict(bundle)],
                strategy="PACK",
                name=name,
                lifetime=lifetime,
                bundle_label_selector=selector,
            )
            groups.append(_HostGroup(pg, name))
            left = max(1.0, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                raise ValueError(_not_placed(ray, bundle, len(names), len(groups) - 1, limit))
            placed = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
            groups[-1].node = str(next(iter(placed.values()), ""))
            taken.add(groups[-1].node)
    except BaseException:
        for group in groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group.pg)
        raise
    return groups


def _not_placed(
    ray: ModuleType, bundle: dict[str, float], hosts: int, placed: int, limit: float
) -> str:
    """Why a start failed: ``placed`` of ``hosts`` groups were placed in time, and what
    the cluster would have free once they are removed again."""
    free = dict(ray.available_resources())
    for key, amount in bundle.items():  # ours, placed, go back
        free[key] = free.get(key, 0.0) + amount * placed
    return (
        f"Ray could not place {hosts} x {bundle} (one host per node) within "
        f"{limit:g}s: {placed} placed, no node with room for the next one "
        "that the mesh does not use yet; free in the cluster now: "
        + ", ".join(f"{k}={v:g}" for k, v in sorted(free.items()) if "_group_" not in k)
    )


def _free_groups(ray: ModuleType, groups: list[_HostGroup]) -> None:
    """Stop the agents of ``groups`` (all at once), kill their actors, remove the groups."""
    actors = [g.actor for g in groups if g.actor is not None]
    with contextlib.suppress(Exception):  # a node is gone, or an actor: kill anyway
        ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=5)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for group in groups:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(group.pg)
