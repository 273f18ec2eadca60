"""Rows 6 (notebook path): a trivial ``%%remote`` cell on 4 ranks, the delay from a
rank's ``print`` to the notebook, and a print flood from one rank next to the same
prints in plain ipykernel, through real kernels (jupyter_client)."""

from __future__ import annotations

import sys
import time

from bench.common import Recorder, Settings, median, sample

PRINTS = 200
#: Lines of the print-flood row.
FLOOD_LINES = 100_000


class _Client:
    def __init__(self, kernel_name: str):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name=kernel_name)

    def run(self, code: str, on_iopub=None, timeout: float = 120) -> None:
        msg_id = self.kc.execute(code)
        while True:
            m = self.kc.get_iopub_msg(timeout=timeout)
            if on_iopub is not None:
                on_iopub(m)
            if (
                m["parent_header"].get("msg_id") == msg_id
                and m["msg_type"] == "status"
                and m["content"]["execution_state"] == "idle"
            ):
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content'].get('evalue')}")

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _print_delays(k: _Client, magic: str, prints: int) -> list[float]:
    """Seconds from a rank's ``print`` (timestamped) to its arrival at the client: the
    first message that shows the line. Ours and a plain kernel send ``stream`` messages;
    ipyparallel's ``%%px --stream`` redraws one display with all the lines so far
    (``display_data``, then ``update_display_data``)."""
    delays: list[float] = []
    seen: set[str] = set()

    def on_iopub(m: dict) -> None:
        kind = m["msg_type"]
        if kind == "stream":
            text = m["content"]["text"]
        elif kind in ("display_data", "update_display_data"):
            text = m["content"]["data"].get("text/plain", "")
        else:
            return
        now = time.time()
        for line in text.splitlines():
            if "@" in line:
                stamp = line.rsplit("@", 1)[1]
                if stamp not in seen:
                    seen.add(stamp)
                    delays.append(now - float(stamp))

    k.run(
        f"{magic}\nimport time\nfor i in range({prints}):\n"
        "    print(f'tick @{time.time()!r}', flush=True)\n    time.sleep(0.005)",
        on_iopub,
    )
    return delays


def _bar_delays(k: _Client, magic: str, frames: int) -> list[float]:
    """Seconds from a progress-bar frame (``\\r``, no newline; timestamped) written on a
    rank to the notebook's redraw of the bar that shows it (our bar display), or written
    in a plain ipykernel cell (``magic`` empty) to the stream message that carries it."""
    delays: list[float] = []

    def on_iopub(m: dict) -> None:
        if m["msg_type"] in ("display_data", "update_display_data"):
            text = m["content"]["data"].get("text/plain", "")
        elif m["msg_type"] == "stream":
            text = m["content"]["text"]
        else:
            return
        now = time.time()
        for frame in text.split("\r"):
            if "@" in frame:
                delays.append(now - float(frame.rsplit("@", 1)[1].split()[0]))

    k.run(
        f"{magic}\nimport sys, time\nfor i in range({frames}):\n"
        "    sys.stderr.write(f'\\rbar {i} @{time.time()!r}'); sys.stderr.flush()\n"
        "    time.sleep(0.005)\nsys.stderr.write('\\n')",
        on_iopub,
    )
    return delays


def _lines_per_s(k: _Client, magic: str, lines: int) -> float:
    """Lines a second from a cell printing ``lines`` lines to the client (all must come)."""
    got = [0]

    def on_iopub(m: dict) -> None:
        if m["msg_type"] == "stream":
            got[0] += m["content"]["text"].count(" flood ")

    code = f"{magic}\nfor i in range({lines}):\n    print(f'line {{i}} flood ')"
    t0 = time.perf_counter()
    k.run(code.lstrip("\n"), on_iopub)
    dt = time.perf_counter() - t0
    if got[0] != lines:
        raise RuntimeError(f"{got[0]} of {lines} flood lines reached the client")
    return lines / dt


def ours(s: Settings, rec: Recorder) -> None:
    from monarch_kernel.kernel.install import install

    install(prefix=sys.prefix)
    k = _Client("monarch")
    try:
        k.run("%mesh b --gpus 4")
        iters = 60 if s.quick else 300
        xs = sample(lambda: k.run("pass"), iters, 10, s.loop_budget_s)
        rec.value("plain_cell", median(xs))
        xs = sample(lambda: k.run("%%remote b\npass"), iters, 10, s.loop_budget_s)
        rec.value("remote_4", median(xs))
        xs = sample(lambda: k.run("%%remote b --ranks 0\npass"), iters, 10, s.loop_budget_s)
        rec.value("remote_1", median(xs))
        delays = _print_delays(k, "%%remote b --ranks 0", PRINTS)
        rec.value("print_delay", median(delays[10:]))
        with rec.guard("bar_delay"):
            delays = _bar_delays(k, "%%remote b --ranks 0", PRINTS)
            rec.value("bar_delay", median(delays[10:]))
        lines = FLOOD_LINES // (5 if s.quick else 1)
        with rec.guard("bar_delay_ipykernel", "lines_remote", "lines_ipykernel", "lines_ratio"):
            plain = _Client("python3")
            try:
                with rec.guard("bar_delay_ipykernel"):
                    delays = _bar_delays(plain, "", PRINTS)
                    rec.value("bar_delay_ipykernel", median(delays[10:]))
                ours_rate = _lines_per_s(k, "%%remote b --ranks 0", lines)
                plain_rate = _lines_per_s(plain, "", lines)
            finally:
                plain.stop()
            rec.value("lines_remote", ours_rate)
            rec.value("lines_ipykernel", plain_rate)
            rec.value("lines_ratio", ours_rate / plain_rate)
        k.run("%mesh stop b")
    finally:
        k.stop()


def ipp(s: Settings, rec: Recorder) -> None:
    """ipyparallel's ``%px`` path in a regular IPython kernel (4 engines)."""
    k = _Client("python3")
    try:
        k.run(
            "import ipyparallel as ipp\ncluster = ipp.Cluster(n=4)\n"
            "rc = cluster.start_and_connect_sync()\nrc.wait_for_engines(4)\nrc.activate()",
            timeout=180,
        )
        iters = 30 if s.quick else 150
        xs = sample(lambda: k.run("pass"), iters, 5, s.loop_budget_s)
        rec.value("plain_cell", median(xs))
        xs = sample(lambda: k.run("%px pass"), iters, 5, s.loop_budget_s)
        rec.value("remote_4", median(xs))
        xs = sample(lambda: k.run("%%px --targets 0\npass"), iters, 5, s.loop_budget_s)
        rec.value("remote_1", median(xs))
        delays = _print_delays(k, "%%px --targets 0 --stream", PRINTS // 2)
        rec.value("print_delay", median(delays[5:]))
        k.run("cluster.stop_cluster_sync()", timeout=60)
    finally:
        k.stop()
