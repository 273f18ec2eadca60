"""Detachable meshes (ours only: no peer has them).

* ``attach_dashboard``: seconds from ``attach()`` of a mesh whose 8 ranks reported 10k
  metric points each (``report(step=, loss=)``) to a dashboard that charts all of them
  (the design's target: <= 2 s). The mesh is made by a controller process that is then
  SIGKILLed, as a kernel killed by the OOM killer would be.
* ``attached_sps`` / ``detached_sps``: steps/s of a loop that reports and prints every
  step, on a mesh of 2 ranks, while a controller is attached and while none is (their
  ratio, ``detached_ratio``: running without a controller must not be slower).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from bench.common import Recorder, Settings

#: The controller that makes the mesh, fills its history, measures steps/s attached,
#: starts the detached loop and kills itself.
CONTROLLER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from monarch_kernel.actor import Actor, endpoint, this_host

    class Trainer(Actor):
        @endpoint
        def fill(self, points):
            import monarch_kernel
            for i in range(points):
                monarch_kernel.report(step=i + 1, loss=1.0 / (i + 1))

        @endpoint
        def loop(self, seconds, path=None):
            import os, time, monarch_kernel
            if path:
                open(path + ".started", "w").close()
            n, end = 0, time.monotonic() + seconds
            while time.monotonic() < end:
                n += 1
                monarch_kernel.report(step=1_000_000 + n, loss=0.5)
                print(f"step {n}", flush=True)
            if path:
                with open(path + ".tmp", "w") as f:
                    f.write(str(n / seconds))
                os.replace(path + ".tmp", path)
            return n / seconds

    ranks, points, seconds, out = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                   sys.argv[4])
    procs = this_host().spawn_procs(per_host={"gpus": ranks}, name="bdet", detachable=True,
                                    keep=600)
    procs.spawn("trainer", Trainer).fill.call(points).get()
    # the loop on a mesh of its own: its reports do not add to the other's history
    two = this_host().spawn_procs(per_host={"gpus": 2}, name="bsps", detachable=True, keep=600)
    loop = two.spawn("trainer", Trainer)
    attached = sum(loop.loop.call(seconds).get().values()) / 2
    paths = [os.path.join(out, f"sps{r}") for r in range(2)]
    for r, path in enumerate(paths):
        loop.slice(gpus=r).loop.broadcast(seconds, path)
    while not all(os.path.exists(p + ".started") for p in paths):  # sent, and running
        time.sleep(0.01)
    print("mk-result", json.dumps({"attached_sps": attached, "paths": paths}), flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def ours(s: Settings, rec: Recorder) -> None:
    ranks, points, seconds = (4, 2000, 2.0) if s.quick else (8, 10_000, 3.0)
    out = tempfile.mkdtemp(prefix="mk-bench-detach-")
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(out, "runtime")
    argv = [sys.executable, "-c", CONTROLLER, str(ranks), str(points), str(seconds), out]
    try:
        with rec.guard("attach_dashboard", "attached_sps", "detached_sps", "detached_ratio"):
            _measure(rec, argv, ranks, points, seconds)
    finally:
        _stop_left_over()
        shutil.rmtree(out, ignore_errors=True)


def _measure(rec: Recorder, argv: list[str], ranks: int, points: int, seconds: float) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the controller failed: {proc.stderr[-2000:]}")
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("mk-result ")]
    if not result:
        raise RuntimeError(f"the controller said nothing: {proc.stderr[-2000:]}")
    info = json.loads(result[-1].removeprefix("mk-result "))
    rec.value("attached_sps", info["attached_sps"])
    detached = _read_all(info["paths"], seconds + 60)
    rec.value("detached_sps", sum(detached) / len(detached))
    rec.value("detached_ratio", (sum(detached) / len(detached)) / info["attached_sps"])
    rec.value("attach_dashboard", _attach_dashboard(ranks, points))


def _stop_left_over() -> None:
    """Stop the mesh if a failure left it detached."""
    from monarch_kernel.controller.detach.attach import AttachError, stop_detached

    for name in ("bdet", "bsps"):
        try:
            stop_detached(name, force=True)
        except AttachError:
            pass  # stopped already (or never made)


def _attach_dashboard(ranks: int, points: int) -> float:
    """Seconds from attach() to a dashboard charting every rank's ``points`` points."""
    from monarch_kernel.actor import ProcMesh
    from monarch_kernel.controller.detach.attach import attach
    from monarch_kernel.widgets import dashboard

    t0 = time.perf_counter()
    attached = attach("bdet")
    procs = ProcMesh(attached.runtime)
    try:
        state = dashboard(procs).state
        attached.finish()
        deadline = time.monotonic() + 60
        while not _charted(state, ranks, points):
            state.drain()
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not chart the whole history in 60 s")
        return time.perf_counter() - t0
    finally:
        procs.stop()


def _charted(state: object, ranks: int, points: int) -> bool:
    series = getattr(state, "metrics", {}).get("loss", {})
    return len(series) == ranks and all(s.count >= points for s in series.values())


def _read_all(paths: list[str], timeout: float) -> list[float]:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise RuntimeError("the detached loop did not report")
        time.sleep(0.1)
    values = []
    for path in paths:
        with open(path) as f:
            values.append(float(f.read()))
    return values
