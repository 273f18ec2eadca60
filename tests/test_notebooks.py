"""The tutorial notebooks, executed for real by nbclient."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from kernel_client import ensure_kernelspec, notebook_client
from notebook_outputs import cell_text, keep_outputs

pytestmark = pytest.mark.local

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _execute(nb: nbformat.NotebookNode, kernel_name: str) -> nbformat.NotebookNode:
    ensure_kernelspec()
    notebook_client(
        nb, kernel_name=kernel_name, timeout=120, resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    return nb


def test_quickstart_runs_with_the_monarch_kernel():
    nb = _execute(nbformat.read(NOTEBOOKS / "01-quickstart.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "ready in" in cell_text(code[0])
    assert "[0-3] hello from every rank" in cell_text(code[1])
    assert "{gpus=3}: (3," in cell_text(code[1])
    pushed = cell_text(code[2])
    assert pushed.startswith("pushed to trainers (4 ranks): scale=10"), pushed
    norms = pushed.splitlines()[-1]
    assert norms.startswith("[") and norms.count(",") == 3
    assert "ValueMesh(gpus=4; {gpus=0}: 2" in cell_text(code[3])
    assert cell_text(code[4]) == "3"
    err = cell_text(code[5])
    assert "ValueError in the cell on ranks 1, 3 of 4" in err and "line 3" in err
    assert "stopped" in cell_text(code[6])
    keep_outputs(nb, NOTEBOOKS / "01-quickstart.ipynb")


def test_magics_load_in_a_plain_ipython_kernel():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext monarch_kernel"),
        nbformat.v4.new_code_cell("%mesh p --gpus 2"),
        nbformat.v4.new_code_cell("%%remote p\nimport os\nprint('hi')\nos.environ['RANK']"),
        nbformat.v4.new_code_cell("%mesh stop p"),
    ]
    _execute(nb, "python3")
    assert "[0-1] hi" in cell_text(nb.cells[2])
    assert "{gpus=1}: '1'" in cell_text(nb.cells[2])


def test_faults_notebook_kills_restarts_and_finds_a_stuck_rank():
    nb = _execute(nbformat.read(NOTEBOOKS / "04-faults.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "ready in" in cell_text(code[0])
    assert "setup cell" in cell_text(code[1])
    died = cell_text(code[5])
    assert "rank 2 of mesh 'faults'" in died and "killed by SIGKILL" in died, died
    resumed = cell_text(code[6])
    assert "resuming after step" in resumed and "step 59 loss" in resumed, resumed
    stacks = cell_text(code[8])
    assert "odd one out" in stacks and "time.sleep(60)" in stacks, stacks
    released = cell_text(code[9])
    # every rank is interrupted where it is, the ones waiting in all_reduce included;
    # none is killed, and the process group is formed again in place
    assert "KeyboardInterrupt in the cell on rank 3 of 4" in released, released
    assert "KeyboardInterrupt in the cell on ranks 0-2 of 4" in released, released
    assert "killed" not in released
    assert "re-formed the process group (gloo) in place" in released, released
    assert "{gpus=3}: 4.0" in cell_text(code[10])
    assert "stopped" in cell_text(code[11])
    keep_outputs(nb, NOTEBOOKS / "04-faults.ipynb")


def test_live_training_notebook_trains_pushes_and_resumes():
    """02-live-training: a tiny GPT trained with DDP on 4 ranks in a --bg loop, the
    learning rate lowered with %push mid-run, then resumed from the checkpoint."""
    nb = _execute(nbformat.read(NOTEBOOKS / "02-live-training.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "ready in" in cell_text(code[0]) and "process group initialised" in cell_text(code[0])
    widgets = [
        o
        for o in code[0].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, "no live dashboard under the %mesh cell"
    assert "vocabulary of" in cell_text(code[2])
    assert "pushed to gpt (4 ranks): lr=0.001" in cell_text(code[4])
    seen = re.search(r"\{0\.003: 0, 0\.001: (\d+)\}", cell_text(code[5]))
    assert seen and 0 < int(seen.group(1)) < 200, cell_text(code[5])  # changed mid-run
    assert cell_text(code[6]).count(": 200") == 4  # every rank resumed after step 199
    assert cell_text(code[7]).startswith("[0] the cat ")
    assert "stopped" in cell_text(code[8])
    keep_outputs(nb, NOTEBOOKS / "02-live-training.ipynb")


def test_actors_notebook_meshes_passed_supervision_and_r2r():
    nb = _execute(nbformat.read(NOTEBOOKS / "03-actors.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    adverbs = cell_text(code[1])
    assert "call_one   21" in adverbs and "choose     True" in adverbs, adverbs
    assert "stream     [40, 41]" in adverbs and "broadcast  [7, 7]" in adverbs, adverbs
    assert "accumulate 101" in adverbs, adverbs
    assert "{gpus: 2} 2 {all: 2}" in cell_text(code[2])  # Monarch's Extent form
    passed = cell_text(code[3])
    assert "[20, 21]" in passed and "versions after a step: [1, 1]" in passed, passed
    assert "rank-to-rank tensors: 1000.0" in passed, passed  # 1000 ones, from rank 1
    chained = cell_text(code[4])
    assert "RuntimeError" in chained and "caused by KeyError: 'weights'" in chained, chained
    handled = cell_text(code[5])
    assert "manager handled:" in handled and "could not load weights" in handled, handled
    assert "unhandled, at the root: [0, 1] RuntimeError" in cell_text(code[6])
    assert "stopped" in cell_text(code[7])
    keep_outputs(nb, NOTEBOOKS / "03-actors.ipynb")


def test_monarch_programs_notebook_job_actors_supervision_spmd():
    nb = _execute(nbformat.read(NOTEBOOKS / "07-monarch-programs.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "{hosts: 2, gpus: 2} ['hosts', 'gpus']" in cell_text(code[0])
    assert "[13, 13, 13, 13]" in cell_text(code[1]) and "14" in cell_text(code[1])
    sup = cell_text(code[2])
    assert "Failure received: MeshFailure(mesh_name=" in sup and "ValueError: bad batch" in sup
    assert "SupervisionError: RankDiedError - Endpoint call mortal.die() failed, The actor " in sup
    here = cell_text(code[3])  # this_proc() and a get_or_spawn_controller singleton, in the kernel
    assert "tally runs in this kernel: True" in here and "total reported by the ranks: 10" in here
    assert "this_proc() actor: 5" in here
    spmd = cell_text(code[4])
    assert "trained 4 ranks" in spmd and "[True, True, True, True]" in spmd
    assert "job active: False | trainers stopped: True" in cell_text(code[5])
    keep_outputs(nb, NOTEBOOKS / "07-monarch-programs.ipynb")


def test_fault_tolerant_training_notebook_recovers_a_killed_rank_from_a_peer():
    path = NOTEBOOKS / "08-fault-tolerant-training.ipynb"
    nb = _execute(nbformat.read(path, as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "ready in" in cell_text(code[0])
    assert "killed rank 2" in cell_text(code[3])
    done = cell_text(code[4])
    assert "Error" not in done, done
    assert "(300, '" in done, done
    said = re.search(r"rank 2 died \(killed by SIGKILL\) at step (\d+); restarted", done)
    assert said and int(said.group(1)) >= 100, done
    assert re.search(r"state of [0-9.]+ KB copied from rank \d in [0-9.]+ s", done), done
    same = cell_text(code[5])
    assert same.count("same process") == 3 and "rank 2: restarted" in same, same
    grown = cell_text(code[8])
    assert re.search(r"world size 4 → 6 at step \d+; state of .* copied to ranks 4-5", grown), grown
    assert "world size 6 → 4 at step" in cell_text(code[9]), cell_text(code[9])
    done = cell_text(code[10])
    assert "Error" not in done and "(800, 4, '" in done, done
    keep_outputs(nb, path)


def test_detach_notebook_takes_over_a_killed_kernels_mesh():
    nb = _execute(nbformat.read(NOTEBOOKS / "09-detach.ipynb", as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "the first kernel was killed" in cell_text(code[0])
    listed = cell_text(code[1])
    assert re.search(r"train\s+gpus=2\s+1\s+2/2", listed) and "detached" in listed, listed
    attached = cell_text(code[2])
    assert "attached mesh 'train'" in attached and "2/2 ranks running" in attached, attached
    assert "printed while no kernel was attached" in attached
    assert "<RemoteJob cell 3 on train ranks [0, 1]: running>" in attached
    pulled = cell_text(code[3])
    assert "pushed to train (2 ranks): lr=0.5" in pulled and "0.5" in pulled.splitlines()[-1]
    waited = cell_text(code[4])
    assert "ValueMesh({gpus: 2})" in waited and ": done in" in waited, waited
    assert "mesh 'train' stopped" in cell_text(code[5])
    keep_outputs(nb, NOTEBOOKS / "09-detach.ipynb")


def test_where_time_goes_notebook_names_the_straggler_and_profiles():
    path = NOTEBOOKS / "11-where-time-goes.ipynb"
    nb = _execute(nbformat.read(path, as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "process group initialised" in cell_text(code[0])
    assert "straggler" not in cell_text(code[2])  # the balanced loop
    assert re.search(r"rank 3: [\d.]+ ms/step \(compute", cell_text(code[3])), cell_text(code[3])
    slow = cell_text(code[5])
    assert "rank 2 (host-0) is the straggler: data loading" in slow, slow
    assert "ranks wait" in slow and "in all_reduce" in slow, slow
    assert "rank 2 (host-0) is no longer the straggler" in slow, slow
    profiled = cell_text(code[8])
    assert "profiling ranks 0, 1, 2, 3 for 3 steps of the running loop" in profiled, profiled
    m = re.search(r"trace: (\S+\.json)", profiled)
    assert m and Path(m.group(1)).exists(), profiled
    assert re.search(r"\(4 ranks, steps \d+-\d+, \d+ ms\)", profiled), profiled  # the same steps
    assert "waited most" in profiled
    assert "ValueMesh(gpus=4" in cell_text(code[9])  # the --bg loop stopped
    assert "stopped" in cell_text(code[10])
    keep_outputs(nb, path)
    keep_outputs(nb, path)


def test_sharded_training_notebook_recovers_an_hsdp_rank_from_its_replica():
    path = NOTEBOOKS / "12-sharded-training.ipynb"
    nb = _execute(nbformat.read(path, as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "hosts=2 × gpus=2" in cell_text(code[0]) and "ready in" in cell_text(code[0])
    placed = cell_text(code[2])
    assert "(Replicate(), Shard(dim=0))" in placed and "(256, 64), (128, 64)" in placed, placed
    assert "killed rank 1" in cell_text(code[4])
    done = cell_text(code[5])
    assert "Error" not in done and "replicas of each shard identical: True" in done, done
    assert re.search(r"rank 1 died \(killed by SIGKILL\) at step \d+; restarted", done), done
    assert re.search(r"state of [0-9.]+ KB copied from rank 3", done), done
    assert done.count("same process") == 3 and "rank 1: restarted" in done, done
    assert "__0_0.distcp" in cell_text(code[6]) and "__3_0.distcp" in cell_text(code[6])
    assert "stopped" in cell_text(code[7])
    keep_outputs(nb, path)


def test_mesh_as_one_device_notebook_trains_with_reduce_and_recovers_from_a_failed_op():
    path = NOTEBOOKS / "10-mesh-as-one-device.ipynb"
    nb = _execute(nbformat.read(path, as_version=4), "monarch")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "hosts=2 × gpus=2" in cell_text(code[0]) and "ready in" in cell_text(code[0])
    made = cell_text(code[1])
    assert "monarch_kernel.Tensor(mesh=<DeviceMesh trainers hosts=2 × gpus=2>" in made, made
    assert "rank at hosts=1, gpus=0 holds [2.0, 2.0, 2.0]" in made, made
    table = code[2].outputs[0].data["text/html"]  # one row per rank, values shown
    assert table.count("<tr>") == 5 and "<th>hosts</th><th>gpus</th>" in table, table
    assert "Linear(in_features=4, out_features=16" in cell_text(code[3])
    assert "torch.Size([20]) per rank, still on the ranks" in cell_text(code[4])
    losses = code[5].outputs[0].data["text/html"]
    assert losses.count("<tr>") == 5 and "<td>(4,)</td><td>float32</td>" in losses, losses
    weights = cell_text(code[6])
    assert "GPUs of a host agree: [True, True] | hosts differ: True" in weights, weights
    # the failed op, shown under the cell that issued it (nothing fetched it there)
    failed = code[7]
    warned = cell_text(failed)
    assert [o.get("name") for o in failed.outputs] == ["stderr"], failed.outputs
    assert warned.startswith("Warning: a tensor-engine op failed on ranks 1, 3"), warned
    cell = failed.execution_count
    assert f"Cell In[{cell}], line 3\n    picked = torch.arange(2.0).index_select" in warned
    assert "Traceback on rank 1:" in warned and "IndexError: index out of range" in warned
    raised = cell_text(code[8])
    assert raised.startswith("A tensor-engine op failed on rank 1: IndexError"), raised
    assert f"Cell In[{cell}], line 3" in raised and "Warning" not in raised, raised
    resumed = cell_text(code[9])
    assert "independent: 30" in resumed and "Error" not in resumed, resumed
    m = re.search(r"step 1 = ([\d.]+), step 20 = ([\d.]+), step 30 = ([\d.]+)", resumed)
    assert m and float(m.group(3)) < float(m.group(1)), resumed
    assert "stopped" in cell_text(code[10])
    keep_outputs(nb, path)
