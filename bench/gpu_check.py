"""The one check of the GPU path on a GPU machine: the tests marked ``gpu``, then the GPU
benchmark rows, written to ``bench/results/gpu.md``.

On the GPU machine (python3 there holds torch; no network), from the repository root:

    bash bench/gpu_check.sh

which is, written out (the wheels come from ``make gpu-wheels`` here, carried as ``.whl/``):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD JUPYTER_PATH=/tmp/mk-jupyter/share/jupyter
    python3 -m monarch_kernel install --prefix /tmp/mk-jupyter
    python3 bench/gpu_check.py

Every step is its own process under its own time limit (a failed or hung step is a result,
not the end of the run) and leaves its JSON in a work folder; no step runs past
:data:`TOTAL_LIMIT` (410 s, under the 7 minutes the check may take) from the start:

1. facts (15 s): torch, CUDA, ``torch.cuda.nccl.version()``, the device, the driver,
   ``hasattr(dist, "shrink_group")``, the carried packages, the kernelspec, the commit;
2. the tests marked ``gpu`` (200 s): one ``pytest -m gpu`` per test file that marks any
   (a collection error or hang in one file costs only that file), ``--timeout`` per test and
   ``faulthandler_timeout`` (a hung test's stacks are in the log); outcomes and times come
   from each file's JUnit XML, or from pytest's ``-v`` lines when the file's process was
   killed; rows the tests record (``MONARCH_KERNEL_GPU_FIGURES``: a folder, one JSON per
   test module, as the benchmark modules write) join the benchmark table;
3. the benchmark modules, ``python3 -m bench.<name> <json>``: gpu_nvml (15 s), gpu_nccl
   (60 s), gpu_ipc (65 s), gpu_train (90 s). Each writes ``{"rows": [{"what", "value",
   "unit", "target", "ok"}], "failures": [str]}``; a module not in the checkout is a row
   "not built". Without CUDA (facts) they are skipped.

Then ``bench/results/gpu.md`` (``--md`` elsewhere), and, where ``$OUT`` is set (the device
tool), gpu.md, gpu-check.json (every step's result), gpu-check.log (everything, each step's
output too) and gpu-tests.xml (the JUnit XML of all files) copied there. The end of the
output is a summary and every failure with its context (message, traceback, captured
output, a killed step's last output). Exit status 0 whatever the checks found; non-zero
only when this script itself breaks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MD = ROOT / "bench" / "results" / "gpu.md"
COMMAND = "bash bench/gpu_check.sh"
#: The whole run: no step goes on past this (seconds). The tests took 78 s in the last run
#: with 14 of today's 23 GPU tests (the longest file, test_gpu_dataplane, about 11.5 s a
#: test: 13 of them now); the benchmark steps about 115 s.
TOTAL_LIMIT = 410.0
FACTS_LIMIT = 15.0
TESTS_LIMIT = 200.0
#: (module under bench/, limit in seconds)
BENCHES: list[tuple[str, float]] = [
    ("gpu_nvml", 15.0),
    ("gpu_nccl", 60.0),
    ("gpu_ipc", 65.0),
    ("gpu_train", 90.0),  # the GPT workload on one GPU, ours vs torchrun (bench/gpu_train.py)
]
#: pytest-timeout's limit for one test; faulthandler dumps every thread's stack a little
#: before it (also when the test is stuck in C, where the timeout's signal cannot act).
PER_TEST_TIMEOUT = 160
#: Bounds on text kept per failure (bytes): the message, the traceback, each captured stream.
TEXT_BOUND = 4000
MD_TEXT_BOUND = 2500
#: What of a step's output the log keeps (head and tail).
LOG_BOUND = 2_000_000
#: Top-level modules of the carried wheels (bench/gpu_wheels.txt), checked by the facts step.
CARRIED_MODULES = ["zmq", "ipykernel", "jupyter_client", "IPython", "ipywidgets", "anywidget"]
GPU_MARK = re.compile(r"\bmark\.gpu\b")


# -- pure parts: text bounds, JUnit parsing, pytest -v lines, the Markdown ------------------


def bound(text: str | None, limit: int = TEXT_BOUND) -> str:
    """``text`` whole if short, else its head and tail with what was left out said."""
    text = text or ""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters left out ...]\n{text[-tail:]}"


def parse_junit(xml_text: str, file: str = "") -> dict[str, Any]:
    """Counts and per-test outcomes of a pytest JUnit XML document of the test file
    ``file`` (its path as pytest was given it): ``{"counts": {passed, failed, error,
    skipped}, "tests": [{"id", "outcome", "seconds", "message", "text", "stdout",
    "stderr"}]}``. A test whose teardown failed after its call (pytest writes two testcases)
    counts once, as its worse outcome."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    tests: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for suite in suites:
        for case in suite.iter("testcase"):
            tid = node_id(case.get("classname", ""), case.get("name", ""), file)
            outcome, message, text = "passed", "", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = el.get("message", "") or ""
                    text = el.text or ""
                    break
            entry = {
                "id": tid,
                "outcome": outcome,
                "seconds": float(case.get("time", "0") or 0),
                "message": bound(message),
                "text": bound(text),
                "stdout": bound(captured(case, "system-out")),
                "stderr": bound(captured(case, "system-err")),
            }
            if tid in by_id:
                _merge(by_id[tid], entry)
                continue
            by_id[tid] = entry
            tests.append(entry)
    return {"counts": count(tests), "tests": tests}


def node_id(classname: str, name: str, file: str = "") -> str:
    """pytest's node id (``tests/test_x.py::Class::test``) from JUnit's classname
    (``tests.test_x.Class``) and name; a collection error (no classname) is
    ``FILE (collection)``."""
    if not classname:
        return f"{file} (collection)" if file else f"{name} (collection)"
    if file:
        module = file[:-3] if file.endswith(".py") else file
        for prefix in (module.replace("/", "."), Path(module).name):
            if classname == prefix or classname.startswith(prefix + "."):
                rest = [p for p in classname[len(prefix) + 1 :].split(".") if p]
                return "::".join([file, *rest, name])
    return f"{classname}::{name}"


_EMPTY_SECTION = re.compile(r"^-+ Captured \w+ -+\n(?=\s*(?:-+ Captured \w+ -+\n|\Z))", re.M)


def captured(case: ET.Element, tag: str) -> str:
    """A testcase's system-out or system-err, without pytest's empty "Captured" sections."""
    text = "\n".join((el.text or "").strip() + "\n" for el in case.findall(tag))
    previous = None
    while previous != text:
        previous, text = text, _EMPTY_SECTION.sub("", text.lstrip("\n"))
    return text.strip()


RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _merge(first: dict[str, Any], later: dict[str, Any]) -> None:
    first["seconds"] += later["seconds"]
    if RANK.get(later["outcome"], 0) > RANK.get(first["outcome"], 0):
        for key in ("outcome", "message", "text"):
            first[key] = later[key]
    for key in ("stdout", "stderr"):
        if later[key] and later[key] != first[key]:
            first[key] = bound(first[key] + "\n" + later[key])


def count(tests: list[dict[str, Any]]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for t in tests:
        out[t["outcome"]] = out.get(t["outcome"], 0) + 1
    return out


_VLINE = re.compile(
    r"^(?P<id>\S+\.py::\S+(?:\[[^\]]*\])?)\s+(?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
)
#: pytest -v writes a test's id when the test starts, its outcome on the same line when it
#: ends: a line that starts with an id and has no outcome is a test that had not ended (what
#: follows on it is what the test or faulthandler wrote to the terminal meanwhile).
_STARTED = re.compile(r"^(?P<id>\S+\.py::\S+?)(?:\s|$)")


def salvage(log: str) -> tuple[list[dict[str, Any]], str | None]:
    """What pytest ``-v`` printed before its process was killed: the tests it finished
    (outcome, no time) and the one it was in (printed without an outcome), if any."""
    tests: dict[str, dict[str, Any]] = {}
    running = None
    outcomes = {"XFAIL": "skipped", "XPASS": "passed"}
    for line in log.splitlines():
        m = _VLINE.match(line.strip())
        if m:
            tid = m["id"]
            outcome = outcomes.get(m["outcome"], m["outcome"].lower())
            old = tests.get(tid)
            if old is None or RANK.get(outcome, 0) > RANK.get(old["outcome"], 0):
                tests[tid] = _blank(tid, outcome)
            running = None
            continue
        s = _STARTED.match(line.strip())
        if s:
            running = s["id"]
    return list(tests.values()), running


def _blank(tid: str, outcome: str) -> dict[str, Any]:
    return {
        "id": tid,
        "outcome": outcome,
        "seconds": None,
        "message": "",
        "text": "",
        "stdout": "",
        "stderr": "",
    }


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """The test files that mark any test ``gpu`` (read as text: importing every test
    module to collect would fail on a machine without Ray, Playwright, ...)."""
    out = []
    for path in sorted(tests_dir.glob("test_*.py")):
        if path.name.endswith("_unit.py"):  # pure Python: never a GPU test
            continue
        try:
            if GPU_MARK.search(path.read_text(errors="replace")):
                out.append(path)
        except OSError:
            continue
    return out


def fmt_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—" if value is None else str(value)
    v = float(value)
    if v != v:  # NaN
        return "—"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_ok(ok: Any) -> str:
    return {True: "✓", False: "✗ **fails**"}.get(ok, "—") if isinstance(ok, bool) else "—"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def failures(results: dict[str, Any]) -> list[tuple[str, str]]:
    """Every failure of the run as (title, context): failed or broken steps, failed or
    erroring tests, benchmark failures and rows whose ``ok`` is false."""
    out: list[tuple[str, str]] = []
    for step in results.get("steps", []):
        status = step.get("status")
        if status in ("timeout", "failed", "crashed"):
            ctx = (
                f"command: {' '.join(step.get('command') or [])}\n"
                f"status {status}, rc {step.get('rc')}, {step.get('seconds', 0):.1f} s "
                f"of {step.get('limit_s', 0):.0f} s\n"
            )
            if step.get("error"):
                ctx += f"{step['error']}\n"
            if step.get("running"):
                ctx += f"test running when it was killed: {step['running']}\n"
            ctx += f"last output:\n{step.get('output_tail', '')}"
            out.append((f"step {step.get('name')}: {status}", ctx))
        if step.get("left_behind"):  # processes the step's own clean-up should have ended
            out.append(
                (f"step {step.get('name')}: processes left behind", "\n".join(step["left_behind"]))
            )
        for msg in step.get("failures") or []:
            out.append((f"step {step.get('name')}", str(msg)))
        for row in step.get("rows") or []:
            if row.get("ok") is False:
                out.append(
                    (
                        f"{step.get('name')}: {row.get('what')}",
                        f"value {fmt_value(row.get('value'))} {row.get('unit', '')}, "
                        f"target {row.get('target', '')}",
                    )
                )
    for t in results.get("tests", {}).get("tests", []):
        if t["outcome"] in ("failed", "error"):
            parts = [t.get("message", "")]
            if t.get("text"):
                parts.append(t["text"])
            parts += [t.get("stdout", ""), t.get("stderr", "")]  # pytest's "Captured" headers
            out.append((f"test {t['id']}: {t['outcome']}", "\n".join(p for p in parts if p)))
    return out


def stamp(results: dict[str, Any], command: str = COMMAND) -> str:
    """The line under the title, as every file the benchmarks write into bench/results/
    has one (bench/report.py ``generated_by``): what wrote it, when, on what machine."""
    f = results.get("facts", {})
    gpu = f.get("device") or "no GPU"
    if f.get("device_memory_gib"):
        gpu += f" ({f['device_memory_gib']:.0f} GiB)"
    if f.get("driver"):
        gpu += f", driver {f['driver']}"
    return (
        f"Generated by `{command}` (`python3 bench/gpu_check.py`) on {results.get('date', '?')}: "
        f"{gpu}; {f.get('cpu', '?')}, {f.get('cores', '?')} CPUs, {f.get('ram', '?')} RAM; "
        f"torch {f.get('torch', '?')}, NCCL {f.get('nccl', '?')}; "
        f"monarch_kernel git {f.get('commit', '?')}. Do not edit by hand: run the command again."
    )


def markdown(results: dict[str, Any], command: str = COMMAND) -> str:
    f = results.get("facts", {})
    lines = [
        "# GPU check: the tests marked `gpu` and the GPU benchmarks",
        "",
        stamp(results, command),
        "",
        f"One run, {results.get('seconds', 0):.0f} s in all (limit {TOTAL_LIMIT:.0f} s); each step "
        "its own process under its own time limit (`bench/gpu_check.py`'s docstring says how).",
        "",
        "## Machine",
        "",
        f"- device: {f.get('device') or 'none (no CUDA)'}"
        + (f", {f['device_memory_gib']:.1f} GiB" if f.get("device_memory_gib") else "")
        + (f", compute capability {f['capability']}" if f.get("capability") else "")
        + (f", {f['sm_count']} SMs" if f.get("sm_count") else ""),
        f"- driver {f.get('driver') or '?'}; CUDA (torch) {f.get('cuda') or 'none'}",
        f"- torch {f.get('torch', '?')}, NCCL {f.get('nccl', '?')}, "
        f"`torch.distributed.shrink_group`: {_yes(f.get('shrink_group'))}",
        f"- Python {f.get('python', '?')}; {f.get('cpu', '?')}, {f.get('cores', '?')} cores, "
        f"{f.get('ram', '?')} RAM; Linux {f.get('kernel', '?')}",
        f"- monarch_kernel git {f.get('commit', '?')}; {results.get('date', '?')}",
    ]
    if f.get("carried"):
        lines.append(
            "- carried packages: " + ", ".join(f"{k} {v}" for k, v in sorted(f["carried"].items()))
        )
    if f.get("kernelspec"):
        lines.append(f"- kernelspec: `{f['kernelspec']}`")
    lines += ["", "## Steps", "", "| step | status | time | limit |", "|---|---|---:|---:|"]
    for step in results.get("steps", []):
        if step.get("figures"):
            continue
        lines.append(
            f"| {_cell(step.get('name'))} | {_cell(step.get('status'))} | "
            f"{step.get('seconds', 0):.1f} s | {step.get('limit_s', 0):.0f} s |"
        )
    tests = results.get("tests", {})
    c = tests.get("counts", {})
    lines += [
        "",
        "## Tests marked `gpu`",
        "",
        f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} "
        f"errors, {c.get('skipped', 0)} skipped, in {len(tests.get('files', []))} file(s): "
        + (", ".join(f"`{p}`" for p in tests.get("files", [])) or "none marks a test `gpu`")
        + ".",
        "",
    ]
    if tests.get("tests"):
        lines += ["| test | outcome | time |", "|---|---|---:|"]
        for t in tests["tests"]:
            secs = "—" if t.get("seconds") is None else f"{t['seconds']:.2f} s"
            outcome = t["outcome"] if t["outcome"] == "passed" else f"**{t['outcome']}**"
            if t["outcome"] == "skipped" and t.get("message"):
                outcome += f" ({_cell(bound(t['message'], 100))})"
            lines.append(f"| `{_cell(t['id'])}` | {outcome} | {secs} |")
        lines.append("")
    lines += [
        "## Benchmarks",
        "",
        "| module | what | value | unit | target | ok |",
        "|---|---|---:|---|---|---|",
    ]
    for step in results.get("steps", []):
        if not step.get("bench"):
            continue
        for row in step.get("rows") or []:
            lines.append(
                f"| {_cell(step['name'])} | {_cell(row.get('what', ''))} | "
                f"{fmt_value(row.get('value'))} | {_cell(row.get('unit', ''))} | "
                f"{_cell(row.get('target', ''))} | {fmt_ok(row.get('ok'))} |"
            )
    fails = failures(results)
    lines += ["", f"## Failures ({len(fails)})", ""]
    if not fails:
        lines.append("None.")
    for title, ctx in fails:
        body = bound(ctx, MD_TEXT_BOUND)
        fence = "```"
        while fence in body:
            fence += "`"
        lines += [f"### {title}", "", f"{fence}text", body, fence, ""]
    return "\n".join(lines).rstrip() + "\n"


def _yes(value: Any) -> str:
    return {True: "yes", False: "no"}.get(value, "?") if isinstance(value, bool) else "?"


# -- facts (its own process: ``gpu_check.py --facts JSON``) ----------------------------------


def host_facts() -> dict[str, Any]:
    """What this process knows without torch: CPU, cores, RAM, kernel, commit, Python."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "commit": commit(),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        out["ram"] = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        out["ram"] = "?"
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def commit(root: Path = ROOT) -> str:
    """The checkout's commit: git where git and .git are there, else .git's HEAD read by
    hand, else ``.whl/COMMIT`` (written by bench/gpu_wheels.sh here: the device machine
    gets the working tree without .git)."""
    if os.environ.get("GPU_CHECK_FROM_WHEELS") == "1":
        # gpu_check.sh with carried wheels: the device machine's .git, where it has one, is
        # the session's first checkout, not this tree; gpu_wheels.sh wrote the commit here
        return _whl_commit(root)
    git = root / ".git"
    if git.exists() and shutil.which("git"):
        try:
            done = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            )
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=20,
            )
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip() + (" + uncommitted changes" if dirty.stdout else "")
        except (OSError, subprocess.SubprocessError):
            pass
    sha = _read_head(git)
    if sha:
        return sha[:12]
    return _whl_commit(root)


def _whl_commit(root: Path) -> str:
    try:
        lines = (root / ".whl" / "COMMIT").read_text().split("\n")
    except OSError:
        return "?"
    sha = lines[0].strip()[:12] or "?"
    note = " + uncommitted changes" if any("uncommitted" in x for x in lines[1:]) else ""
    return f"{sha}{note} (.whl/COMMIT)"


def _read_head(git: Path) -> str | None:
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            text = git.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            git = (git.parent / text.split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git
        if (git / "commondir").exists():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in (git, common):
            if (base / ref).exists():
                return (base / ref).read_text().strip()
        for base in (git, common):
            packed = base / "packed-refs"
            if packed.exists():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split(" ", 1)[0]
    except OSError:
        return None
    return None


def facts_main(path: str) -> None:
    """The facts step: written to ``path`` as it goes (a hang leaves what was found)."""
    out: dict[str, Any] = host_facts()
    out["failures"] = []

    def save() -> None:
        Path(path).write_text(json.dumps(out, indent=1, default=str))

    save()
    from importlib import metadata

    carried: dict[str, str] = {}
    for mod in CARRIED_MODULES:
        try:
            __import__(mod)
            name = {"zmq": "pyzmq", "IPython": "ipython"}.get(mod, mod)
            carried[name] = metadata.version(name)
        except Exception as e:  # a carried wheel that does not import: say which and why
            out["failures"].append(f"import {mod}: {type(e).__name__}: {e}")
    out["carried"] = carried
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec("monarch")
        out["kernelspec"] = " ".join(spec.argv) + f" ({spec.resource_dir})"
    except Exception as e:
        out["failures"].append(f"kernelspec 'monarch': {type(e).__name__}: {e}")
    save()
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        out["failures"].append(f"import torch: {type(e).__name__}: {e}")
        save()
        return
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["shrink_group"] = hasattr(dist, "shrink_group")
    out["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    save()
    out["driver"] = _driver()
    save()
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as e:
        out["cuda_available"] = False
        out["failures"].append(f"torch.cuda.is_available(): {type(e).__name__}: {e}")
    if out["cuda_available"]:
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:
            out["failures"].append(f"torch.cuda.nccl.version(): {type(e).__name__}: {e}")
        try:
            p = torch.cuda.get_device_properties(0)
            out["device"] = p.name
            out["device_count"] = torch.cuda.device_count()
            out["device_memory_gib"] = p.total_memory / 2**30
            out["capability"] = f"{p.major}.{p.minor}"
            out["sm_count"] = p.multi_processor_count
        except Exception as e:
            out["failures"].append(f"device properties: {type(e).__name__}: {e}")
    save()


def _driver() -> str | None:
    try:
        import importlib

        pynvml = importlib.import_module("pynvml")  # nvidia-ml-py, on the GPU machine
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return None


# -- running steps ---------------------------------------------------------------------------


class Log:
    """What this run prints, also kept in the work folder's gpu-check.log."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("w", encoding="utf-8", errors="replace")

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def quiet(self, text: str) -> None:
        """Into the log only (a step's whole output)."""
        self.file.write(text + ("" if text.endswith("\n") else "\n"))
        self.file.flush()


def step_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        paths.append(str(ROOT))  # kernels and ranks the tests start import monarch_kernel
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["MONARCH_KERNEL_TREE_GUARD"] = "0"  # no git (and no .git) on the device machine
    return env


#: The environment variable that marks every process a step starts (kernels and ranks
#: inherit the environment): what is left of a step afterwards is found by it, and only it.
MARK_ENV = "MONARCH_GPU_CHECK_RUN"


def run_process(
    name: str, argv: list[str], limit: float, work: Path, log: Log, env: dict[str, str]
) -> dict[str, Any]:
    """Run ``argv`` (cwd: the repository root) in a session of its own, its output to
    ``work/NAME.out``; past ``limit`` seconds its process group is ended (TERM, then KILL).
    Whatever it started that is still there afterwards (found by :data:`MARK_ENV`) is ended
    too, and named in the result: it would hold GPU memory in the next step."""
    out_path = work / f"{name}.out"
    began = time.monotonic()
    mark = f"{os.getpid()}-{name}-{time.time():.0f}"
    result: dict[str, Any] = {"name": name, "command": argv, "limit_s": limit}
    log.say(f"-- {name}: up to {limit:.0f} s: {' '.join(argv)}")
    try:
        with out_path.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**env, MARK_ENV: mark},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                result["rc"] = proc.wait(timeout=max(limit, 1.0))
                result["status"] = "ok" if result["rc"] == 0 else "failed"
            except subprocess.TimeoutExpired:
                _end_group(proc)
                result["rc"] = proc.returncode
                result["status"] = "timeout"
    except OSError as e:
        result.update(status="crashed", rc=None, error=f"{type(e).__name__}: {e}")
    left = _end_marked(mark)
    if left:
        result["left_behind"] = left
    result["seconds"] = time.monotonic() - began
    text = out_path.read_text(errors="replace") if out_path.exists() else ""
    result["output_tail"] = text[-TEXT_BOUND:]
    log.quiet(f"---- output of {name} ({len(text)} characters) ----")
    log.quiet(bound(text, LOG_BOUND))
    log.quiet(f"---- end of {name} ----")
    log.say(
        f"   {name}: {result['status']} (rc {result.get('rc')}) in {result['seconds']:.1f} s"
        + (f"; processes left behind, ended: {left}" if left else "")
    )
    return result


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _end_marked(mark: str) -> list[str]:
    """SIGKILL every process whose environment has ``MARK_ENV=mark``; returns 'pid
    command line' of each."""
    try:
        import psutil
    except ImportError:
        return []
    ended = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid == me or p.environ().get(MARK_ENV) != mark:
                continue
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            what = " ".join(p.cmdline())[:100]
            p.kill()
            ended.append(f"{p.pid} {what}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return ended


def step_facts(work: Path, log: Log, env: dict[str, str], limit: float) -> dict[str, Any]:
    path = work / "facts.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--facts", str(path)]
    result = run_process("facts", argv, limit, work, log, env)
    data: dict[str, Any] = {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        result.setdefault("error", f"no facts JSON: {type(e).__name__}: {e}")
    result["failures"] = data.pop("failures", [])
    result["data"] = data
    return result


def step_tests(
    work: Path,
    log: Log,
    env: dict[str, str],
    limit: float,
    per_test: int,
    tests_dir: Path,
    only: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tests marked gpu, one pytest process per file, all at once (``only``: the
    files whose names contain one of these comma-separated words). Returns (step, tests)."""
    files = gpu_test_files(tests_dir)
    if only is not None:
        words = [w for w in only.split(",") if w]
        files = [f for f in files if any(w in f.name for w in words)]
    began = time.monotonic()
    tests: dict[str, Any] = {"files": [_rel(f) for f in files], "tests": []}
    step: dict[str, Any] = {"name": "tests", "limit_s": limit, "status": "ok", "failures": []}
    step["command"] = ["python3", "-m", "pytest", "-m", "gpu", "...", "tests/<file>"]
    xmls: list[str] = []
    if not files:
        log.say("-- tests: no test file marks a test gpu")
        step["status"] = "no tests"

    def one(path: Path) -> tuple[Path, dict[str, Any], list[dict[str, Any]], str | None]:
        """One file's pytest process (the files run at once: the machine has 16 cores and
        the tests wait on processes far more than they compute)."""
        xml = work / f"junit-{path.stem}.xml"
        argv = [
            sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
            "-o", "addopts=", "-v", "-rA", f"--timeout={per_test}",
            "-o", f"faulthandler_timeout={max(per_test - 10, 5)}",
            "-o", "junit_logging=all", "-o", "junit_log_passing_tests=false",
            f"--junitxml={xml}", _rel(path),
        ]  # fmt: skip
        run = run_process(f"tests-{path.stem}", argv, limit, work, log, env)
        found: list[dict[str, Any]] = []
        text: str | None = None
        if xml.exists():
            try:
                text = xml.read_text(errors="replace")
                found = parse_junit(text, _rel(path))["tests"]
            except ET.ParseError as e:
                run["error"] = f"unreadable JUnit XML: {e}"
                text = None
        if run["status"] != "ok" and not found:
            found, running = salvage((work / f"tests-{path.stem}.out").read_text(errors="replace"))
            if running:
                run["running"] = running
                found.append({**_blank(running, "error"), "message": f"killed: {run['status']}"})
        # pytest's rc 1 (tests failed) and 5 (none selected) are outcomes, not a broken step
        if run["status"] == "failed" and run.get("rc") in (1, 5) and (found or run["rc"] == 5):
            run["status"] = "ok"
        return path, run, found, text

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
        outcomes = list(pool.map(one, files))
    for _path, run, found, text in outcomes:
        if text is not None:
            xmls.append(text)
        tests["tests"].extend(found)
        if run["status"] != "ok":  # the file's own entry in the steps says what happened
            step["status"] = "incomplete"
            step.setdefault("runs", []).append(run)
    tests["counts"] = count(tests["tests"])
    step["seconds"] = time.monotonic() - began
    _merge_xml(xmls, work / "gpu-tests.xml")
    return step, tests


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _merge_xml(docs: list[str], path: Path) -> None:
    root = ET.Element("testsuites")
    for doc in docs:
        try:
            el = ET.fromstring(doc)
        except ET.ParseError:
            continue
        root.extend([el] if el.tag == "testsuite" else list(el))
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def step_bench(
    name: str, limit: float, work: Path, log: Log, env: dict[str, str], skip: str | None
) -> dict[str, Any]:
    if not (ROOT / "bench" / f"{name}.py").exists():
        log.say(f"-- {name}: not built (no bench/{name}.py)")
        return {
            "name": name, "bench": True, "status": "not built", "limit_s": limit, "seconds": 0.0,
            "rows": [{"what": f"not built (no bench/{name}.py)", "value": None, "unit": "",
                      "target": "", "ok": None}],
        }  # fmt: skip
    if skip:
        log.say(f"-- {name}: skipped ({skip})")
        return {
            "name": name, "bench": True, "status": "skipped", "limit_s": limit, "seconds": 0.0,
            "rows": [{"what": f"skipped: {skip}", "value": None, "unit": "", "target": "",
                      "ok": None}],
        }  # fmt: skip
    path = work / f"{name}.json"
    result = run_process(
        name, [sys.executable, "-m", f"bench.{name}", str(path)], limit, work, log, env
    )
    result["bench"] = True
    result["rows"], result["failures"] = [], []
    try:
        data = json.loads(path.read_text())
        rows = data.get("rows", [])
        if not isinstance(rows, list):
            raise ValueError("'rows' is not a list")
        result["rows"] = [r for r in rows if isinstance(r, dict)]
        result["failures"] = [str(x) for x in data.get("failures", [])]
    except (OSError, ValueError, AttributeError) as e:
        said = result["status"] != "ok"  # the step's failure shows its output already
        result["failures"].append(
            f"no usable JSON from bench.{name} ({type(e).__name__}: {e}); rc {result.get('rc')}"
            + ("" if said else f", last output:\n{result.get('output_tail', '')}")
        )
    return result


#: Where the tests marked gpu leave benchmark rows of their own (tests/test_gpu_nccl.py's
#: ``record``): one ``{"rows": [...], "failures": [...]}`` JSON per test module.
FIGURES_ENV = "MONARCH_KERNEL_GPU_FIGURES"


def recorded_figures(folder: Path) -> list[dict[str, Any]]:
    """The rows the tests recorded, one benchmark entry per file of ``folder``."""
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        entry: dict[str, Any] = {"name": path.stem, "bench": True, "figures": True}
        try:
            data = json.loads(path.read_text())
            entry["rows"] = [r for r in data.get("rows", []) if isinstance(r, dict)]
            entry["failures"] = [str(x) for x in data.get("failures", [])]
        except (OSError, ValueError, AttributeError) as e:
            entry["rows"], entry["failures"] = [], [f"{path.name}: {type(e).__name__}: {e}"]
        out.append(entry)
    return out


# -- the run ---------------------------------------------------------------------------------


def check(args: argparse.Namespace) -> None:
    began = time.monotonic()
    md_path = Path(args.md)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "gpu-check.log")
    log.say(f"gpu_check: work folder {work}; python {sys.executable}")
    env = step_env()
    results: dict[str, Any] = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "steps": [],
        "tests": {"files": [], "tests": [], "counts": count([])},
        "work": str(work),
    }

    def left() -> float:
        return TOTAL_LIMIT - (time.monotonic() - began)

    def save() -> None:  # after every step: a run killed from outside still leaves a report
        results["seconds"] = time.monotonic() - began
        save_report(results, md_path, log)

    facts = step_facts(work, log, env, min(FACTS_LIMIT, left()))
    results["facts"] = {**host_facts(), **facts.pop("data")}
    results["steps"].append(facts)
    save()

    tests_limit = min(args.tests_limit, left() - 10)
    figures = work / "figures"
    figures.mkdir(exist_ok=True)
    tests_env = {**env, FIGURES_ENV: str(figures)}
    step, tests = step_tests(
        work, log, tests_env, tests_limit, args.per_test, Path(args.tests_dir), args.tests
    )
    results["tests"] = tests
    results["steps"].append(step)
    for run in step.pop("runs", []):
        results["steps"].append(run)
    results["steps"].extend(recorded_figures(figures))
    save()

    skip = None
    if results["facts"].get("cuda_available") is False and not args.force_bench:
        skip = "no CUDA device (facts)"
    for name, limit in BENCHES:
        if args.benches is not None and name not in args.benches.split(","):
            continue
        room = left() - 5
        if room < min(limit, 10):
            results["steps"].append(
                {"name": name, "bench": True, "status": "timeout", "limit_s": limit,
                 "seconds": 0.0, "error": f"not started: {left():.0f} s of the run left",
                 "rows": []}
            )  # fmt: skip
            continue
        results["steps"].append(step_bench(name, min(limit, room), work, log, env, skip))
        save()
    save()
    summary(results, md_path, log)
    log.file.close()
    save_report(results, md_path, None)  # the log once more, whole


#: The files that come back from the device machine ($OUT), besides the report.
OUT_FILES = ("gpu-check.json", "gpu-check.log", "gpu-tests.xml")


def save_report(results: dict[str, Any], md_path: Path, log: Log | None) -> None:
    """Write the report and the JSON of every step so far; copy them, the log and the JUnit
    XML to ``$OUT`` where that is set (the device tool brings back what is there)."""
    work = Path(results["work"])
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(results))
    (work / "gpu-check.json").write_text(json.dumps(results, indent=1, default=str))
    out = os.environ.get("OUT")
    if not out or not Path(out).is_dir():
        return
    if log is not None:
        log.file.flush()
    for f in (md_path, *(work / name for name in OUT_FILES)):
        if f.exists():
            shutil.copy(f, Path(out) / f.name)


def summary(results: dict[str, Any], md_path: Path, log: Log) -> None:
    """Every failure with its context, then one line: the end of what the run prints."""
    fails = failures(results)
    log.say("")
    log.say("=" * 78)
    for title, ctx in fails:
        log.say(f"FAILURE: {title}")
        log.say(bound(ctx))
        log.say("-" * 78)
    c = results["tests"]["counts"]
    log.say(
        f"gpu_check: {results['seconds']:.0f} s; "
        f"device {results['facts'].get('device') or 'none'}; "
        f"tests {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
        f"{c['skipped']} skipped; steps "
        + ", ".join(f"{s['name']} {s.get('status')}" for s in results["steps"])
        + f"; {len(fails)} failure(s); wrote {md_path}"
        + (f" and {', '.join(OUT_FILES)} to $OUT" if os.environ.get("OUT") else "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--facts", metavar="JSON", help=argparse.SUPPRESS)  # the facts step itself
    p.add_argument("--md", default=str(MD), help="where the report goes (%(default)s)")
    p.add_argument("--work", help="the work folder (default: a new one under $TMPDIR)")
    p.add_argument("--per-test", type=int, default=PER_TEST_TIMEOUT, help="seconds a test")
    p.add_argument("--tests-limit", type=float, default=TESTS_LIMIT, help="seconds, all tests")
    p.add_argument("--tests-dir", default=str(ROOT / "tests"), help=argparse.SUPPRESS)
    p.add_argument("--tests", help="only the gpu test files whose names contain these (a,b)")
    p.add_argument("--benches", help="only these benchmark modules (gpu_ipc,gpu_nccl)")
    p.add_argument("--force-bench", action="store_true", help="run the benchmarks without CUDA")
    args = p.parse_args(argv)
    if args.facts:
        facts_main(args.facts)
        return 0
    check(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
