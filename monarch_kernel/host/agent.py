"""The host agent (``python -m monarch_kernel.host``), one per machine.

It starts the warm template at once (so torch is imported while it waits), then reads
its configuration (controller addresses and mesh key) as one JSON line on stdin or from
``$MONARCH_KERNEL_HOST_CONFIG``, connects to the controller, forks ranks through the
template, reports every rank death at once with the rank's last output lines, fans
multi-rank messages out to its local ranks, and exits when the controller disappears
(heartbeat loss; on Linux also the parent-death signal).

Ranks are named here by their *slot* (their wire id: the ``d`` of a fan-out, the ``r`` of
a rank's messages, ``RankConfig.slot``), which a rank keeps when a shrink renumbers the
ranks; this agent's own ``host`` is its host slot likewise.

Size: over the ~450-line habit: the agent's one loop, its handler table and its sockets'
set-up share the loop's state; the ranks it runs are :mod:`~.ranks`,
the controller's liveness :mod:`~.liveness`, the fan-out and fan-in
their own modules.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import zmq
import zmq.utils.z85

from monarch_kernel.host.config import AgentConfig
from monarch_kernel.host.desk import Desk, StopAsked, leave_launcher
from monarch_kernel.host.fanin import FanInSocket
from monarch_kernel.host.fanout import RankFanOut
from monarch_kernel.host.gpu_stats import GpuSampler
from monarch_kernel.host.gpu_stats import enabled as gpu_stats_enabled
from monarch_kernel.host.liveness import (
    ControllerLink,
    SilentController,
    arm_heartbeats,
    parent_ended,
)
from monarch_kernel.host.netinfo import interface_of, source_address
from monarch_kernel.host.ranks import LocalRanks
from monarch_kernel.host.stacks import dump_stacks
from monarch_kernel.host.template_handle import DEFAULT_GRACE, Template, TemplateEvent
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.wire import Codec, WireError, tempdirs
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import NOBLOCK, limit_size, readable
from monarch_kernel.wire.codec import recv as wire_recv
from monarch_kernel.wire.codec import send as wire_send
from monarch_kernel.wire.desk import ControllerId
from monarch_kernel.wire.identity import ident_tag
from monarch_kernel.wire.key_gate import close_gates
from monarch_kernel.wire.osutil import request_tail
from monarch_kernel.wire.ports import PortReservation
from monarch_kernel.wire.reports import GpuStats

log = logging.getLogger("monarch_kernel.host")

#: Seconds between the agent's heartbeats (the controller declares a host lost after a
#: few seconds of silence); also the longest its message loop ever waits.
HEARTBEAT_INTERVAL = 0.5
#: The longest the loop takes messages off its inbox in one turn (s): its heartbeats
#: and its ranks' exits are not held up by a long stream of messages.
INBOX_BUDGET = 0.1
#: The longest a ``dump_stacks`` holds up the agent's loop, waiting for the dumps.
STACKS_WAIT = 0.3
#: ``0`` turns fan-in off (every rank replies to the controller itself): for comparisons.
FANIN_ENV = "MONARCH_KERNEL_FANIN"


#: Rendezvous ports of re-formed process groups (``NEW_PORT``) an agent keeps reserved;
#: the oldest is let go when another is asked for (its re-form finished long before).
HELD_PORTS = 32


class HostAgent:
    def __init__(self, controller_pid: int | None = None, template: Template | None = None):
        """``template``: the warm template, when it was started before this agent's
        imports (``host.main``: its torch import runs beside them); else started here."""
        self.controller_pid = controller_pid
        # mode 0700; the local launcher makes it (and removes it if we are killed)
        given = os.environ.pop("MONARCH_KERNEL_HOST_DIR", "")
        if given:
            self.private_dir = given
        else:  # started by Ray, Slurm or a join command: ours to remove, and if we are
            # killed outright, the next agent or kernel on this machine sweeps it
            tempdirs.sweep()
            self.private_dir = tempdirs.make_private_dir(
                tempdirs.HOST_PREFIX, room=tempdirs.SOCKET_NAME_ROOM
            )
            tempdirs.mark_owners(self.private_dir, [os.getpid()])
        self.template = template if template is not None else Template()
        self.ranks = LocalRanks(self.template)
        self.pids = self.ranks.pids  # rank -> pid (read by the fan-out and the desk)
        self.stop_grace = DEFAULT_GRACE  # the controller's ``stop`` may say otherwise
        self.cfg: AgentConfig | None = None
        #: The host's GPUs, sampled through NVML (their stats go with the ranks' through
        #: the fan-in: :meth:`gpu_of`; its thread starts with the first stats).
        self.gpus: GpuSampler | None = None
        #: A detachable mesh's holder, clock and attach desk (None: not detachable).
        self.desk: Desk | None = None
        #: Where the local launcher put us (a detachable agent moves out of it).
        self.launch_dir = os.path.dirname(self.private_dir)
        #: A SIGTERM ended us (``shutdown``); whether our controller is gone (decided
        #: once, by :meth:`controller_gone`).
        self.signalled = False
        self._controller_gone: bool | None = None
        #: The ports this agent gave out for rank 0's store to listen on: MASTER_PORT
        #: (first, from :meth:`configure` on) and the re-forms' rendezvous (NEW_PORT),
        #: held until the agent ends (``wire.ports.PortReservation``: a port merely found
        #: free may be taken by the time rank 0 binds it, and then the ranks' first
        #: collective waits forever), the oldest re-form's let go past HELD_PORTS.
        self.held: list[PortReservation] = []
        #: Handlers of the controller's messages by kind (forwarded ones, with header
        #: ``f``, never get here): ``handler(header)``; "stop" ends the message loop.
        self.handlers: dict[str, Callable[[H.AnyHeader], str | None]] = {
            K.SPAWN_RANKS: self.on_spawn_ranks,
            K.SIGNAL_RANKS: self.on_signal_ranks,
            K.KILL_RANKS: self.on_kill_ranks,
            K.STOP: self.on_stop,
            K.NEW_PORT: self.on_new_port,
            K.HEARTBEAT: self.on_ignored,
            K.HELLO: self.on_ignored,
            K.DUMP_STACKS: self.on_dump_stacks,
            K.DETACH: self.on_detach,
        }

    def configure(self, cfg: AgentConfig) -> None:
        """Connect to the controller and bind the fan-out socket, as ``cfg`` says."""
        send = cfg.send
        if not cfg.advertise and send.startswith("tcp://"):
            # Any launcher on other machines: our address is the one we reach the
            # controller from (MASTER_ADDR, and the interface gloo/NCCL use).
            try:
                addr = source_address(send)
            except (OSError, ValueError):
                addr = ""
            if addr and not addr.startswith("127.") and addr != "::1":
                cfg = replace(cfg, advertise=addr)
        self.cfg = cfg
        self.host = cfg.host
        self.codec = Codec(bytes.fromhex(cfg.key))
        self.hb_timeout = cfg.hb_timeout
        self.ctx = zmq.Context()
        if cfg.detach_keep > 0:  # outlive the controller (see host/desk.py)
            self.private_dir = leave_launcher(self.private_dir)
            self.desk = Desk(cfg, self.private_dir, self.ctx)
        #: Suffix of our ranks' routing ids and ours (launchers.base.ident_tag).
        self.tag = ident_tag(cfg.curve_secret)
        ident = b"h%d" % self.host + self.tag
        self.inbox = self.ctx.socket(zmq.DEALER)
        self.inbox.setsockopt(zmq.IDENTITY, ident)
        limit_size(self.inbox)  # ZMQ_MAXMSGSIZE: no frame above it is allocated
        self.curve_client(self.inbox)
        self.inbox.connect(cfg.send)
        self.out = self.ctx.socket(zmq.DEALER)
        self.out.setsockopt(zmq.IDENTITY, ident)
        self.out.setsockopt(zmq.LINGER, 2000)
        limit_size(self.out)
        self.curve_client(self.out)
        if cfg.recv.startswith("tcp://"):  # (on this machine its pid says it all)
            arm_heartbeats(self.out)  # a controller that stops answering closes the link
        self.link = ControllerLink(self.out)
        self.out.connect(cfg.recv)
        #: What we make of a silent controller (gone, or busy: see host/liveness.py).
        self.silent = SilentController(self.host, self.link)
        self.holder: ControllerId | None = cfg.controller()
        if self.desk is not None:
            self.desk.follow(self.silent)
        curve = (cfg.curve_secret, cfg.curve_public) if cfg.curve_secret else None
        #: Our ranks' inboxes connect here (greetings, fanned-out messages).
        self.fan = RankFanOut(
            self.ctx, f"ipc://{self.private_dir}/fan", self.codec, self.host, self.tag, curve
        )
        #: Fan-in of replies (not for a detachable mesh: while no controller is
        #: attached we send nothing, and its ranks keep their results themselves).
        self.fanin: FanInSocket | None = None
        if self.desk is None and os.environ.get(FANIN_ENV, "1") != "0":
            self.gpus = GpuSampler() if gpu_stats_enabled() else None
            self.fanin = FanInSocket(
                self.ctx, f"ipc://{self.private_dir}/fanin", self.codec, self.host,
                self.out, self.send, curve, self.gpu_of if self.gpus is not None else None,
            )  # fmt: skip
        self.held.append(PortReservation())
        self.master_port = self.held[-1].port
        self.hostname = cfg.hostname or socket.gethostname()
        #: The network interface that owns our advertised address (gloo and NCCL use it).
        self.ifname = interface_of(cfg.advertise) if cfg.advertise else None

    def gpu_of(self, ranks: Collection[int]) -> dict[int, GpuStats]:
        """rank -> the stats of the GPU it is on, for those of ``ranks`` running here."""
        if self.gpus is None:
            return {}
        pids = {r: self.pids[r] for r in ranks if r in self.pids}
        cfgs = self.ranks.cfgs
        local = {r: cfgs[r].local_rank for r in pids if r in cfgs}
        try:
            return self.gpus.for_ranks(pids, local)
        except Exception as exc:  # telemetry never takes the agent's loop down
            log.debug("host %s: no GPU stats: %r", self.host, exc)
            return {}

    def tell_taken_over(self, by: ControllerId) -> None:
        """Tell the controller holding the mesh that ``by`` took it over."""
        try:
            header = H.TakenOver(host=self.host, by=(by.pid, by.hostname)).encode()
            wire_send(self.out, self.codec.encode(header), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def curve_client(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE client of the controller when the mesh uses CURVE."""
        cfg = self.cfg
        if cfg is not None and cfg.curve_secret:
            sock.setsockopt(zmq.CURVE_SERVERKEY, cfg.curve_server.encode())
            sock.setsockopt(zmq.CURVE_PUBLICKEY, cfg.curve_public.encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve_secret.encode())

    def send(self, header: H.WireHeader, payload: bytes = b"") -> None:
        """Send a message to the controller (none while a detachable mesh has none:
        what happens meanwhile is told at the next attach)."""
        if self.desk is not None and not self.desk.attached:
            return
        wire_send(self.out, self.codec.encode(header, payload))

    def send_heartbeat(self) -> None:
        """A heartbeat never blocks the loop: if the controller does not take what we
        send (its queue is full), it hears from us once it does."""
        try:
            heartbeat = H.Heartbeat(host=self.host).encode()
            wire_send(self.out, self.codec.encode(heartbeat), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def run(self) -> None:
        """Say ready, then serve the controller, the template and the ranks' greetings
        until told to stop (or the controller falls silent).

        One loop on purpose: the order of its steps is the agent's priorities (the
        template's events and the ranks' greetings, their replies through the fan-in
        before the controller's inbox, heartbeats last), which reads best in one place."""
        assert self.cfg is not None, "configure() first"
        ready = H.HostReady(
            host=self.host,
            pid=os.getpid(),
            hostname=self.hostname,
            addr=self.cfg.advertise or "127.0.0.1",
            port=self.master_port,
            desk=self.desk.address if self.desk is not None else "",
            dir=self.desk.dir if self.desk is not None else "",
        )
        self.send(ready.encode())
        poller = self.make_poller()
        fanin, link, desk = self.fanin, self.link, self.desk
        last_rx = last_hb = time.monotonic()
        template, writing = self.template, False
        while True:
            if bool(template.pending) != writing:  # commands wait for room in its pipe
                writing = bool(template.pending)
                if writing:
                    poller.register(template.cmd_w, zmq.POLLOUT)
                else:
                    poller.unregister(template.cmd_w)
            # While a rank waits for our hello, retry it every few milliseconds.
            quick = self.fan.busy
            # Never wait longer than half a heartbeat interval, so heartbeats go on time.
            wait = 2 if quick else int(HEARTBEAT_INTERVAL * 500)
            if fanin is not None:  # a batch of replies may be due sooner
                wait = fanin.timeout_ms(wait)
            events = dict(poller.poll(wait))
            if template.pending:
                template.flush()
            if self.fan.backlog:
                self.fan.flush_backlog()
            now = time.monotonic()
            if self.template.event_r in events:
                for ev in self.template.events():
                    if self.on_template_event(ev) == "exit":
                        return
            if self.fan.sock in events:
                self.fan.on_greeting()
            if self.fan.greeted:
                self.fan.answer_greetings()
            if fanin is not None:  # ranks' replies first: the controller waits on them
                if fanin.sock in events:
                    fanin.receive()
                else:
                    fanin.send_due()
            if self.inbox in events:
                last_rx = now
                self.silent.heard()
                if self.take_inbox(now + INBOX_BUDGET) == "stop":
                    return
            if link.monitor in events:
                link.on_events()
            if desk is not None and desk.sock in events and self.on_desk(desk):
                return
            now = time.monotonic()
            if now - last_hb >= HEARTBEAT_INTERVAL and (desk is None or desk.attached):
                self.send_heartbeat()
                last_hb = now
            if desk is not None:
                if desk.expired(now, now - max(last_rx, desk.attached_at)):
                    log.error("host %s: no controller attached in time, stopping", self.host)
                    return
            elif now - last_rx > self.hb_timeout and self.controller_lost(now - last_rx):
                return

    def make_poller(self) -> zmq.Poller:
        """What the message loop waits on: the inbox, the template's events, the ranks'
        greetings, the fan-in, and a detachable mesh's desk and link."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.template.event_r, zmq.POLLIN)
        poller.register(self.fan.sock, zmq.POLLIN)
        if self.fanin is not None:
            poller.register(self.fanin.sock, zmq.POLLIN)
        if self.desk is not None:
            poller.register(self.desk.sock, zmq.POLLIN)
            # The desk follows the link as it changes (a closed one is a kernel gone:
            # another may attach at once); otherwise it is read when the controller
            # falls silent (one socket fewer to poll on every wake-up).
            poller.register(self.link.monitor, zmq.POLLIN)
        return poller

    def take_inbox(self, until: float) -> str | None:
        """Handle the controller's messages waiting in the inbox, until ``until``
        (monotonic): bounded, as the fan-in's receive, so that a long stream of chunks
        (a 2 GiB push) never keeps the heartbeats from going; the rest waits a turn.
        "stop" when one of them ended the message loop."""
        inbox = self.inbox
        while readable(inbox):  # (a raised zmq.Again costs more than a message)
            try:
                frames = wire_recv(inbox, NOBLOCK)
            except zmq.Again:  # (only this thread reads it: not expected)
                break
            if self.on_message(frames) == "stop":
                return "stop"
            if time.monotonic() >= until:
                break
        return None

    def controller_lost(self, silent_for: float) -> bool:
        """Whether a controller silent for ``silent_for`` seconds is gone: only if known
        gone (a busy kernel keeps its mesh); said in the log."""
        why = self.silent.gone(silent_for, self.holder)
        if why is None:
            return False
        log.error(
            "host %s: controller silent for %.0fs and %s, shutting down",
            self.host,
            silent_for,
            why,
        )
        return True

    def on_message(self, frames: list[Any]) -> str | None:
        try:
            msg = self.codec.decode(frames)
        except WireError as exc:
            log.warning("host %s dropped a message: %s", self.host, exc)
            return None
        h = msg.header
        if h.get("f"):  # a fan-out: the frames go on unchanged, whatever their kind
            ours = [r for r in H.OtherOrdered.decode(h).targets or () if r in self.pids]
            request = h.get("i")
            if self.fanin is not None and h.get("w") and isinstance(request, str):
                self.fanin.expect(request, ours)  # they reply through us (wire.fanin)
            for r in ours:
                self.fan.forward(r, frames)
            return None
        kind = h["k"]
        try:
            handler = self.handlers[kind]
        except (KeyError, TypeError):  # unknown (or unhashable) kind
            log.warning("host %s: unknown message kind %r", self.host, kind)
            return None
        try:
            header = H.decode(h)
        except H.HeaderError as exc:
            log.warning("host %s dropped a message: %s", self.host, exc)
            return None
        return handler(header)

    def on_spawn_ranks(self, h: H.AnyHeader) -> None:
        """SPAWN_RANKS: fork one rank per spec in ``ranks`` (each merged over ``common``
        and over what this agent adds: see :meth:`rank_part`)."""
        assert isinstance(h, H.SpawnRanks)
        agent = self.rank_part()
        for spec in h.ranks:
            slot = spec.get("slot", spec["rank"])  # this agent knows ranks by their slot
            log_path = os.path.join(self.private_dir, f"rank{slot}.log")
            cfg = RankConfig.build(spec, h.common, dict(agent, log=log_path))
            if os.path.exists(cfg.log):
                os.unlink(cfg.log)
            self.ranks.fork(cfg)

    def rank_part(self) -> dict[str, str]:
        """What ranks get from this agent: the mesh key, the controller's addresses,
        the fan-out socket, the hostname, the CURVE keys (through the template's pipe,
        never a command line) and the interface gloo/NCCL should use."""
        assert self.cfg is not None
        out = dict(self.cfg.rank_part(), fanout=self.fan.addr, hostname=self.hostname)
        if self.fanin is not None:
            out["fanin"] = self.fanin.address
        if self.ifname:
            out["ifname"] = self.ifname
        return out

    def on_signal_ranks(self, h: H.AnyHeader) -> None:
        """SIGNAL_RANKS: send signal ``sig`` to the local ranks ``d``."""
        assert isinstance(h, H.SignalRanks)
        self.ranks.signal(h.targets, int(h.signal))

    def on_kill_ranks(self, h: H.AnyHeader) -> None:
        """KILL_RANKS: SIGKILL the local ranks ``d``; their exits are reported as expected."""
        assert isinstance(h, H.KillRanks)
        self.ranks.kill(h.targets)

    def on_stop(self, h: H.AnyHeader) -> str:
        """STOP: leave the message loop (``shutdown`` then stops the ranks, giving them
        ``grace`` seconds to exit cleanly)."""
        assert isinstance(h, H.Stop)
        try:
            grace = DEFAULT_GRACE if h.grace is None else h.grace
            self.stop_grace = max(0.0, float(grace))
        except (TypeError, ValueError):
            self.stop_grace = DEFAULT_GRACE
        self.ranks.expect_all_exits()
        return "stop"

    def on_detach(self, h: H.AnyHeader) -> None:
        """DETACH: the controller of this detachable mesh leaves; the ranks run on."""
        if self.desk is not None:
            self.desk.lose_controller("the kernel detached")

    def on_desk(self, desk: Desk) -> bool:
        """Answer the desk's requests; True when one stops the mesh."""
        asked = desk.serve(self)
        if not isinstance(asked, StopAsked):
            return False
        self.stop_grace = max(0.0, asked.grace)
        self.ranks.expect_all_exits()
        return True

    def on_new_port(self, h: H.AnyHeader) -> None:
        """NEW_PORT: answer request ``i`` with a free port on this host (the rendezvous
        of a re-formed process group)."""
        assert isinstance(h, H.NewPort)
        if len(self.held) > HELD_PORTS:
            self.held.pop(1).release()  # never the master port, at 0
        self.held.append(PortReservation())
        self.send(H.Port(host=self.host, request=h.request, port=self.held[-1].port).encode())

    def on_ignored(self, h: H.AnyHeader) -> None:
        """HEARTBEAT and HELLO: receiving anything already counts as a heartbeat."""

    def on_dump_stacks(self, h: H.AnyHeader) -> None:
        """DUMP_STACKS: make the local ranks ``d`` dump their stacks (faulthandler, on
        ``STACKS_SIGNAL``) and answer request ``i`` for each, on its behalf (``h`` set);
        see :func:`.stacks.dump_stacks`."""
        assert isinstance(h, H.DumpStacks)
        logs = {r: os.path.join(self.private_dir, f"rank{r}.log") for r in h.targets}
        for r, threads in dump_stacks(self.pids, logs, STACKS_WAIT):
            header = H.Result(request=h.request, ok=True, rank=r, host=self.host)
            self.send(header.encode(), pickle.dumps(threads))

    def on_template_event(self, ev: TemplateEvent) -> str | None:
        e = ev["e"]
        if e == "forked":
            if not self.ranks.forked(ev["rank"], ev["pid"]):
                return None
            started = H.RankStarted(host=self.host, rank=ev["rank"], pid=ev["pid"])
            self.send(started.encode())
        elif e == "exit":
            rank = ev["rank"]
            was_current = self.pids.get(rank) == ev["pid"]
            if not self.ranks.exited(rank, ev["pid"]):
                return None
            if was_current:
                self.fan.rank_gone(rank)
            if self.fanin is not None:  # what it sent goes before its death (and the
                self.fanin.rank_gone(rank)  # rest of its requests' batches without it)
            expected_exits = self.ranks.expected_exits
            desk, expected = self.desk, rank in expected_exits
            if desk is not None and desk.rank_exited(
                rank, ev["pid"], ev["code"], ev["signal"], expected
            ):
                self.ranks.fork_again(rank)
            log_path = os.path.join(self.private_dir, f"rank{rank}.log")
            exit_ = H.RankExit(
                host=self.host,
                rank=rank,
                pid=ev["pid"],
                code=ev["code"],
                signal=ev["signal"],
                tail=request_tail(log_path),
                expected=rank in expected_exits,
            )
            self.send(exit_.encode())
            expected_exits.discard(rank)
        elif e == "template_exit":
            log.error("host %s: template exited (%s)", self.host, ev.get("code"))
            return "exit"
        return None

    def shutdown(self, signalled: bool = False) -> None:
        """Stop the ranks and the template, close the sockets, remove our directories
        (and a dead controller's: see :meth:`controller_gone`); ``signalled``: a SIGTERM
        ended us (from a controller that is ending, or from one that stops us)."""
        # Already on our way out: a SIGTERM now (the controller dying) must not cut the
        # clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.signalled = signalled
        if self.gpus is not None:
            self.gpus.close()
        self.template.stop(self.stop_grace)
        # Report the exits the template emitted while stopping, then say goodbye.
        try:
            os.set_blocking(self.template.event_r, False)
            for ev in self.template.events():
                if ev["e"] == "exit":
                    self.ranks.expected_exits.add(ev["rank"])
                    self.on_template_event(ev)
        except (OSError, ValueError):
            pass
        if self.desk is not None and self.cfg is not None:
            self.desk.close(self.cfg)
        if self.cfg is not None:
            close_gates(self.ctx)
            # What is still queued (the ranks' exits, our goodbye) gets half a second to
            # reach a controller that lives; one that is gone reads none of it. Known
            # gone only for the local launcher's agents, whose parent it is (a Ray
            # agent's parent is its actor, which may end while the kernel lives).
            dead = self.desk is None and self.local_launch() and self.controller_gone()
            self.ctx.destroy(linger=0 if dead else 500)
            self.remove_dead_controller_sockets()
        for hold in self.held:
            hold.release()
        shutil.rmtree(self.private_dir, ignore_errors=True)
        # A controller killed outright never ran its atexit: its local launcher's
        # directory (which holds our private one) goes with its agents.
        if self.local_launch() and self.controller_gone():
            shutil.rmtree(self.launch_dir, ignore_errors=True)

    def local_launch(self) -> bool:
        """Whether the local launcher started us (our directory is in its own)."""
        return os.path.basename(self.launch_dir).startswith("mk-launch-")

    def controller_gone(self) -> bool:
        """Whether the controller that started us (the local launcher's, our parent)
        has ended (:func:`~.liveness.parent_ended`). Decided once."""
        if self._controller_gone is None:
            self._controller_gone = parent_ended(self.controller_pid, self.signalled)
        return self._controller_gone

    def remove_dead_controller_sockets(self) -> None:
        """A controller killed outright leaves its unix sockets' private directory
        behind; the agents it started remove it (never while the controller lives)."""
        addr = self.cfg.send if self.cfg is not None else ""
        if self.desk is not None:  # a detachable mesh's sockets outlive their controller
            return
        folder = os.path.dirname(addr.removeprefix("ipc://"))
        if not (addr.startswith("ipc://") and os.path.basename(folder).startswith("mk-mesh-")):
            return
        # The local launcher's agents are the controller's children: re-parented = dead.
        if self.controller_gone():
            shutil.rmtree(folder, ignore_errors=True)


__all__ = ["HostAgent", "interface_of", "source_address"]
