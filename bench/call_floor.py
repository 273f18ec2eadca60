"""Row 2 beside the floor: gathered calls to N ranks in blocks alternating with raw
ZeroMQ pings to N server processes (one message out to each, N replies gathered), in
ours' worker with the mesh alive (see :mod:`bench.floor` for why beside, not apart)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from bench.common import SMALL_MESH, Recorder, Settings, median
from bench.floor import RawFloor, alternating
from bench.shm_floor import MODES as SHM_MODES
from bench.shm_floor import ShmServers
from bench.wire_floor import MODES, WireServers


def gathered_vs_floor(
    s: Settings, rec: Recorder, ns: list[int], call_on: Callable[[int], Callable[[], object]]
) -> None:
    """``call_{n}_beside``, ``call_{n}_floor`` and their ratio ``call_{n}_vs_floor``;
    for N up to :data:`~bench.common.SMALL_MESH`, also the floors of our wire format
    (:func:`wire_floors`)."""
    for n in ns:
        keys = (f"call_{n}_beside", f"call_{n}_floor", f"call_{n}_vs_floor")
        with rec.guard(*keys):
            floor = RawFloor(servers=n)
            try:
                got = alternating(
                    call_on(n), floor.ping_all, s.call_iters, s.warmup // 4, 2 * s.loop_budget_s
                )
            finally:
                floor.close()
            rec.value(keys[0], median(got.ours), samples=len(got.ours))
            rec.value(keys[1], median(got.floor), samples=len(got.floor))
            rec.ratio(keys[2], keys[0], keys[1])
        if n <= SMALL_MESH:
            wire_floors(s, rec, n)


def wire_floors(s: Settings, rec: Recorder, n: int) -> None:
    """``call_{n}_wire_{mode}_vs_floor``: a gathered no-op call to N server processes
    in each mode of :mod:`bench.wire_floor` (pickles; + our header; + the signature;
    our codec), and ``call_{n}_shm_{mode}_vs_floor``: the same over shared memory and
    eventfd wake-ups instead of ZeroMQ (:mod:`bench.shm_floor`: one byte; our codec),
    each timed in blocks alternating with the raw pings to N processes."""
    starts: list[tuple[str, Callable[[], WireServers | ShmServers]]] = [
        (f"call_{n}_wire_{mode}_vs_floor", functools.partial(WireServers, n, mode))
        for mode in MODES
    ]
    starts += [
        (f"call_{n}_shm_{mode}_vs_floor", functools.partial(ShmServers, n, mode))
        for mode in SHM_MODES
    ]
    with rec.guard(*(key for key, _ in starts)):
        floor = RawFloor(servers=n)
        try:
            for key, start in starts:
                with rec.guard(key):
                    servers = start()
                    try:
                        got = alternating(
                            servers.call,
                            floor.ping_all,
                            s.call_iters,
                            s.warmup // 4,  # as the rows above: the processes are fresh
                            s.loop_budget_s,
                        )
                    finally:
                        servers.close()
                    rec.value(
                        key,
                        median(got.ours) / median(got.floor),
                        us=round(median(got.ours) * 1e6, 1),
                        floor_us=round(median(got.floor) * 1e6, 1),
                        samples=len(got.ours),
                    )
        finally:
            floor.close()
