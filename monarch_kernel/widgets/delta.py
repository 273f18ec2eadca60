"""Send only what changed: the dashboard's one way of writing to a widget."""

from __future__ import annotations

from typing import Any

import ipywidgets as W


def put(widget: W.Widget, **values: Any) -> int:
    """Set those of ``values`` that differ from ``widget``'s, all in one comm message;
    returns the messages sent (0 or 1), which the dashboard counts."""
    changed = {k: v for k, v in values.items() if getattr(widget, k) != v}
    if not changed:
        return 0
    with widget.hold_sync():
        for k, v in changed.items():
            setattr(widget, k, v)
    return 1
