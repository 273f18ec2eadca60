"""Launchers start host agents; every backend runs the same host agent command."""

from __future__ import annotations

from typing import Any


def get_launcher(backend: str, **options: Any) -> Any:
    """The launcher for ``backend`` (``local`` ...); a clear error for unknown ones."""
    if backend == "local":
        from monarch_kernel.launchers.local import LocalLauncher

        return LocalLauncher.shared()
    known = "local"
    raise ValueError(f"unknown backend {backend!r}; available backends: {known}")
