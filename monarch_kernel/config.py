"""Process-wide configuration (Monarch's ``monarch.config``): ``configure(**keys)``,
the ``configured(**keys)`` context manager, ``get_global_config()``.

Keys monarch_kernel acts on:

- ``host_meshes``: ``{name: {"hosts": N, "backend": "local" | "slurm" | ..., **options}}``,
  what :func:`monarch_kernel.actor.hosts_from_config` gives for ``name`` (default: two
  emulated local hosts, as Monarch's).
- ``host_spawn_ready_timeout``: how long ``spawn_procs`` waits for its ranks (a number of
  seconds or a humantime string such as ``"2m"``; default ``"120s"``).
- ``ray_placement_timeout``: how long a Ray mesh's start waits for its placement groups
  (all of them together; default ``"30s"``); then a ValueError naming what the cluster
  has free, with the groups placed so far removed again.
- ``actor_spawn_max_idle``: how long an actor's constructor may run (Monarch's key and
  default, ``"30s"``), timed on its rank from its start; then the actor fails as in
  Monarch (``spawn()`` returns, its supervision hears of it, calls to it raise
  ``SupervisionError`` saying so) and the rank's other work goes on.
- ``max_value_size``: the largest value one message carries (``%push``/``%pull``, an
  endpoint's arguments or result, a cell's result), in bytes or with a K, M, G, T suffix
  (``"16G"``); default half of the machine's memory. Set in this process's environment
  as ``MONARCH_KERNEL_MAX_VALUE`` (what :mod:`monarch_kernel.wire.limits` reads), so that
  meshes started afterwards on this machine inherit it; give other machines the same
  with ``--env MONARCH_KERNEL_MAX_VALUE=16G``. A larger value fails with an error naming
  the bound.

Monarch's other keys (transports, log forwarding, message acks, RDMA tuning ...) are
accepted and kept, so Monarch code that sets them runs, but they have no effect here
(rank output always streams to the cell that caused it; the transport is ZeroMQ). A key
neither knows is a ValueError naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from monarch_kernel.wire.limits import MAX_VALUE_ENV, parse_size

#: Monarch's ``monarch._src.actor.config.prefix_python_logs_with_actor``: ``logging``
#: records of code an actor runs start with ``[actor=<its instance>] ``
#: (``rank.actor_logs``). Per process, as Monarch's: set it where the actors run.
prefix_python_logs_with_actor = True

#: Keys we act on, with their defaults (``max_value_size``: None, the wire's default).
DEFAULTS: dict[str, Any] = {
    "host_meshes": {},
    "host_spawn_ready_timeout": "120s",
    "actor_spawn_max_idle": "30s",
    "ray_placement_timeout": "30s",
    "max_value_size": None,
}

#: Monarch's configuration keys (``monarch.config.configure``'s documented ones): taken
#: and kept, without effect here.
MONARCH_KEYS = frozenset(
    [
        "default_transport",
        "enable_log_forwarding",
        "enable_file_capture",
        "tail_log_lines",
        "codec_max_frame_length",
        "message_delivery_timeout",
        "mesh_proc_spawn_max_idle",
        "process_exit_timeout",
        "message_ack_time_interval",
        "message_ack_every_n_messages",
        "message_ttl_default",
        "split_max_buffer_size",
        "split_max_buffer_age",
        "stop_actor_timeout",
        "cleanup_timeout",
        "default_encoding",
        "channel_net_rx_buffer_full_check_interval",
        "channel_tcp_congestion",
        "message_latency_sampling_rate",
        "enable_dest_actor_reordering_buffer",
        "mesh_bootstrap_enable_pdeathsig",
        "mesh_terminate_concurrency",
        "mesh_terminate_timeout",
        "small_write_threshold",
        "max_cast_dimension_size",
        "remote_alloc_bind_to_inaddr_any",
        "remote_alloc_bootstrap_addr",
        "remote_alloc_allowed_port_range",
        "read_log_buffer",
        "force_file_log",
        "prefix_with_rank",
        "get_actor_state_max_idle",
        "supervision_watchdog_timeout",
        "proc_stop_max_idle",
        "get_proc_state_max_idle",
        "mesh_admin_addr",
        "mesh_attach_config_timeout",
        "pyspy_bin",
        "rdma_allow_tcp_fallback",
        "rdma_disable_ibverbs",
        "rdma_max_chunk_size_mb",
        "rdma_ibverbs_target",
        "rdma_peer_device_affinity",
        "rdma_max_nics_per_buffer",
        "rdma_min_stripe_size_kb",
        "rdma_qps_per_cq",
        "rdma_cq_poller_per_device",
        "rdma_runtime_worker_threads",
    ]
)

_runtime: dict[str, Any] = {}
_lock = threading.Lock()


def configure(**kwargs: Any) -> None:
    """Set configuration keys for this process (see the module docstring)."""
    for key, value in kwargs.items():
        if key not in DEFAULTS and key not in MONARCH_KEYS:
            raise ValueError(
                f"unknown configuration key {key!r}; monarch_kernel's keys: "
                f"{', '.join(sorted(DEFAULTS))} (and Monarch's own)"
            )
        if key in ("host_spawn_ready_timeout", "actor_spawn_max_idle", "ray_placement_timeout"):
            seconds(value)  # checked now, not when a mesh starts
        if key == "host_meshes":
            _check_host_meshes(value)
        if key == "max_value_size" and value is not None:
            parse_size(str(value), "max_value_size")  # checked now
    with _lock:
        _runtime.update(kwargs)
        _apply_env()


def _apply_env() -> None:
    """Mirror ``max_value_size`` into this process's environment (call under _lock);
    the variable's value from before the first configure() comes back once the key is
    no longer configured."""
    global _env_before
    value = _runtime.get("max_value_size")
    if value is not None:
        if _env_before is _UNSET:
            _env_before = os.environ.get(MAX_VALUE_ENV)
        os.environ[MAX_VALUE_ENV] = str(parse_size(str(value), "max_value_size"))
    elif _env_before is not _UNSET:
        if _env_before is None:
            os.environ.pop(MAX_VALUE_ENV, None)
        else:
            os.environ[MAX_VALUE_ENV] = str(_env_before)
        _env_before = _UNSET


_UNSET = object()
_env_before: object = _UNSET


def get_global_config() -> dict[str, Any]:
    """The configuration in effect: defaults overlaid with what was configured (a copy)."""
    with _lock:
        return {**DEFAULTS, **_runtime}


def get_runtime_config() -> dict[str, Any]:
    """Only what :func:`configure` set (a copy)."""
    with _lock:
        return dict(_runtime)


def clear_runtime_config() -> None:
    """Forget everything :func:`configure` set."""
    with _lock:
        _runtime.clear()
        _apply_env()


@contextlib.contextmanager
def configured(**overrides: Any) -> Iterator[dict[str, Any]]:
    """Apply ``overrides`` for the ``with`` block (yields the merged configuration); the
    previous configuration is back afterwards, also after an exception."""
    saved = get_runtime_config()
    configure(**overrides)
    try:
        yield get_global_config()
    finally:
        with _lock:
            _runtime.clear()
            _runtime.update(saved)
            _apply_env()


def get(key: str) -> Any:
    """The value in effect for ``key``."""
    return get_global_config()[key]


_UNITS = {
    "ms": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
}


def seconds(value: object) -> float:
    """A duration in seconds from a number or a humantime string (``"1h 30m"``)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", value.strip().lower())
        rebuilt = "".join(f"{n}{u}" for n, u in parts)
        whole = rebuilt == re.sub(r"\s+", "", value.strip().lower())
        if parts and whole and all(u in _UNITS for _, u in parts):
            return sum(float(n) * _UNITS[u] for n, u in parts)
    raise ValueError(f"not a duration: {value!r} (use seconds or e.g. '30s', '5m', '1h 30m')")


def _check_host_meshes(value: object) -> None:
    if not isinstance(value, dict):
        raise ValueError("host_meshes must be a dict: {name: {'hosts': N, 'backend': ...}}")
    for name, spec in value.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("hosts", 1), int):
            raise ValueError(
                f"host_meshes[{name!r}] must be a dict like {{'hosts': 2, 'backend': 'local'}}"
            )


__all__ = [
    "clear_runtime_config",
    "configure",
    "configured",
    "get_global_config",
    "get_runtime_config",
]
