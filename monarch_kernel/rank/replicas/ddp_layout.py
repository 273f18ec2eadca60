"""The gradient bucket layout of a DDP model, and giving a model another rank's layout.

A rank whose DDP object was built anew (restarted; its set-up cells run again) holds
its gradients in parameter order until its second step, while the other ranks' buckets
are in the order their gradients became ready; the all-reduce sums buckets element by
element, so they must agree (:func:`adopt_layout`). Used when a rank takes a replica's
state (``rank.training.state``, ``replicas``).
"""

from __future__ import annotations

from typing import Any


def bucket_layout(model: Any) -> list[list[int]] | None:
    """The gradient buckets of the DDP object ``model`` (None if it is not one), as
    lists of indices into its reducer's parameters, in bucket order."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model, DDP):
        return None
    parameters, _ = model._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(parameters)}
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in bucket.parameters()] for bucket in buckets]


def adopt_layout(model: Any, layout: list[list[int]] | None) -> bool:
    """Give the DDP object ``model`` a new reducer whose gradient buckets are laid out
    as ``layout`` (a replica's :func:`bucket_layout`), as unpickling a DDP object makes
    one. Returns whether it did.

    Why: a restarted rank builds its DDP object anew, whose buckets hold the gradients in
    parameter order until its second step, while the replicas' buckets are in the order
    their gradients became ready (rebuilt after their first step). The all-reduce sums
    bucket element by element, so the first step after the recovery would mix up
    gradients; with the replicas' layout it sums the same elements in the same order as
    an uninterrupted run (bit for bit). Every rank then rebuilds its buckets at the
    second step, as the re-formed group asked them to. A communication hook registered
    on it must be registered again (as after a pickle).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model, DDP) or not layout:
        return False
    import torch.distributed as dist

    parameters, expect_sparse = model._build_params_for_reducer()
    if sorted(i for bucket in layout for i in bucket) != list(range(len(parameters))):
        raise ValueError(
            "the replica's DDP model has other parameters than this rank's: build the "
            "same model on every rank"
        )
    names = model._build_debug_param_to_name_mapping(parameters)
    # _ddp_init_helper reverses what this returns (see torch's DistributedDataParallel)
    given = (list(reversed(layout)), [model.bucket_bytes_cap] * len(layout))
    original = dist._compute_bucket_assignment_by_size
    dist._compute_bucket_assignment_by_size = lambda *args, **kwargs: given
    try:
        model._ddp_init_helper(parameters, expect_sparse, names, model.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original
    if model.static_graph:
        model.reducer._set_static_graph()
        if model.logger is not None:
            model.logger._set_static_graph()
    return True
