"""The ``lightning`` backend against a stand-in for ``lightning_sdk.Job`` (the cloud is
out of reach here): the job's exact command runs on network-namespace hosts
(``lightning_standin.py``), whose signatures are checked against the installed SDK.

Also: the clear errors (no credentials, no or an unknown machine type, too many GPUs per
machine) and the Studio notebook, executed by nbclient.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import wait_no_orphans
from helpers import wait_until
from netns import netns_hosts_fixture
from notebook_outputs import keep_outputs

from monarch_kernel.actor import host_mesh
from monarch_kernel.launchers import get_launcher
from monarch_kernel.launchers.join import TOKEN_ENV
from monarch_kernel.launchers.lightning_engine import find_credentials, import_sdk, machine_types

pytestmark = pytest.mark.cluster

# Imported as the backend imports it: lightning_sdk's own import would set TQDM_POSITION
# and TQDM_MININTERVAL in this process's environment at collection, and every kernel a
# later test starts (and its ranks) would draw tqdm bars once a second, a row down.
try:
    lightning_sdk: Any = import_sdk()  # the module (the tests read more of it than the backend)
except ValueError:
    pytest.skip("needs lightning-sdk", allow_module_level=True)
from lightning_standin import Job, Studio, make_sdk  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(2)


@pytest.fixture
def sdk(net, monkeypatch):
    """The stand-in SDK on the two hosts, as seen from inside a Studio."""
    monkeypatch.setenv("LIGHTNING_CLOUD_SPACE_ID", "standin-studio")
    standin = make_sdk(net, startup=1.0, boot=0.6)
    yield standin
    standin.close()


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for key in ("LIGHTNING_CLOUD_SPACE_ID", "LIGHTNING_API_KEY", "LIGHTNING_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LIGHTNING_CREDENTIAL_PATH", str(tmp_path / "credentials.json"))
    return tmp_path / "credentials.json"


def _group_pids(job) -> set[int]:
    """Every process of the job's machines (each machine is one process group)."""
    pgids = {m._proc.pid for m in job.machines if m._proc is not None}
    out = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids:
                out.add(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out


class StatusWatcher:
    """Samples every host's dashboard status line while the mesh starts."""

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}
        self.notices: set[str | None] = set()
        self.stop = threading.Event()

    def __call__(self, procs) -> None:
        threading.Thread(target=self.run, args=(procs.runtime,), daemon=True).start()

    def run(self, rt) -> None:
        while not self.stop.is_set():
            for h in rt.hosts:
                if h.handle is not None:
                    line = h.handle.status()
                    seen = self.seen.setdefault(h.index, [])
                    if not seen or seen[-1] != line:
                        seen.append(line)
                    self.notices.add(h.handle.notice())
            time.sleep(0.05)


def _start(sdk, name: str, watcher=None):
    mesh = host_mesh(
        hosts=2,
        backend="lightning",
        machine="H100_X_8",
        sdk=sdk,
        bind=sdk.Job.hosts.gateway,
        poll_interval=0.2,
    )
    return mesh.spawn_procs({"gpus": 2}, name=name, timeout=60, on_starting=watcher)


def test_two_machine_mesh_through_a_job(sdk, net):
    watcher = StatusWatcher()
    t0 = time.monotonic()
    procs = _start(sdk, "lit", watcher)
    print(f"\n2 Lightning machines x 2 ranks up in {time.monotonic() - t0:.1f}s")
    watcher.stop.set()
    rt = procs.runtime
    launcher = rt.launcher
    try:
        (job,) = sdk.Job.started
        spec = job.spec
        # One job, as the issue asks: the join command, the token only in env.
        assert spec["num_machines"] == 2 and spec["interruptible"] is False
        assert spec["machine"] is lightning_sdk.Machine.H100_X_8
        assert isinstance(spec["studio"], Studio) and spec["studio"].name == "standin-studio"
        assert job.name.startswith("mk-lit-")
        port = rt.launcher.join.url.rsplit(":", 1)[1]
        assert spec["command"] == (
            f"python -m monarch_kernel.host --join tcp://{net.gateway}:{port}"
        )
        assert list(spec["env"]) == [TOKEN_ENV]
        token = spec["env"][TOKEN_ENV]
        assert token.startswith("g2-") and token not in spec["command"]
        # The dashboard saw each machine's job status before it joined.
        for i in range(2):
            lines = watcher.seen[i]
            assert any("Pending" in s and job.name in s for s in lines), lines
            assert "joined from" in lines[-1], lines
        assert any("Running at 10.77." in s for i in range(2) for s in watcher.seen[i])
        (notice,) = watcher.notices
        assert notice is not None and "goes to sleep" in notice and job.name in notice
        # A cell across the hosts: every rank on its own machine, with the Studio's python.
        code = "import socket, sys\nwhere = (socket.gethostname(), sys.executable)"
        assert rt.restarter.run_cell(list(range(4)), code, "[1]", [], time.monotonic() + 30) == ""
        where = procs.pull("where").values()
        names = [w[0] for w in where]
        # Each machine takes the next free host slot (one group token): any order.
        assert names[0] == names[1] and names[2] == names[3]
        assert sorted({names[0], names[2]}) == sorted(h.name for h in net.hosts)
        venv_python = os.path.join(os.path.dirname(sys.executable), "python")
        assert {w[1] for w in where} == {venv_python}
        # An actor call across the hosts.
        from actors import Worker

        who = procs.spawn("who", Worker).whoami.call().get(timeout=30)
        assert sorted(v["env"]["GROUP_RANK"] for v in who.values()) == ["0", "0", "1", "1"]
        # No token or key on any command line of the job's processes.
        pids = _group_pids(job)
        assert len(pids) >= 2 * (1 + 2)  # agents and ranks on each machine
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            assert token not in cmdline and rt.key.hex() not in cmdline
    finally:
        procs.stop()  # %mesh stop
    # The allocation went with its last host: the job was stopped, nothing is left.
    assert job.stop_calls >= 1
    assert job.status in (
        lightning_sdk.Status.Stopped,
        lightning_sdk.Status.Completed,
    ), job.status
    wait_until(lambda: not _group_pids(job), timeout=10, what="the job's processes to end")
    launcher.shutdown()
    assert not wait_no_orphans()


#: A gloo all_reduce over the mesh's ranks (the group formed at the mesh's size now).
ALL_REDUCE = """\
import datetime, torch, torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
_t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(_t)
total = (_t.item(), dist.get_world_size(), __import__("socket").gethostname())
"""


def test_grow_and_shrink_by_a_machine(sdk, net):
    """``procs.grow(hosts="+1")`` (``%mesh grow NAME --hosts +1``) starts a job for the
    new machine; the new rank takes part in an all_reduce; ``shrink(hosts=1)`` stops
    that job and keeps the first."""
    mesh = host_mesh(
        hosts=1,
        backend="lightning",
        machine="H100_X_8",
        sdk=sdk,
        bind=sdk.Job.hosts.gateway,
        poll_interval=0.2,
    )
    procs = mesh.spawn_procs({"gpus": 1}, name="lg", timeout=60)
    rt = procs.runtime
    launcher = rt.launcher
    try:
        (first,) = sdk.Job.started
        t0 = time.monotonic()
        report = procs.grow(hosts="+1", timeout=60)
        print(f"\ngrow lightning 1 → 2 machines: {time.monotonic() - t0:.1f}s")
        assert "world size 1 → 2; rank 1 started" in report.describe(), report.describe()
        first_, grown = sdk.Job.started
        assert first_ is first and grown.spec["num_machines"] == 1
        assert grown.status is lightning_sdk.Status.Running, grown.status
        failed = rt.restarter.run_cell([0, 1], ALL_REDUCE, "[1]", [], time.monotonic() + 60)
        assert failed == "", failed
        totals = list(procs.pull("total").values())
        assert [t[:2] for t in totals] == [(3.0, 2)] * 2, totals
        # the new machine is one the first job does not run on
        assert sorted(t[2] for t in totals) == sorted(h.name for h in net.hosts), totals

        t0 = time.monotonic()
        report = procs.shrink(hosts=1)
        assert "world size 2 → 1; rank 1 stopped" in report.describe(), report.describe()
        wait_until(
            lambda: grown.status is lightning_sdk.Status.Stopped,
            timeout=15,
            what="the grown machine's job to stop",
        )
        print(f"shrink lightning 2 → 1 machines, its job stopped: {time.monotonic() - t0:.1f}s")
        assert grown.stop_calls >= 1 and first.stop_calls == 0
        assert first.status is lightning_sdk.Status.Running, first.status
        wait_until(lambda: not _group_pids(grown), timeout=10, what="its processes to end")
    finally:
        procs.stop()
    wait_until(lambda: not _group_pids(first), timeout=10, what="the job's processes to end")
    assert first.stop_calls >= 1
    launcher.shutdown()
    assert not wait_no_orphans()


def test_kernel_exit_stops_the_job(sdk):
    """Kernel shutdown/exit: the engine's atexit handler stops a job still running."""
    from monarch_kernel.launchers.engine import _release_all

    procs = _start(sdk, "exiting")
    (job,) = sdk.Job.started
    assert job.status is lightning_sdk.Status.Running
    pids = _group_pids(job)
    assert pids
    try:
        _release_all()  # what interpreter exit runs (EngineLauncher.shutdown per launcher)
        assert job.stop_calls == 1 and job.status is lightning_sdk.Status.Stopped
        assert not any(psutil.pid_exists(p) for p in pids)
        _release_all()  # idempotent: a second release does not call the cloud again
        assert job.stop_calls == 1
    finally:
        procs.stop()
    assert not wait_no_orphans()


def test_a_failed_job_fails_the_start_at_once(net, monkeypatch):
    """A job that ends before its machines join (here: a Studio whose environment has no
    ``python``) fails the mesh start with the job's name and logs, not a timeout."""
    from monarch_kernel.calls.errors import MeshStartError

    monkeypatch.setenv("LIGHTNING_CLOUD_SPACE_ID", "standin-studio")
    sdk = make_sdk(net, startup=0.3, boot=0.1, studio_env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    try:
        t0 = time.monotonic()
        with pytest.raises(
            MeshStartError, match=r"Lightning job mk-broken-\w+ is Failed; its logs"
        ):
            _start(sdk, "broken")
        assert time.monotonic() - t0 < 15
        (job,) = sdk.Job.started
        assert "python: command not found" in sdk.logs(job)
        assert job.stop_calls >= 1  # released although it had ended
    finally:
        sdk.close()
    assert not wait_no_orphans()


def test_no_credentials_is_one_clear_error(no_credentials):
    with pytest.raises(ValueError, match=r"^no Lightning credentials: .*Studio.*LIGHTNING_API_KEY"):
        get_launcher("lightning", machine="H100_X_8", sdk=lightning_sdk)
    # What counts as credentials is what the SDK reads.
    assert find_credentials() is None
    no_credentials.write_text('{"user_id": "u", "api_key": "k", "auth_token": ""}')
    assert find_credentials() == str(no_credentials)
    assert find_credentials({"LIGHTNING_API_KEY": "k"}) == "the environment"
    assert find_credentials({"LIGHTNING_CLOUD_SPACE_ID": "s"}) == "this Studio"


def test_machine_type_is_required_and_checked(sdk):
    with pytest.raises(ValueError, match=r"needs --machine TYPE; one of: .*H100_X_8"):
        get_launcher("lightning", sdk=sdk)
    with pytest.raises(ValueError, match=r"unknown Lightning machine type 'H100_X_9'; one of:"):
        get_launcher("lightning", machine="H100_X_9", sdk=sdk)
    # The list is the installed SDK's.
    assert set(machine_types(lightning_sdk)) >= {"H100", "H100_X_2", "H100_X_4", "H100_X_8"}


def test_more_ranks_than_the_machine_has_gpus(sdk):
    mesh = host_mesh(
        hosts=2,
        backend="lightning",
        machine="h100_x_4",
        sdk=sdk,
        bind="127.0.0.1",
        allow_loopback=True,
    )
    try:
        with pytest.raises(ValueError, match=r"8 ranks per host but a H100_X_4 machine has 4 GPUs"):
            mesh.spawn_procs({"gpus": 8}, name="toobig", timeout=10)
        assert sdk.Job.started == []  # refused before any job was submitted
    finally:
        mesh.launcher.shutdown()


# -- the stand-in cannot drift from the installed SDK -------------------------------------


def _params(fn) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults (annotations differ only in spelling)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    "what",
    ["Job.run", "Job.__init__", "Job.stop", "Job.wait", "Studio.__init__"],
)
def test_standin_signatures_match_the_installed_sdk(what):
    cls, meth = what.split(".")
    import lightning_standin

    real = getattr(getattr(lightning_sdk, cls), meth)
    ours = getattr(getattr(lightning_standin, cls), meth)
    assert _params(ours) == _params(real), what
    kind = type(inspect.getattr_static(getattr(lightning_sdk, cls), meth))
    assert type(inspect.getattr_static(getattr(lightning_standin, cls), meth)) is kind


def test_standin_properties_and_data_are_the_sdks():
    import lightning_standin

    for name in ("status", "machines", "name", "rank", "private_ip_address", "link"):
        assert isinstance(inspect.getattr_static(lightning_sdk.Job, name), property), name
        assert isinstance(inspect.getattr_static(Job, name), property), name
    # Machine types and job states are the SDK's own objects, not copies.
    assert lightning_standin.Machine is lightning_sdk.Machine
    assert lightning_standin.Status is lightning_sdk.Status
    # The names the backend takes from the SDK exist there.
    assert all(hasattr(lightning_sdk, n) for n in ("Job", "Machine", "Studio"))


# -- the Studio notebook -------------------------------------------------------------------


def test_studio_notebook_runs_outside_a_studio(monkeypatch):
    """Executed like the other tutorials (tests/test_notebooks.py); its Studio-only cells
    say why they are skipped."""
    import nbformat
    from kernel_client import ensure_kernelspec, notebook_client

    monkeypatch.delenv("LIGHTNING_CLOUD_SPACE_ID", raising=False)
    ensure_kernelspec()
    nb = nbformat.read(NOTEBOOKS / "05-lightning-studio.ipynb", as_version=4)
    notebook_client(
        nb, kernel_name="monarch", timeout=120, resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    texts = []
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        parts = [o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream"]
        parts += [
            o.data.get("text/plain", "")
            for o in cell.get("outputs", [])
            if o.output_type in ("execute_result", "display_data")
        ]
        assert not any(o.output_type == "error" for o in cell.get("outputs", [])), cell.source
        texts.append("\n".join(parts))
    skipped = "skipped: not inside a Lightning Studio (LIGHTNING_CLOUD_SPACE_ID unset)"
    assert sum(skipped in t for t in texts) == 2, texts
    assert any("[0-1] hello from every rank" in t for t in texts), texts
    assert any("stopped" in t for t in texts), texts
    keep_outputs(nb, NOTEBOOKS / "05-lightning-studio.ipynb")


def test_magic_errors_in_the_kernel():
    """``%mesh --backend lightning`` in the kernel: one clear error per bad input, and
    nothing reaches the SDK's network code (each is raised before)."""
    import nbformat
    from kernel_client import ensure_kernelspec, notebook_client

    setup = (
        "import os\n"
        "for k in ('LIGHTNING_CLOUD_SPACE_ID', 'LIGHTNING_API_KEY', 'LIGHTNING_AUTH_TOKEN'):\n"
        "    os.environ.pop(k, None)\n"
        "os.environ['LIGHTNING_CREDENTIAL_PATH'] = '/nonexistent/credentials.json'"
    )
    cells = [
        setup,
        "%mesh big --backend lightning --hosts 2 --machine H100_X_8 --gpus 8",
        "os.environ['LIGHTNING_API_KEY'] = 'not-a-real-key'",
        "%mesh big --backend lightning --hosts 2 --machine H100_X_9 --gpus 8",
        "%mesh big --backend lightning --hosts 2 --gpus 8",
    ]
    ensure_kernelspec()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    notebook_client(nb, kernel_name="monarch", timeout=60, allow_errors=True).execute()

    def text(cell) -> str:
        out = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append(o.text)
            elif o.output_type == "error":
                out.append(f"{o.ename}: {o.evalue}")
            elif o.output_type in ("execute_result", "display_data"):
                out.append(o.data.get("text/plain", ""))
        return "\n".join(out)

    no_creds, unknown, missing = (text(nb.cells[i]) for i in (1, 3, 4))
    assert no_creds.count("no Lightning credentials") == 1, no_creds
    assert "unknown Lightning machine type 'H100_X_9'; one of:" in unknown, unknown
    assert "H100_X_8" in unknown
    assert "the lightning backend needs --machine TYPE" in missing, missing


def test_local_mesh_inside_a_studio_warns_about_idle_sleep():
    """Inside a Studio (``LIGHTNING_CLOUD_SPACE_ID`` set) ``%mesh NAME --gpus N`` is the
    local backend on the Studio's machine, and says that an idle Studio ends it."""
    from kernel_client import Kernel

    k = Kernel(env={"LIGHTNING_CLOUD_SPACE_ID": "studio-test"})
    try:
        r = k.run("%mesh studio --gpus 1")
        assert "(local) ready" in r.stdout, r.stderr + r.error_text
        assert "Lightning Studio's own machine" in r.stdout and "idle Studio" in r.stdout
        k.run("%mesh stop studio")
    finally:
        k.shutdown()
