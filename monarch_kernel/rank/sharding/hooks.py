"""The automatic part of sharding errors, installed in every rank at no start-up cost.

* FSDP2's root lazy init (``FSDPState._lazy_init``, run by the root module's first
  forward, before any FSDP collective) is wrapped so that the ranks compare the model's
  fingerprint first (:mod:`.fingerprint`) and raise a :class:`ShardingError` naming the
  tensor instead of failing in a mismatched all-gather. FSDP2 is patched when it is
  imported (a ``sys.meta_path`` finder watches for it): ranks start without importing
  ``torch.distributed.fsdp``.
* :func:`.explain.note` is registered with ``rank.errors``: a failed DTensor operation's
  error gets a note naming its DTensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from monarch_kernel.rank import errors
from monarch_kernel.rank.import_hooks import when_imported
from monarch_kernel.rank.sharding import explain, fingerprint

#: The module of FSDP2's per-module state (``FSDPState``).
FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_PATCHED = "_monarch_kernel_checked"
#: How long a rank waits for its peers' fingerprints before it leaves the comparison to
#: them: a peer that comes later still compares (every fingerprint is there by then) and
#: raises, and the ranks already in FSDP's all-gather are released by the mesh as for any
#: failed rank. The wait is a poll: the stop button interrupts it.
PEER_WAIT_S = 60.0
#: Whether the automatic check runs (``MONARCH_SHARDING_CHECK=0`` turns it off).
enabled = os.environ.get("MONARCH_SHARDING_CHECK", "1") != "0"


def install() -> None:
    """Patch FSDP2 now if it is loaded, else as soon as it is; register the note."""
    errors.add_explainer(explain.note)
    when_imported(FSDP_STATE, patch)


def patch(module: ModuleType) -> None:
    """Wrap ``FSDPState._lazy_init`` (once) with the fingerprint comparison."""
    state = getattr(module, "FSDPState", None)
    original = getattr(state, "_lazy_init", None)
    if state is None or original is None or getattr(original, _PATCHED, False):
        return
    state._lazy_init = _wrap(original)


def _wrap(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def _lazy_init(self: Any) -> None:
        # Only the root's first lazy init (``_is_root`` still unset): every later call,
        # and every non-root state's, returns at once in the original.
        if enabled and self._is_root is None and len(getattr(self, "_modules", ())) == 1:
            before = _idle(self)
            try:
                check_root(self._modules[0])
            except BaseException:
                # FSDP marked the state FORWARD before calling us: left so, its next
                # forward would skip the root's set-up (and this lazy init) altogether.
                if before is not None:
                    self._training_state = before
                raise
        original(self)

    setattr(_lazy_init, _PATCHED, True)
    _lazy_init.__doc__ = original.__doc__
    return _lazy_init


def _idle(state: Any) -> Any:
    """FSDP2's ``TrainingState.IDLE`` (what a state is between steps), if it has one."""
    common = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_common")
    training_state = getattr(common, "TrainingState", None)
    return getattr(training_state, "IDLE", None)


def check_root(root: Any) -> None:
    """Compare ``root``'s fingerprint with its peers' (the ranks of its meshes); raise
    :class:`~.fingerprint.ShardingError` when they differ. Any other failure of the
    comparison itself is ignored: it must never stop a model that would train."""
    try:
        ex = fingerprint.exchange_for(fingerprint.participants(root), "fsdp")
        if ex is None or len(ex.ranks) < 2:
            return
    except Exception:
        return
    try:
        mine = fingerprint.take(root)
    except Exception:
        with contextlib.suppress(Exception):
            fingerprint.abstain(ex)  # the peers must not wait for this rank's fingerprint
        return
    try:
        # A restarted rank builds and initialises its model alone: its peers did theirs
        # long ago (they will not come). It compares with what is there, without waiting.
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
        prints = fingerprint.gather(ex, mine, 0.0 if restarted else PEER_WAIT_S)
        text = fingerprint.compare(prints) if prints else None
    except Exception:
        return
    if text:
        raise fingerprint.ShardingError(text)
