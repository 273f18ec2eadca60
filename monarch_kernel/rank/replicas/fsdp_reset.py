"""Putting FSDP2 modules back to a clean state after a step that did not complete.

A step cut short (a peer died, the process group was aborted, the stop button) leaves
FSDP2's per-iteration state where it stopped: some parameter groups unsharded (their
all-gather done), a forward root claimed, reduce-scatter states queued. The next
forward then skips the all-gathers it thinks are done while a peer whose step stopped
elsewhere (or a restarted rank, which starts clean) runs them: the ranks' collectives
no longer pair up and the next step hangs or mixes tensors. :func:`reset_fsdp` drops
that state on every root FSDP module of a model (torch's ``reset_iter_state`` where it
has one), so that every rank redoes the step from the same, sharded, state. Gradients of
the failed step are discarded (the step is redone).
"""

from __future__ import annotations

import sys
from typing import Any


def fsdp_roots(model: Any) -> list[Any]:
    """The root FSDP2 modules in ``model`` (the ones whose forward ran as a root)."""
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    cls = getattr(module, "FSDPModule", None) if module is not None else None
    if cls is None or not callable(getattr(model, "modules", None)):
        return []
    roots = []
    for sub in model.modules():
        if isinstance(sub, cls):
            state = sub._get_fsdp_state()
            if getattr(state, "_is_root", None):
                roots.append(sub)
    return roots


def param_groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDP2 state: ``_fsdp_param_groups`` where torch has
    several per state (2.12 on), else its one ``_fsdp_param_group`` (2.11: seen on the
    GPU machine, where the plural raised AttributeError), which may be None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]


def reset_fsdp(model: Any) -> int:
    """Reset the per-iteration state of every root FSDP2 module of ``model`` (see the
    module); how many were reset."""
    roots = fsdp_roots(model)
    for root in roots:
        state = root._get_fsdp_state()
        groups = [g for s in state._state_ctx.all_states for g in param_groups(s)]
        for group in groups:
            # Its all-gather was aborted with the process group: nothing to wait for
            # (waiting would raise the abort again).
            group._all_gather_result = None
        reset = getattr(root, "reset_iter_state", None)
        if callable(reset):
            reset()
        else:
            _reset_by_hand(state, groups)
    return len(roots)


def _reset_by_hand(state: Any, groups: list[Any]) -> None:
    """What ``reset_iter_state`` does, for a torch without it (the GPU machine's)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    comm = state._comm_ctx
    if hasattr(comm, "all_gather_state"):
        comm.all_gather_state = None
    getattr(comm, "reduce_scatter_states", []).clear()
    getattr(comm, "post_forward_order", []).clear()
    last = getattr(comm, "_last_post_reduce_events", None)
    if isinstance(last, dict):
        last.clear()
    for sub in state._state_ctx.all_states:
        sub._modules_to_run_forward.clear()
        sub._training_state = TrainingState.IDLE
    for group in groups:
        for name in ("_post_reduce_event", "_all_reduce_state", "_partial_reduce_output"):
            if hasattr(group, name):
                setattr(group, name, None)
        if hasattr(group, "_reshard_after_forward_event"):
            group._reshard_after_forward_event = None
        group._post_forward_indices.clear()
        group._training_state = TrainingState.IDLE
        group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False
