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
case of a cell or an endpoint, and no other task of the rank's event loop may be inside
one: then its state outside regions is known exactly (the CPU's and CUDA's dtypes and
the cache setting as the code found them). Not covered: other devices' autocast dtypes,
``mps`` and ``maia`` autocast (torch's "any autocast on" does not look at them), and
``inference_mode``, whose guard a cut leaves alive in the interrupted frames (it ends
with them; training then fails loudly, "Inference tensors cannot be saved for
backward", rather than silently). With torch older than 2.4 (no device-generic autocast
API) only gradient tracking is put back.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, NamedTuple


class TorchModes(NamedTuple):
    """torch's thread-local modes that an interrupt can leave switched (module doc)."""

    #: Gradient tracking on.
    grad: bool
    #: Autocast on for some device.
    autocast: bool
    #: Autocast regions entered and not left (torch's nesting count).
    nesting: int
    #: Autocast's dtype for the CPU and for CUDA (None: not known, torch < 2.4).
    cpu_dtype: object = None
    cuda_dtype: object = None
    #: Autocast's cache of cast weights on.
    cache: bool = True


#: The modes of a thread where torch was not imported yet: torch's defaults, where they
#: are known without torch (its dtypes are not: None).
DEFAULT_MODES = TorchModes(grad=True, autocast=False, nesting=0)

_call = operator.methodcaller("__call__")
_new = tuple.__new__
#: The torch module last looked at, and whether it has the device-generic autocast API
#: (torch >= 2.4) that the autocast modes are read and put back with.
_seen: tuple[object, bool] | None = None


def _has_autocast_api(torch: Any) -> bool:
    global _seen
    if _seen is None or _seen[0] is not torch:
        c = torch._C
        names = ("_autocast_supported_devices", "get_autocast_dtype", "_is_any_autocast_enabled")
        _seen = (torch, all(hasattr(c, n) for n in names))
    return _seen[1]


def torch_modes() -> TorchModes | None:
    """This thread's modes now; None while torch is not imported (or half imported).
    About 2 µs. The nesting count (which has no getter) is read as an
    increment and a decrement run in one C loop (``map``): no interrupt can land
    between the two, which would leave it counted up for good."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not _has_autocast_api(torch):  # torch < 2.4: gradient tracking only
            return TorchModes(torch.is_grad_enabled(), False, 0)
        c = torch._C
        _, nesting = map(_call, (c.autocast_increment_nesting, c.autocast_decrement_nesting))
        modes = (
            torch.is_grad_enabled(),
            c._is_any_autocast_enabled(),
            nesting,
            c.get_autocast_dtype("cpu"),
            c.get_autocast_dtype("cuda"),
            c.is_autocast_cache_enabled(),
        )
        return _new(TorchModes, modes)  # (the named tuple's own __new__ is Python: 1 µs)
    except AttributeError:  # an import of torch that was itself interrupted
        return None


def restore_after_interrupt(before: TorchModes | None, autocast: bool = True) -> list[str]:
    """Put back the modes an interrupt left switched since ``before`` (this thread's
    modes when the interrupted code started; None: torch was not imported then, so
    torch's defaults). ``autocast``: False when other code may still be inside an
    autocast region of this thread (tasks of its event loop), which closing it would
    break. Returns what was put back (for the note printed to stderr)."""
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
        if autocast and _autocast_left(now, want):
            _close_autocast(torch, now, want)
            fixed.append(_what_was_left(now, want))
    except Exception:  # a broken torch: nothing more to put right
        pass
    if fixed:
        try:
            sys.stderr.write(_note(fixed))
        except Exception:
            pass
    return fixed


def _autocast_left(now: TorchModes, want: TorchModes) -> bool:
    """Whether autocast is not as ``want`` had it outside any region (False where that
    is not known: ``want`` inside a region, or torch < 2.4, whose modes say nothing of
    autocast). Dtypes and the cache setting count only where ``want`` read them (not
    where torch was imported by the interrupted code itself)."""
    if want.autocast or want.nesting != 0 or now.cpu_dtype is None:
        return False
    if now.autocast or now.nesting != 0:
        return True
    return want.cpu_dtype is not None and now[3:] != want[3:]


def _close_autocast(torch: Any, now: TorchModes, want: TorchModes) -> None:
    """Autocast as outside any region, as ``want`` had it: off on every device, nesting
    zero, the cache of cast weights dropped, dtypes and the cache setting put back."""
    c = torch._C
    for device in c._autocast_supported_devices():
        if c.is_autocast_enabled(device):
            c.set_autocast_enabled(device, False)
    nesting = now.nesting
    while nesting > 0:
        nesting = c.autocast_decrement_nesting()
    while nesting < 0:
        nesting = c.autocast_increment_nesting()
    c.clear_autocast_cache()
    if want.cpu_dtype is not None:
        c.set_autocast_dtype("cpu", want.cpu_dtype)
    if want.cuda_dtype is not None:
        c.set_autocast_dtype("cuda", want.cuda_dtype)
    c.set_autocast_cache_enabled(want.cache)


def _what_was_left(now: TorchModes, want: TorchModes) -> str:
    if now.autocast:
        return "autocast on"
    if now.nesting != want.nesting:
        return f"autocast's nesting at {now.nesting}"
    return "autocast's dtype or cache setting changed"


def _note(fixed: list[str]) -> str:
    what = " and ".join(fixed)
    back = "they are" if len(fixed) > 1 else "it is"
    return (
        f"note: the interrupt left torch's {what} (torch's own code, such as an optimizer "
        "step or entering and leaving an autocast region, switches it for a moment); "
        f"{back} back as when the interrupted code started\n"
    )
