"""Names for JSON-shaped data that crosses a process boundary as JSON: Jupyter message
contents and MIME bundles, configuration lines of host agents and ranks."""

from __future__ import annotations

from typing import Any, TypeAlias

#: A JSON object as decoded by ``json.loads`` (values not checked: read them by name).
JsonObject: TypeAlias = dict[str, Any]
#: A Jupyter MIME bundle: MIME type -> data (``text/plain``, ``text/html`` ...).
MimeBundle: TypeAlias = dict[str, Any]

__all__ = ["JsonObject", "MimeBundle"]
