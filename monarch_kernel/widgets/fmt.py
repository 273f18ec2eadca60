"""Short human-readable numbers for tiles and headers."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``512 B``, ``12 KB``, ``1.5 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


def age(seconds: float) -> str:
    """``<1s``, ``42s``, ``3m``."""
    if seconds < 1.5:
        return "<1s"
    if seconds < 90:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m"


def num(v: float) -> str:
    """``12`` for whole numbers, else 4 significant digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


def rate_text(bps: float | None) -> str:
    """``1.2 MB/s`` style text (``—`` when unknown)."""
    if bps is None:
        return "—"
    if bps >= 1e9:
        return f"{bps / 1e9:.1f} GB/s"
    if bps >= 1e6:
        return f"{bps / 1e6:.1f} MB/s"
    if bps >= 1e3:
        return f"{bps / 1e3:.0f} KB/s"
    return f"{bps:.0f} B/s"


def duration(seconds: float) -> str:
    """``42s``, ``3m 05s``, ``2h 01m``."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"
