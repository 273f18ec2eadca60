"""CUDA tensors in the results of a rank's calls to ranks of its own machine go by CUDA IPC.

The other half of :mod:`.cuda_args`: a rank that calls ranks of its machine (``call``,
``call_one``, ``choose``, ``stream``) says so in the call (``rp``: its process id, see
``wire.headers.Call``), and each CUDA tensor of :data:`~.cuda_args.MIN_BYTES` or more in
the answer, at any depth, travels as a data-plane handle instead of being pickled
through host memory:

* the answering rank copies it on its device (the value as it was returned, as a
  pickled result is: the actor may change its tensor as soon as the endpoint returned),
  shares the copy for one read, and sends the handles ahead of the value (the reply's
  payload is ``(handles, value)``, its header says so: ``x``);
* the caller reads them when it asks for the value (``.get()``, in that thread, onto
  its current CUDA device as a pickled CUDA tensor lands) device to device, lets go of
  its mappings at once and says it has its copies (``read_done``): the answering rank
  drops them;
* a reply the caller never reads (the future dropped, the call failed on another rank,
  a reply that came after the caller stopped waiting) is let go of unread
  (:meth:`ResultReader.discard`, ``calls.reply.HandleReply``): its copies are dropped
  the same way; and the answering rank drops whatever it keeps for a caller that is
  gone (``Server.holders``, looked at once a second).

Results sent to the notebook, to other machines, or where CUDA IPC is off
(``MONARCH_KERNEL_CUDA_IPC=0``, expandable segments) are pickled as before, and so is a
tensor no copy of which fits on the device.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Sequence
from typing import Any

from monarch_kernel.calls import reply as calls_reply
from monarch_kernel.rank import context
from monarch_kernel.rank.dataplane.common import counters_
from monarch_kernel.rank.dataplane.cuda_args import (
    ipc_here,
    is_parameter,
    large_plain,
    read_copy,
    read_done,
    share_copy,
)
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.wire import dumps, loads
from monarch_kernel.wire.codec import Buffer
from monarch_kernel.wire.serialize import PROTOCOL, What, tensors_reduced_by

# -- the answering rank -------------------------------------------------------------------


class ResultCopies:
    """The copies one result's CUDA tensors were shared as, each kept for one read by
    process ``reader`` (or until it is gone). :meth:`reduce` is the serializer's hook."""

    def __init__(self, reader: int) -> None:
        self.reader = reader
        self.refs: list[TensorRef] = []
        #: id(tensor) -> (tensor, its reduction): a tensor pickled again (the
        #: serializer's fallback) gets the same handle
        self._made: dict[int, tuple[Any, tuple[Any, ...]]] = {}

    def reduce(self, t: Any) -> tuple[Any, ...] | None:
        """``t`` as the index of a handle on a copy of it, or None: pickled as usual."""
        if not large_plain(t):
            return None
        done = self._made.get(id(t))
        if done is not None:
            return done[1]
        ref = share_copy(t, reads=1, holder=self.reader)
        if ref is None:
            return None
        self.refs.append(ref)
        counters_["ipc_results"] += 1
        reduced = (_result_tensor, (len(self.refs) - 1, t.requires_grad, is_parameter(t)))
        self._made[id(t)] = (t, reduced)
        return reduced

    def release(self) -> None:
        """Drop the copies now (the reply could not be sent)."""
        from monarch_kernel.rank.dataplane.plane import server

        refs, self.refs, self._made = self.refs, [], {}
        owner = server()
        for ref in refs:
            owner.release(ref.id)


def dump_result(
    value: Any, what: What, reader: int
) -> tuple[bytes, list[pickle.PickleBuffer], ResultCopies | None]:
    """``value`` pickled for a caller of this machine that takes handles (process
    ``reader``): its payload and buffers, and the copies its large CUDA tensors were
    shared as (None: there were none, and the payload is the plain pickle). Raises what
    ``wire.dumps`` raises (no copy is then kept)."""
    if "torch" not in sys.modules or not ipc_here():  # (no torch: no tensor in it)
        payload, buffers = dumps(value, what)
        return payload, buffers, None
    copies = ResultCopies(reader)
    try:
        with tensors_reduced_by(copies.reduce):
            payload, buffers = dumps(value, what)
    except BaseException:
        copies.release()
        raise
    if not copies.refs:
        return payload, buffers, None
    return pickle.dumps((copies.refs, payload), PROTOCOL), buffers, copies


# -- the caller ---------------------------------------------------------------------------

#: The handles of the reply this thread is reading (:meth:`ResultReader.read`).
_reading = threading.local()


def _result_tensor(index: int, requires_grad: bool, parameter: bool) -> Any:
    """The caller's side of :meth:`ResultCopies.reduce`: a private copy of handle
    ``index`` of the reply being read."""
    refs: list[TensorRef] | None = getattr(_reading, "refs", None)
    if refs is None or not 0 <= index < len(refs):
        raise RuntimeError(
            "a CUDA tensor of an endpoint's result was unpickled outside its reply "
            "(monarch_kernel.rank.dataplane.cuda_results)"
        )
    return read_copy(refs[index], requires_grad, parameter)


class ResultReader:
    """Reads replies whose CUDA tensors came as handles (``calls.reply.HandleReply``)."""

    def read(self, payload: bytes, buffers: Sequence[Buffer], what: What) -> object:
        """The value of a reply: each handle read onto this thread's device; every copy
        is then let go of, read or not (the value failed to unpickle part-way)."""
        refs, inner = _handles(payload)
        before = getattr(_reading, "refs", None)
        _reading.refs = refs
        try:
            return loads(inner, buffers, what)
        finally:
            _reading.refs = before
            read_done.tell(lambda: refs)

    def discard(self, payload: bytes) -> None:
        """A reply that will never be read: its copies are let go of (this runs where
        the reply is collected: any thread, maybe in the middle of a socket's use)."""
        read_done.tell(lambda: _handles(payload)[0])


def _handles(payload: bytes) -> tuple[list[TensorRef], bytes]:
    refs, inner = pickle.loads(payload)
    return refs, inner


#: The one reader of this process, told to ``calls.reply`` (a rank that asks for
#: results by handle has imported this module).
reader = ResultReader()
calls_reply.handle_reader = reader
if context.in_rank():
    read_done.start()  # (a rank that asks for results by handle: before any finalizer)


def reader_pid() -> int:
    """What a call asking for results by handle carries (``rp``): this process's id
    (looked up each time: a template's fork has another)."""
    return os.getpid()
