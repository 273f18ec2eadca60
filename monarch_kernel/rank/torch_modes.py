"""An interrupt never leaves torch's thread-local modes switched by torch's own code.

torch switches per-thread modes in Python frames of its own and switches them back a few
bytecodes later:

* **gradient tracking**: an optimizer's ``step``
  (``torch.optim.optimizer._use_grad_for_differentiable``: off, the step, and in a
  ``finally`` a Python call before it is set back), ``no_grad``'s enter and exit;
* **autocast**: ``torch.autocast.__enter__`` turns it on, sets its dtype and counts one
  level of nesting, each a separate call, and ``__exit__`` undoes them one by one (the
  cast-weight cache is dropped when the count returns to zero).

The stop button's ``KeyboardInterrupt`` lands between two bytecodes of whatever runs.
One that lands between a switch and its switch back skips the restore:

* gradient tracking left off: the next training cell fails on that rank alone
  ("element 0 of tensors does not require grad and does not have a grad_fn"; a CI run
  of twenty stop-button presses in a DDP loop hit it once);
* autocast left on (an ``__enter__`` cut after its switch on: ``with`` then never calls
  ``__exit__``; or an ``__exit__`` cut before its switch off): the next cells of that
  rank alone compute in lower precision, with no error; a nesting count left above
  zero also keeps the cache of cast weights from ever being dropped, so later autocast
  regions of that rank may use casts of weights from before an optimizer step.

So the rank notes the modes when it starts a piece of user code and, if an interrupt
ends that code with a mode changed, sets it back and says so in the output. Only
interrupts: a cell that turns gradients off on purpose and ends normally (or with any
other error) keeps what it did, as in a local kernel. Autocast is put back only when
the code started outside any autocast region (nesting zero, every device off), the
case of a cell or an endpoint; then its off state is known exactly, the dtypes and the
cache setting are put back to what they were when the rank first ran user code.
"""

from __future__ import annotations

import sys
from typing import NamedTuple


class TorchModes(NamedTuple):
    """torch's thread-local modes that an interrupt can leave switched (module doc)."""

    #: Gradient tracking on.
    grad: bool
    #: Autocast on for some device.
    autocast: bool
    #: Autocast regions entered and not left (torch's nesting count).
    nesting: int


#: The modes of a thread where torch was not imported yet: torch's defaults.
DEFAULT_MODES = TorchModes(grad=True, autocast=False, nesting=0)


class _AutocastBaseline(NamedTuple):
    """Autocast's settings outside any region, when the rank first ran user code."""

    dtypes: tuple[tuple[str, object], ...]
    cache_enabled: bool


_baseline: _AutocastBaseline | None = None


def torch_modes() -> TorchModes | None:
    """This thread's modes now; None while torch is not imported (or half imported).
    Cheap (about half a microsecond): a dict lookup and four C calls."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        c = torch._C
        nesting: int = c.autocast_increment_nesting() - 1  # (read: no getter of its own)
        c.autocast_decrement_nesting()
        modes = TorchModes(torch.is_grad_enabled(), c._is_any_autocast_enabled(), nesting)
    except AttributeError:  # an import of torch that was itself interrupted
        return None
    global _baseline
    if _baseline is None and not modes.autocast and nesting == 0:
        _baseline = _read_baseline(torch)
    return modes


def _read_baseline(torch: object) -> _AutocastBaseline | None:
    try:
        c = torch._C  # type: ignore[attr-defined]
        devices = tuple(c._autocast_supported_devices())
        dtypes = tuple((d, c.get_autocast_dtype(d)) for d in devices)
        return _AutocastBaseline(dtypes, bool(c.is_autocast_cache_enabled()))
    except (AttributeError, RuntimeError):
        return None


def restore_after_interrupt(before: TorchModes | None) -> list[str]:
    """Put back the modes an interrupt left switched since ``before`` (this thread's
    modes when the interrupted code started; None: torch was not imported then, so
    torch's defaults). Returns what was put back (for the note printed to stderr)."""
    want = DEFAULT_MODES if before is None else before
    now = torch_modes()
    if now is None or now == want:
        return []
    torch = sys.modules["torch"]
    fixed: list[str] = []
    try:
        if now.grad != want.grad:
            torch.set_grad_enabled(want.grad)  # used as a function: it takes effect at once
            fixed.append("gradient tracking " + ("off" if now.grad is False else "on"))
        if not want.autocast and want.nesting == 0 and (now.autocast or now.nesting):
            _autocast_off(torch, now.nesting)
            fixed.append("autocast on" if now.autocast else f"autocast's nesting at {now.nesting}")
    except Exception:  # a broken torch: nothing more to put right
        pass
    if fixed:
        try:
            sys.stderr.write(_note(fixed))
        except Exception:
            pass
    return fixed


def _autocast_off(torch: object, nesting: int) -> None:
    """Autocast as outside any region: off on every device, nesting zero, the cache of
    cast weights dropped, dtypes and the cache setting as in :data:`_baseline`."""
    c = torch._C  # type: ignore[attr-defined]
    for device in c._autocast_supported_devices():
        if c.is_autocast_enabled(device):
            c.set_autocast_enabled(device, False)
    while nesting > 0:
        nesting = c.autocast_decrement_nesting()
    while nesting < 0:
        nesting = c.autocast_increment_nesting()
    c.clear_autocast_cache()
    if _baseline is not None:
        for device, dtype in _baseline.dtypes:
            if c.get_autocast_dtype(device) != dtype:
                c.set_autocast_dtype(device, dtype)
        c.set_autocast_cache_enabled(_baseline.cache_enabled)


def _note(fixed: list[str]) -> str:
    what = " and ".join(fixed)
    back = "they are" if len(fixed) > 1 else "it is"
    return (
        f"note: the interrupt left torch's {what} (torch's own code, such as an optimizer "
        "step or entering and leaving an autocast region, switches it for a moment); "
        f"{back} back as when the interrupted code started\n"
    )
