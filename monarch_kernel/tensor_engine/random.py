"""Monarch's ``monarch.random`` (``monarch_kernel.random``): the ranks' random number
generator state as mesh tensors.

``get_state()`` is each rank's state (a :class:`State` of mesh tensors), ``set_state``
puts one back, ``new_state(seed)`` makes the state a seed (a mesh tensor: one per rank)
gives, leaving the current one as it was; ``make_deterministic()`` asks torch for
deterministic algorithms on every rank. On CPU ranks the ``cuda`` half is the CPU
generator's state (``cuda`` read as ``cpu``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from monarch_kernel.tensor_engine.remote_functions import remote

#: Bytes of torch's CPU generator state.
_CPU_STATE = 5056


class State(NamedTuple):
    """A random number generator state per rank: the CPU generator's, the GPU's."""

    cpu: Any
    cuda: Any


def _state_shapes() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(_CPU_STATE, dtype=torch.uint8),
        torch.empty(_CPU_STATE, dtype=torch.uint8),
    )


@remote(propagate=_state_shapes)
def _get_state() -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.get_rng_state()
    return cpu, cpu.clone()


@remote(propagate=lambda state: None)
def set_state(state: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Make ``state`` (a :class:`State`) each rank's generator state."""
    cpu, _device = state
    torch.set_rng_state(cpu)


@remote(propagate=lambda seed: None)
def _manual_seed(seed: torch.Tensor) -> None:
    torch.manual_seed(int(seed.item()))


@remote(propagate=lambda: None)
def make_deterministic() -> None:
    """Deterministic algorithms on every rank (``torch.use_deterministic_algorithms``,
    cuDNN's deterministic and non-benchmark modes, cuBLAS's workspace setting)."""
    import os

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def get_state() -> State:
    """Each rank's generator state now, as mesh tensors on the active mesh."""
    return State(*_get_state())


def new_state(seed: Any) -> State:
    """The state ``torch.manual_seed(seed)`` gives on each rank (``seed``: a mesh tensor,
    one value per rank); the ranks' current state is left as it was."""
    orig = get_state()
    _manual_seed(seed)
    mine = get_state()
    set_state(orig)
    return mine


__all__ = ["State", "get_state", "make_deterministic", "new_state", "set_state"]
