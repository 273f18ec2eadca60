"""Shared fixtures: real meshes, the no-orphan check after every test, and the check
that a session leaves the git checkout as it found it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import WaitTimeout, wait_until
from timeout_dump import RankDumpTimer

__all__ = ["WaitTimeout", "pid_alive", "project_processes", "wait_no_orphans", "wait_until"]

ORPHAN_GRACE = 10.0
#: A wait for processes to exit longer than this is reported (a warning in the summary).
SLOW_ORPHAN_WAIT = 5.0

#: The test lanes (markers registered in pyproject.toml; README "Fast lane"). Every test is in
#: exactly one: a module sets ``pytestmark``, a module that mixes kinds marks its ``unit``
#: tests one by one, and a test with no lane marker is in ``local``.
LANES = ("unit", "local", "cluster", "browser")
#: Modules not (yet) carrying their own lane marker: test_layering.py (pure AST checks).
UNMARKED_LANES: dict[str, str] = {}


#: tqdm's settings in this process's environment when the session started. Kernels that
#: tests start inherit the environment, and so do their ranks: a module whose import
#: changes these (lightning_sdk's import sets TQDM_POSITION and TQDM_MININTERVAL) would
#: change how every later test's progress bars are drawn.
TQDM_AT_START = {k: v for k, v in os.environ.items() if k.startswith("TQDM_")}

#: The checkout the tests run from.
ROOT = Path(__file__).resolve().parent.parent

#: The host template's late ``torch._dynamo`` import (``monarch_kernel.host.template``,
#: ``PREIMPORT_LATE``: about 1.1 s of CPU once a template has forked and the host has had a
#: spare core for a few seconds) serves only ranks forked later, restarted ones that
#: rebuild DDP. Most tests restart none, and with a mesh or more per test it was minutes
#: of the suite's CPU: off by default (``MONARCH_KERNEL_PREIMPORT_LATE`` empty, inherited
#: by the kernels, agents and templates tests start), on in the modules that restart
#: ranks inside DDP training, which keep the product's path under test
#: (:func:`_late_imports`).
LATE_IMPORT_MODULES = frozenset({"test_ddp_failures.py", "test_peer_state.py"})
LATE_IMPORT_ENV = "MONARCH_KERNEL_PREIMPORT_LATE"
#: Whether the session was started with its own setting (then kept everywhere).
_LATE_IMPORT_GIVEN = LATE_IMPORT_ENV in os.environ
os.environ.setdefault(LATE_IMPORT_ENV, "")  # before any cluster or kernel starts

#: Where a test keeps what is for people to look at afterwards (screenshots, logs), and
#: Hypothesis its example database: git-ignored. Anything else a test writes goes under a
#: temporary directory (``tmp_path``, ``tmp_path_factory``, ``short_tmp``): a session must
#: leave the checkout as it found it (``pytest_sessionfinish``).
ARTIFACTS = ROOT / "test-artifacts"


def _terminated(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"pytest got signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (``timeout``, ``kill``, a CI runner cancelling) ends the session as
    Ctrl-C does, so that fixtures are torn down: the session's Ray and Slurm clusters,
    network namespaces and host agents are removed, not left running."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    _hypothesis_storage_in_artifacts()


def _hypothesis_storage_in_artifacts() -> None:
    """Hypothesis keeps its example database and a cache of the constants in the source
    under ``.hypothesis/`` in the current directory (the checkout, under ``make test``):
    under test-artifacts/ instead, unless HYPOTHESIS_STORAGE_DIRECTORY says where."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return
    try:
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:  # the test extra brings it; without it, nothing to redirect
        return
    set_hypothesis_home_dir(ARTIFACTS / "hypothesis")


#: ``0``: do not check that the session left the checkout as it was (for a developer who
#: edits files while the tests run; ``make test`` and CI never set it).
TREE_GUARD_ENV = "MONARCH_KERNEL_TREE_GUARD"
#: ``git status`` of the checkout when the session started: each path it listed (a change
#: not committed, an untracked file; git-ignored paths are not listed), with its status
#: letters and what its file holds (``_stamp``). Only in the controller process.
TREE_AT_START = pytest.StashKey[dict[str, tuple[str, str | None]]]()
#: The paths the session changed in the checkout, for the terminal summary.
TREE_CHANGED = pytest.StashKey[list[str]]()


def _tree() -> dict[str, tuple[str, str | None]] | None:
    """The checkout's changes as :data:`TREE_AT_START` holds them; None where the tests
    do not run in a git checkout (an sdist) or git is absent or fails."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return None
    argv = ["git", "--no-optional-locks", "status", "--porcelain=v1", "-z", "--no-renames"]
    try:  # (--no-optional-locks: no index.lock taken from a developer's own git commands)
        out = subprocess.run(
            [*argv, "--untracked-files=all"], cwd=ROOT, capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    tree: dict[str, tuple[str, str | None]] = {}
    for entry in out.stdout.split(b"\0"):
        if entry:  # "XY path", the path as it is (-z: never quoted)
            path = os.fsdecode(entry[3:])
            tree[path] = (entry[:2].decode(), _stamp(ROOT / path))
    return tree


def _stamp(path: Path) -> str | None:
    """What ``path`` holds (its content's digest, a link's target), None if it is gone:
    a file written again with what it held is no change (a developer's formatter may
    rewrite a file it leaves as it was)."""
    try:
        if path.is_symlink():
            return "-> " + os.readlink(path)
        if path.is_dir():  # a submodule: its status letters say whether it changed
            return "dir"
        return hashlib.sha1(path.read_bytes()).hexdigest()
    except OSError:
        return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers
def pytest_sessionstart(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller checks the whole session
    if os.environ.get(TREE_GUARD_ENV) == "0":
        return  # a developer editing files while a run goes on (never set in CI)
    tree = _tree()
    if tree is not None:
        session.config.stash[TREE_AT_START] = tree


@pytest.hookimpl(trylast=True)  # after the session's fixtures (and the workers) are done
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail a session that changed the checkout: a path that ``git status`` lists now and
    did not at the start, or lists with other letters, or whose file changed since (a
    developer's own edits made before the session are no failure, unless a test changed
    them again), or that it no longer lists."""
    before = session.config.stash.get(TREE_AT_START, None)
    after = _tree() if before is not None else None
    if before is None or after is None:
        return
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if not changed:
        return
    session.config.stash[TREE_CHANGED] = [
        f"{after[p][0] if p in after else 'as committed:'} {p}" for p in changed
    ]
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Before pytest-timeout's own timer (which it still sets: None lets it run), one
    that prints the stacks of the test's ranks shortly before the limit
    (``timeout_dump``): pytest-timeout shows only this process's threads."""
    if settings.timeout and settings.timeout > 0:
        timer = RankDumpTimer(settings.timeout)
        item.stash[_RANK_DUMP] = timer
        timer.start()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = item.stash.get(_RANK_DUMP, None)
    if timer is not None:
        timer.cancel()


_RANK_DUMP = pytest.StashKey[RankDumpTimer]()


#: (worker, module) -> [first start, last stop, seconds in its tests' phases], from the
#: reports pytest-xdist forwards to the controller (``_summarise_timeline``).
_TIMELINE: dict[tuple[str, str], list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(report, "node", None)
    gateway = getattr(getattr(worker, "gateway", None), "id", None)
    if gateway is None or not getattr(report, "stop", None):
        return  # one process (no workers): pytest's own --durations says enough
    key = (str(gateway), report.nodeid.split("::", 1)[0])
    span = _TIMELINE.setdefault(key, [report.start, report.stop, 0.0])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
    span[2] += report.duration


def _summarise_timeline(reporter: pytest.TerminalReporter) -> None:
    """Where the wall time of a ``make test`` run went (the suite must stay under 25
    minutes on a 2-core CI machine): each worker's busy time and when it finished, and
    the longest modules, so that an idle worker at the end shows up."""
    if not _TIMELINE:
        return
    start = min(s for s, _, _ in _TIMELINE.values())
    reporter.section("where the time went (pytest-xdist workers)")
    for worker in sorted({w for w, _ in _TIMELINE}):
        spans = [v for (w, _), v in _TIMELINE.items() if w == worker]
        busy = sum(d for _, _, d in spans)
        end = max(e for _, e, _ in spans) - start
        reporter.line(f"{worker}: {len(spans)} modules, {busy:.0f} s in tests, done at {end:.0f} s")
    ranked = sorted(_TIMELINE.items(), key=lambda kv: -kv[1][2])
    lines = [
        f"  {busy:6.0f} s  {module} ({worker}, {s0 - start:.0f}-{s1 - start:.0f} s)"
        for (worker, module), (s0, s1, busy) in ranked
    ]
    for line in lines[:15]:
        reporter.line(line)
    # every module, for whoever trims the suite's time (git-ignored, like the rest there)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "module-times.txt").write_text("\n".join(lines) + "\n")
    reporter.line(f"(all {len(lines)} modules: {ARTIFACTS / 'module-times.txt'})")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _summarise_timeline(terminalreporter)
    changed = terminalreporter.config.stash.get(TREE_CHANGED, None)
    if not changed:
        return
    terminalreporter.section("the tests changed the git checkout", red=True, bold=True)
    terminalreporter.line(
        "These paths changed while the tests ran (git status --porcelain; git-ignored "
        "paths are not counted):",
        red=True,
    )
    for line in changed:
        terminalreporter.line(f"    {line}")
    terminalreporter.line(
        "A test writes only under a temporary directory (tmp_path, tmp_path_factory, "
        "short_tmp) or under test-artifacts/ (git-ignored), never into the checkout. "
        f"(A file edited by hand while the tests ran is listed too: {TREE_GUARD_ENV}=0 "
        "turns this check off for such a run.)",
        red=True,
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    changed = {k for k, v in os.environ.items() if k.startswith("TQDM_")} | set(TQDM_AT_START)
    changed = {k for k in changed if os.environ.get(k) != TQDM_AT_START.get(k)}
    for name in changed:
        if name in TQDM_AT_START:
            os.environ[name] = TQDM_AT_START[name]
        else:
            del os.environ[name]
    if changed:
        warnings.warn(
            f"a test module's import changed {', '.join(sorted(changed))} in the environment; "
            "put back (import lightning_sdk with lightning_engine.import_sdk)",
            stacklevel=1,
        )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        lanes = {m.name for m in item.iter_markers() if m.name in LANES}
        if len(lanes) > 1:
            raise pytest.UsageError(f"{item.nodeid} is in more than one lane: {sorted(lanes)}")
        if not lanes:
            item.add_marker(UNMARKED_LANES.get(item.path.name, "local"))
        if _uses_a_session_cluster(item) and item.path.name not in CLUSTER_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session's Ray cluster or a Slurm cluster: add "
                f"{item.path.name} to CLUSTER_MODULES in tests/conftest.py"
            )
        if item.get_closest_marker("gpu") is not None and not _HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (bench/gpu_check.py)"))
    # those first: on two workers, the longest unit of work starts at once
    items.sort(key=lambda item: item.path.name not in CLUSTER_MODULES)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


#: Whether this machine has a CUDA GPU (tests marked ``gpu`` are skipped without one).
_HAS_CUDA = _cuda_available()


#: The modules that use the session's Ray cluster or a Slurm cluster (one ``munged``,
#: which the first cluster started and stops when its module ends): ``make test`` runs
#: them on one pytest-xdist worker, one after another (see ``pytest_xdist_make_scheduler``).
CLUSTER_MODULES = frozenset(
    {
        "test_ray.py",
        "test_elastic_ray.py",
        "test_detach_engines.py",
        "test_slurm.py",
        "test_elastic_slurm.py",
    }
)
CLUSTER_GROUP = "ray-and-slurm"


def _uses_a_session_cluster(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return "ray_session_cluster" in getattr(item, "fixturenames", ()) or hasattr(
        module, "slurm_cluster_fixture"
    )


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``make test`` runs the suite on two pytest-xdist workers. A unit of work is a
    module, run on one worker in order (a module-scoped kernel or mesh is started once,
    and a test may build on what an earlier one left in it), except that all of
    :data:`CLUSTER_MODULES` are one unit: one Ray cluster serves them all and no two
    Slurm clusters overlap. (xdist's own ``loadgroup`` cannot do this with this pytest:
    it renames test ids through an attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return CLUSTER_GROUP if os.path.basename(module) in CLUSTER_MODULES else module

    config.option.loadscopereorder = False  # the collection's order (cluster modules first)
    return ModuleScheduling(config, log)


def project_processes() -> list[psutil.Process]:
    """Host agents, templates and ranks of ours that are alive on this machine
    and descend from this test process."""
    me = psutil.Process()
    out = []
    for p in me.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "monarch_kernel" in cmd and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def wait_no_orphans(
    keep: Container[int] = frozenset(),
    timeout: float = ORPHAN_GRACE,
    excused: Callable[[psutil.Process], bool] = lambda _: False,
) -> list:
    """Wait up to ``timeout`` for our processes (but ``keep`` and the ``excused``) to
    exit; return those left."""

    def left() -> list[psutil.Process]:
        return [p for p in project_processes() if p.pid not in keep and not excused(p)]

    first = left()
    began = time.monotonic()
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not left(), timeout=timeout, what="our processes to exit")
    waited = time.monotonic() - began
    if waited > SLOW_ORPHAN_WAIT:  # CI's log then says whose processes a test waited for
        warnings.warn(
            f"waited {waited:.1f}s for processes to exit: "
            + ", ".join(f"{p.pid} {_cmdline(p)[:70]}" for p in first),
            stacklevel=2,
        )
    return left()


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "(gone)"


#: Module-scoped fixtures that own long-lived processes; their ranks may legitimately be
#: restarted inside a test, so those tests are checked when the module's fixture ends.
SHARED_FIXTURES = {"kernel", "procs4", "mesh22", "workers", "two_meshes", "machines"}


@pytest.fixture(scope="module", autouse=True)
def _late_imports(request: pytest.FixtureRequest) -> Any:
    """Turns the late import on for a module of :data:`LATE_IMPORT_MODULES` before its
    own fixtures start anything, and off again after it; a value the session was
    started with is kept."""
    if _LATE_IMPORT_GIVEN or os.path.basename(str(request.path)) not in LATE_IMPORT_MODULES:
        yield
        return
    os.environ[LATE_IMPORT_ENV] = "torch._dynamo"
    yield
    os.environ[LATE_IMPORT_ENV] = ""


@pytest.fixture(autouse=True)
def no_orphans(request):
    """Fail a test that leaves any rank or host agent behind.

    Tests on a shared module-scoped mesh or kernel are checked at that fixture's
    teardown instead (every process it started must be gone then).
    """
    before = {p.pid for p in project_processes()}
    yield
    if SHARED_FIXTURES & set(request.fixturenames):
        return
    # Processes of a survivor (a module's mesh) are its own to end: not waited for.
    left = wait_no_orphans(keep=before, excused=lambda p: _owned_by_a_survivor(p, before))
    assert not left, "processes left behind: " + ", ".join(
        f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in left
    )


def _owned_by_a_survivor(proc: psutil.Process, before: Container[int]) -> bool:
    """Whether ``proc`` descends from one of ours that was there before the test and is
    still alive (a rank of a module's mesh that started process-group workers): it is
    that process's to end, and its own fixture checks that it did."""
    try:
        return any(a.pid in before and a.is_running() for a in proc.parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


@pytest.fixture(scope="session")
def ray_session_cluster():
    """The real two-node Ray cluster of the test session (``ray_cluster.py``), started
    by the first test that needs it (minutes on a loaded machine: once per session). A
    test may kill its second node: modules call ``ensure_two_nodes()`` first."""
    from ray_cluster import ray_cluster_fixture

    yield from ray_cluster_fixture()


@pytest.fixture
def short_tmp():
    """A fresh directory with a short path (``/tmp/mkt-XXXXXXXX``), removed after: a
    test that makes it the temporary directory of a launcher or agent, whose private
    directories must stay there (pytest's own ``tmp_path`` is long enough, on a
    pytest-xdist worker, for them to move to ``/tmp``: ``wire.tempdirs``)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = tempfile.mkdtemp(prefix="mkt-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def place():
    """A :class:`~detach_place.Place` (kernels with a TMPDIR and Jupyter runtime
    directory of their own) for one test of detachable meshes: at its end nothing of it
    may be left, no process started with its TMPDIR and no ``mk-*`` directory."""
    from detach_place import Place

    p = Place()
    yield p
    left, dirs = p.close()
    assert not left, f"processes left behind: {left}"
    assert not dirs, f"temporary directories left behind: {dirs}"


@pytest.fixture(scope="module")
def procs4():
    """A 4-rank local mesh shared by one test module; checked for orphans after."""
    yield from local_mesh({"gpus": 4})


def local_mesh(per_host: dict[str, int]) -> Iterator[Any]:
    """The body of a module's mesh fixture (``yield from local_mesh(...)``): a local
    process mesh of ``per_host``, started without a kernel; once stopped, none of its
    processes may be left."""
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host=per_host)
    yield procs
    procs.stop()
    left = wait_no_orphans()
    assert not left, f"mesh left processes behind: {[p.pid for p in left]}"


@pytest.fixture
def mesh2():
    """A fresh 2-rank local mesh for one test, stopped after it (the test's own ranks
    are checked for orphans by ``no_orphans``)."""
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    yield procs
    procs.stop()


@pytest.fixture
def python_sigint():
    """Ctrl-C raises KeyboardInterrupt in this process during the test, as in a kernel,
    however pytest was started: a shell's background job inherits SIGINT ignored, and
    Python then leaves it ignored (our Ctrl-C handling defers to whatever is there)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``MeshFailure`` events that reach the client's ``unhandled_fault_hook``
    during the test (the hook is this list's ``append``)."""
    import monarch_kernel.actor as actor_api

    got: list[Any] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", got.append)
    return got
