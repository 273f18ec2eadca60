"""Random number generators on the ranks, as remote functions on the active mesh
(Monarch's ``monarch.builtins.random``). On CPU ranks the ``cuda`` ones act on the CPU
generator (``cuda`` read as ``cpu``) unless the rank has CUDA."""

from __future__ import annotations

import torch

from monarch_kernel.tensor_engine.remote_functions import remote

#: Bytes of torch's CPU generator state.
_CPU_STATE = 5056


def _cuda() -> bool:
    return torch.cuda.is_available()


@remote(propagate="inspect")
def set_manual_seed_remote(seed: int, process_idx: int = 0) -> None:
    """``torch.manual_seed(seed ^ process_idx)`` on each rank (the same seed everywhere
    unless ``process_idx`` differs)."""
    torch.manual_seed(seed ^ process_idx)


@remote(propagate=lambda: torch.empty(_CPU_STATE, dtype=torch.uint8))
def get_rng_state_remote() -> torch.Tensor:
    """Each rank's CPU generator state (a mesh tensor)."""
    return torch.get_rng_state()


@remote(propagate="inspect")
def set_rng_state_remote(new_state: torch.Tensor) -> None:
    """Set each rank's CPU generator state."""
    torch.set_rng_state(new_state)


@remote(propagate=lambda: None)
def seed_remote() -> None:
    """``torch.seed()`` on each rank: a non-deterministic seed of its own."""
    torch.seed()


@remote(propagate=lambda: None)
def random_seed_remote() -> None:
    """``torch.random.seed()`` on each rank (as :func:`seed_remote`)."""
    torch.random.seed()


@remote(propagate="inspect")
def manual_seed_cuda_remote(seed: int) -> None:
    """Seed each rank's current GPU generator (the CPU one on a rank without CUDA)."""
    if _cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@remote(propagate="inspect")
def manual_seed_all_cuda_remote(seed: int) -> None:
    """Seed every GPU generator of each rank (the CPU one on a rank without CUDA)."""
    if _cuda():
        torch.cuda.manual_seed_all(seed)
    else:
        torch.manual_seed(seed)


@remote(propagate=lambda: [torch.empty(_CPU_STATE, dtype=torch.uint8)])
def get_rng_state_all_cuda_remote() -> list[torch.Tensor]:
    """Each rank's GPU generator states (its CPU one on a rank without CUDA)."""
    if _cuda():
        return list(torch.cuda.get_rng_state_all())
    return [torch.get_rng_state()]


@remote(propagate="inspect")
def set_rng_state_all_cuda_remote(states: list[torch.Tensor]) -> None:
    """Set each rank's GPU generator states (its CPU one on a rank without CUDA)."""
    if _cuda():
        torch.cuda.set_rng_state_all(states)
    else:
        torch.set_rng_state(states[0])


__all__ = [
    "get_rng_state_all_cuda_remote",
    "get_rng_state_remote",
    "manual_seed_all_cuda_remote",
    "manual_seed_cuda_remote",
    "random_seed_remote",
    "seed_remote",
    "set_manual_seed_remote",
    "set_rng_state_all_cuda_remote",
    "set_rng_state_remote",
]
