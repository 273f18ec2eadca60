"""JupyterLab's visual debugger on a ``%%remote`` cell (issue 26), through a real kernel and
jupyter_client speaking DAP as the Debugger panel does: a gutter breakpoint in a dumped
``%%remote`` cell stops the 4 ranks running it; one session shows a thread per rank, its
stack, scopes, variables (a tensor's shape, dtype, device), evaluates in a rank's frame,
steps one rank and continues every rank."""

from __future__ import annotations

import os

import pytest
from dap_client import DapClient
from ipykernel.compiler import murmur2_x86
from kernel_client import Kernel

from monarch_kernel.launchers.local import MAX_RANKS_ENV

pytestmark = pytest.mark.local

#: Line 5 (the %%remote line is line 1) runs on every rank with ``t`` and ``x`` set.
CELL = """%%remote m
import os, torch
rank = int(os.environ["RANK"])
t = torch.zeros(2, 3) + rank
x = rank * 10
y = x + 1
y"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env={MAX_RANKS_ENV: "4"})
    r = k.run("%mesh m --gpus 4")
    assert "ready" in r.stdout, r.stderr + r.error_text
    yield k
    k.shutdown_and_check()


def test_kernel_info_advertises_the_debugger(kernel):
    kernel.kc.kernel_info()
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert "debugger" in reply["content"].get("supported_features", [])


def test_breakpoint_stops_four_ranks_inspect_step_continue(kernel):
    dap = DapClient(kernel)
    info = dap.start()
    assert info["hashMethod"] == "Murmur2"
    path = dap.ok("dumpCell", code=CELL)["sourcePath"]
    # the path JupyterLab computes itself from debugInfo (a reloaded page finds its cells)
    digest = murmur2_x86(CELL, info["hashSeed"])
    assert path == f"{info['tmpFilePrefix']}{digest}{info['tmpFileSuffix']}"
    bps = dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
    assert [b["line"] for b in bps["breakpoints"]] == [5]
    assert any(b["source"] == path for b in dap.ok("debugInfo")["breakpoints"])
    dap.ok("configurationDone")

    msg_id = kernel.kc.execute(CELL)
    stopped = dap.wait_events("stopped", 4)
    tids = sorted(e["body"]["threadId"] for e in stopped)
    assert len(set(tids)) == 4 and {e["body"]["reason"] for e in stopped} == {"breakpoint"}
    threads = {t["id"]: t["name"] for t in dap.ok("threads")["threads"]}
    by_rank = {int(n.split()[1]): i for i, n in threads.items() if n.startswith("rank ")}
    assert sorted(by_rank) == [0, 1, 2, 3] and sorted(by_rank.values()) == tids
    assert threads[by_rank[3]] == "rank 3 · MainThread"

    frames = dap.ok("stackTrace", threadId=by_rank[1])["stackFrames"]
    top = frames[0]
    assert (top["line"], top["source"]["path"]) == (5, path)
    scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] == "Globals")
    variables = {v["name"]: v for v in dap.ok("variables", variablesReference=ref)["variables"]}
    assert variables["rank"]["value"] == "1"
    assert variables["t"]["value"] == "shape=(2, 3) dtype=torch.float32 device=cpu"
    fields = dap.ok("variables", variablesReference=variables["t"]["variablesReference"])
    assert {v["name"]: v["value"] for v in fields["variables"]}["shape"] == "(2, 3)"
    assert "x" not in variables  # line 5 has not run yet
    assert dap.ok("evaluate", expression="rank * 100 + t.sum().item()", frameId=top["id"])[
        "result"
    ] == str(100 + 6.0)
    # another rank's frame answers with its own values
    top3 = dap.ok("stackTrace", threadId=by_rank[3])["stackFrames"][0]
    assert dap.ok("evaluate", expression="rank", frameId=top3["id"])["result"] == "3"
    bad = dap.request("evaluate", expression="no_such_name", frameId=top3["id"])
    assert not bad["success"] and "NameError" in bad["message"]

    dap.ok("next", threadId=by_rank[1])  # rank 1 alone runs line 5
    step = dap.wait_events("stopped", 1)[0]["body"]
    assert (step["threadId"], step["reason"]) == (by_rank[1], "step")
    frames = dap.ok("stackTrace", threadId=by_rank[1])["stackFrames"]
    assert frames[0]["line"] == 6
    assert dap.ok("evaluate", expression="x", frameId=frames[0]["id"])["result"] == "10"

    reply = dap.ok("continue", threadId=by_rank[1])
    assert reply["allThreadsContinued"] is True
    result = kernel.collect(msg_id)
    assert result.reply["status"] == "ok", result.error_text
    assert "11" in result.text and "31" in result.text
    assert [t for t in dap.ok("threads")["threads"] if t["id"] in tids] == []
    dap.ok("disconnect", restart=False, terminateDebuggee=True)


def test_without_the_debugger_breakpoints_use_pdb_prompts(kernel):
    # after disconnect the cell's gutter breakpoints are gone: it runs through
    r = kernel.run(CELL)
    assert r.reply["status"] == "ok" and "31" in r.text, r.error_text
    assert os.environ.get("PYTHONBREAKPOINT") != "0"
