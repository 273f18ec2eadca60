"""Elastic meshes across machines: ``%mesh grow NAME --hosts +1`` on the ``join`` backend
(host agents in network namespaces, see ``netns.py``) while a ``--bg`` DDP loop trains.

The grow shows the one-line join command for the new host and waits (``--timeout``) for
someone to run it on the new machine; the loop trains on meanwhile, and parks at a step
boundary only once the new host's ranks are ready. The loop and its reference are those
of ``test_elastic`` (a global batch split by ``rank::world_size``: the same losses at any
world size).
"""

from __future__ import annotations

import re
import time

import pytest
from helpers import wait_until
from kernel_client import Kernel
from netns import Joiner, agent_env, netns_hosts_fixture
from test_detach_join import _left_in_namespaces, _on_hosts
from test_elastic import BATCH, SETUP, reference_losses, usage_error, value

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

MESH = "jg"
JOIN_LINE = "python -m monarch_kernel.host --join"
#: ``test_elastic``'s loop, ended by ``%push jg stop=True``: the flag is summed over the
#: ranks inside the step, so every rank stops after the same step however long the grow
#: takes on a loaded machine (new ranks get ``stop`` from the second set-up cell).
STOP_SETUP = f"%%remote {MESH} --setup\nstop = False\n"
TRAIN = f"""\
%%remote {MESH} --bg
losses, worlds = [], []
state = TrainingState(model=model, optimizer=opt, extra={{"losses": losses, "worlds": worlds}})
while True:
    with state.stepping():
        x, y = batch(state.step)
        mine = slice(state.rank, None, state.world_size)  # re-split at every step
        loss = F.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        total = torch.stack([loss.detach() * x[mine].shape[0], torch.tensor(float(stop))])
        dist.all_reduce(total)
        losses.append(round(total[0].item() / {BATCH}, 7))
        worlds.append(state.world_size)
        opt.step()
    progress = state.step
    if total[1].item() > 0:
        break
    time.sleep(0.02)
"""


@pytest.fixture
def net():
    gen = netns_hosts_fixture(3)
    hosts = next(gen)
    yield hosts
    next(gen, None)
    assert not _left_in_namespaces(hosts), _left_in_namespaces(hosts)


def _pids(k: Kernel) -> list[int]:
    r = k.run(f"%remote {MESH} __import__('os').getpid()")
    assert not r.errors, r.error_text
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


def _progress(k: Kernel, at_least: int) -> int:
    seen = [0]

    def far() -> bool:
        seen[0] = int(value(k, f"_p = %pull {MESH} progress\nmin(_p.values())"))
        return seen[0] >= at_least

    wait_until(far, timeout=90, what=f"the loop to reach step {at_least}")
    return seen[0]


def _join(k: Kernel, job: str, joiner: Joiner, host: int) -> None:
    """Play the person who runs the command the cell ``job`` shows for ``host``."""
    k.wait_for_output(job, f"host {host}: {JOIN_LINE}", timeout=60)
    shown = k.output_so_far(job)[0]
    joiner.progress("\n".join(ln for ln in shown.splitlines() if f"host {host}: " in ln))


def test_grow_join_mesh_by_a_host_while_training(net):
    joiner = Joiner(net)
    k = Kernel(env={"PYTHONPATH": agent_env()["PYTHONPATH"]})
    try:
        job = k.submit(
            f"%mesh {MESH} --backend join --hosts 2 --gpus 1 --bind {net.gateway} --dist"
        )
        for h in (0, 1):
            _join(k, job, joiner, h)
        r = k.collect(job, timeout=120)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        for cell in (SETUP.format(mesh=MESH, batch=BATCH), STOP_SETUP):
            r = k.run(cell, timeout=120)
            assert not r.errors, r.error_text
        before = _pids(k)

        # nobody runs the command: the grow fails in one line that says what to do, and
        # the mesh is as it was (the token is void)
        t0 = time.monotonic()
        text = usage_error(k, f"%mesh grow {MESH} --hosts +1 --timeout 3")
        print(f"\ngrow with nobody joining failed after {time.monotonic() - t0:.1f}s: {text}")
        assert "host 2 did not join within 3s" in text and "--timeout" in text, text
        assert value(k, f"{MESH}.runtime.world, len({MESH}.runtime.hosts)") == (2, 2)

        train = k.submit(TRAIN)
        assert not k.collect(train, timeout=60).errors
        at = _progress(k, 20)

        # the stop button while a grow waits for its host to join: the grow ends at once,
        # its host is taken back (the command shown is void) and the loop trains on
        grow = k.submit(f"%mesh grow {MESH} --hosts +1 --timeout 600")
        k.wait_for_output(grow, "to join (--timeout SECONDS waits longer)", timeout=60)
        shown = [ln for ln in k.output_so_far(grow)[0].splitlines() if "host 2: " in ln]
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        r = k.collect(grow, timeout=120)
        print(f"grow interrupted while waiting for a join: ended in {time.monotonic() - t0:.1f}s")
        assert "grow interrupted" in r.stderr and "void" in r.stderr, r.stderr + r.error_text
        assert "the training goes on as before" in r.stderr, r.stderr
        assert value(k, f"{MESH}.runtime.world, len({MESH}.runtime.hosts)") == (2, 2)
        at = _progress(k, at + 5)
        late = Joiner(net)  # someone runs the void command after all: refused
        late.progress("\n".join(shown))
        wait_until(lambda: 2 in late.agents, timeout=30, what="the late agent to start")
        assert late.agents[2].wait(60) != 0
        assert value(k, f"{MESH}.runtime.world, len({MESH}.runtime.hosts)") == (2, 2)
        t0 = time.monotonic()
        grow = k.submit(f"%mesh grow {MESH} --hosts +1")
        _join(k, grow, joiner, 2)
        joined = time.monotonic() - t0
        r = k.collect(grow, timeout=180)
        took = time.monotonic() - t0
        assert not r.errors, r.error_text
        grown = re.search(r"world size 2 → 3 at step ([\d,]+); .*copied to rank 2", r.stdout)
        assert grown, r.stdout + r.stderr
        assert "no survivor restarted" in r.stdout, r.stdout
        assert "for host(s) 2 to join (--timeout SECONDS waits longer)" in r.stdout, r.stdout
        paused = float(re.search(r"paused ([\d.]+) s", r.stdout).group(1))  # type: ignore[union-attr]
        print(
            f"grow join 2 → 3 hosts: command shown+joined {joined:.1f}s, whole grow "
            f"{took:.1f}s, training paused {paused:.2f}s"
        )
        at_grow = int(grown.group(1).replace(",", ""))

        _progress(k, at_grow + 10)
        r = k.run(f"%mesh shrink {MESH} --hosts 2", timeout=120)
        shrunk = re.search(r"world size 3 → 2 at step ([\d,]+); rank 2 stopped", r.stdout)
        assert shrunk, r.stdout + r.stderr + r.error_text
        at_shrink = int(shrunk.group(1).replace(",", ""))
        assert at_grow < at_shrink
        _progress(k, at_shrink + 10)
        r = k.run(f"%push {MESH} stop=True")
        assert not r.errors, r.error_text

        outcome = value(
            k,
            f"_o = %remote {MESH} (state.step, losses, worlds, os.environ['WORLD_SIZE'], "
            "dist.get_world_size())\nlist(_o.values())",
            timeout=180,
        )
        steps = outcome[0][0]
        assert steps > at_shrink and [o[0] for o in outcome] == [steps] * 2, outcome
        assert [o[3:] for o in outcome] == [("2", 2)] * 2, outcome
        _, losses, worlds, _, _ = outcome[0]
        assert outcome[1][1] == losses and outcome[1][2] == worlds
        assert worlds == [2] * at_grow + [3] * (at_shrink - at_grow) + [2] * (steps - at_shrink)
        assert losses == pytest.approx(reference_losses(list(range(steps))), rel=1e-5, abs=1e-6)
        assert _pids(k) == before, "a survivor was restarted"

        # grow again between cells: the new host's rank gets the replicas' state
        grow = k.submit(f"%mesh grow {MESH} --hosts +1")
        joiner.agents.pop(2).wait(30)  # the first host 2's agent exited with the shrink
        _join(k, grow, joiner, 2)
        r = k.collect(grow, timeout=180)
        assert "world size 2 → 3; rank 2 started" in r.stdout, r.stdout + r.stderr + r.error_text
        assert "copied" in r.stdout, r.stdout
        sizes = value(
            k,
            f"%remote {MESH} import socket\n_w = %remote {MESH} (socket.gethostname(), "
            "os.environ['WORLD_SIZE'], dist.get_world_size())\nlist(_w.values())",
        )
        assert sizes == [(h.name, "3", 3) for h in net.hosts], sizes
        digests = value(
            k,
            f"_d = %remote {MESH} __import__('monarch_kernel.rank.replicas.replicas', "
            "fromlist=['_']).digest_namespace(globals())\n"
            "[sorted((o.name, o.digest) for o in d.objects) for d in _d.values()]",
        )
        assert len(digests[0]) >= 2 and all(d == digests[0] for d in digests), digests
        assert _pids(k)[:2] == before

        assert "stopped" in k.run(f"%mesh stop {MESH}", timeout=60).stdout
        for agent in joiner.agents.values():
            agent.wait(30)
        wait_until(lambda: not _on_hosts(net), timeout=30, what="the ranks on the hosts to end")
    finally:
        k.shutdown_and_check(timeout=30)
        for agent in joiner.agents.values():
            if agent.poll() is None:
                agent.kill()
