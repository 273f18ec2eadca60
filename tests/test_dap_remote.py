"""JupyterLab's visual debugger on a ``%%remote`` cell (issue 26), through a real kernel and
jupyter_client speaking DAP as the Debugger panel does: a gutter breakpoint in a dumped
``%%remote`` cell stops the 4 ranks running it; one session shows a thread per rank, its
stack, scopes, variables (a tensor's shape, dtype, device), evaluates in a rank's frame,
steps one rank and continues every rank."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def session(kernel):
    """One debugger session for the module, as one JupyterLab page keeps it (ipykernel 7.4
    cannot initialize again after a disconnect: the last test disconnects)."""
    dap = DapClient(kernel)
    dap.info = dap.start()
    return dap


def test_kernel_info_advertises_the_debugger(kernel):
    kernel.kc.kernel_info()
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert "debugger" in reply["content"].get("supported_features", [])


def test_breakpoint_stops_four_ranks_inspect_step_continue(kernel, session):
    dap, info = session, session.info
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
    assert [f["name"] for f in frames] == ["<module>"]  # the rank's own frames are hidden
    top = frames[0]
    assert (top["line"], top["source"]["path"]) == (5, path)
    scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] == "Globals")
    variables = {v["name"]: v for v in dap.ok("variables", variablesReference=ref)["variables"]}
    assert variables["rank"]["value"] == "1"
    assert variables["t"]["value"] == "shape=(2, 3) dtype=torch.float32 device=cpu"
    assert variables["t"]["type"] == "Tensor [2, 3] torch.float32 cpu"
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

    # the modules a rank loaded (the one named, else the one JupyterLab shows)
    first = dap.ok("modules", threadId=by_rank[2], moduleCount=5)
    assert len(first["modules"]) == 5 and first["totalModules"] > 5
    listed = dap.ok("modules")["modules"]
    names = {m["name"] for m in listed}
    assert "torch" in names and "ipykernel.kernelbase" not in names  # the rank's, not ours
    assert all(m["path"].endswith(".py") for m in listed)

    refused = dap.request("pause", threadId=by_rank[0])
    assert not refused["success"] and "breakpoint()" in refused["message"]
    # the cell's source, as the panel's editor asks for it
    assert dap.ok("source", source={"path": path})["content"] == CELL

    # as JupyterLab's Continue button sends it: the thread id it has left once it forgot
    # the stopped one (1 when none); every paused rank runs on
    reply = dap.ok("continue", threadId=1)
    assert reply["allThreadsContinued"] is True
    # JupyterLab's "Paused in Debugger" overlay goes on this event
    continued = dap.wait_events("continued", 1)[0]["body"]
    assert continued == {"threadId": by_rank[1], "allThreadsContinued": True}
    result = kernel.collect(msg_id)
    assert result.reply["status"] == "ok", result.error_text
    assert "11" in result.text and "31" in result.text
    assert [t for t in dap.ok("threads")["threads"] if t["id"] in tids] == []
    assert "ipykernel.kernelbase" in {m["name"] for m in dap.ok("modules")["modules"]}
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[])


#: Rank 2 fails in ``boom`` (line 5) with ``v == 0``.
FAILING = """%%remote m
import os
rank = int(os.environ["RANK"])
def boom(v):
    return 1 / v
boom(rank - 2)"""


def test_exception_breakpoint_stops_the_failing_rank_post_mortem(kernel, session):
    dap = session
    dap.ok("setExceptionBreakpoints", filters=["uncaught"])
    dap.ok("configurationDone")
    msg_id = kernel.kc.execute(FAILING)
    stopped = dap.wait_events("stopped", 1)[0]["body"]
    assert stopped["reason"] == "exception" and "ZeroDivisionError" in stopped["text"]
    tid = stopped["threadId"]
    names = {t["id"]: t["name"] for t in dap.ok("threads")["threads"]}
    assert names[tid] == "rank 2 · MainThread"
    top = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
    assert (top["name"], top["line"]) == ("boom", 5)
    assert dap.ok("evaluate", expression="v", frameId=top["id"])["result"] == "0"
    rich = dap.ok("richInspectVariables", variableName="v", frameId=top["id"])
    assert rich["data"]["text/plain"] == "0"
    cell_frame = dap.ok("stackTrace", threadId=tid)["stackFrames"][1]
    dap.ok(
        "copyToGlobals",
        srcVariableName="rank",
        dstVariableName="failed_rank",
        srcFrameId=cell_frame["id"],
    )
    dap.ok("continue", threadId=tid)
    result = kernel.collect(msg_id)
    assert result.reply["status"] == "error" and "ZeroDivisionError" in result.error_text
    assert kernel.run("failed_rank").text == "2"
    dap.ok("setExceptionBreakpoints", filters=[])


#: Actors defined in the notebook; line 8 runs on every rank with ``v`` and ``rank`` set,
#: line 14 in an async endpoint.
ACTOR = """from monarch_kernel.actor import Actor, endpoint

class Scaler(Actor):
    @endpoint
    def scale(self, v):
        import os
        rank = int(os.environ["RANK"])
        out = v * (rank + 1)
        return out

class Later(Actor):
    @endpoint
    async def later(self, v):
        w = v + 1
        return w"""


def test_breakpoint_in_an_endpoint_defined_in_the_notebook(kernel, session):
    dap = session
    path = dap.ok("dumpCell", code=ACTOR)["sourcePath"]
    # a cell the kernel runs itself: debugpy gets the breakpoint, and the ranks too
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 8}])
    dap.ok("configurationDone")
    assert kernel.run(ACTOR).reply["status"] == "ok"
    r = kernel.run("scalers, laters = m.spawn('scalers', Scaler), m.spawn('laters', Later)")
    assert r.reply["status"] == "ok", r.error_text
    msg_id = kernel.kc.execute("scalers.scale.call(2).get()")
    stopped = dap.wait_events("stopped", 4)
    tids = {e["body"]["threadId"] for e in stopped}
    names = {t["id"]: t["name"] for t in dap.ok("threads")["threads"] if t["id"] in tids}
    by_rank = {int(n.split()[1]): i for i, n in names.items()}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert names[by_rank[2]] == "rank 2 · MainThread (mesh m)"
    top = dap.ok("stackTrace", threadId=by_rank[2])["stackFrames"][0]
    assert (top["name"], top["line"], top["source"]["path"]) == ("scale", 8, path)
    scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] == "Locals")
    listed = dap.ok("variables", variablesReference=ref)["variables"]
    local = {v["name"]: v["value"] for v in listed}
    assert (local["v"], local["rank"]) == ("2", "2") and "out" not in local
    dap.ok("next", threadId=by_rank[2])
    step = dap.wait_events("stopped", 1)[0]["body"]
    assert (step["threadId"], step["reason"]) == (by_rank[2], "step")
    top = dap.ok("stackTrace", threadId=by_rank[2])["stackFrames"][0]
    assert top["line"] == 9
    assert dap.ok("evaluate", expression="out", frameId=top["id"])["result"] == "6"
    assert dap.ok("continue", threadId=1)["allThreadsContinued"] is True  # as JupyterLab
    result = kernel.collect(msg_id)
    assert result.reply["status"] == "ok", result.error_text
    assert all(f"{{gpus={r}}}: {2 * (r + 1)}" in result.text for r in range(4)), result.text
    # an async endpoint stops the same way
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 14}])
    msg_id = kernel.kc.execute("laters.later.call(4).get()")
    stopped = dap.wait_events("stopped", 4)
    top = dap.ok("stackTrace", threadId=stopped[0]["body"]["threadId"])["stackFrames"][0]
    assert (top["name"], top["line"]) == ("later", 14)
    assert dap.ok("evaluate", expression="v", frameId=top["id"])["result"] == "4"
    dap.ok("continue", threadId=1)
    assert kernel.collect(msg_id).reply["status"] == "ok"
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[])
    r = kernel.run("scalers.scale.call(3).get()")  # no breakpoint any more: runs through
    assert r.reply["status"] == "ok" and "12" in r.text, r.error_text


#: A background cell; line 5 runs on rank 1 only.
BG = """%%remote m --bg
import os
rank = int(os.environ["RANK"])
if rank == 1:
    z = rank * 7
rank"""


def test_breakpoint_in_a_bg_cell_leaves_the_notebook_usable(kernel, session):
    dap = session
    path = dap.ok("dumpCell", code=BG)["sourcePath"]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
    dap.ok("configurationDone")
    assert kernel.run(BG).reply["status"] == "ok"
    assert kernel.run("job = _").reply["status"] == "ok"
    tid = dap.wait_events("stopped", 1)[0]["body"]["threadId"]
    assert kernel.run("6 * 7").text == "42"  # the kernel is free while rank 1 is paused
    assert kernel.run("job.done()").text == "False"
    top = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
    assert (top["line"], top["source"]["path"]) == (5, path)
    assert dap.ok("evaluate", expression="rank", frameId=top["id"])["result"] == "1"
    dap.ok("continue", threadId=1)
    r = kernel.run("print(sorted(job.wait(timeout=60).values()))")
    assert r.reply["status"] == "ok" and "[0, 1, 2, 3]" in r.stdout, r.error_text
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[])


def test_the_stop_button_ends_a_paused_cell(kernel, session):
    dap = session
    path = dap.ok("dumpCell", code=CELL)["sourcePath"]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
    dap.ok("configurationDone")
    dap.drop_events()  # (the continued events of the cells before)
    msg_id = kernel.kc.execute(CELL)
    tids = {e["body"]["threadId"] for e in dap.wait_events("stopped", 4)}
    kernel.km.interrupt_kernel()
    result = kernel.collect(msg_id)
    assert result.reply["status"] == "error" and "interrupted" in result.error_text
    # the panel is told every paused rank runs on (one by one, or all at once)
    resumed: set[int] = set()
    while not tids <= resumed:
        body = dap.wait_events("continued", 1)[0]["body"]
        resumed |= tids if body["allThreadsContinued"] else {body["threadId"]}
    assert [t for t in dap.ok("threads")["threads"] if t["name"].startswith("rank ")] == []


def test_disconnect_forgets_the_breakpoints(kernel, session):
    dap = session
    path = dap.ok("dumpCell", code=CELL)["sourcePath"]
    dap.ok("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
    dap.ok("disconnect", restart=False, terminateDebuggee=True)
    r = kernel.run(CELL)  # runs through: no breakpoint, no debugger
    assert r.reply["status"] == "ok" and "31" in r.text, r.error_text
    assert r.reply["status"] == "ok" and "31" in r.text, r.error_text
