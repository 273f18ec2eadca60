"""Launchers start host agents; every backend runs the same host agent command.

The seam is typed (:mod:`monarch_kernel.launchers.base`): a :class:`Launcher` starts host
agents from :class:`HostConfig` s and returns a :class:`HostHandle` per agent.
"""

from __future__ import annotations

from monarch_kernel.launchers.base import HostConfig, HostHandle, Launcher

BACKENDS = ("local", "join", "ray", "slurm", "lightning")

__all__ = ["BACKENDS", "HostConfig", "HostHandle", "Launcher", "get_launcher"]


def get_launcher(backend: str, **options: object) -> Launcher:
    """The launcher for ``backend`` (``local`` ...); a clear error for unknown ones."""
    if backend == "local":
        from monarch_kernel.launchers.local import LocalLauncher

        if options:
            raise ValueError(f"the local backend takes no options, got {', '.join(options)}")

        return LocalLauncher.shared()
    if backend == "join":
        from monarch_kernel.launchers.join import JoinLauncher

        return JoinLauncher(**options)  # type: ignore[arg-type]
    if backend == "ray":
        from monarch_kernel.launchers.ray_engine import RayLauncher

        return RayLauncher(**options)  # type: ignore[arg-type]
    if backend == "slurm":
        from monarch_kernel.launchers.slurm_engine import SlurmLauncher

        return SlurmLauncher(**options)  # type: ignore[arg-type]
    if backend == "lightning":
        from monarch_kernel.launchers.lightning_engine import LightningLauncher

        return LightningLauncher(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown backend {backend!r}; available backends: {', '.join(BACKENDS)}")
