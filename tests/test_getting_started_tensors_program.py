"""The tensor sections of Monarch's ``docs/source/examples/getting_started.py``
("Distributed Tensors", "Free Remote Functions", "Channels and Low-level messaging"),
as a user runs them: a script with this environment's Python (issue 50).

``../shared/monarch_examples/getting_started_actors.py`` ports only the actor
sections; Monarch's file is BSD-3 and is not copied here: :data:`PROGRAM` is our own
program that makes those sections' calls in their order, on the meshes the example
builds before them (``hosts_from_config("MONARCH_HOSTS")``, two emulated hosts here,
``spawn_procs(per_host={"gpus": 2})``: 4 processes instead of the example's 16 on
two hosts; its ``send`` section reads 4 answers, one a process, as here), with
``monarch`` read as ``monarch_kernel``. The lines marked ``# check:`` are the test's.
The example's ``linear.forward.rref(t)`` multiplies a 3x4 shard by a 3x3 weight: it
fails on the ranks (in Monarch too, where nothing fetches it); the program checks that
its output holds that error, then makes the same call on a tensor whose shape fits.

The script must exit 0, print each section's marker, and leave no process behind.
"""

from __future__ import annotations

import sys

import pytest
from helpers import assert_in_order, run_program

#: Seconds the program may take (about 10 s quiet; 4 ranks start).
LIMIT = 180

pytestmark = [pytest.mark.local, pytest.mark.timeout(LIMIT + 60)]

PROGRAM = r"""
import torch
from monarch_kernel.actor import Actor, Channel, Port, context, endpoint, hosts_from_config

hosts = hosts_from_config("MONARCH_HOSTS")
trainer_procs = hosts.spawn_procs(per_host={"gpus": 2})
print(f"Process mesh extent: {trainer_procs.extent}")


class DataLoader(Actor):
    def __init__(self):
        self.i = 0

    @endpoint
    def example(self):
        self.i += 1
        return f"<fake data {self.i}>"


class Trainer(Actor):
    def __init__(self, dataloader: DataLoader):
        my_rank = context().actor_instance.rank
        self.dataloader = dataloader.slice(**my_rank)

    @endpoint
    def step(self, input=None):
        data = self.dataloader.example.call_one().get()
        return f"Step with data {data} and input = {input}"


dataloaders = trainer_procs.spawn("dataloader", DataLoader)
dtrainers = trainer_procs.spawn("dtrainers", Trainer, dataloaders)
print(dtrainers.step.call().get())

# Distributed Tensors
with trainer_procs.activate():
    t = torch.rand(3, 4)
print(t)

from monarch_kernel import fetch_shard

one = fetch_shard(t, hosts=0, gpus=0).get()
two = fetch_shard(t, hosts=0, gpus=1).get()
print("one", one)
print("two", two)
assert tuple(one.shape) == (3, 4) and not torch.equal(one, two)  # check: a value a rank

with trainer_procs.activate():
    dist_compute = t @ t.T

d = fetch_shard(dist_compute, hosts=0, gpus=0).get()
print("dist", d)
assert torch.allclose(d, one @ one.T)  # check: computed on that rank

steps = dtrainers.step.call(dist_compute[0]).get()
print(steps)
first = steps.item(hosts=0, gpus=0)  # check: each actor got its own process's shard
assert "fake data 2" in first and str(d[0]) in first, first
last = steps.item(hosts=1, gpus=1)
assert str(fetch_shard(dist_compute, hosts=1, gpus=1).get()[0]) in last, last


class LinearActor(Actor):
    def __init__(self):
        self.w = torch.rand(3, 3)

    @endpoint(propagate=lambda x: x)
    def forward(self, input):
        return input @ self.w


linear = trainer_procs.spawn("linear", LinearActor)

o = torch.relu(linear.forward.rref(t))
# check: the example's own call multiplies a 3x4 by a 3x3 on the ranks: its output
# holds the ranks' error (Monarch's too; the example never fetches it), the shape the
# propagate function gave is known on the controller
from monarch_kernel.mesh_controller import RemoteException  # check:

assert tuple(o.shape) == (3, 4)  # check:
try:  # check:
    fetch_shard(o, hosts=0, gpus=0).get()  # check:
    raise AssertionError("the rref's mismatched matmul did not fail")  # check:
except RemoteException as e:  # check:
    assert "cannot be multiplied" in str(e), e  # check:
w = linear.slice(hosts=0, gpus=0).forward.call_one(torch.eye(3)).get()  # check:
o = torch.relu(linear.forward.rref(dist_compute))  # check: shapes that fit
o0 = fetch_shard(o, hosts=0, gpus=0).get()  # check:
assert torch.allclose(o0, torch.relu(d @ w)), (o0, d @ w)  # check:
print("rref ok")


# Actor Context
class ContextAwareActor(Actor):
    @endpoint
    def get_context_info(self):
        actor_instance = context().actor_instance
        message_rank = context().message_rank
        return f"Actor rank: {actor_instance.rank}, message rank: {message_rank}"


c = trainer_procs.spawn("context_actor", ContextAwareActor)
print(c.get_context_info.call().get())

# Free Remote Functions
from monarch_kernel import remote


@remote
def check_memory():
    import psutil

    return psutil.Process().memory_info()


with trainer_procs.activate():
    memory = check_memory.call().get()
    print(memory)
assert len(list(memory.values())) == 4  # check: one a process
assert all(m.rss > 0 for m in memory.values())  # check:

# Channels and Low-level messaging
port, recv = Channel.open()

port.send(3)
print(recv.recv().get())

from monarch_kernel.actor import send

with trainer_procs.activate():
    send(check_memory, args=(), kwargs={}, port=port)

answers = []
for _ in range(4):
    answer = recv.recv().get()
    answers.append(answer)
    print(answer)
assert all(a.rss > 0 for a in answers)  # check:
print("getting started tensors: done")
"""

#: what the program must print, in this order
MARKERS = [
    "Process mesh extent:",
    "Step with data <fake data 1> and input = None",
    "one tensor(",
    "two tensor(",
    "dist tensor(",
    "Step with data <fake data 2> and input = tensor(",
    "rref ok",
    "Actor rank:",
    "rss=",
    "3",
    "rss=",
    "getting started tensors: done",
]


def test_getting_started_tensor_sections_run_as_a_script(tmp_path):
    script = tmp_path / "getting_started_tensors.py"
    script.write_text(PROGRAM)
    proc = run_program([sys.executable, str(script)], tmp_path, LIMIT)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}\n{err[-4000:]}"
    assert_in_order(out, MARKERS)
    # print(t) of a mesh tensor names its mesh and shape (its values are on the ranks)
    assert "Tensor(mesh=<DeviceMesh" in out and "shape=(3, 4)" in out, out[:2000]
    assert "Traceback" not in err, err[-3000:]
