"""Runs one peer's worker process and makes sure nothing it started survives it.

Every process a worker starts (ranks, host agents, Ray's raylet and workers, ipyparallel
engines, Monarch's process allocator) inherits ``BENCH_RUN_TAG`` in its environment; after
the worker exits we wait a grace period for those processes to go away by themselves, then
kill and report whatever is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench.common import Settings

TAG_VAR = "BENCH_RUN_TAG"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class PeerRun:
    peer: str
    results: dict[str, dict[str, Any]]
    wall_s: float
    error: str | None = None
    leftovers: list[str] = field(default_factory=list)


def tagged_processes(tag: str) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def sweep(tag: str, grace_s: float = 15.0) -> list[str]:
    """Wait up to ``grace_s`` for tagged processes to exit; kill and describe the rest."""
    deadline = time.monotonic() + grace_s
    left = tagged_processes(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = tagged_processes(tag)
    described = []
    for p in left:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(left, timeout=5)
    return described


def run_peer(peer: str, settings: Settings, timeout_s: float) -> PeerRun:
    tag = uuid.uuid4().hex
    fd, out = tempfile.mkstemp(prefix=f"bench-{peer}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, **{TAG_VAR: tag})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "bench.worker", peer, settings.to_json(), out]
    print(f"== {peer}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    error = None
    try:
        code = proc.wait(timeout_s)
        if code != 0:
            error = f"worker exited with code {code}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f} s"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        sweep(tag, grace_s=0)
        raise
    wall = time.perf_counter() - t0
    leftovers = sweep(tag)
    try:
        with open(out) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = {}
    finally:
        os.unlink(out)
    if leftovers:
        print(f"   {peer}: killed {len(leftovers)} leftover processes", flush=True)
    return PeerRun(peer, results, wall, error, leftovers)
