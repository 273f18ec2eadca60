"""``TrainingState``: what a rank's training state is, and where its steps begin and end.

Declaring it is what lets a mesh replace a dead rank without a checkpoint: when a rank
dies in the middle of a step, the others wait at the step boundary, the controller
restarts the dead rank, and the new rank takes this state straight from a live replica
(over the data plane), then joins the loop at the same step. See the README section
"Training that survives a dead rank" and :mod:`monarch_kernel.rank.training.park`.

The loop must be written on ``state.step`` so that a redone step is redone::

    state = TrainingState(model=ddp, optimizer=opt, data=loader_state, extra={"losses": losses})
    while state.step < 1000:
        with state.stepping():
            ...one step: forward, backward, optimizer.step()...
"""

from __future__ import annotations

import pickle
import sys
import time
import traceback
from types import TracebackType
from typing import Any

from monarch_kernel.rank import context, world
from monarch_kernel.rank.dataplane.plane import server
from monarch_kernel.rank.replicas.ddp_layout import adopt_layout, bucket_layout
from monarch_kernel.rank.replicas.fsdp_reset import reset_fsdp
from monarch_kernel.rank.replicas.shards import replica_ranks
from monarch_kernel.rank.training.park import park, take_expected, take_hold, tell
from monarch_kernel.rank.training.parts import (
    Snapshot,
    StateOffer,
    load_model,
    load_optimizer,
    pickled,
    rng_state,
    set_rng_state,
    share_tree,
)
from monarch_kernel.wire.train_msgs import Notice

#: Words in an error's text that say a collective failed because of a peer (a dead
#: rank, an aborted or re-formed process group), not because of this rank's code.
PEER_FAILURE_WORDS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "broken pipe",
    "abort",
    "process group",
    "peer",
    "timed out",
    "socket",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because another rank did."""
    if not isinstance(exc, Exception):
        return False  # Ctrl-C, SystemExit: never parked
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if isinstance(dist_error, type) and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, (RuntimeError, OSError, TimeoutError)):
        return False
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(word in text for word in PEER_FAILURE_WORDS)


def sharded_part(model: Any) -> str:
    """The name of a parameter or buffer of ``model`` that is a *shard* (a ``DTensor``
    with a ``Shard`` placement, as FSDP2 makes), or '' when every tensor is whole. A
    sharded rank's state exists on no other rank unless the mesh keeps replicas of each
    shard, so it cannot be taken from a peer."""
    if model is None:
        return ""
    for name, value in model.state_dict().items():
        placements = getattr(value, "placements", None)
        if placements and any(type(p).__name__ == "Shard" for p in placements):
            return str(name)
    return ""


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class TrainingState:
    """A rank's training state: ``model`` (parameters and buffers), ``optimizer``,
    the step counter ``step``, the RNG states (torch, numpy, ``random``; ``rng=False``
    to leave them out), ``data`` (a data loader, sampler or any object with
    ``state_dict``/``load_state_dict``: its position) and ``extra`` (a dict of picklable
    objects; lists and dicts in it are updated in place when state is loaded).

    ``with state.stepping():`` marks one step. ``state.step`` advances when the step
    completes: its block ended, or the optimizer's ``step()`` ran in it. A step that
    fails before that has its RNG, data and extra state put back as they were at its
    start, so that running it again draws the same batch.
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        data: Any = None,
        rng: bool = True,
        extra: dict[str, Any] | None = None,
        step: int = 0,
    ):
        for name, part in (("model", model), ("optimizer", optimizer), ("data", data)):
            if part is not None and not _has_state_dict(part):
                raise TypeError(
                    f"TrainingState({name}=...) needs an object with state_dict() and "
                    f"load_state_dict(), got {type(part).__name__}"
                )
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(
                f"TrainingState(extra=...) takes a dict of picklable objects, got "
                f"{type(extra).__name__}"
            )
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"TrainingState(step=...) must be an int >= 0, got {step!r}")
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.rng = bool(rng)
        self.extra: dict[str, Any] = extra if extra is not None else {}
        self.step = step
        self._stepped = False
        self._announced: str | None = None
        self._shared: list[int] = []
        self._hook = None
        #: the rank's world generation the loop last saw (see ``world_changed``)
        self._world_seen = world.generation
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._hook = optimizer.register_step_post_hook(self._optimizer_stepped)

    def _optimizer_stepped(self, *args: Any) -> None:
        self._stepped = True

    @property
    def world_size(self) -> int:
        """The number of ranks training now (``WORLD_SIZE``; it changes when the mesh
        grows or shrinks at a step boundary: ``%mesh grow NAME``)."""
        return world.world_size()

    @property
    def rank(self) -> int:
        """This rank's flat rank now (``RANK``)."""
        return context.current_rank().rank if context.in_rank() else 0

    @property
    def world_changed(self) -> bool:
        """True in the first step after the mesh grew or shrank (and in a new rank's
        first step): the moment to split the data again by ``world_size``."""
        return self._world_seen != world.generation

    def stepping(self) -> _Step:
        """The context manager around one training step (see the class)."""
        return _Step(self)

    # -- whole state (a disk checkpoint, a comparison) ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything declared, as one dict (tensors included): ``torch.save`` it for a
        checkpoint on disk, or, for a sharded (FSDP2/HSDP) model, save it as a
        distributed checkpoint (``torch.distributed.checkpoint.save(state.state_dict(),
        checkpoint_id=...)``: every rank writes its shards). For a sharded model the
        model and optimizer parts are torch's ``get_state_dict`` (keyed by parameter
        names, the optimizer's state made if it has none yet, so that
        ``torch.distributed.checkpoint.load`` can fill a fresh one in place)."""
        model, optimizer = self._tensor_parts()
        return {"step": self.step, "model": model, "optimizer": optimizer, "small": self._small()}

    def _tensor_parts(self) -> tuple[Any, Any]:
        if self._sharded():
            from torch.distributed.checkpoint.state_dict import get_state_dict

            optimizers = [self.optimizer] if self.optimizer is not None else []
            return get_state_dict(self.model, optimizers)
        model = self.model.state_dict() if self.model is not None else None
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        return model, optimizer

    def _sharded(self) -> bool:
        return self.model is not None and replica_ranks(self.model) is not None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (after ``torch.load``, or filled in
        place by ``torch.distributed.checkpoint.load``)."""
        if self._sharded():
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.model,
                [self.optimizer] if self.optimizer is not None else [],
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"] if self.optimizer is not None else {},
            )
            self._load_small(_as_bytes(state["small"]))
            return
        if self.model is not None and state.get("model") is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._load_small(_as_bytes(state["small"]))

    def _small(self) -> bytes:
        parts = {
            "step": self.step,
            "rng": rng_state() if self.rng else None,
            "data": self.data.state_dict() if self.data is not None else None,
            "extra": self.extra,
        }
        return pickled(parts, "the step, RNG, data or extra state")

    def _load_small(self, blob: bytes) -> None:
        parts = pickle.loads(blob)
        self.step = int(parts["step"])
        if self.rng and parts["rng"] is not None:
            set_rng_state(parts["rng"])
        if self.data is not None and parts["data"] is not None:
            self.data.load_state_dict(parts["data"])
        _update_in_place(self.extra, parts["extra"])

    # -- from peer to peer (the orders of training.park) ----------------------------------------
    def offer(self) -> StateOffer:
        """Share this rank's state at its step boundary (for another rank to load)."""
        dp = server()
        count = [0]
        ids = self._shared

        def share(t: Any) -> Any:
            ref = dp.share(t)
            ids.append(ref.id)
            return ref

        model = share_tree(self.model.state_dict(), share, count) if self.model else None
        optim = share_tree(self.optimizer.state_dict(), share, count) if self.optimizer else None
        rank = context.current_rank().rank
        offer = StateOffer(rank, self.step, model, optim, self._small(), count[0])
        offer.layout = bucket_layout(self.model)
        return offer

    def load(self, offer: StateOffer) -> Notice:
        """Take ``offer``'s state (pulled from its rank now); what was loaded."""
        t0 = time.monotonic()
        if self.model is not None and offer.model is not None:
            load_model(self.model, offer.model)
            adopt_layout(self.model, offer.layout)
        if self.optimizer is not None and offer.optimizer is not None:
            load_optimizer(self.optimizer, offer.optimizer)
        self._load_small(offer.small)
        self._world_seen = -1  # a new (or restarted) rank: its first step sees the world anew
        request = context.current_request or ""
        seconds = time.monotonic() - t0
        return Notice(
            "loaded", request, self.step, nbytes=offer.nbytes, seconds=seconds, source=offer.source
        )

    def released(self) -> None:
        """The state this rank offered was taken: stop offering it."""
        dp = server()
        for ident in self._shared:
            dp.release(ident)
        self._shared.clear()


def _as_bytes(value: Any) -> bytes:
    """The pickled small state as saved: bytes (``torch.save``) or a stream that a
    distributed checkpoint loaded it as."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    read = getattr(value, "getvalue", None) or getattr(value, "read", None)
    if callable(read):
        return bytes(read())
    raise TypeError(f"TrainingState.load_state_dict: 'small' is {type(value).__name__}")


def _update_in_place(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Put ``theirs`` into ``mine``; lists and dicts already there are updated in place
    (so that names bound to them in the cell see the new contents)."""
    for key, value in theirs.items():
        old = mine.get(key)
        if isinstance(old, list) and isinstance(value, list):
            old[:] = value
        elif isinstance(old, dict) and isinstance(value, dict):
            old.clear()
            old.update(value)
        else:
            mine[key] = value


class _Step:
    """One step of a :class:`TrainingState` (``with state.stepping():``)."""

    __slots__ = ("state", "snapshot")

    def __init__(self, state: TrainingState):
        self.state = state
        self.snapshot: Snapshot | None = None

    def __enter__(self) -> TrainingState:
        state = self.state
        request = context.current_request
        if request is not None and state._announced != request:
            state._announced = request
            offer = take_expected(request)
            if offer is not None:  # a restarted rank: take a replica's state first
                _load_expected(state, request, offer)
            tell(Notice("active", request, state.step))
        if request is not None and take_hold(request):  # the mesh is resized here
            order = park(state, request, "")
            if order.op != "resume":
                raise RuntimeError(f"the mesh could not be resized: {order.why}")
        state._stepped = False
        data = state.data.state_dict() if state.data is not None else None
        self.snapshot = Snapshot(
            rng_state() if state.rng else None,
            pickled(data, "the data state") if data is not None else b"",
            pickled(state.extra, "extra"),
        )
        return state

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        state = self.state
        if exc is None or state._stepped:
            state.step += 1  # it completed: its optimizer step ran
            state._world_seen = world.generation
            return False
        self._restore()
        request = context.current_request
        if request is None or not is_peer_failure(exc):
            return False
        if tb is not None:
            # The failed collective's frames hold its pending work; the process group
            # cannot be re-formed while they live.
            traceback.clear_frames(tb)
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        # FSDP2 modules stopped mid-step: clean, so the redone step pairs up everywhere
        reset_fsdp(state.model)
        replicas = replica_ranks(state.model)
        shard = sharded_part(state.model) if replicas is not None and len(replicas) < 2 else ""
        if shard:  # no peer holds this rank's shard: say so, the recovery gives up
            why = (
                f"sharded: the model is sharded (FSDP2: parameter {shard!r} is a shard) and "
                "no rank holds a replica of another rank's shard; recovering from peers "
                "needs a replica of each shard: HSDP (fully_shard(model, mesh=dm) on "
                "monarch_kernel.sharding.device_mesh() of a mesh with --hosts)"
            )
        order = park(state, request, why, has_state=not shard, replicas=replicas or ())
        return order.op == "resume"

    def _restore(self) -> None:
        state, snap = self.state, self.snapshot
        if snap is None:
            return
        if snap.rng is not None:
            set_rng_state(snap.rng)
        if state.data is not None and snap.data:
            state.data.load_state_dict(pickle.loads(snap.data))
        _update_in_place(state.extra, pickle.loads(snap.extra))


def _load_expected(state: TrainingState, request: str, offer: StateOffer) -> None:
    """A restarted rank's first step: load the replica's state it was told to expect;
    if that fails (the replica died meanwhile), wait at the boundary for another."""
    try:
        notice = state.load(offer)
    except Exception as exc:
        tell(Notice("load_failed", request, state.step, False, f"{type(exc).__name__}: {exc}"))
        order = park(state, request, "", has_state=False)
        if order.op != "resume":
            raise RuntimeError(
                f"rank could not take the training state of a live replica: {order.why}"
            ) from exc
        return
    tell(notice)
