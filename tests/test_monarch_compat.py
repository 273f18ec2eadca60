"""Monarch's names a Monarch program relies on: ``monarch_kernel.spmd``, awaitable
``logging_option``, ``send``, ``hosts_from_config``, ``monarch_kernel.job``,
``monarch_kernel.config``, ``Point.extent`` / ``ProcMesh._labels`` and Monarch's
``str()`` forms, actors' background tasks."""

from __future__ import annotations

import asyncio
import json
import os
import re
import textwrap

import pytest
from helpers import wait_until

from monarch_kernel import config
from monarch_kernel.actor import (
    Actor,
    Channel,
    HostMesh,
    SupervisionError,
    current_rank,
    endpoint,
    hosts_from_config,
    send,
    this_host,
    this_proc,
)
from monarch_kernel.calls.future import Future
from monarch_kernel.job import JobState, LocalJob, ProcessJob, SlurmJob
from monarch_kernel.shape import Extent, Point, Shape
from monarch_kernel.spmd import SPMDActor, setup_torch_elastic_env, setup_torch_elastic_env_async

# Mixed lanes (as test_parity_api.py): the unit tests are marked one by one, the rest
# run real meshes and are in "local" (conftest).

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class EnvReader(Actor):
    @endpoint
    def env(self) -> dict[str, str]:
        return {k: os.environ.get(k, "") for k in TORCHRUN_VARS}

    @endpoint
    def point(self) -> tuple[str, list[str], list[int], str]:
        p = current_rank()
        return str(p), p.extent.labels, p.extent.sizes, str(p.extent)


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> tuple[int, int]:
        if x < 0:
            raise ValueError(f"negative: {x}")
        return current_rank().rank, x


class Background(Actor):
    """Monarch's actors keep running tasks an endpoint started (grpo_yield.py)."""

    def __init__(self) -> None:
        self.ticks = 0
        self.task: asyncio.Task[None] | None = None

    @endpoint
    async def start(self) -> None:
        async def tick() -> None:
            while True:
                self.ticks += 1
                await asyncio.sleep(0.001)

        self.task = asyncio.create_task(tick())

    @endpoint
    async def ticks_(self) -> int:
        return self.ticks

    @endpoint
    async def stop_ticking(self) -> None:
        assert self.task is not None
        self.task.cancel()


# -- unit: shapes, futures, config ------------------------------------------------------


@pytest.mark.unit
def test_point_and_extent_print_as_monarch():
    p = Point({"hosts": 1, "gpus": 3}, 7, (2, 4))
    assert str(p) == "{'hosts': 1/2, 'gpus': 3/4}"
    ext = p.extent
    assert isinstance(ext, Extent)
    assert ext.labels == ["hosts", "gpus"] and ext.sizes == [2, 4] and ext.nelements == 8
    assert str(ext) == "{hosts: 2, gpus: 4}" and ext == {"hosts": 2, "gpus": 4}
    assert Shape(("gpus",), (4,)).points()[2].extent.labels == ["gpus"]
    assert Point({}, 0).extent == {}


@pytest.mark.unit
def test_a_future_is_driven_like_a_coroutine():
    done: Future[int] = Future()
    done.set_result(3)
    assert asyncio.run(done) == 3
    assert asyncio.run(done) == 3  # again: a future, not a coroutine

    async def both() -> list[int]:
        later: Future[int] = Future()
        asyncio.get_running_loop().call_later(0.01, later.set_result, 5)
        return list(await asyncio.gather(later, done))

    assert asyncio.run(both()) == [5, 3]
    failed: Future[int] = Future()
    failed.set_exception(KeyError("x"))
    with pytest.raises(KeyError):
        asyncio.run(failed)


@pytest.mark.unit
def test_configure_and_configured():
    with config.configured(host_spawn_ready_timeout="1m 30s", enable_log_forwarding=True) as c:
        assert c["host_spawn_ready_timeout"] == "1m 30s" and c["enable_log_forwarding"]
        assert config.seconds(config.get("host_spawn_ready_timeout")) == 90.0
    assert "enable_log_forwarding" not in config.get_global_config()
    with pytest.raises(ValueError, match="no_such_key"):
        config.configure(no_such_key=1)
    with pytest.raises(ValueError, match="duration"):
        config.configure(host_spawn_ready_timeout="soon")


@pytest.mark.unit
def test_jobs_check_their_arguments():
    with pytest.raises(ValueError, match="positive"):
        ProcessJob({"trainers": 0})
    with pytest.raises(ValueError, match="identifier"):
        ProcessJob({"my trainers": 1})
    with pytest.raises(TypeError, match="bind_to"):
        SlurmJob({"mesh0": 2}, bind_to="x")
    job = SlurmJob(meshes={"mesh0": 2}, time_limit="06:00:00", qos="high", gpus_per_node=8)
    assert job._options["time"] == "06:00:00"
    assert "--qos=high" in job._options["salloc_args"] and job.gpus_per_node == 8
    with pytest.raises(AttributeError, match="Available names: a, b"):
        _ = JobState({"a": HostMesh(1), "b": HostMesh(1)}).c
    with pytest.raises(NotImplementedError, match="client_script"):
        LocalJob().apply(client_script="train.py")


# -- spmd -------------------------------------------------------------------------------


def test_spmd_actor_sets_the_torchrun_environment_and_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    out = tmp_path / "out"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            import torch.distributed as dist
            dist.init_process_group("gloo")
            t = __import__("torch").ones(1)
            dist.all_reduce(t)
            with open({str(out)!r} + os.environ["RANK"], "w") as f:
                local = os.environ["LOCAL_RANK"]
                f.write(f"{{__name__}} {{sys.argv[1:]}} {{int(t.item())}} {{local}}")
            dist.destroy_process_group()
            """
        )
    )
    procs = this_host().spawn_procs(per_host={"hosts": 1, "gpus": 2})
    try:
        assert procs._labels == ["hosts", "gpus"]
        spmd = procs.spawn("_SPMDActor", SPMDActor)
        first = dict.fromkeys(procs._labels, 0)
        addr, port = spmd.slice(**first).get_host_port.call_one(None).get()
        assert isinstance(addr, str) and isinstance(port, int)
        ok = spmd.main.call(addr, port, [str(script), "--lr", "0.1"]).get()
        assert ok.values() == [True, True]
        assert [(out.parent / f"out{r}").read_text() for r in (0, 1)] == [
            "__main__ ['--lr', '0.1'] 2 0",
            "__main__ ['--lr', '0.1'] 2 1",
        ]
        with pytest.raises(Exception, match="No script or module specified"):
            spmd.main.call(addr, port, []).get()
        # ["-m", module, *args], as torchrun: json.tool with its arguments, as __main__
        src, dst = tmp_path / "in.json", tmp_path / "out.json"
        src.write_text('{"b": 1, "a": [2]}')
        one = spmd.slice(hosts=0, gpus=0)
        assert one.main.call_one(addr, port, ["-m", "json.tool", str(src), str(dst)]).get()
        assert json.loads(dst.read_text()) == {"b": 1, "a": [2]}
        with pytest.raises(Exception, match="-m needs a module name"):
            one.main.call_one(addr, port, ["-m"]).get()
    finally:
        procs.stop()


def test_setup_torch_elastic_env_sync_and_async():
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        setup_torch_elastic_env(procs, "10.1.2.3", 4567)
        reader = procs.spawn("reader", EnvReader)
        envs = reader.env.call().get().values()
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {
            ("10.1.2.3", "4567", "2")
        }
        assert {e["ROLE_NAME"] for e in envs} == {"rank"}
        asyncio.run(setup_torch_elastic_env_async(procs))
        envs = reader.env.call().get().values()
        assert {e["MASTER_ADDR"] for e in envs} == {__import__("socket").gethostname()}
        assert reader.point.call().get().values()[1] == (
            "{'gpus': 1/2}",
            ["gpus"],
            [2],
            "{gpus: 2}",
        )
        with pytest.raises(ValueError, match="both master_addr and master_port"):
            setup_torch_elastic_env(procs, "10.1.2.3")
    finally:
        procs.stop()


# -- logging_option, send, background tasks ---------------------------------------------


def test_logging_option_is_awaitable_and_send_delivers_to_a_port(mesh2):
    assert mesh2.logging_option(stream_to_client=True, aggregate_window_sec=3).get() is None
    asyncio.run(mesh2.logging_option(stream_to_client=True))

    async def awaited() -> None:
        await mesh2.logging_option(stream_to_client=False, aggregate_window_sec=None)

    asyncio.run(awaited())
    with pytest.raises(ValueError, match="aggregate_window_sec"):
        mesh2.logging_option(stream_to_client=False, aggregate_window_sec=3)

    echo = mesh2.spawn("echo", Echo)
    port, recv = Channel[tuple[int, int]].open()
    send(echo.echo, (7,), {}, port=port)
    assert sorted(recv.recv().get(timeout=30) for _ in range(2)) == [(0, 7), (1, 7)]
    send(echo.echo, args=(8,), kwargs={}, port=port, selection="choose")
    assert recv.recv().get(timeout=30)[1] == 8
    send(echo.echo, (-1,), {}, port=port, selection="choose")
    with pytest.raises(Exception, match="negative: -1"):
        recv.recv().get(timeout=30)
    send(echo.echo, (9,), {})  # fire and forget, no port
    send(echo.echo, (9,), {}, selection="choose")
    with pytest.raises(ValueError, match="selection"):
        send(echo.echo, (1,), {}, selection="some")
    with pytest.raises(TypeError, match="endpoint"):
        send(print, (1,), {})  # type: ignore[arg-type]
    assert echo.slice(gpus=0).echo.call_one(1).get() == (0, 1)


def test_background_tasks_of_an_actor_run_between_messages(mesh2):
    bg = mesh2.slice(gpus=0).spawn("bg", Background)
    bg.start.call_one().get()
    first = bg.ticks_.call_one().get()
    # No message goes to the actor meanwhile: its task still runs.
    wait_until(lambda: bg.ticks_.call_one().get() > first + 20, timeout=10, what="ticks")
    bg.stop_ticking.call_one().get()
    assert bg.ticks_.call_one().get() >= first


# -- hosts and jobs ---------------------------------------------------------------------


def test_hosts_from_config_and_jobs_give_host_meshes():
    hosts = hosts_from_config("MONARCH_HOSTS")
    assert str(hosts.extent) == "{hosts: 2}" and len(hosts) == 2
    with config.configured(host_meshes={"small": {"hosts": 1, "backend": "local"}}):
        assert len(hosts_from_config("small")) == 1

    job = ProcessJob({"trainers": 2, "loaders": 1}, env={"MK_JOB_ENV": "yes"})
    assert not job.active
    state = job.state(cached_path=None)
    assert job.active and len(state.trainers) == 2 and len(state.loaders) == 1
    procs = state.trainers.spawn_procs(per_host={"gpus": 1})
    reader = procs.spawn("reader", EnvReader)
    assert str(procs.extent) == "{hosts: 2, gpus: 1}"
    assert [p["hosts"] for p, _ in reader.env.call().get()] == [0, 1]
    env_of = procs.spawn("envof", _EnvOf)
    assert env_of.get.call().get().values() == ["yes", "yes"]
    job.kill()
    assert not job.active and procs.stopped
    local = LocalJob(hosts=("a", "b"))
    s = local.state()
    assert s.a is this_host() and s.b is this_host()
    local.kill()


class _EnvOf(Actor):
    @endpoint
    def get(self) -> str:
        return os.environ.get("MK_JOB_ENV", "")


# -- the failure model ------------------------------------------------------------------


class Mortal(Actor):
    @endpoint
    def die(self) -> None:
        os._exit(3)

    @endpoint
    def ok(self) -> int:
        return current_rank().rank


@pytest.mark.unit
def test_mesh_failure_prints_as_monarch():
    # The forms Monarch 0.7 prints (str(), report()), with this project's actor ids.
    from monarch_kernel.actor import MeshFailure

    tb = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in fail\n'
        '    raise ValueError("bad")\n'
        "ValueError: bad\n"
    )
    f = MeshFailure("trainers", "t", 2, {"type": "ValueError", "message": "bad", "traceback": tb})
    assert str(f) == (
        "MeshFailure(mesh_name=trainers, crashed_ranks=[2], event=Supervision event: "
        "actor trainers/t[2] failed:\n"
        "  Traceback (most recent call last):\n"
        '    File "x.py", line 3, in fail\n'
        '      raise ValueError("bad")\n'
        "  ValueError: bad\n"
        ")"
    )
    assert f.report() == (
        "The actor trainers/t[2] and all its descendants have failed:\n"
        "  Traceback (most recent call last):\n"
        '    File "x.py", line 3, in fail\n'
        '      raise ValueError("bad")\n'
        "  ValueError: bad\n"
    )
    assert f.crashed_ranks == [2] and f.mesh_name == "trainers"
    # went up through an owner that did not handle it: the owner failed, naming its child
    up = MeshFailure(
        "mid", "p", 0, {"type": "ValueError", "message": "x", "origin": "leaf/c[1]"}, ("mid/p[0]",)
    )
    assert str(up) == (
        "MeshFailure(mesh_name=mid, crashed_ranks=[0], event=Supervision event: actor mid/p[0] "
        "failed because it did not handle a supervision event from its child. The child's "
        "event was:\n  Supervision event: actor leaf/c[1] failed:\n    ValueError: x)"
    )
    assert up.report() == (
        "The actor leaf/c[1] and all its descendants have failed:\n  ValueError: x"
    )
    gone = "the process this actor was running on exited with non-zero code 3 (rank 1 on host h)"
    died = MeshFailure("m", "", 1, {"type": "RankDied", "message": gone})
    assert str(died) == (
        f"MeshFailure(mesh_name=m, crashed_ranks=[1], event=Supervision event: actor m[1] "
        f"failed:\n  {gone})"
    )
    assert died.report() == f"The actor m[1] and all its descendants have failed:\n  {gone}"


def test_calls_to_a_dead_actor_raise_supervision_error(monkeypatch):
    import monarch_kernel.actor as actor_api
    from monarch_kernel.actor import ActorError

    hooked: list[object] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", hooked.append)
    procs = this_host().spawn_procs(per_host={"gpus": 2}, on_failure="continue")
    try:
        m = procs.spawn("mortal", Mortal)
        name = procs.name
        with pytest.raises(SupervisionError) as info:
            m.slice(gpus=1).die.call_one().get(timeout=30)
        err = info.value
        assert isinstance(err, ActorError) and isinstance(err, RuntimeError)
        gone = "the process this actor was running on exited with non-zero code 3"
        # Monarch's words first, then ours (rank, host, pid, exit code, last output)
        assert str(err).startswith(
            f"Endpoint call mortal.die() failed, The actor {name}/mortal[1] and all its "
            f"descendants have failed:\n  {gone}\nrank 1 of mesh {name!r} (host "
        ), str(err)
        assert "exit code 3" in str(err) and err.endpoint == "mortal.die()"
        with pytest.raises(SupervisionError) as info:
            m.ok.call().get(timeout=30)  # the whole mesh: rank 1 is gone
        assert str(info.value).startswith(
            f"Endpoint call mortal.ok() failed, The actor {name}/mortal[1] and all its "
            f"descendants have failed:\n  {gone}\n"
        ), str(info.value)
        assert m.slice(gpus=0).ok.call_one().get(timeout=30) == 0  # the rest is usable
        wait_until(lambda: hooked, timeout=10, what="the fault hook")
        (failure,) = hooked  # once per failure
        assert re.fullmatch(
            rf"MeshFailure\(mesh_name={name}, crashed_ranks=\[1\], event=Supervision event: "
            rf"actor {name}\[1\] failed:\n  {gone} \(rank 1 on host \S+\)\)",
            str(failure),
        ), str(failure)
    finally:
        procs.stop()
    with pytest.raises(SupervisionError) as info:
        m.slice(gpus=0).ok.call_one().get(timeout=30)
    assert str(info.value) == (
        f"Endpoint call mortal.ok() failed, Supervision event: actor {name}/mortal[0] has "
        f"status:\n  stopped: mesh {name!r} is stopped; create a new mesh"
    )


# -- small names --------------------------------------------------------------------------


@pytest.mark.unit
def test_small_names_future_from_coro_and_generic_actor_mesh():
    from monarch_kernel.actor import ActorMesh

    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0.01)
        return a + b

    async def boom() -> None:
        raise KeyError("k")

    assert Future._from_coro(add(2, 3)).get(timeout=10) == 5
    with pytest.raises(KeyError):
        Future._from_coro(boom()).get(timeout=10)
    assert Future._resolved(4).get() == 4
    assert ActorMesh[Echo] is ActorMesh  # type: ignore[misc]


def test_shutdown_context_stops_every_mesh():
    from monarch_kernel.actor import shutdown_context

    a = this_host().spawn_procs(per_host={"gpus": 1})
    b = this_host().spawn_procs(per_host={"gpus": 1})
    here = this_proc()  # the controller's own process: its actors stop too
    local = here.spawn("local", Echo)
    assert shutdown_context().get() is None
    assert a.stopped and b.stopped and here.stopped
    with pytest.raises(SupervisionError, match="Endpoint call local.echo"):
        local.echo.call_one(1).get(timeout=30)
    assert not this_proc().stopped  # a new one
