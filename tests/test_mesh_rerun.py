"""``%mesh NAME ...`` again on a live mesh of that name, through a real kernel: the same
spec keeps the mesh (a notebook's Run All too), another spec is refused with what
differs and the choices, ``--replace`` starts it anew; more ranks than CPU cores is said
under the cell; ``spawn_procs(name=...)`` refuses a name a live mesh has."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import nbformat
import pytest
from kernel_client import Kernel, Result
from nbclient import NotebookClient
from notebook_outputs import cell_text

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    k = Kernel()
    yield k
    k.shutdown_and_check()


def ok(kernel: Kernel, code: str, timeout: float = 120) -> Result:
    r = kernel.run(code, timeout=timeout)
    assert not r.errors, r.stderr + r.error_text
    return r


def usage_error(kernel: Kernel, line: str) -> str:
    """The one-line UsageError ``line`` is refused with."""
    r = kernel.run(line)
    assert r.reply["status"] == "error" and r.reply["ename"] == "UsageError", r
    text = r.stderr.strip()
    assert "\n" not in text, text
    return text


def rank_pids(kernel: Kernel, mesh: str) -> list[int]:
    """The process ids of mesh ``mesh``'s ranks, as the ranks themselves say."""
    pids = ast.literal_eval(ok(kernel, f"_v = %pull {mesh} _pid\nlist(_v.values())").text)
    assert len(pids) == len(set(pids)) and all(isinstance(p, int) for p in pids), pids
    return pids


def start(kernel: Kernel, mesh: str, gpus: int) -> list[int]:
    """``%mesh MESH --gpus N`` (a new mesh), ``x = 7`` on its ranks; their pids."""
    r = ok(kernel, f"%mesh {mesh} --gpus {gpus}")
    assert "ready" in r.stdout, r.stdout
    ok(kernel, f"%%remote {mesh}\nimport os\n_pid = os.getpid()\nx = 7")
    return rank_pids(kernel, mesh)


def test_the_same_spec_keeps_the_mesh_its_ranks_and_their_state(kernel):
    pids = start(kernel, "same", 2)
    try:
        r = ok(kernel, "%mesh same --gpus 2")
        assert re.search(
            r"^mesh 'same' is already running with this spec \(2 ranks, up \d+s\): kept; "
            r"%mesh stop same first, or add --replace, to start it anew$",
            r.stdout,
            re.M,
        ), r.stdout
        assert "ready in" not in r.stdout
        assert rank_pids(kernel, "same") == pids
        assert ok(kernel, "%%remote same\nx").text.count(": 7") == 2
    finally:
        kernel.run("%mesh stop same")


def test_another_spec_is_refused_naming_the_difference_and_leaves_the_mesh_alone(kernel):
    pids = start(kernel, "spec", 2)
    try:
        choices = (
            "To start it anew, which loses its ranks' state (their namespaces): "
            "%mesh stop spec first, or add --replace"
        )
        assert usage_error(kernel, "%mesh spec --gpus 3") == (
            "UsageError: %mesh spec: mesh 'spec' is already running with another spec: "
            "--gpus 3 vs the live --gpus 2. To resize it and keep its ranks' state: "
            f"%mesh grow spec --gpus +1. {choices}"
        )
        assert usage_error(kernel, "%mesh spec --gpus 1") == (
            "UsageError: %mesh spec: mesh 'spec' is already running with another spec: "
            "--gpus 1 vs the live --gpus 2. To resize it and keep its ranks' state: "
            f"%mesh shrink spec --gpus 1. {choices}"
        )
        assert usage_error(kernel, "%mesh spec --gpus 2 --on-failure continue --env A=1") == (
            "UsageError: %mesh spec: mesh 'spec' is already running with another spec: "
            "--env A=1 vs the live mesh without --env; --on-failure continue vs the live "
            f"--on-failure restart. {choices}"
        )
        assert "--dist vs the live mesh without --dist" in usage_error(
            kernel, "%mesh spec --gpus 2 --dist"
        )
        assert rank_pids(kernel, "spec") == pids  # untouched: same processes, same state
        assert ok(kernel, "%%remote spec\nx").text.count(": 7") == 2
        assert "gpus=2" in ok(kernel, "%mesh").text
    finally:
        kernel.run("%mesh stop spec")


def test_replace_stops_the_mesh_and_starts_it_anew(kernel):
    pids = start(kernel, "rep", 2)
    try:
        r = ok(kernel, "%mesh rep --gpus 1 --replace")
        assert re.search(
            r"^mesh 'rep' \(2 ranks, up \d+s\) stopped for --replace; its ranks' state is "
            r"gone, a new mesh starts$",
            r.stdout,
            re.M,
        ), r.stdout
        assert "mesh 'rep': gpus=1 (local) ready in" in r.stdout, r.stdout
        ok(kernel, "%%remote rep\nimport os\n_pid = os.getpid()")
        new = rank_pids(kernel, "rep")
        assert len(new) == 1 and not set(new) & set(pids), (new, pids)
        r = kernel.run("%%remote rep\nx")
        assert "NameError" in r.error_text, r.error_text
    finally:
        kernel.run("%mesh stop rep")


def test_more_ranks_than_cpu_cores_is_said_under_the_cell(kernel):
    cores, gpus, others = ast.literal_eval(
        ok(
            kernel,
            "from monarch_kernel.wire.osutil import cpu_count as _cc\n"
            "from monarch_kernel.kernel.mesh.oversubscribed import local_gpus as _lg\n"
            "from monarch_kernel.controller.mesh import registry as _reg\n"
            "_cc(), _lg({}), len(_reg.live())",
        ).text
    )
    if gpus:
        pytest.skip("a machine with GPUs says GPUs shared, not cores")
    assert others == 0  # every test here stops its meshes
    n = cores + 1
    r = ok(kernel, f"%mesh over --gpus {n}")
    try:
        assert re.search(
            rf"^{n} ranks on {cores} CPU cores?: each rank gets about [0-9./]+ of a core; "
            r"fine for trying things, slow for real work \(--gpus sets ranks per host\)$",
            r.stdout,
            re.M,
        ), r.stdout
        assert "ready" in r.stdout
        kernel.run("%mesh stop over")
        r = ok(kernel, f"%mesh fits --gpus {cores}")  # as many ranks as cores: not said
        assert "ready" in r.stdout and "of a core" not in r.stdout, r.stdout
    finally:
        kernel.run("%mesh stop over")
        kernel.run("%mesh stop fits")


def test_run_all_again_keeps_the_notebooks_mesh(kernel):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%mesh nbm --gpus 2"),
        nbformat.v4.new_code_cell(
            "%%remote nbm\nimport os\n_pid = os.getpid()\n"
            "try:\n    runs += 1\nexcept NameError:\n    runs = 1\nruns"
        ),
    ]
    try:
        outputs = []
        pids = []
        for _ in range(2):
            # through the test's own client: a second client of the same kernel manager
            # would share its shell socket's identity, and one of them miss its replies
            client = NotebookClient(nb, km=kernel.km, timeout=120)
            client.kc = kernel.kc
            client.execute()
            outputs.append([cell_text(c) for c in nb.cells])
            pids.append(rank_pids(kernel, "nbm"))
        assert "ready" in outputs[0][0] and "{gpus=1}: 1" in outputs[0][1], outputs[0]
        assert "is already running with this spec" in outputs[1][0], outputs[1]
        assert "{gpus=1}: 2" in outputs[1][1], outputs[1]  # the ranks kept their state
        assert pids[0] == pids[1]
    finally:
        kernel.run("%mesh stop nbm")


def test_spawn_procs_refuses_a_name_a_live_mesh_has(kernel):
    ok(
        kernel,
        "from monarch_kernel.actor import this_host\n"
        "sp = this_host().spawn_procs({'gpus': 1}, name='sp')",
    )
    try:
        ok(kernel, "%%remote sp\nimport os\n_pid = os.getpid()\nx = 7")
        pids = rank_pids(kernel, "sp")
        r = kernel.run("this_host().spawn_procs({'gpus': 2}, name='sp')")
        assert r.errors and r.errors[0]["ename"] == "MeshNameTaken", r.error_text
        assert "a live mesh is already named 'sp'; stop it first" in r.errors[0]["evalue"]
        # %mesh NAME on the spawn_procs mesh: the same rule
        assert "--gpus 2 vs the live --gpus 1" in usage_error(kernel, "%mesh sp --gpus 2")
        assert rank_pids(kernel, "sp") == pids
        assert ": 7" in ok(kernel, "%%remote sp\nx").text
    finally:
        kernel.run("sp.stop()")
