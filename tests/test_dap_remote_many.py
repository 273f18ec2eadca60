"""The visual debugger with 64 ranks paused at once (issue 26): one session lists a
thread per rank, every rank's stack answers, ``continue`` resumes all 64 and the cell
finishes. The speed figures are in ``python -m bench.dap_panel``."""

from __future__ import annotations

import pytest
from dap_client import DapClient
from kernel_client import Kernel

from monarch_kernel.launchers.local import MAX_RANKS_ENV

pytestmark = pytest.mark.local

RANKS = 64
CELL = """%%remote m
import os
rank = int(os.environ["RANK"])
x = rank * 10
x"""


def test_sixty_four_paused_ranks_in_one_session():
    k = Kernel(env={MAX_RANKS_ENV: str(RANKS)})
    try:
        r = k.run(f"%mesh m --gpus {RANKS}", timeout=300)
        assert "ready" in r.stdout, r.stderr + r.error_text
        dap = DapClient(k)
        dap.start()
        path = dap.ok("dumpCell", code=CELL)["sourcePath"]
        dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 4}])
        dap.ok("configurationDone")
        msg_id = k.kc.execute(CELL)
        stopped = dap.wait_events("stopped", RANKS, timeout=300)
        threads = {t["id"]: t["name"] for t in dap.ok("threads")["threads"]}
        assert sorted(threads.values()) == sorted(f"rank {r} · MainThread" for r in range(RANKS))
        assert {e["body"]["threadId"] for e in stopped} == set(threads)
        for tid in threads:
            top = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
            assert (top["line"], top["source"]["path"]) == (4, path)
        last = max(threads, key=lambda t: int(threads[t].split()[1]))
        top = dap.ok("stackTrace", threadId=last)["stackFrames"][0]
        assert dap.ok("evaluate", expression="rank", frameId=top["id"])["result"] == "63"
        assert dap.ok("continue", threadId=last)["allThreadsContinued"] is True
        result = k.collect(msg_id, timeout=300)
        assert result.reply["status"] == "ok", result.error_text
        assert "630" in result.text
    finally:
        k.shutdown_and_check(timeout=60)
