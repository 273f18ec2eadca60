"""Values as the visual debugger's Variables panel shows them (the rank's side).

Each expandable value shown gets a reference (an index into this pause's table, from 1);
tensors and arrays read as ``shape=(4, 8) dtype=torch.float32 device=cpu`` and expand
into those fields.
"""

from __future__ import annotations

import types
from typing import Any

#: Most children listed for one value (a huge list or dict).
MAX_CHILDREN = 300
#: Most characters of one value's text.
MAX_TEXT = 300


def is_tensor(value: Any) -> bool:
    """A torch tensor or an array-like with a shape and dtype (numpy)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def summary(value: Any) -> str:
    """One line for the panel: a tensor's shape, dtype and device, else its repr."""
    if is_tensor(value):
        device = getattr(value, "device", "cpu")
        return f"shape={tuple(value.shape)} dtype={value.dtype} device={device}"
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the panel
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


class Values:
    """The references handed out during one pause."""

    def __init__(self) -> None:
        self._table: list[Any] = []

    def clear(self) -> None:
        self._table.clear()

    def ref(self, value: Any) -> int:
        self._table.append(value)
        return len(self._table)

    @staticmethod
    def user_globals(namespace: dict[str, Any]) -> dict[str, Any]:
        """A cell's globals without dunders, modules and the kernel's own helpers."""
        return {
            k: v
            for k, v in namespace.items()
            if not k.startswith(("__", "_mk_")) and not isinstance(v, types.ModuleType)
        }

    def variable(self, name: str, value: Any) -> dict[str, Any]:
        expandable = is_tensor(value) or isinstance(value, (dict, list, tuple, set))
        plain = (int, float, str, bytes, bool, type(None), _ValuesText)
        if not expandable and not isinstance(value, plain):
            expandable = bool(getattr(value, "__dict__", None))
        kind = type(value).__name__
        if is_tensor(value):  # (the panel shows an expandable value's type, not its value)
            kind = f"{kind} {list(value.shape)} {value.dtype} {getattr(value, 'device', 'cpu')}"
        return {
            "name": name,
            "value": summary(value),
            "type": kind,
            "variablesReference": self.ref(value) if expandable else 0,
        }

    def children(self, ref: int) -> list[dict[str, Any]]:
        if not 1 <= ref <= len(self._table):
            raise LookupError(f"no variables reference {ref} (the rank ran on since)")
        value = self._table[ref - 1]
        if is_tensor(value):
            items: list[tuple[str, Any]] = [
                ("shape", tuple(value.shape)),
                ("dtype", value.dtype),
                ("device", getattr(value, "device", "cpu")),
            ]
            if hasattr(value, "requires_grad"):
                items.append(("requires_grad", value.requires_grad))
            items.append(("values", _ValuesText(value)))
        elif isinstance(value, dict):
            items = [(str(k), v) for k, v in list(value.items())[:MAX_CHILDREN]]
        elif isinstance(value, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(value[:MAX_CHILDREN])]
        elif isinstance(value, set):
            items = [(str(i), v) for i, v in enumerate(list(value)[:MAX_CHILDREN])]
        else:
            attrs = getattr(value, "__dict__", {}) or {}
            items = [(str(k), v) for k, v in list(attrs.items())[:MAX_CHILDREN]]
        return [self.variable(name, v) for name, v in items]

    def evaluate(self, expression: str, frame: Any) -> dict[str, Any]:
        """``expression`` in ``frame`` (a statement is executed: the result is empty)."""
        try:
            code = compile(expression, "<debug console>", "eval")
        except SyntaxError:
            exec(compile(expression, "<debug console>", "exec"), frame.f_globals, frame.f_locals)
            return {"result": "", "variablesReference": 0}
        value = eval(code, frame.f_globals, frame.f_locals)
        shown = self.variable(expression, value)
        return {
            "result": shown["value"],
            "type": shown["type"],
            "variablesReference": shown["variablesReference"],
        }


class _ValuesText:
    """A tensor's printed values, shown as text (never expanded)."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:
        return repr(self._tensor)
