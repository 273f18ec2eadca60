"""``endpoint.rref(...)`` (Monarch's): an actor endpoint called as an op of the tensor
engine, returning mesh tensors.

The call is one :class:`~monarch_kernel.wire.tensor_ops.CallOp` of a remote function
(``rank.tensors.actor_calls.call_endpoint``, by import path) on the ranks of the
endpoint's mesh-tensor arguments (else of the active mesh), which must be the actor
mesh's: each rank runs the actor's method on its local tensors, in order with the ops
issued before and after, and keeps what it returns as the op's outputs. Their shapes
come from the endpoint's ``propagate`` function, run here on fake tensors (Monarch has
no cached propagation for actors either). The batch is sent at once, so a plain call to
the actor issued after the ``rref`` reaches each rank after it. A rank whose actor is
busy when the op runs waits for it (the op takes its place in the actor's line, as
Monarch's mailbox does): the calls issued before the ``rref`` run first, those after it
later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils._pytree import tree_flatten

from monarch_kernel.calls.requester import Requester
from monarch_kernel.tensor_engine.remote_functions import Remote

#: The rank-side function (imported there by this path).
_RUNNER = "monarch_kernel.rank.tensors.actor_calls.call_endpoint"


def endpoint_rref(
    requester: Requester,
    ranks: Sequence[int],
    actor: str,
    method: str,
    where: str,
    sl: Any,
    propagate: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call ``method`` of actor ``actor`` (named ``where`` in errors) on ``ranks`` of
    ``requester``'s process mesh (``sl``: the slice called, for ``context()``) as an op;
    mesh tensors of what it returns, shaped by ``propagate`` (None for
    ``"inspect"``)."""
    if propagate is None or propagate == "cached":
        raise NotImplementedError(
            f"{where}.rref: cached propagation is not implemented for actor endpoints "
            "(nor in Monarch): say what it returns with @endpoint(propagate=lambda *args: "
            f"...) or as_endpoint(actors.{method}, propagate=...), or propagate='inspect' "
            "when it returns no tensors"
        )
    if propagate == "mocked":
        raise NotImplementedError(
            f"{where}.rref: mocked propagation is not implemented for actor endpoints "
            "(nor in Monarch): give a propagate function"
        )
    if propagate != "inspect" and not callable(propagate):
        raise ValueError(
            f"{where}: propagate must be a function of the endpoint's arguments or "
            f"'inspect', got {propagate!r}"
        )
    shapes: Any = propagate  # "inspect": no mesh tensors back
    if callable(propagate):
        endpoints_own = propagate

        def of_the_endpoint(_actor: str, _method: str, _sl: Any, a: Any, k: Any) -> Any:
            return endpoints_own(*a, **k)  # the endpoint's arguments only

        shapes = of_the_endpoint
    fn = Remote(_RUNNER, shapes)
    fn.__name__ = f"{where}.rref"
    mesh, _ = fn._mesh_of(tree_flatten((args, kwargs))[0])
    if mesh.requester is not requester or sorted(mesh.rank_tuple) != sorted(ranks):
        raise ValueError(
            f"{where}.rref runs on the ranks of its mesh tensors (else of the active "
            f"mesh), {mesh!r}, which must be those of the actor mesh (ranks {list(ranks)} "
            f"of mesh {requester.name!r}): slice the actor mesh, or activate its mesh"
        )
    out = fn(actor, method, sl, tuple(args), dict(kwargs))
    mesh.client.flush()  # sent now: a later plain call to the actor comes after it
    return out
