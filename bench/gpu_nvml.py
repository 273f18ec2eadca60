"""What the host agent's GPU telemetry costs (``monarch_kernel.host.gpu_stats``): µs per
NVML call of each kind the sampler makes and per full host sample (every GPU: util,
memory, power, compute processes, GPM where supported), each the mean of up to 1000, and
a sample's cost as a share of a 100 ms training step at the sampling period
(``PERIOD``, 1 s: a step pays ``cost / period`` of its time on average, on the agent's
thread, not the rank's). Also checks that sampling leaves CUDA uninitialised in the
sampling process (the agent must never create a CUDA context).

``python -m bench.gpu_nvml OUT_JSON`` writes ``{"rows": [{"what", "value", "unit",
"target", "ok"}], "failures": [str]}``. Without ``nvidia-ml-py`` or a GPU: one skipped
row (``ok`` null), exit 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from monarch_kernel.host.gpu_stats import PERIOD, GpuSampler, call_costs_us, sample_cost_us

#: Calls (or samples) per measurement, fewer when one is slow (each at most ~BUDGET_S).
REPS = 1000
BUDGET_S = 5.0
STEP_S = 0.1  #: the training step the share is of
SHARE_TARGET = 0.5  #: percent of a step at most

rows: list[dict[str, Any]] = []
failures: list[str] = []


def row(what: str, value: float, unit: str, target: str, ok: bool | None) -> None:
    rows.append({"what": what, "value": value, "unit": unit, "target": target, "ok": ok})


def write(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)
    os.replace(path + ".tmp", path)


def _reps(sampler: GpuSampler) -> int:
    """As many samples as fit in :data:`BUDGET_S` (at most :data:`REPS`)."""
    t0 = time.perf_counter()
    for _ in range(10):
        sampler.sample()
    each = (time.perf_counter() - t0) / 10
    return max(10, min(REPS, int(BUDGET_S / max(each, 1e-9))))


def measure() -> None:
    try:  # imported first, as a process that holds torch: sampling must not start CUDA
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    sampler = GpuSampler()
    if not sampler.open():
        row(f"skipped: {sampler.reason}", 0.0, "", "NVML and a GPU", None)
        return
    nvml = sampler.nvml
    assert nvml is not None
    try:
        n = _reps(sampler)
        try:
            for name, us in call_costs_us(nvml, n).items():
                row(f"NVML {name}, GPU 0 (x{n})", us, "µs/call", "info", None)
        except Exception:
            failures.append(f"per-call costs:\n{traceback.format_exc()}")
        sample = sampler.sample()
        assert sample is not None
        gpm = sum(1 for d in sample.devices if d.pcie_tx is not None)
        row("GPUs", float(len(sample.devices)), "", "info", None)
        row("GPUs with GPM (PCIe, NVLink rates)", float(gpm), "", "info", None)
        cost = sample_cost_us(sampler, n)
        row(f"full host sample (x{n})", cost, "µs", "info", None)
        share = cost / (PERIOD * 1e6) * 100
        row(
            f"sample cost per {STEP_S * 1000:.0f} ms step at a {PERIOD:g} s period",
            share,
            "%",
            f"<= {SHARE_TARGET} %",
            share <= SHARE_TARGET,
        )
    finally:
        sampler.close()
    if torch is None:
        return
    started = bool(torch.cuda.is_initialized())
    row("CUDA initialised by sampling (0: no)", float(started), "", "0", not started)


def main(argv: list[str]) -> int:
    out = argv[1] if len(argv) > 1 else "gpu_nvml.json"
    try:
        measure()
    except Exception:
        failures.append(traceback.format_exc())
    write(out)
    for r in rows:
        print(f"{r['what']}: {r['value']:.4g} {r['unit']} (target {r['target']}, ok {r['ok']})")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
