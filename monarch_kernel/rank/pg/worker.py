"""The process-group worker: a disposable process that holds a real gloo group.

It runs :func:`serve` on its end of a SOCK_SEQPACKET socket (see :mod:`.protocol`):
join a rendezvous once (:class:`~.protocol.Configure`), then start each
:class:`~.protocol.OpRequest` on its gloo group and report :class:`~.protocol.Done`
or :class:`~.protocol.Failed` from the completion callback (gloo's own threads).
The main loop never blocks in a collective, so the socket closing (the rank aborting
the group, or dying) ends the worker at once, whatever its collectives are doing.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from monarch_kernel.rank.pg.protocol import (
    MAX_FDS,
    MAX_MESSAGE,
    ConfigFailed,
    Configure,
    Done,
    Failed,
    OpRequest,
    Ready,
    TensorRef,
    Unmap,
    decode_options,
    error_text,
)
from monarch_kernel.rank.pg.shm import Slot, map_slot

#: Prefix of an OpRequest method that runs a per-tensor op over pairs of tensors (the
#: ``*_coalesced`` forms gloo lacks): ``each:_allgather_base``.
EACH = "each:"


def serve(sock: socket.socket) -> None:
    """Serve the rank on ``sock`` until it closes (then return: the caller exits)."""
    import torch

    torch.set_num_threads(1)
    _Worker(sock).loop()


class _Worker:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.slots: dict[int, Slot] = {}
        self.pg: Any = None

    def send(self, msg: object) -> None:
        data = pickle.dumps(msg, protocol=5)
        with self.send_lock:
            try:
                self.sock.send(data)
            except OSError:  # the rank is gone: the main loop ends us
                pass

    def loop(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
            except OSError:
                return
            if not data:
                return
            msg = pickle.loads(data)
            if isinstance(msg, OpRequest):
                self.run(msg, fds)
            elif isinstance(msg, Configure):
                self.configure(msg)
            elif isinstance(msg, Unmap):
                slot = self.slots.pop(msg.region, None)
                if slot is not None:
                    slot.close()

    def configure(self, msg: Configure) -> None:
        import torch.distributed as dist

        try:
            os.environ.update(msg.env)
            timeout = timedelta(seconds=msg.timeout_s)
            store = dist.TCPStore(
                msg.host, msg.port, is_master=False, wait_for_workers=False, timeout=timeout
            )
            prefixed = dist.PrefixStore(msg.prefix, store)
            self.pg = dist.ProcessGroupGloo(prefixed, msg.rank, msg.size, timeout)
        except Exception as exc:
            self.send(ConfigFailed(error_text(exc)))
            return
        self.send(Ready())

    def run(self, req: OpRequest, fds: list[int]) -> None:
        for (region, size), fd in zip(req.new_regions, fds):
            self.slots[region] = map_slot(region, size, fd)
        try:
            if self.pg is None:
                raise RuntimeError("the worker has no process group (not configured)")
            args = _resolve(req.args, self.slots)
            opts = decode_options(req.options)
            future = self._start(req.method, args, opts)
        except Exception as exc:
            self.send(Failed(req.op_id, error_text(exc)))
            return
        op_id = req.op_id
        future.add_done_callback(lambda f: self._finished(op_id, f))

    def _start(self, method: str, args: list[Any], opts: object) -> Any:
        import torch

        if method.startswith(EACH):
            call = getattr(self.pg, method[len(EACH) :])
            outputs, inputs = args
            futures = [_future(call(o, i, opts)) for o, i in zip(outputs, inputs)]
            return torch.futures.collect_all(futures)
        call = getattr(self.pg, method)
        work = call(*args) if opts is None else call(*args, opts)
        return _future(work)

    def _finished(self, op_id: int, future: Any) -> None:
        try:
            value = future.value()
            if isinstance(value, list):  # collect_all: a list of futures
                for sub in value:
                    if hasattr(sub, "value"):
                        sub.value()
        except Exception as exc:
            self.send(Failed(op_id, error_text(exc)))
            return
        self.send(Done(op_id))


def _resolve(tree: Any, regions: dict[int, Slot]) -> Any:
    """``tree`` with every TensorRef replaced by its view in its region."""
    if isinstance(tree, TensorRef):
        region = regions.get(tree.region)
        if region is None:
            raise RuntimeError(f"an op names region {tree.region}, which was never sent")
        return region.view(tree)
    if isinstance(tree, (list, tuple)):
        return [_resolve(t, regions) for t in tree]
    return tree


def _future(work: Any) -> Any:
    """The torch Future of a gloo Work (one completed by a thread for works without)."""
    import torch

    try:
        return work.get_future()
    except RuntimeError:  # send/recv works have no future
        future: Any = torch.futures.Future()

        def wait() -> None:
            try:
                work.wait()
                future.set_result(None)
            except Exception as exc:
                future.set_exception(exc)

        threading.Thread(target=wait, name="mk-pg-wait", daemon=True).start()
        return future


def run_child(body: Callable[[socket.socket], None], sock: socket.socket) -> None:
    """Run ``body(sock)`` in a freshly forked child and exit (never returns or raises)."""
    code = 0
    try:
        body(sock)
    except BaseException:
        code = 1
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        os._exit(code)
