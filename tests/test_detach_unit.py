"""The pieces of detachable meshes that need no mesh: durations, the desk's messages,
the attach file, the temp-dir ownership marks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from typing import Any

import pytest

from monarch_kernel.controller import attach_file
from monarch_kernel.controller.attach_file import AttachFile, AttachFileError, HostEntry
from monarch_kernel.controller.detach.release import detach_option
from monarch_kernel.launchers.reservation import Reservation, describe
from monarch_kernel.wire import tempdirs
from monarch_kernel.wire.desk import (
    ControllerId,
    DeskOp,
    DeskReply,
    DeskRequest,
    RankStatus,
    describe_duration,
    parse_duration,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-2h", "0", "2x", "inf", "nanh"])
def test_bad_durations_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="write e.g. 90s, 30m, 2h or 1d"):
        parse_duration(text)


def test_durations_read_short():
    assert [describe_duration(s) for s in (5, 600, 7200, 5400 + 7200)] == [
        "5s",
        "10m",
        "2h",
        "3h30m",
    ]


def test_detach_options_are_checked_before_anything_starts():
    assert detach_option("local", "m", False, None) == 0.0
    assert detach_option("local", "m", True, None) == 7200.0
    assert detach_option("local", "m", True, "30m") == 1800.0
    with pytest.raises(ValueError, match="pass detachable=True"):
        detach_option("local", "m", False, "30m")
    assert detach_option("join", "m", True, "1h") == 3600.0
    assert detach_option("ray", "m", True, "10m") == 600.0
    assert detach_option("slurm", "m", True, "10m") == 600.0
    match = "local, join, ray or slurm backend in this version, not 'lightning'"
    with pytest.raises(ValueError, match=match):
        detach_option("lightning", "m", True, None)
    with pytest.raises(ValueError, match="needs a name"):
        detach_option("local", None, True, None)
    with pytest.raises(ValueError, match="letters, digits"):
        detach_option("local", "a/b", True, None)
    with pytest.raises(ValueError, match="positive number of seconds"):
        detach_option("local", "m", True, -5)


def test_an_engine_reservation_reads_back_and_says_what_it_holds():
    ray = Reservation("ray", "mk-t-0-1-5", "10.0.0.1:6379", "monarch_kernel", ["a0", "a1"])
    assert Reservation.from_json(ray.to_json()) == ray
    assert ray.describe() == "ray pg mk-t-0-1-5"
    slurm = Reservation("slurm", "12", members=["mk-t-abc"])
    assert slurm.describe() == "slurm job 12"
    assert Reservation("slurm", "7", ours=False).describe() == "slurm job 7 (its step)"
    assert describe(None) == "" and describe({"engine": "ray"}) == ""  # damaged: nothing


def test_desk_messages_round_trip_and_refuse_garbage():
    me = ControllerId(123, "box", 1000.5)
    req = DeskRequest(DeskOp.ATTACH, me, force=True, grace=1.0)
    assert DeskRequest.from_json(req.to_json()) == req
    reply = DeskReply(
        True,
        holder=me,
        detached_since=5.0,
        keep_until=65.0,
        epoch=2,
        ranks=(RankStatus(0, 77, True), RankStatus(1, 78, False, None, 9, 6.0)),
        refused={"forged": 1},
    )
    assert DeskReply.from_json(reply.to_json()) == reply
    for bad in (b"{", b'{"op": "dance"}', b"[]"):
        with pytest.raises(ValueError, match="malformed desk request"):
            DeskRequest.from_json(bad)
    with pytest.raises(ValueError, match="malformed desk reply"):
        DeskReply.from_json(b'{"error": "no ok"}')


def test_this_process_is_alive_and_a_recycled_pid_is_not_its_holder():
    me = ControllerId.of_this_process()
    assert me.alive() is True
    assert ControllerId(me.pid, me.hostname, me.started - 100).alive() is False
    assert ControllerId(me.pid, "another-machine").alive() is None


def _file(name: str) -> AttachFile:
    return AttachFile(
        name=name,
        run_id="r1",
        key="00" * 32,
        created=1.0,
        keep=60.0,
        backend="local",
        per_host={"gpus": 2},
        n_hosts=1,
        controller=ControllerId(1, "box", 2.0),
        send="ipc:///x/send",
        recv="ipc:///x/recv",
        ipc_dir="/x",
        env={},
        on_failure="restart",
        grace=3.0,
        common={"world_size": 2},
        hosts=[HostEntry(0, 10, "box", "127.0.0.1", 2900, "ipc:///tmp/mk-detached-q/desk")],
    )


def test_attach_file_is_private_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    f = _file("m")
    f.write()
    assert f.path == str(tmp_path / "monarch-mesh-m.json")
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    back = attach_file.read(f.path)
    assert back == f
    assert back.hosts[0].rank_log(1) == "/tmp/mk-detached-q/rank1.log"
    assert attach_file.all_files() == [f.path]
    other = _file("m")
    other.run_id = "r2"
    other.remove()  # another run's: left alone
    assert os.path.exists(f.path)
    f.remove()
    assert not os.path.exists(f.path)


def test_attach_file_errors_name_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(AttachFileError, match="no attach file"):
        attach_file.read(str(tmp_path / "nope.json"))
    (tmp_path / "v.json").write_text('{"version": 99}')
    os.chmod(tmp_path / "v.json", 0o600)
    with pytest.raises(AttachFileError, match="version 99; this monarch_kernel reads version 3"):
        attach_file.read(str(tmp_path / "v.json"))
    # a file of the layout before the package's modules moved (its ranks pickle old paths)
    (tmp_path / "v1.json").write_text('{"version": 1}')
    os.chmod(tmp_path / "v1.json", 0o600)
    with pytest.raises(AttachFileError, match="version 1; this monarch_kernel reads version 3"):
        attach_file.read(str(tmp_path / "v1.json"))
    # a mesh of protocol 13, whose agents would drop this kernel's signatures as forged
    (tmp_path / "v2.json").write_text('{"version": 2}')
    os.chmod(tmp_path / "v2.json", 0o600)
    with pytest.raises(AttachFileError, match="version 2; this monarch_kernel reads version 3"):
        attach_file.read(str(tmp_path / "v2.json"))
    (tmp_path / "d.json").write_text('{"version": 3, "name": "m"}')
    os.chmod(tmp_path / "d.json", 0o600)
    with pytest.raises(AttachFileError, match="damaged"):
        attach_file.read(str(tmp_path / "d.json"))
    os.chmod(tmp_path / "d.json", 0o640)  # copied without its mode: others may read the key
    with pytest.raises(AttachFileError, match=r"readable or writable by others \(mode 640\)"):
        attach_file.read(str(tmp_path / "d.json"))
    os.chmod(tmp_path / "d.json", 0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(tmp_path / "d.json", 4321, -1)
        with pytest.raises(AttachFileError, match="belongs to another user"):
            attach_file.read(str(tmp_path / "d.json"))
    (tmp_path / "u.json").write_text("{")
    os.chmod(tmp_path / "u.json", 0o000)  # unreadable (root reads it anyway: then damaged)
    with pytest.raises(AttachFileError, match="cannot read the attach file"):
        attach_file.read(str(tmp_path / "u.json"))


def test_sweep_removes_dirs_whose_owners_are_all_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, alive, unmarked = (tmp_path / f"mk-launch-{n}" for n in ("dead", "alive", "none"))
    for d in (dead, alive, unmarked):
        d.mkdir()
    tempdirs.mark_owners(str(dead), [os.getpid()])  # marked while its owner ran ...
    (dead / tempdirs.OWNERS).write_text(f"[[{gone.pid}, 1.0]]")  # ... which is gone now
    tempdirs.mark_owners(str(alive), [gone.pid, os.getpid()])
    assert tempdirs.sweep(str(tmp_path)) == [str(dead)]
    assert alive.exists() and unmarked.exists() and not dead.exists()


def test_a_ranks_metric_history_spans_the_whole_run_in_bounded_memory(tmp_path):
    import zmq

    from monarch_kernel.rank import link

    ctx = zmq.Context()
    out = ctx.socket(zmq.DEALER)
    fd = os.open(tmp_path / "rank0.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        keeper = link.ControllerLink(out, fd)
        total = 5 * link.HISTORY
        for step in range(1, total + 1):
            keeper.record({"step": float(step)}, None)
        history = keeper.welcome()
        steps = [values["step"] for _, _, values in history]
        assert len(steps) <= link.HISTORY
        assert steps[0] == 1.0 and steps[-1] >= total - 8  # from the start to (nearly) now
        assert steps == sorted(steps)
        gaps = {b - a for a, b in zip(steps, steps[1:])}
        assert max(gaps) <= 8  # evenly thinned: no stretch of the run is missing
        keeper.close()
    finally:
        os.close(fd)
        out.close(0)
        ctx.term()


def test_the_shared_local_launcher_is_made_once_under_contention(short_tmp, monkeypatch):
    """The kernel's pre-warm thread and the first ``%mesh`` ask for the shared launcher
    at about the same time: one launcher (one ``mk-launch-*`` directory) must come of it.
    Two left one directory owned by the kernel alone, which no agent removed when the
    kernel was killed (test_detach's test_killed_kernels_temp_dirs_are_removed failed
    about once in twelve runs)."""
    import tempfile
    import threading

    from monarch_kernel.launchers.local import LocalLauncher

    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    monkeypatch.setattr(LocalLauncher, "_shared", None)
    start = threading.Barrier(8)
    got: list[LocalLauncher] = []

    def ask() -> None:
        start.wait()
        got.append(LocalLauncher.shared())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and len({id(x) for x in got}) == 1
    made = [n for n in os.listdir(short_tmp) if n.startswith("mk-launch-")]
    assert len(made) == 1, made
    got[0].shutdown()


def test_an_attaching_controller_gets_the_history_before_any_live_metric(tmp_path):
    """``attached`` while the training loop reports on another thread: the history
    reply comes before every live metric, and no step is missing from history + live
    (a real outbox and link, over a real ZeroMQ pair)."""
    import pickle
    import threading

    import zmq

    from monarch_kernel.rank import link
    from monarch_kernel.rank.outbox import Outbox
    from monarch_kernel.rank.signals import MainThread
    from monarch_kernel.wire import Codec, Message
    from monarch_kernel.wire import kinds as K
    from monarch_kernel.wire.codec import recv as wire_recv

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://controller")
    out = ctx.socket(zmq.DEALER)
    out.connect("inproc://controller")
    fd = os.open(tmp_path / "rank0.log", os.O_WRONLY | os.O_CREAT, 0o600)
    codec = Codec(b"k" * 32)
    outbox = Outbox(0, ctx, out, codec, MainThread(Outbox.send.__code__), {}, "here", "m")
    keeper = outbox.link = link.ControllerLink(out, fd, connected=False)
    reported = threading.Event()
    stop = threading.Event()

    def training() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            outbox.report({"step": step})
            if step == 5000:
                reported.set()

    trainer = threading.Thread(target=training)

    def end_training() -> None:
        """Stop the trainer, taking what it still sends: with the controller's queue
        full it waits for room (as a rank does while its controller is there), and a
        socket closed under it would fail it."""
        stop.set()
        deadline = time.monotonic() + 30
        while trainer.is_alive() and time.monotonic() < deadline:
            if router.poll(10):
                router.recv_multipart()
        trainer.join(1)

    trainer.start()
    try:
        assert reported.wait(30)
        keeper.reconnected()  # the new controller's connection (its attach comes next)
        attach = Message({"k": K.ATTACHED, "i": "welcome-1", "q": 0})
        link.serve_attached(keeper, outbox, attach)
        received: list[tuple[str, Any]] = []
        while len(received) < 300:
            msg = codec.decode(wire_recv(router)[1:])
            received.append((msg.kind, pickle.loads(msg.payload)))
        end_training()
        kinds = [kind for kind, _ in received]
        assert kinds[0] == K.RESULT, kinds[:5]  # nothing live before the history
        assert set(kinds[1:]) == {K.METRIC}
        history = [values["step"] for _, _, values in received[0][1]["history"]]
        live = [values["step"] for _, values in received[1:]]
        assert live == sorted(live), live[:20]
        assert history[-1] >= 5000 and live[0] <= history[-1] + 1, (history[-5:], live[:5])
        assert set(range(1, int(live[-1]) + 1)) <= set(history) | set(live)  # none lost
    finally:
        end_training()
        assert not trainer.is_alive()
        keeper.close()
        os.close(fd)
        out.close(0)
        router.close(0)
        ctx.term()
