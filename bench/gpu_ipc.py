"""CUDA tensors rank to rank on one GPU through the data plane (CUDA IPC, device to
device) next to a plain device-to-device copy, and a CUDA tensor from the controller to a
rank (an endpoint argument of the notebook's call). Two kinds of rank-to-rank read:
``TensorRef.get`` semantics (each read asks the owner, which synchronizes its device:
the value as of the read; the mapping is kept), and an ``RDMABuffer(one_sided=True)``
read (one-sided after the first, as RDMA: a device copy only). Rank-to-rank endpoint
calls carry a CUDA argument or return a CUDA result by CUDA IPC
(``rank.dataplane.cuda_args``, ``cuda_results``): their rows time the whole call. The
controller-to-rank rows time the notebook's call by CUDA IPC and pickled as before, with
where the pickled path's time goes (the controller's pickling, a device-to-host copy;
the rank's host-to-device copy; each next to the same copy with pinned memory).

``python -m bench.gpu_ipc OUT_JSON`` writes ``{"rows": [{"what", "value", "unit",
"target", "ok"}], "failures": [str]}``. Each measurement is tried on its own (a failure
is a traceback in ``failures``, the others still run); the whole run stops itself after
:data:`LIMIT_S` seconds, writing what it has. Without CUDA: one skipped row, exit 0.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from monarch_kernel.actor import Actor, endpoint

MiB = 1 << 20
SIZES_MIB = (1, 64, 256, 1024)
#: Controller -> rank goes through host memory (pickled): slow; the smaller sizes only.
CONTROLLER_SIZES_MIB = (1, 64, 256)
#: Argument sizes where IPC and pickling are timed side by side (``cuda_args.MIN_BYTES``).
THRESHOLD_KIB = (128, 512, 2048)
LIMIT_S = 60.0
RATIO = 0.5  #: target: IPC rank to rank at least this share of a D2D copy's GB/s

rows: list[dict[str, Any]] = []
failures: list[str] = []
_lock = threading.Lock()


def row(what: str, value: float, unit: str, target: str, ok: bool | None) -> None:
    with _lock:
        rows.append({"what": what, "value": value, "unit": unit, "target": target, "ok": ok})


def write(path: str) -> None:
    with _lock:
        data = {"rows": list(rows), "failures": list(failures)}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def attempt(what: str, fn: Any) -> Any:
    try:
        return fn()
    except BaseException:  # one failure must not stop the others
        with _lock:
            failures.append(f"{what}:\n{traceback.format_exc()}")
        return None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _reps(mib: int) -> int:
    return 20 if mib <= 64 else 8


class Ipc(Actor):
    """Owns CUDA tensors and reads others' by the data plane (timed inside the rank)."""

    def __init__(self) -> None:
        self.kept: dict[int, Any] = {}

    @endpoint
    def share(self, mib: int):
        import torch

        import monarch_kernel

        t = torch.ones(mib * MiB // 4, device="cuda")
        self.kept[mib] = t
        return monarch_kernel.share(t)

    @endpoint
    def read_timed(self, ref, reps: int, transport: str = "auto") -> list[float]:
        import torch

        dst = torch.empty(ref.shape, dtype=getattr(torch, ref.dtype), device="cuda")
        # (the first read maps the handle, kept, and makes the pinned buffers)
        return _timed_reads(lambda: ref.read_into(dst, transport), dst, reps)

    @endpoint
    def buffer(self, mib: int):
        import torch

        from monarch_kernel.rdma import RDMABuffer

        t = torch.ones(mib * MiB // 4, device="cuda")
        self.kept[-mib] = (t, RDMABuffer(t, one_sided=True))
        return self.kept[-mib][1]

    @endpoint
    def read_buffer_timed(self, buf, mib: int, reps: int) -> list[float]:
        import torch

        dst = torch.empty(mib * MiB // 4, device="cuda")
        # (the first read maps it, the owner answering; one-sided from then on)
        return _timed_reads(lambda: buf.read_into(dst).get(), dst, reps)

    @endpoint
    def take(self, t) -> str:
        return str(t.device)

    @endpoint
    def send_timed(self, other, mib: float, reps: int) -> list[float]:
        """Seconds of ``reps`` answered calls to ``other.take`` with a CUDA tensor of
        ``mib`` MiB (rank to rank: by CUDA IPC, ``rank.dataplane.cuda_args``); one first."""
        import torch

        t = torch.ones(int(mib * MiB) // 4, device="cuda")
        other.take.call_one(t).get()
        return _timings(lambda: other.take.call_one(t).get(), reps)

    @endpoint
    def handles_from(self, nbytes: int) -> None:
        """CUDA tensors of ``nbytes`` or more go as handles in this rank's calls (the
        threshold, ``cuda_args.MIN_BYTES``; a huge one: every tensor is pickled)."""
        from monarch_kernel.rank.dataplane import cuda_args

        cuda_args.MIN_BYTES = nbytes

    @endpoint
    def give(self, mib: int):
        """A CUDA tensor of ``mib`` MiB this actor keeps (an endpoint's result)."""
        import torch

        if mib not in self.kept:
            self.kept[mib] = torch.ones(mib * MiB // 4, device="cuda")
        return self.kept[mib]

    @endpoint
    def fetch_timed(self, other, mib: int, reps: int) -> list[float]:
        """Seconds of ``reps`` answered calls to ``other.give``, each read (rank to rank:
        the result by CUDA IPC, ``rank.dataplane.cuda_results``); one first."""
        other.give.call_one(mib).get()
        return _timings(lambda: other.give.call_one(mib).get(), reps)

    @endpoint
    def h2d_timed(self, mib: int, pinned: bool) -> float:
        """Seconds of one host-to-device copy of ``mib`` MiB from pageable (as an endpoint
        argument's bytes are placed) or pinned host memory (median of 3)."""
        import torch

        host = torch.ones(mib * MiB // 4, pin_memory=pinned)
        return _median(_timings(lambda: host.to("cuda"), 3, torch.cuda.synchronize))

    @endpoint
    def phases(self) -> dict:
        """Seconds and counts of this rank's CUDA IPC phases so far (cuda_ipc)."""
        from monarch_kernel.rank.dataplane import cuda_ipc

        return {"seconds": dict(cuda_ipc.phase_seconds), "counts": dict(cuda_ipc.phase_counts)}

    @endpoint
    def counters(self) -> dict:
        from monarch_kernel.rank.dataplane.plane import counters

        return counters()


def _timings(fn: Any, times: int, then: Any = None) -> list[float]:
    """Seconds of each of ``times`` calls of ``fn()`` (each followed by ``then()``, timed
    with it: a device synchronize, for work ``fn`` only queues)."""
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        if then is not None:
            then()
        took.append(time.perf_counter() - t0)
    return took


def _timed_reads(read: Any, dst: Any, reps: int) -> list[float]:
    """Seconds of ``read()`` (into ``dst``, a tensor of ones) 1 + ``reps`` times: the first
    read's (it maps what the others reuse: callers set it apart), then each other's."""
    took = _timings(read, reps + 1)
    assert float(dst[:4].sum()) == 4.0
    return took


def d2d(mib: int) -> float:
    """GB/s of ``dst.copy_(src)`` on one GPU (bytes copied per second)."""
    import torch

    src = torch.ones(mib * MiB // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    took = []
    for _ in range(_reps(mib)):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        took.append(start.elapsed_time(end) / 1e3)
    return mib * MiB / _median(took) / 1e9


def main(argv: list[str]) -> int:
    out = argv[1] if len(argv) > 1 else "gpu_ipc.json"
    started = time.monotonic()

    def watchdog() -> None:
        time.sleep(LIMIT_S)
        with _lock:
            failures.append(f"stopped at the run's limit of {LIMIT_S:.0f} s")
        write(out)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    import torch

    if not torch.cuda.is_available():
        row("gpu_ipc", 0.0, "", "needs CUDA: skipped", None)
        write(out)
        return 0
    row("device", 0.0, torch.cuda.get_device_name(0), "", None)
    base: dict[int, float] = {}
    for mib in SIZES_MIB:
        gbs = attempt(f"d2d {mib} MiB", lambda mib=mib: d2d(mib))
        if gbs is not None:
            base[mib] = gbs
            row(f"D2D copy on one GPU, {mib} MiB", gbs, "GB/s", "baseline", None)
    write(out)
    from monarch_kernel.actor import this_host

    procs = attempt("spawn", lambda: this_host().spawn_procs(per_host={"gpus": 2}))
    if procs is None:
        write(out)
        return 0
    try:
        actors = procs.spawn("ipc", Ipc)
        owner, reader = actors.slice(gpus=0), actors.slice(gpus=1)

        def rank_to_rank(mib: int, transport: str = "auto") -> None:
            ref = owner.share.call_one(mib).get()
            before = (owner.phases.call_one().get(), reader.phases.call_one().get())
            first, *took = reader.read_timed.call_one(ref, _reps(mib), transport).get()
            after = (owner.phases.call_one().get(), reader.phases.call_one().get())
            gbs = mib * MiB / _median(took) / 1e9
            if transport == "auto":
                reads = len(took) + 1
                phases_row(mib, before, after, (first + sum(took)) / reads, reads)
            if transport == "auto":
                want = RATIO * base[mib] if mib in base else None
                ok = None if want is None else gbs >= want
                target = f">= {RATIO}x D2D" + (f" ({want:.0f} GB/s)" if want else "")
                row(f"rank->rank CUDA by IPC (data plane), {mib} MiB", gbs, "GB/s", target, ok)
            else:
                row(f"rank->rank CUDA staged (transport={transport}), {mib} MiB", gbs, "GB/s",
                    "info: pinned host memory, for comparison", None)  # fmt: skip

        def phases_row(mib: int, before: Any, after: Any, mean: float, reads: int) -> None:
            """Where one read's time goes: ms per read in each phase (the owner's describe
            or renewal; the reader's map, copy, unmap), the rest being the request and
            its answer; ``mean`` and the phases over all ``reads``, the first (which
            maps the tensor, kept for the others) included."""
            parts = {}
            for b, a in zip(before, after, strict=True):
                for phase, secs in a["seconds"].items():
                    if a["counts"][phase] - b["counts"][phase]:
                        parts[phase] = (secs - b["seconds"][phase]) / reads
            known = sum(parts.values())
            text = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in parts.items())
            row(f"rank->rank CUDA by IPC, {mib} MiB: ms per read (mean of {reads})",
                mean * 1e3, "ms", f"info: {text}, messages {(mean - known) * 1e3:.3f}",
                None)  # fmt: skip

        def one_sided(mib: int) -> None:
            buf = owner.buffer.call_one(mib).get()
            _first, *took = reader.read_buffer_timed.call_one(buf, mib, _reps(mib)).get()
            gbs = mib * MiB / _median(took) / 1e9
            want = RATIO * base[mib] if mib in base else None
            row(f"rank->rank CUDA RDMABuffer read (one-sided, kept mapping), {mib} MiB", gbs,
                "GB/s", f">= {RATIO}x D2D" + (f" ({want:.0f} GB/s)" if want else ""),
                None if want is None else gbs >= want)  # fmt: skip

        for mib in SIZES_MIB:
            attempt(f"rank->rank {mib} MiB", lambda mib=mib: rank_to_rank(mib))
            write(out)
        for mib in SIZES_MIB:
            attempt(f"RDMABuffer {mib} MiB", lambda mib=mib: one_sided(mib))
            write(out)
        attempt("rank->rank staged 64 MiB", lambda: rank_to_rank(64, "tcp"))

        def argument(mib: int) -> None:
            took = owner.send_timed.call_one(reader, mib, _reps(mib)).get()
            row(f"rank->rank CUDA endpoint argument (by IPC), {mib} MiB",
                mib * MiB / _median(took) / 1e9, "GB/s",
                "info: a call's CUDA argument; was pickled through host memory", None)  # fmt: skip

        def each_size(what: str, measure: Any) -> None:
            """``measure(mib)`` at each of CONTROLLER_SIZES_MIB, while time is left."""
            for mib in CONTROLLER_SIZES_MIB:
                if time.monotonic() - started > LIMIT_S - 15:
                    failures.append(f"{what} {mib} MiB skipped: near the time limit")
                    break
                attempt(f"{what} {mib} MiB", lambda mib=mib: measure(mib))
                write(out)

        def result(mib: int) -> None:
            took = reader.fetch_timed.call_one(owner, mib, _reps(mib)).get()
            row(f"rank->rank CUDA endpoint result (by IPC), {mib} MiB",
                mib * MiB / _median(took) / 1e9, "GB/s",
                "info: a call's CUDA result; was pickled through host memory", None)  # fmt: skip

        def threshold(kib: int) -> None:
            """A small CUDA argument by IPC and pickled, alternating (the choice of
            ``cuda_args.MIN_BYTES``, 1 MiB: where the handle's fixed cost, a request and
            a mapping, meets the bytes' time through host memory)."""
            from monarch_kernel.rank.dataplane.cuda_args import MIN_BYTES

            took: dict[str, list[float]] = {"ipc": [], "pickled": []}
            try:
                for _ in range(3):
                    for how, nbytes in (("ipc", 0), ("pickled", 1 << 62)):
                        owner.handles_from.call_one(nbytes).get()
                        took[how] += owner.send_timed.call_one(reader, kib / 1024, 5).get()
            finally:
                owner.handles_from.call_one(MIN_BYTES).get()
            ipc, pickled = _median(took["ipc"]), _median(took["pickled"])
            row(f"rank->rank CUDA argument, {kib} KiB: by IPC / pickled (call time)",
                ipc / pickled, "x", f"info: {ipc * 1e3:.2f} ms vs {pickled * 1e3:.2f} ms; "
                "below 1: IPC pays at this size (handles from 1 MiB now)", None)  # fmt: skip

        for kib in THRESHOLD_KIB:
            attempt(f"threshold {kib} KiB", lambda kib=kib: threshold(kib))
        write(out)
        each_size("rank->rank argument", argument)
        each_size("rank->rank result", result)
        counts = attempt("counters", lambda: reader.counters.call_one().get())
        if counts is not None:
            row("receiver's bytes_ipc", float(counts["bytes_ipc"]), "bytes", "> 0", None)
            row("receiver's ipc_fallbacks", float(counts["ipc_fallbacks"]), "count", "0",
                counts["ipc_fallbacks"] == 0)  # fmt: skip
            row("receiver's one-sided RDMA reads", float(counts["ipc_one_sided"]), "count",
                "> 0", counts["ipc_one_sided"] > 0)  # fmt: skip
        write(out)

        def controller_to_rank(mib: int) -> None:
            """The notebook's call with a CUDA argument: by CUDA IPC (the notebook's
            process uses CUDA: ``cuda_args.may_share``), and pickled through host memory
            as before (every tensor below the threshold)."""
            from monarch_kernel.rank.dataplane import cuda_args

            t = torch.ones(mib * MiB // 4, device="cuda")
            threshold = cuda_args.MIN_BYTES
            for how, nbytes, info in (
                ("by IPC", threshold, "info: the notebook shares a device copy"),
                ("pickled", 1 << 62, "info: through host memory (D2H, message, H2D)"),
            ):
                cuda_args.MIN_BYTES = nbytes
                try:
                    assert owner.take.call_one(t).get().startswith("cuda")  # warm
                    took = _timings(lambda: owner.take.call_one(t).get(), 3 if mib > 64 else 5)
                finally:
                    cuda_args.MIN_BYTES = threshold
                row(f"controller->rank CUDA endpoint argument ({how}), {mib} MiB",
                    mib * MiB / _median(took) / 1e9, "GB/s", info, None)  # fmt: skip

        def controller_phases(mib: int) -> None:
            """Where a controller->rank CUDA argument's time goes: the controller's
            pickling (its device-to-host copy into fresh pageable memory), the same copy
            into pinned memory for comparison, and the rank's host-to-device copy from
            pageable and from pinned memory; the rest is the message."""
            from monarch_kernel.wire.serialize import dumps

            t = torch.ones(mib * MiB // 4, device="cuda")
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            parts = {}
            for name, fn in (("pickle (D2H pageable)", lambda: dumps((t,))),
                             ("D2H pinned", lambda: pinned.copy_(t))):  # fmt: skip
                parts[name] = _median(_timings(fn, 3, torch.cuda.synchronize))
            for name, pin in (("rank H2D pageable", False), ("rank H2D pinned", True)):
                parts[name] = owner.h2d_timed.call_one(mib, pin).get()
            text = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
            row(f"controller->rank CUDA argument, {mib} MiB: phases (ms)",
                sum(parts[k] for k in ("pickle (D2H pageable)", "rank H2D pageable")) * 1e3,
                "ms", f"info: {text}", None)  # fmt: skip

        each_size("controller->rank phases", controller_phases)
        each_size("controller->rank", controller_to_rank)
    finally:
        attempt("stop", procs.stop)
        write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
