"""The parts of a rank's training state, and how they travel from one rank to another.

A :class:`StateOffer` is what a live replica hands out when another rank needs its
state: every tensor of its model, optimizer and extra state is *shared* on the data
plane (:func:`monarch_kernel.rank.dataplane.plane.share`: kept in place, moved into shared
memory on a host with other ranks) and replaced in the pickled skeleton by its small
:class:`~monarch_kernel.rank.dataplane.ref.TensorRef`; the receiver pulls the bytes
straight from that rank (shared memory on its host, its data socket from another host)
and loads them. Nothing goes to disk and nothing big goes through the controller.

The small per-step parts (the RNG states, the data loader's position, extra objects)
are also what :class:`Snapshot` keeps at each step's start, so that a step that did not
complete is redone from exactly where it began.
"""

from __future__ import annotations

import pickle
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.replicas.shards import local_tensor, optimizer_state_like_params


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (a module, an optimizer,
    a ``StatefulDataLoader``, a sampler of one's own)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def rng_state() -> dict[str, Any]:
    """The RNG states of torch (CPU, and CUDA once initialised), numpy (if imported)
    and Python's ``random``."""
    out: dict[str, Any] = {"python": random.getstate()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


@dataclass
class Snapshot:
    """The small parts of a rank's state at one step's start (restored if the step
    fails before its optimizer step ran)."""

    rng: dict[str, Any] | None
    data: bytes  #: the pickled data-loader state (b"" without one)
    extra: bytes  #: the pickled extra objects


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def share_tree(value: Any, share: Callable[[Any], TensorRef], count: list[int]) -> Any:
    """``value`` (dicts, lists, tuples of anything) with every tensor replaced by its
    shared handle (a DTensor's by its local part's); ``count[0]`` grows by the bytes
    shared."""
    if _is_tensor(value):
        ref = share(local_tensor(value).detach())
        count[0] += ref.nbytes
        return ref
    if isinstance(value, dict):
        return {k: share_tree(v, share, count) for k, v in value.items()}
    if isinstance(value, list):
        return [share_tree(v, share, count) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(share_tree(v, share, count) for v in value)
    return value


def fetch_tree(value: Any, refs: list[TensorRef]) -> Any:
    """The inverse of :func:`share_tree`: every handle replaced by a copy of the
    owner's tensor (pulled from it now); ``refs`` collects the handles read."""
    if isinstance(value, TensorRef):
        refs.append(value)
        return value.get()
    if isinstance(value, dict):
        return {k: fetch_tree(v, refs) for k, v in value.items()}
    if isinstance(value, list):
        return [fetch_tree(v, refs) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(fetch_tree(v, refs) for v in value)
    return value


@dataclass
class StateOffer:
    """A live replica's training state at a step boundary, as handles on its tensors.

    ``model``: the module's state dict with tensors as handles; ``optimizer``: likewise;
    ``small``: the pickled step, RNG, data and extra state (a few KB).
    """

    source: int  #: the rank that offers it
    step: int
    model: dict[str, Any] | None
    optimizer: Any
    small: bytes
    nbytes: int  #: bytes of tensors offered
    made: float = field(default_factory=time.time)
    #: The DDP model's gradient buckets (``replicas.ddp_layout.bucket_layout``), None if not DDP.
    layout: list[list[int]] | None = None

    def refs(self) -> list[TensorRef]:
        """Every tensor handle in the offer."""
        found: list[TensorRef] = []
        fetch_walk(self.model, found)
        fetch_walk(self.optimizer, found)
        return found


def fetch_walk(value: Any, found: list[TensorRef]) -> None:
    """Collect the handles in ``value`` without reading them."""
    if isinstance(value, TensorRef):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            fetch_walk(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            fetch_walk(v, found)


def load_model(model: Any, offered: dict[str, Any]) -> None:
    """Read the offered state dict into ``model``: straight into its own tensors where
    names and sizes match (one copy; a DTensor's local part: the replica holds the same
    shard), through ``load_state_dict`` otherwise."""
    own = model.state_dict()
    rest: dict[str, Any] = {}
    for name, ref in offered.items():
        dst = local_tensor(own.get(name))
        if (
            isinstance(ref, TensorRef)
            and dst is not None
            and dst.is_contiguous()
            and dst.numel() * dst.element_size() == ref.nbytes
            and tuple(dst.shape) == tuple(ref.shape)
        ):
            ref.read_into(dst)
        else:
            rest[name] = ref.get() if isinstance(ref, TensorRef) else ref
    missing = set(own) - set(offered)
    if missing:
        raise KeyError(
            f"the replica's model has no {sorted(missing)[:3]}: the models differ; build "
            "the same model on every rank"
        )
    if rest:
        model.load_state_dict({**own, **rest})


def load_optimizer(optimizer: Any, offered: Any) -> None:
    """Load the offered optimizer state (pulled from the replica now) into ``optimizer``;
    the moments of sharded (DTensor) parameters become DTensors like them."""
    state = fetch_tree(offered, [])
    if isinstance(state, dict):
        state = optimizer_state_like_params(optimizer, state)
    optimizer.load_state_dict(state)


def pickled(value: Any, what: str) -> bytes:
    """``pickle.dumps(value)`` with an error that names the part that does not pickle."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"TrainingState: {what} cannot be pickled ({type(exc).__name__}: {exc}); "
            "keep only picklable objects in it"
        ) from None
