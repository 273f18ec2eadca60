"""The workload benchmark's correctness in a tiny configuration: plain torchrun and our
``%%remote`` loop (a real kernel, a real mesh) train the same model on the same batches
to the same loss curve, and the loss check fails a curve that strays (bench/train.py)."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import train  # noqa: E402
from bench.train_gpt import Config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: A model small enough that both runs take seconds (the benchmark's is 10M parameters).
TINY = Config(vocab=512, dim=64, layers=2, heads=4, seq=16, batch=2, warmup=2, steps=4, extra=0)


def test_torchrun_and_remote_loop_train_the_same_curve(tmp_path):
    plan = train.Plan(TINY, kill_after=0, timeout_s=240)
    runs = {}
    for system in ("torchrun", "ours_remote"):
        work = tmp_path / system
        work.mkdir()
        runs[system] = train.run_system(system, plan, str(work))
        assert runs[system].error is None, runs[system].error
        sps, cold = runs[system].sps, runs[system].cold_s
        assert sps is not None and sps > 0
        assert cold is not None and cold > 0
    base = runs["torchrun"].losses
    assert len(base) == TINY.warmup + TINY.steps
    rss = runs["ours_remote"].driver_rss
    assert rss is not None and rss > 0
    check = train.loss_check(runs)
    assert check.startswith("passed"), check
    # The same check on a curve that strays at one step by twice the tolerance fails.
    strayed = list(base)
    strayed[-1] += 2 * train.LOSS_TOL
    runs["ours_remote"] = dataclasses.replace(runs["ours_remote"], losses=strayed)
    assert train.loss_check(runs).startswith("FAILED"), train.loss_check(runs)
    # A run that stopped early has no full curve: also a failure, never a pass.
    runs["ours_remote"] = dataclasses.replace(runs["ours_remote"], losses=base[:-1])
    assert train.loss_check(runs).startswith("FAILED")
