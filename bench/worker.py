"""One peer's benchmarks in a process of their own: ``python -m bench.worker PEER SETTINGS OUT``.

A fresh process per peer keeps runtimes from disturbing each other (threads, sockets,
signal handlers) and makes "cold" start-up figures really cold. A peer whose library
cannot be imported reports every figure as ``not available: <reason>``.
"""

from __future__ import annotations

import importlib
import sys

from bench.common import Recorder, Settings

MODULES = {
    "zmq": "bench.raw_zmq",
    "ours": "bench.ours",
    "monarch": "bench.monarch_peer",
    "ray": "bench.ray_peer",
    "ipp": "bench.ipp_peer",
    "dask": "bench.dask_peer",
    "train": "bench.train",
}


def main(argv: list[str]) -> int:
    peer, settings_json, out = argv
    settings = Settings.from_json(settings_json)
    rec = Recorder(out)
    try:
        module = importlib.import_module(MODULES[peer])
        available = getattr(module, "available", lambda: None)()
    except Exception as exc:  # reported, not raised
        available = f"{type(exc).__name__}: {exc}"
    if available:
        rec.note("_unavailable", f"not available: {available}")
        return 0
    if peer not in ("zmq", "train") and settings.wants("rtt"):
        from bench.raw_zmq import floor_rtt

        rec.value("floor_rtt", floor_rtt())
    module.run(settings, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
