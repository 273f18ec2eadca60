"""Headers between the controller and a host agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypedDict

from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.headers.base import (
    CODEC_KEYS,
    HeaderError,
    WireHeader,
    check_keys,
    missing_key,
)

# -- controller <-> host agent ------------------------------------------------------


class RankSpec(TypedDict, total=False):
    """One rank of a ``spawn_ranks`` message (fields of ``rank.config.RankConfig``); the
    CURVE keys only where peers of other machines may call it."""

    rank: int
    local_rank: int
    coords: list[int]
    host: int
    restart_count: int
    peer_secret: str  #: the CURVE secret of its TCP peer socket
    peer_port: int  #: the port it listened on before a restart
    slot: int  #: its wire id, where it is not its rank (ranks renumbered by a shrink)


class _OptionalCommon(TypedDict, total=False):
    """Keys of :class:`MeshCommon` that only some meshes carry."""

    #: On a CURVE mesh: the secret of the controller's listener keypair (``rank.listener_gate``).
    listener_key: str
    #: 1 where the controller reads large results from its ranks' shared memory
    #: (``wire.arena``: a local mesh on unix sockets).
    shm_results: int


class MeshCommon(_OptionalCommon):
    """The part of ``spawn_ranks`` that every rank of the mesh shares."""

    labels: list[str]
    sizes: list[int]
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    mesh: str
    env: dict[str, str]
    sys_path: list[str]
    cwd: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SpawnRanks:
    """``spawn_ranks``: fork one rank per spec of ``ranks``, each merged over
    ``common`` (see :class:`monarch_kernel.rank.config.RankConfig`)."""

    KIND: ClassVar[str] = K.SPAWN_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"ranks", "common"}

    ranks: list[RankSpec]
    common: MeshCommon

    def encode(self) -> WireHeader:
        return {"k": K.SPAWN_RANKS, "ranks": self.ranks, "common": self.common}

    @classmethod
    def decode(cls, h: WireHeader) -> SpawnRanks:
        check_keys(cls, h)
        try:
            return cls(ranks=h["ranks"], common=h["common"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SignalRanks:
    """``signal_ranks``: send signal ``sig`` to the host's ranks ``d``."""

    KIND: ClassVar[str] = K.SIGNAL_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d", "sig"}

    targets: list[int]
    signal: int

    def encode(self) -> WireHeader:
        return {"k": K.SIGNAL_RANKS, "d": self.targets, "sig": self.signal}

    @classmethod
    def decode(cls, h: WireHeader) -> SignalRanks:
        check_keys(cls, h)
        try:
            return cls(targets=h["d"], signal=h["sig"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class KillRanks:
    """``kill_ranks``: SIGKILL the host's ranks ``d`` (their exits are expected)."""

    KIND: ClassVar[str] = K.KILL_RANKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d"}

    targets: list[int]

    def encode(self) -> WireHeader:
        return {"k": K.KILL_RANKS, "d": self.targets}

    @classmethod
    def decode(cls, h: WireHeader) -> KillRanks:
        check_keys(cls, h)
        try:
            return cls(targets=h["d"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """``stop``: the host agent stops its ranks (``grace`` seconds to exit) and exits."""

    KIND: ClassVar[str] = K.STOP
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"grace"}

    grace: float | None = None  #: seconds (not checked here: the agent falls back)

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.STOP}
        if self.grace is not None:
            h["grace"] = self.grace
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Stop:
        check_keys(cls, h)
        return cls(grace=h.get("grace"))


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpStacks:
    """``dump_stacks``: answer request ``i`` with the stacks of ranks ``d``."""

    KIND: ClassVar[str] = K.DUMP_STACKS
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"d", "i"}

    targets: list[int]
    request: str

    def encode(self) -> WireHeader:
        return {"k": K.DUMP_STACKS, "d": self.targets, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> DumpStacks:
        check_keys(cls, h)
        try:
            return cls(targets=h["d"], request=h["i"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class NewPort:
    """``new_port``: answer request ``i`` with a free port of the host."""

    KIND: ClassVar[str] = K.NEW_PORT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"i"}

    request: str | None

    def encode(self) -> WireHeader:
        return {"k": K.NEW_PORT, "i": self.request}

    @classmethod
    def decode(cls, h: WireHeader) -> NewPort:
        check_keys(cls, h)
        try:
            return cls(request=h["i"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """``hb``: from the controller (no keys) or from host agent ``h``."""

    KIND: ClassVar[str] = K.HEARTBEAT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h"}

    host: int | None = None

    def encode(self) -> WireHeader:
        return {"k": K.HEARTBEAT} if self.host is None else {"k": K.HEARTBEAT, "h": self.host}

    @classmethod
    def decode(cls, h: WireHeader) -> Heartbeat:
        check_keys(cls, h)
        return cls(host=h.get("h"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """``ck``: a part of a large value's stream (``wire.chunks``): stream ``st``,
    section ``x`` at byte offset ``o``; a fan-out's chunk also carries its route
    (``f``, ``d``). Read by the receiving loop's assembler, before any other decoding."""

    KIND: ClassVar[str] = K.CHUNK
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"st", "x", "o", "f", "d"}

    stream: str
    section: int
    offset: int
    fanout: int | None = None
    targets: object = None

    def encode(self) -> WireHeader:
        h: WireHeader = {"k": K.CHUNK, "st": self.stream, "x": self.section, "o": self.offset}
        if self.fanout is not None:
            h["f"] = self.fanout
        if self.targets is not None:
            h["d"] = self.targets
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> Chunk:
        check_keys(cls, h)
        return cls(
            stream=h["st"], section=h["x"], offset=h["o"], fanout=h.get("f"), targets=h.get("d")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReady:
    """``host_ready``: host agent ``h`` is up (its pid, hostname, address, free port;
    a detachable mesh's agent also its attach desk)."""

    KIND: ClassVar[str] = K.HOST_READY
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {
        "h",
        "pid",
        "host",
        "addr",
        "port",
        "desk",
        "dir",
    }

    host: int
    pid: int
    hostname: str  #: ``host``
    addr: str  #: the address other hosts reach it at
    port: int  #: a free port (MASTER_PORT when this is host 0)
    desk: str = ""  #: its attach desk's address (a detachable mesh), else ""
    dir: str = ""  #: a detachable mesh's agent: its private directory (its ranks' logs)

    def encode(self) -> WireHeader:
        h: WireHeader = {
            "k": K.HOST_READY,
            "h": self.host,
            "pid": self.pid,
            "host": self.hostname,
            "addr": self.addr,
            "port": self.port,
        }
        if self.desk:
            h["desk"] = self.desk
        if self.dir:
            h["dir"] = self.dir
        return h

    @classmethod
    def decode(cls, h: WireHeader) -> HostReady:
        check_keys(cls, h)
        try:
            return cls(
                host=h["h"],
                pid=h["pid"],
                hostname=h["host"],
                addr=h["addr"],
                port=h["port"],
                desk=h.get("desk", ""),
                dir=h.get("dir", ""),
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Detach:
    """``detach``: the controller of a detachable mesh leaves; the agent keeps the ranks."""

    KIND: ClassVar[str] = K.DETACH
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS

    def encode(self) -> WireHeader:
        return {"k": K.DETACH}

    @classmethod
    def decode(cls, h: WireHeader) -> Detach:
        check_keys(cls, h)
        return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class TakenOver:
    """``taken_over``: host agent ``h`` tells its old controller that another took the
    mesh over (``by``: that one's pid and hostname)."""

    KIND: ClassVar[str] = K.TAKEN_OVER
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "by"}

    host: int
    by: tuple[int, str]

    def encode(self) -> WireHeader:
        return {"k": K.TAKEN_OVER, "h": self.host, "by": list(self.by)}

    @classmethod
    def decode(cls, h: WireHeader) -> TakenOver:
        check_keys(cls, h)
        try:
            pid, hostname = h["by"]
            return cls(host=h["h"], by=(int(pid), str(hostname)))
        except KeyError as exc:
            raise missing_key(cls, exc) from None
        except (TypeError, ValueError):
            raise HeaderError(f"'taken_over' header: bad 'by' {h.get('by')!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Port:
    """``port``: host agent ``h``'s answer to ``new_port`` request ``i``."""

    KIND: ClassVar[str] = K.PORT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "i", "port"}

    host: int
    request: str | None
    port: int

    def encode(self) -> WireHeader:
        return {"k": K.PORT, "h": self.host, "i": self.request, "port": self.port}

    @classmethod
    def decode(cls, h: WireHeader) -> Port:
        check_keys(cls, h)
        try:
            return cls(host=h["h"], request=h["i"], port=h["port"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStarted:
    """``rank_started``: host agent ``h`` forked rank ``r`` as ``pid``."""

    KIND: ClassVar[str] = K.RANK_STARTED
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {"h", "r", "pid"}

    host: int
    rank: int
    pid: int

    def encode(self) -> WireHeader:
        return {"k": K.RANK_STARTED, "h": self.host, "r": self.rank, "pid": self.pid}

    @classmethod
    def decode(cls, h: WireHeader) -> RankStarted:
        check_keys(cls, h)
        try:
            return cls(host=h["h"], rank=h["r"], pid=h["pid"])
        except KeyError as exc:
            raise missing_key(cls, exc) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """``rank_exit``: rank ``r`` (``pid``) of host agent ``h`` ended."""

    KIND: ClassVar[str] = K.RANK_EXIT
    KEYS: ClassVar[frozenset[str]] = CODEC_KEYS | {
        "h",
        "r",
        "pid",
        "code",
        "sig",
        "tail",
        "expected",
    }

    host: int
    rank: int
    pid: int
    code: int | None  #: exit status (None: killed by a signal)
    signal: int | None  #: ``sig``: the signal that killed it
    tail: list[str] = field(default_factory=list)  #: its last output lines
    expected: bool = False  #: the exit was asked for

    def encode(self) -> WireHeader:
        return {
            "k": K.RANK_EXIT,
            "h": self.host,
            "r": self.rank,
            "pid": self.pid,
            "code": self.code,
            "sig": self.signal,
            "tail": self.tail,
            "expected": self.expected,
        }

    @classmethod
    def decode(cls, h: WireHeader) -> RankExit:
        check_keys(cls, h)
        try:
            return cls(
                host=h["h"],
                rank=h["r"],
                pid=h["pid"],
                code=h["code"],
                signal=h["sig"],
                tail=h["tail"],
                expected=h["expected"],
            )
        except KeyError as exc:
            raise missing_key(cls, exc) from None
