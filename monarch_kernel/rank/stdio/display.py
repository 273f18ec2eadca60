"""Rich output from a rank: ``IPython.display``'s ``display``, ``update_display``,
``clear_output`` and display handles, and matplotlib figures, sent to the controller as
``display`` messages tagged with the request being served, so they appear under the
cell (or with the endpoint's output) that made them, labelled by rank.

A rank runs no IPython kernel. :func:`install` (at rank start) replaces the functions of
``IPython.core.display_functions`` (at once if IPython is loaded, else as it is
imported, before ``IPython.display`` copies them), makes ``display`` a builtin as it is
in a notebook, and makes :mod:`.mpl_backend` matplotlib's default
backend (``$MPLBACKEND``, unless the user set another than the notebook's inline one,
which ranks inherit from the kernel's environment): ``plt.show()`` sends the figures,
and figures left open when a cell ends are sent then (:func:`after_cell`), as the
inline backend does.
Objects are formatted with IPython's ``DisplayFormatter`` (``_repr_html_``,
``_repr_png_``, ``_repr_mimebundle_``, ...); without IPython, as their ``repr``.

A bundle over :data:`MAX_BYTES` is not sent: a line says what was left out instead.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import sys
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

from monarch_kernel.rank.import_hooks import when_imported

#: The largest display a rank sends, in bytes (all its representations together);
#: ``$MONARCH_KERNEL_DISPLAY_MAX`` sets it.
MAX_BYTES = int(os.environ.get("MONARCH_KERNEL_DISPLAY_MAX", 8 * 1024 * 1024))
#: The matplotlib backend ranks use unless ``$MPLBACKEND`` says otherwise.
MPL_BACKEND = "module://monarch_kernel.rank.stdio.mpl_backend"
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"

#: ``send(op, display_id, payload)``: :meth:`~monarch_kernel.rank.outbox.Outbox.display`
Send = Callable[[str, "str | None", bytes], None]
_send: Send | None = None
_formatter: Any = None
_PATCHED = "_monarch_kernel_display"


def install(send: Send) -> None:
    """Route this process's displays to ``send`` (a rank's outbox)."""
    global _send
    _send = send
    builtins.display = display  # type: ignore[attr-defined]
    # Unset, or the inline backend inherited from the kernel's environment (it needs the
    # kernel's IPython shell): ours. A backend the user chose (--env MPLBACKEND=...) stays.
    if os.environ.get("MPLBACKEND", "") in ("", "inline", INLINE_BACKEND):
        os.environ["MPLBACKEND"] = MPL_BACKEND
    when_imported("IPython.core.display_functions", _patch)


def _patch(module: ModuleType) -> None:
    if getattr(module, _PATCHED, False):
        return
    originals = {
        name: getattr(module, name, None)
        for name in ("display", "clear_output", "publish_display_data")
    }
    module.display = display  # type: ignore[attr-defined]
    module.clear_output = clear_output  # type: ignore[attr-defined]
    module.publish_display_data = publish_display_data  # type: ignore[attr-defined]
    setattr(module, _PATCHED, True)
    ours: dict[str, Callable[..., Any]] = {
        "display": display,
        "clear_output": clear_output,
        "publish_display_data": publish_display_data,
    }
    for name in ("IPython.display", "IPython.core.display", "IPython"):
        other = sys.modules.get(name)
        if other is None:
            continue
        for attr, original in originals.items():
            if original is not None and getattr(other, attr, None) is original:
                setattr(other, attr, ours[attr])


# -- the functions users call -------------------------------------------------------------
def display(
    *objs: Any,
    include: Any = None,
    exclude: Any = None,
    metadata: dict[str, Any] | None = None,
    transient: dict[str, Any] | None = None,
    display_id: Any = None,
    raw: bool = False,
    clear: bool = False,
    **kwargs: Any,
) -> Any:
    """IPython's ``display`` for a rank (same arguments; a display handle back when a
    ``display_id`` is given)."""
    transient = dict(transient or {})
    if display_id:
        if display_id is True:
            display_id = uuid.uuid4().hex
        transient["display_id"] = display_id
    update = bool(kwargs.get("update"))
    if update and "display_id" not in transient:
        raise TypeError("display_id required for update_display")
    if not objs and display_id:
        objs, raw = ({},), True  # an empty output to update later
    if clear:
        clear_output(wait=True)
    for obj in objs:
        if raw:
            data, md = dict(obj), dict(metadata or {})
        else:
            data, md = _format(obj, include, exclude)
            if not data:
                continue  # _ipython_display_ showed it itself
            if metadata:
                md.update(metadata)
        _publish("update" if update else "display", data, md, transient.get("display_id"))
    if display_id:
        return _handle(str(display_id))
    return None


def publish_display_data(
    data: dict[str, Any],
    metadata: dict[str, Any] | None = None,
    *,
    transient: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """IPython's ``publish_display_data`` for a rank."""
    did = (transient or {}).get("display_id")
    _publish("update" if kwargs.get("update") else "display", dict(data), metadata or {}, did)


def clear_output(wait: bool = False) -> None:
    """Clear what this rank displayed under the cell (``wait``: when it next displays
    something); other ranks' output stays."""
    _flush_streams()
    if _send is not None:
        _send("clear_wait" if wait else "clear", None, b"")


def _handle(display_id: str) -> Any:
    try:
        from IPython.core.display_functions import DisplayHandle
    except ImportError:  # pragma: no cover - display_id without IPython
        return None
    return DisplayHandle(display_id)


# -- formatting and sending ------------------------------------------------------------------
def _format(obj: Any, include: Any, exclude: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    figure = _figure_bundle(obj)
    if figure is not None:
        return figure, {}
    global _formatter
    if _formatter is None:
        try:
            from IPython.core.formatters import DisplayFormatter
        except ImportError:
            return {"text/plain": repr(obj)}, {}
        _formatter = DisplayFormatter()
    data, md = _formatter.format(obj, include=include, exclude=exclude)
    return dict(data), dict(md)


def _figure_bundle(obj: Any) -> dict[str, Any] | None:
    """A matplotlib figure as PNG (tight bounding box, as the inline backend draws it)."""
    figure_mod = sys.modules.get("matplotlib.figure")
    if figure_mod is None or not isinstance(obj, figure_mod.Figure):
        return None
    buf = io.BytesIO()
    obj.savefig(buf, format="png", bbox_inches="tight")
    return {"image/png": buf.getvalue(), "text/plain": repr(obj)}


def _size(data: dict[str, Any]) -> int:
    size = 0
    for value in data.values():
        if isinstance(value, (str, bytes, bytearray)):
            size += len(value)
        else:
            size += len(repr(value))
    return size


def _publish(op: str, data: dict[str, Any], metadata: dict[str, Any], display_id: Any) -> None:
    if _send is None:  # not in a rank (a subprocess that inherited the backend)
        print(data.get("text/plain", ""))
        return
    size = _size(data)
    if size > MAX_BYTES:
        kinds = ", ".join(sorted(k for k in data if k != "text/plain")) or "text"
        data = {
            "text/plain": f"[display not shown: its {kinds} is {size / 2**20:.1f} MiB, over "
            f"the {MAX_BYTES / 2**20:.0f} MiB a rank sends (MONARCH_KERNEL_DISPLAY_MAX); "
            "save it to a file instead]"
        }
        metadata = {}
    _flush_streams()  # what the rank printed before comes first
    try:
        payload = pickle.dumps({"data": data, "metadata": metadata})
    except Exception as exc:  # not picklable metadata or data: its text
        payload = pickle.dumps({"data": {"text/plain": f"[display not sent: {exc}]"}})
    _send(op, None if display_id is None else str(display_id), payload)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def after_cell() -> None:
    """A cell ended: show the matplotlib figures it left open (and close them)."""
    backend = sys.modules.get("monarch_kernel.rank.stdio.mpl_backend")
    if backend is not None:
        backend.flush_figures()
