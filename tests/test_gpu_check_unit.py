"""bench/gpu_check.py's pure parts: the JUnit XML read into outcomes, what pytest -v printed
before a killed run, the Markdown report written from given step results, and where the
commit comes from on a machine without .git."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="1" skipped="1"
 tests="5" time="3.2">
<testcase classname="" name="tests.test_gpu_x" time="0.000">
 <error message="collection failure">ImportError while importing test module</error>
</testcase>
<testcase classname="tests.test_gpu_x" name="test_ok" time="1.250" />
<testcase classname="tests.test_gpu_x.TestGroup" name="test_fails[a-1]" time="0.500">
 <failure message="AssertionError: 2 != 3">def test_fails():
&gt;   assert 2 == 3
E   AssertionError</failure>
 <system-out>--------------------------------- Captured Log ---------------------------------

--------------------------------- Captured Out ---------------------------------
rank 0 said hello</system-out>
 <system-err>--------------------------------- Captured Err ---------------------------------
</system-err>
</testcase>
<testcase classname="tests.test_gpu_x" name="test_skipped" time="0.001">
 <skipped type="pytest.skip" message="needs a CUDA GPU">skip</skipped>
</testcase>
<testcase classname="tests.test_gpu_x" name="test_teardown" time="0.200" />
<testcase classname="tests.test_gpu_x" name="test_teardown" time="0.300">
 <error message="failed on teardown with &quot;RuntimeError: left a rank&quot;">teardown tb</error>
</testcase>
</testsuite></testsuites>
"""


def test_junit_outcomes_ids_times_and_captured_output():
    got = gc.parse_junit(JUNIT, "tests/test_gpu_x.py")
    assert got["counts"] == {"passed": 1, "failed": 1, "error": 2, "skipped": 1}
    by_id = {t["id"]: t for t in got["tests"]}
    assert list(by_id) == [
        "tests/test_gpu_x.py (collection)",
        "tests/test_gpu_x.py::test_ok",
        "tests/test_gpu_x.py::TestGroup::test_fails[a-1]",
        "tests/test_gpu_x.py::test_skipped",
        "tests/test_gpu_x.py::test_teardown",
    ]
    assert by_id["tests/test_gpu_x.py::test_ok"]["seconds"] == pytest.approx(1.25)
    failed = by_id["tests/test_gpu_x.py::TestGroup::test_fails[a-1]"]
    assert failed["message"] == "AssertionError: 2 != 3" and "assert 2 == 3" in failed["text"]
    # pytest's empty "Captured" sections are dropped, the one with text is kept
    assert failed["stdout"].endswith("Captured Out " + "-" * 33 + "\nrank 0 said hello")
    assert "Captured Log" not in failed["stdout"] and failed["stderr"] == ""
    # a teardown error is a second testcase of the same test: one test, the worse outcome
    teardown = by_id["tests/test_gpu_x.py::test_teardown"]
    assert teardown["outcome"] == "error" and "left a rank" in teardown["message"]
    assert teardown["seconds"] == pytest.approx(0.5)


def test_a_killed_run_is_read_from_pytests_verbose_lines():
    log = "\n".join(
        [
            "collecting ... collected 3 items",
            "tests/test_gpu_x.py::test_ok PASSED                          [ 33%]",
            "tests/test_gpu_x.py::test_p[1] FAILED                        [ 66%]",
            "tests/test_gpu_x.py::test_hangs Timeout (0:01:20)!",
            'Thread 0x7f (most recent call first):\n  File "x.py", line 3 in wait',
        ]
    )
    tests, running = gc.salvage(log)
    assert [(t["id"], t["outcome"]) for t in tests] == [
        ("tests/test_gpu_x.py::test_ok", "passed"),
        ("tests/test_gpu_x.py::test_p[1]", "failed"),
    ]
    assert running == "tests/test_gpu_x.py::test_hangs"
    assert gc.salvage(log.rsplit("\n", 3)[0])[1] is None  # every test printed had ended


def test_only_files_that_mark_a_test_gpu_are_run(tmp_path):
    (tmp_path / "test_a.py").write_text("pytestmark = [pytest.mark.local, pytest.mark.gpu]\n")
    (tmp_path / "test_b.py").write_text("@pytest.mark.gpu\ndef test_x(): pass\n")
    (tmp_path / "test_c.py").write_text("pytestmark = pytest.mark.gpus_or_not\n")
    (tmp_path / "helper.py").write_text("pytest.mark.gpu\n")
    assert [p.name for p in gc.gpu_test_files(tmp_path)] == ["test_a.py", "test_b.py"]


def _results() -> dict:
    return {
        "date": "2026-11-26 12:00 UTC",
        "seconds": 312.4,
        "facts": {
            "device": "NVIDIA H100 80GB HBM3",
            "device_memory_gib": 79.2,
            "driver": "580.159.04",
            "torch": "2.11.0+cu130",
            "cuda": "13.0",
            "nccl": "2.28.9",
            "shrink_group": True,
            "cpu": "Intel Xeon",
            "cores": 16,
            "ram": "128 GiB",
            "commit": "abcdef123456 (.whl/COMMIT)",
            "python": "3.12.3",
        },
        "tests": {
            "files": ["tests/test_gpu_x.py"],
            "counts": {"passed": 1, "failed": 1, "error": 0, "skipped": 0},
            "tests": [
                {"id": "tests/test_gpu_x.py::test_ok", "outcome": "passed", "seconds": 1.5},
                {
                    "id": "tests/test_gpu_x.py::test_bad",
                    "outcome": "failed",
                    "seconds": None,
                    "message": "AssertionError: NCCL hung",
                    "text": "tb with ``` fences",
                    "stdout": "rank 1 output",
                    "stderr": "",
                },
            ],
        },
        "steps": [
            {"name": "facts", "status": "ok", "seconds": 3.0, "limit_s": 20},
            {
                "name": "gpu_nccl",
                "bench": True,
                "status": "timeout",
                "rc": -15,
                "seconds": 90.2,
                "limit_s": 90,
                "command": ["python3", "-m", "bench.gpu_nccl", "x.json"],
                "output_tail": "last words of the module",
                "rows": [
                    {
                        "what": "DDP steps/s",
                        "value": 1234.5,
                        "unit": "steps/s",
                        "target": ">= 0.99 x torchrun",
                        "ok": True,
                    },
                    {
                        "what": "abort time",
                        "value": 0.0123,
                        "unit": "s",
                        "target": "<= 0.01 s",
                        "ok": False,
                    },
                ],  # fmt: skip
                "failures": ["Traceback: RuntimeError in the 2-rank case"],
            },
            {
                "name": "gpu_nvml",
                "bench": True,
                "status": "not built",
                "seconds": 0.0,
                "limit_s": 20,
                "rows": [
                    {
                        "what": "not built (no bench/gpu_nvml.py)",
                        "value": None,
                        "unit": "",
                        "target": "",
                        "ok": None,
                    }
                ],
            },
            {
                "name": "test_gpu_x",
                "bench": True,
                "figures": True,
                "status": "ok",
                "rows": [
                    {
                        "what": "stop -> idle",
                        "value": 0.4,
                        "unit": "s",
                        "target": "<= 1 s",
                        "ok": True,
                    }
                ],
            },
        ],  # fmt: skip
    }


def test_the_report_names_the_machine_every_test_every_row_and_every_failure():
    md = gc.markdown(_results())
    stamp = md.split("\n")[2]
    assert stamp.startswith("Generated by `bash bench/gpu_check.sh`")
    for fact in ("2026-11-26 12:00 UTC", "NVIDIA H100 80GB HBM3", "580.159.04", "2.11.0+cu130",
                 "NCCL 2.28.9", "abcdef123456", "16 CPUs", "Do not edit by hand"):  # fmt: skip
        assert fact in stamp
    assert "`torch.distributed.shrink_group`: yes" in md
    assert "| `tests/test_gpu_x.py::test_ok` | passed | 1.50 s |" in md
    assert "| `tests/test_gpu_x.py::test_bad` | **failed** | — |" in md
    assert "| gpu_nccl | DDP steps/s | 1,234 | steps/s | >= 0.99 x torchrun | ✓ |" in md
    assert "| gpu_nccl | abort time | 0.0123 | s | <= 0.01 s | ✗ **fails** |" in md
    assert "| gpu_nvml | not built (no bench/gpu_nvml.py) | — |  |  | — |" in md
    assert "| test_gpu_x | stop -> idle | 0.4 | s | <= 1 s | ✓ |" in md
    assert "| gpu_nccl | timeout | 90.2 s | 90 s |" in md
    assert "| test_gpu_x |" not in md.split("## Benchmarks")[0]  # recorded rows: no step
    failures = md.split("## Failures (4)")[1]
    for text in ("step gpu_nccl: timeout", "last words of the module", "RuntimeError in the 2",
                 "gpu_nccl: abort time", "test tests/test_gpu_x.py::test_bad: failed",
                 "AssertionError: NCCL hung", "rank 1 output"):  # fmt: skip
        assert text in failures
    assert "````text\n" in failures  # a fence longer than any in the text


def test_failures_list_every_kind_once():
    titles = [title for title, _ in gc.failures(_results())]
    assert titles == [
        "step gpu_nccl: timeout",
        "step gpu_nccl",
        "gpu_nccl: abort time",
        "test tests/test_gpu_x.py::test_bad: failed",
    ]


def test_figures_the_tests_recorded_become_benchmark_rows(tmp_path):
    row = {"what": "w", "value": 1.0, "unit": "s", "target": "", "ok": None}
    (tmp_path / "test_gpu_nccl.json").write_text(json.dumps({"rows": [row], "failures": []}))
    (tmp_path / "test_gpu_bad.json").write_text("{not json")
    got = {e["name"]: e for e in gc.recorded_figures(tmp_path)}
    assert got["test_gpu_nccl"]["rows"] == [row] and got["test_gpu_nccl"]["figures"]
    assert "test_gpu_bad.json" in got["test_gpu_bad"]["failures"][0]
    assert gc.recorded_figures(tmp_path / "absent") == []


def test_the_commit_without_git_comes_from_the_wheels_folder(tmp_path):
    assert gc.commit(tmp_path) == "?"
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "COMMIT").write_text("0123456789abcdef0123\nuncommitted changes\n")
    assert gc.commit(tmp_path) == "0123456789ab + uncommitted changes (.whl/COMMIT)"
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\nfedcba9876543210fedc refs/heads/main\n")
    assert gc._read_head(git) == "fedcba9876543210fedc"
    (git / "refs" / "heads" / "main").write_text("aaaabbbbccccddddeeee\n")
    assert gc._read_head(git) == "aaaabbbbccccddddeeee"


def test_bound_keeps_head_and_tail():
    text = "a" * 50 + "b" * 50
    assert gc.bound(text, 200) == text
    cut = gc.bound(text, 30)
    assert cut.startswith("a" * 10) and cut.endswith("b" * 20) and "70 characters" in cut
