"""The process group around a training recovery, on the rank side.

:func:`reform` joins the new rendezvous the controller chose (survivors from their
parked step, a restarted rank before its set-up cells run again).

:func:`local_collectives` is for the restarted rank's set-up cells: they are run again
there (``DistributedDataParallel(model)`` and friends), while the other ranks stay
parked at the step boundary and take part in no collective. So while they run, the
collectives of ``torch.distributed`` complete locally, as if every peer had sent this
rank's own data: a broadcast or an all-reduce leaves the tensors as they are, an
all-gather fills every slot with this rank's tensor, a barrier returns. What the
set-up computes this way is then overwritten by the replica's state (the model's
parameters and buffers, the optimizer, the step); a set-up whose *other* results
depend on what peers send is not covered (see the README).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: torch.distributed functions replaced while set-up cells run again on a restarted
#: rank, with what they do instead.
_ORIGINALS: dict[str, Callable[..., Any]] = {}
#: Seconds a parking rank waits for its process group's abort.
ABORT_WAIT = 1.0


class _Done:
    """A finished ``Work`` for ``async_op=True`` callers."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        import torch

        fut: Any = torch.futures.Future()
        fut.set_result(None)
        return fut


def _result(kwargs: dict[str, Any]) -> Any:
    return _Done() if kwargs.get("async_op") else None


def _unchanged(*args: Any, **kwargs: Any) -> Any:
    return _result(kwargs)


def _all_gather(tensor_list: list[Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
    for t in tensor_list:
        t.copy_(tensor)
    return _result(kwargs)


def _all_gather_into_tensor(out: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
    n = max(1, out.numel() // max(1, inp.numel()))
    out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))
    return _result(kwargs)


def _all_gather_object(object_list: list[Any], obj: Any, *args: Any, **kwargs: Any) -> None:
    for i in range(len(object_list)):
        object_list[i] = obj


def _verify_params(*args: Any, **kwargs: Any) -> None:
    return None


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "broadcast": _unchanged,
    "all_reduce": _unchanged,
    "reduce": _unchanged,
    "barrier": _unchanged,
    "monitored_barrier": _unchanged,
    "broadcast_object_list": _unchanged,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_object": _all_gather_object,
    "_broadcast_coalesced": _unchanged,
    "_verify_params_across_processes": _verify_params,
}


def local_collectives(on: bool) -> None:
    """Make ``torch.distributed``'s collectives complete locally (``on``), or restore
    them. Run as a cell of its own before and after the set-up cells."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        if not on:
            return
        import torch.distributed as dist
    from monarch_kernel.rank.pg import backend

    backend.defer_forming(on)  # new_group groups are formed after, with the peers'
    if on:
        for name, fn in _REPLACEMENTS.items():
            if name not in _ORIGINALS and hasattr(dist, name):
                _ORIGINALS[name] = getattr(dist, name)
                setattr(dist, name, fn)
        return
    for name, fn in _ORIGINALS.items():
        setattr(dist, name, fn)
    _ORIGINALS.clear()


def release_peers() -> None:
    """Abort this rank's process group as it parks: its connections close, so peers
    still blocked in a collective with it (waiting for its data) are released too and
    park in turn. The group is formed again by :func:`reform`."""
    import threading

    from monarch_kernel.rank.pg import distributed

    def abort() -> None:
        try:
            distributed.abort_process_group("a peer failed in the training step")
        except Exception:  # a group broken beyond aborting is re-formed all the same
            pass

    # On a thread, waited for a moment only: a backend slow to abort must not keep
    # this rank from parking (the controller waits for every rank to park).
    thread = threading.Thread(target=abort, name="mk-park-abort", daemon=True)
    thread.start()
    thread.join(ABORT_WAIT)


def reform(addr: str, port: int, backend: str | None = None, defer: bool = False) -> int:
    """Join the process group's new rendezvous at ``addr:port`` (the world as before;
    ``backend``: the others' backend, for a restarted rank that has no group yet).
    With ``defer`` (a restarted rank is coming back) the ``new_group`` subgroups are
    left for :func:`reform_subgroups`; returns how many wait for it.

    The default group is re-formed in place (``distributed.reform_process_group``: the
    user objects that hold it keep working; a restarted rank first makes one alone, see
    :func:`monarch_kernel.rank.pg.alone.form_alone`).
    """
    from monarch_kernel.rank.pg import distributed

    distributed.reform_process_group(addr, port, backend, defer=defer)
    return distributed.deferred_subgroups()


def reform_subgroups(addr: str, port: int) -> int:
    """Form the subgroups a deferred :func:`reform` left (every rank of the mesh,
    the restarted ones after their set-up cells); how many were formed."""
    from monarch_kernel.rank.pg import distributed

    return distributed.reform_subgroups(addr, port)
