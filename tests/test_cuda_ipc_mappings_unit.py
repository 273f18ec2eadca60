"""The CPU-side parts of kept CUDA IPC mappings (``rank.dataplane.cuda_ipc``): the
receiver's :class:`Mappings` (least recently used, idle and dead owners dropped, the owner
told exactly when it still holds the lease), the owner's lease renewal and its
:class:`Board` of RDMA buffers offered one-sided, read through ``/proc/<pid>/fd`` as a
receiver does. The mapped tensors here are plain objects: opening real handles needs a
GPU (``tests/test_gpu_dataplane.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from monarch_kernel.rank.dataplane import cuda_ipc

pytestmark = pytest.mark.unit

ME = os.getpid()


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return int(child.stdout)


class Told:
    """What the owners were told: the leases said done, in order."""

    def __init__(self) -> None:
        self.leases: list[int] = []

    def __call__(self, lease: int) -> None:
        self.leases.append(lease)


def _mapping(ident: int, told: Told, pid: int = ME, used: float = 0.0, **kw) -> cuda_ipc.Mapping:
    key = ("run", pid, ident, "torch.float32")
    return cuda_ipc.Mapping(key, object(), 100 + ident, pid, ident, told, used=used,
                            renewed=used, **kw)  # fmt: skip


def _mappings(**kw) -> cuda_ipc.Mappings:
    m = cuda_ipc.Mappings(idle=10.0, **kw)
    m.sweeping = True  # no sweeper thread: the tests call sweep() with their own clock
    return m


def test_a_kept_mapping_is_found_again_and_the_least_recently_used_goes_first():
    told = Told()
    maps = _mappings(limit=2)
    a, b, c = (_mapping(i, told) for i in (1, 2, 3))
    maps.put(a)
    maps.put(b)
    assert maps.get(a.key) == (a, a.tensor)  # a is now the most recently used
    maps.put(c)
    assert maps.get(b.key) is None and b.tensor is None, "b was the least recently used"
    assert told.leases == [102]
    assert maps.get(a.key) == (a, a.tensor) and maps.get(c.key) == (c, c.tensor)


def _mapped_twice(told: Told) -> tuple[cuda_ipc.Mappings, cuda_ipc.Mapping, cuda_ipc.Mapping]:
    """Mappings where tensor 1 was kept, then kept again (lease 555) under the same key."""
    maps = _mappings()
    old = _mapping(1, told)
    maps.put(old)
    new = cuda_ipc.Mapping(old.key, object(), 555, ME, 1, told)
    maps.put(new)
    return maps, old, new


def test_replacing_a_mapping_drops_the_old_one_and_tells_its_owner():
    told = Told()
    maps, old, new = _mapped_twice(told)
    assert old.tensor is None and told.leases == [101] and maps.get(old.key) == (new, new.tensor)


def test_sweep_drops_idle_mappings_and_those_of_dead_owners_telling_only_the_living():
    told = Told()
    maps = _mappings()
    idle = _mapping(1, told, used=0.0)
    fresh = _mapping(2, told, used=8.0)
    orphan = _mapping(3, told, pid=_dead_pid(), used=8.0)
    for m in (idle, fresh, orphan):
        maps.put(m)
    assert maps.sweep(now=12.0) == 2
    assert set(maps.held) == {fresh.key}
    assert told.leases == [101], "the dead owner is not written to; the idle one is told"
    assert idle.tensor is None and orphan.tensor is None and fresh.tensor is not None


def test_drop_tensor_drops_every_dtype_of_it_and_tell_false_says_nothing():
    told = Told()
    maps = _mappings()
    f32 = _mapping(1, told)
    u8 = cuda_ipc.Mapping(("run", ME, 1, "torch.uint8"), object(), 7, ME, 1, told)
    other = _mapping(2, told)
    for m in (f32, u8, other):
        maps.put(m)
    maps.drop_tensor("run", ME, 1)
    assert set(maps.held) == {other.key} and sorted(told.leases) == [7, 101]
    maps.drop(other.key, tell=False)  # the owner let that lease go already
    assert maps.held == {} and sorted(told.leases) == [7, 101]
    maps.drop(other.key)  # dropped once only
    assert sorted(told.leases) == [7, 101]


def test_a_failing_owner_notification_does_not_stop_the_drop():
    def broken(lease: int) -> None:
        raise RuntimeError("owner's socket closed")

    maps = _mappings()
    m = _mapping(1, broken)  # type: ignore[arg-type]
    maps.put(m)
    maps.drop(m.key)
    assert maps.held == {} and m.tensor is None


def test_the_sweeper_thread_drops_an_idle_mapping_and_ends_when_none_is_left():
    told = Told()
    maps = cuda_ipc.Mappings(idle=0.1)
    maps.put(_mapping(1, told, used=0.0))  # (monotonic 0: long idle)
    sweepers = [t for t in threading.enumerate() if t.name == "mk-ipc-mappings"]
    assert sweepers, "a sweeper starts with the first kept mapping"
    for t in sweepers:
        t.join(timeout=30)
    assert maps.held == {} and told.leases == [101] and not maps.sweeping


def test_idle_seconds_come_from_the_environment_or_are_a_clear_error():
    assert cuda_ipc.idle_seconds({}) == cuda_ipc.MAPPING_IDLE_SECONDS
    assert cuda_ipc.idle_seconds({cuda_ipc.IDLE_ENV: "2.5"}) == 2.5
    for bad in ("soon", "-1", str(cuda_ipc.LEASE_SECONDS)):
        with pytest.raises(ValueError, match=cuda_ipc.IDLE_ENV):
            cuda_ipc.idle_seconds({cuda_ipc.IDLE_ENV: bad})


def test_a_lease_is_renewed_only_for_its_own_process_tensor_and_memory():
    leases = cuda_ipc.Leases()
    where = (0x7000, 0, (4,), (1,), "torch.float32")
    ident = leases.add(cuda_ipc.Lease("t", ME, 10.0, (b"h", 1), 7, where))
    assert not leases.renew(ident, 7, ME + 1, where, now=5.0), "another process"
    assert not leases.renew(ident + 1, 7, ME, where, now=5.0), "no such lease"
    assert leases.held[ident].deadline == 10.0, "not ended: it is not theirs"
    assert leases.renew(ident, 7, ME, where, now=5.0)
    assert leases.held[ident].deadline == 5.0 + cuda_ipc.LEASE_SECONDS
    leases.done(ident)
    assert not leases.renew(ident, 7, ME, where, now=6.0), "done: the receiver maps it again"


@pytest.mark.parametrize(
    "tensor, moved",
    [(8, (0x7000, 0, (4,), (1,), "torch.float32")), (7, (0x9000, 0, (4,), (1,), "torch.float32")),
     (7, (0x7000, 0, (8,), (1,), "torch.float32"))],
    ids=["another tensor", "new memory", "resized"],
)  # fmt: skip
def test_a_lease_whose_tensor_moved_is_ended_not_renewed(tensor, moved):
    leases = cuda_ipc.Leases()
    where = (0x7000, 0, (4,), (1,), "torch.float32")
    ident = leases.add(cuda_ipc.Lease("t", ME, 10.0, (b"h", 1), 7, where))
    assert not leases.renew(ident, tensor, ME, moved, now=5.0)
    assert ident not in leases.held, "the receiver drops that mapping: the lease ends"


def test_layout_changes_when_a_tensor_gets_new_memory_not_when_changed_in_place():
    import torch

    t = torch.zeros(4)
    before = cuda_ipc.layout(t)
    t.add_(1)
    assert cuda_ipc.layout(t) == before
    t.data = torch.ones(4)
    assert cuda_ipc.layout(t) != before
    t2 = torch.zeros(4)
    kept = cuda_ipc.layout(t2)
    t2.resize_(1 << 20)
    assert cuda_ipc.layout(t2) != kept


def test_the_board_offers_a_buffer_until_it_is_dropped_as_a_receiver_reads_it():
    board = cuda_ipc.Board(slots=2)
    s5 = board.claim(5)
    assert board.claim(5) == s5, "one slot per buffer"
    s6 = board.claim(6)
    assert board.claim(7) == -1, "full: buffer 7 is used with a message each time"
    view = cuda_ipc.BoardView(board.path, board.ino)  # as a receiver: /proc/<pid>/fd/<fd>
    assert view.offers(s5, 5) and view.offers(s6, 6)
    assert not view.offers(s5, 6) and not view.offers(99, 5) and not view.offers(-1, 5)
    board.clear(5)
    assert not view.offers(s5, 5), "dropped: refused at once"
    assert board.claim(7) == s5, "its slot is reused"
    assert not view.offers(s5, 5) and view.offers(s5, 7)
    with pytest.raises(OSError, match="not the owner's board"):
        cuda_ipc.BoardView(board.path, board.ino + 1)


def test_one_sided_use_needs_the_board_and_a_recent_answer_from_the_owner():
    board = cuda_ipc.Board(slots=4)
    slot = board.claim(3)
    view = cuda_ipc.BoardView(board.path, board.ino)
    told = Told()
    m = cuda_ipc.Mapping(("run", ME, 3, "torch.uint8"), object(), 1, ME, 3, told, view, slot,
                         used=100.0, renewed=100.0)  # fmt: skip
    assert m.one_sided(now=101.0)
    assert not m.one_sided(now=100.0 + cuda_ipc.RENEW_SECONDS), "asks the owner again"
    board.clear(3)
    assert not m.one_sided(now=101.0)
    plain = _mapping(4, told, used=100.0)
    assert not plain.one_sided(now=101.0), "a shared tensor (no board): always asks"


def test_a_drop_naming_a_mapping_leaves_a_newer_one_under_the_same_key():
    told = Told()
    maps, stale, newer = _mapped_twice(told)  # another thread mapped it again meanwhile
    maps.drop(stale.key, tell=False, mapping=stale)
    assert maps.get(stale.key) == (newer, newer.tensor) and told.leases == [101]


def test_a_tensor_taken_from_a_mapping_outlives_its_drop_and_get_marks_it_used():
    told = Told()
    maps = _mappings()
    m = _mapping(1, told, used=0.0)
    maps.put(m)
    found = maps.get(m.key)
    assert found is not None and m.used > 0.0, "marked used: the sweeper keeps it"
    kept, tensor = found
    maps.sweep(now=m.used + 11.0)  # dropped meanwhile (idle)
    assert kept.tensor is None and tensor is not None, "the taker still holds the tensor"
    assert maps.get(m.key) is None


def test_the_sweeper_survives_an_error_and_goes_on():
    told = Told()
    calls = []

    def flaky_alive(pid: int) -> bool:
        calls.append(pid)
        if len(calls) == 1:
            raise OSError("/proc unreadable for a moment")
        return True

    maps = cuda_ipc.Mappings(idle=0.1, alive=flaky_alive)
    maps.put(_mapping(1, told, used=0.0))
    for t in [t for t in threading.enumerate() if t.name == "mk-ipc-mappings"]:
        t.join(timeout=30)
    assert maps.held == {} and told.leases == [101]
