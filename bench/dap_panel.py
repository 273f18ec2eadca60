"""How fast the visual debugger's panel fills for paused ranks (issue 26).

A real monarch kernel (jupyter_client) with a mesh of N local ranks; the client speaks
DAP as JupyterLab's Debugger panel does: a gutter breakpoint in a ``%%remote`` cell stops
every rank; for each rank's ``stopped`` event the client then sends what JupyterLab sends
to fill the Callstack and Variables panels (``stackTrace``, ``scopes``, ``variables``) and
times it from sending the first request to the last reply (the kernel's time plus two
local round trips on the control channel). ``threads`` and ``stackTrace`` are timed
alone too (the issue's 50 ms bound). Medians and maxima over all ranks.

    python -m bench.dap_panel [RANKS ...]      # default: 4 64
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dap_client import DapClient
from kernel_client import Kernel

from monarch_kernel.launchers.local import MAX_RANKS_ENV

CELL = """%%remote m
import os, torch
rank = int(os.environ["RANK"])
t = torch.zeros(2, 3) + rank
x = rank * 10
x"""


def _ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:.1f} ms, max {max(samples) * 1e3:.1f} ms"


def measure(ranks: int) -> dict[str, list[float]]:
    """The times (s) for one mesh of ``ranks`` ranks paused at one breakpoint."""
    k = Kernel(env={MAX_RANKS_ENV: str(ranks)})
    try:
        r = k.run(f"%mesh m --gpus {ranks}", timeout=300)
        assert "ready" in r.stdout, r.stderr + r.error_text
        dap = DapClient(k)
        dap.start()
        path = dap.ok("dumpCell", code=CELL)["sourcePath"]
        dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
        dap.ok("configurationDone")
        msg_id = k.kc.execute(CELL)
        stopped = dap.wait_events("stopped", ranks, timeout=300)
        times: dict[str, list[float]] = {"panel": [], "threads": [], "stackTrace": []}
        for event in stopped:
            tid = event["body"]["threadId"]
            t0 = time.perf_counter()
            top = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
            scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
            dap.ok("variables", variablesReference=scopes[-1]["variablesReference"])
            times["panel"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert len(dap.ok("threads")["threads"]) >= ranks
            times["threads"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dap.ok("stackTrace", threadId=tid)
            times["stackTrace"].append(time.perf_counter() - t0)
        dap.ok("continue", threadId=stopped[0]["body"]["threadId"])
        assert k.collect(msg_id, timeout=300).reply["status"] == "ok"
        return times
    finally:
        k.shutdown()


def main(argv: list[str]) -> None:
    for ranks in [int(a) for a in argv] or [4, 64]:
        t = measure(ranks)
        print(f"| stopped event → panel filled, {ranks} ranks | {_ms(t['panel'])} |")
        print(f"| threads, {ranks} paused ranks | {_ms(t['threads'])} |")
        print(f"| stackTrace, {ranks} paused ranks | {_ms(t['stackTrace'])} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
