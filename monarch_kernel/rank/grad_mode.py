"""An interrupt never leaves torch's gradient tracking turned off.

torch turns gradient tracking off and back on in Python frames of its own: an
optimizer's ``step`` (``torch.optim.optimizer._use_grad_for_differentiable``: off, the
step, and in a ``finally`` a Python call before it is set back), ``no_grad``'s enter and
exit. The stop button's ``KeyboardInterrupt`` lands between two bytecodes of whatever
runs; one that lands after the switch off and before the switch back skips the restore,
and the rank is left with gradient tracking off: the next training cell fails on that
rank alone ("element 0 of tensors does not require grad and does not have a grad_fn").
A CI run of twenty stop-button presses in a DDP loop hit it once (tight loops of
thousands of interrupts into an optimizer step did not: the window is small).

So the rank notes the mode when it starts a piece of user code and, if an interrupt
ends that code with the mode changed, sets it back and says so in the output. Only
interrupts: a cell that turns gradients off on purpose and ends normally (or with any
other error) keeps what it did, as in a local kernel.
"""

from __future__ import annotations

import sys

#: Printed to the interrupted code's stderr when the mode was put back.
RESTORED_NOTE = (
    "note: the interrupt left torch's gradient tracking off (torch's own code, such as an "
    "optimizer step, turns it off for a moment); it is on again, as it was when the "
    "interrupted code started\n"
)


def grad_mode() -> bool | None:
    """Whether gradient tracking is on for this thread; None while torch is not
    imported (or half imported). Cheap: one dict lookup and one C call."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        enabled: bool = torch.is_grad_enabled()
    except AttributeError:  # an import of torch that was itself interrupted
        return None
    return enabled


def restore_after_interrupt(before: bool | None) -> bool:
    """Set gradient tracking back to ``before`` (its mode when the interrupted code
    started; None: torch was not imported then, so torch's default, on) if it differs
    now; True if it did (and the note was printed)."""
    want = True if before is None else before
    now = grad_mode()
    if now is None or now == want:
        return False
    torch = sys.modules["torch"]
    try:
        torch.set_grad_enabled(want)  # used as a function: it takes effect at once
    except Exception:  # a broken torch: nothing to put right
        return False
    try:
        sys.stderr.write(RESTORED_NOTE)
    except Exception:
        pass
    return True
