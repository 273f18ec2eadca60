"""``remote_autograd_function`` (Monarch's ``monarch.cached_remote_function``): a
``torch.autograd.Function`` whose ``forward`` and ``backward`` run on the ranks, as one
node of the controller's autograd graph.

The controller's node calls two remote functions with cached propagation (each runs
once for real on the mesh's first rank per argument signature, to learn what it
returns): the rank's forward makes a plain ``FunctionCtx``, marks the inputs the
controller wants gradients of as requiring them, runs the class's ``forward`` without
recording a graph, and returns its outputs, the attributes it set on the context and
the tensors it saved; the controller saves those as mesh tensors, and its backward
sends them back with the incoming gradients to the class's ``backward`` on the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from monarch_kernel.tensor_engine.opaque import callable_wire, resolve_callable
from monarch_kernel.tensor_engine.remote_functions import Remote
from monarch_kernel.wire.tensor_ops import RemoteFunction

_FORWARD = Remote(f"{__name__}._forward_on_rank")
_BACKWARD = Remote(f"{__name__}._backward_on_rank")


@contextlib.contextmanager
def _requiring_grad(tensors: list[Any], indices: list[int]) -> Iterator[None]:
    """``tensors[i]`` (leaves) require grad for the block, for the ``i`` in
    ``indices`` (what the class's code may test, as on the controller)."""
    for i in indices:
        if not tensors[i].is_leaf:
            raise RuntimeError("an autograd function's input on a rank is not a leaf tensor")
        tensors[i].requires_grad_(True)
    try:
        yield
    finally:
        for i in indices:
            tensors[i].requires_grad_(False)


def _forward_on_rank(
    function: RemoteFunction, wanted: list[int], *args: Any
) -> tuple[Any, dict[str, Any], tuple[Any, ...], list[int]]:
    """(On a rank.) The class's forward: its outputs, the attributes it set on its
    context, the tensors it saved, and which of those required grad."""
    cls = resolve_callable(function)
    ctx = torch.autograd.function.FunctionCtx()
    before = set(vars(ctx))
    flat, _ = tree_flatten(args)
    with _requiring_grad(flat, wanted):
        with torch.no_grad():
            out = cls.forward(ctx, *args)  # type: ignore[attr-defined]
        saved = tuple(getattr(ctx, "to_save", ()) or ())
        saved_wanted = []
        for i, t in enumerate(saved):
            # a rank's tensors keep no autograd state: which required grad travels
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
                t.requires_grad_(False)
                saved_wanted.append(i)
    attrs = {k: v for k, v in vars(ctx).items() if k not in before and k != "to_save"}
    return out, attrs, saved, saved_wanted


def _backward_on_rank(
    function: RemoteFunction,
    attrs: dict[str, Any],
    saved: tuple[Any, ...],
    saved_wanted: list[int],
    *grads: Any,
) -> Any:
    """(On a rank.) The class's backward, its context made again from ``attrs`` and
    ``saved``."""
    cls = resolve_callable(function)
    ctx = torch.autograd.function.FunctionCtx()
    for k, v in attrs.items():
        setattr(ctx, k, v)
    saved_list = list(saved)
    with _requiring_grad(saved_list, saved_wanted), torch.no_grad():
        ctx.saved_tensors = tuple(saved_list)  # type: ignore[attr-defined]  # (as torch sets it)
        return cls.backward(ctx, *grads)  # type: ignore[attr-defined]


class RemoteAutogradFunction(torch.autograd.Function):
    """Base of the classes :func:`remote_autograd_function` makes."""

    #: how the wrapped class travels to the ranks
    _target: RemoteFunction

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        raise NotImplementedError("made by remote_autograd_function(cls)")

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError("made by remote_autograd_function(cls)")


def remote_autograd_function(
    target_class: type[torch.autograd.Function], name: str | None = None
) -> type[RemoteAutogradFunction]:
    """A ``torch.autograd.Function`` whose ``forward`` and ``backward`` are
    ``target_class``'s, run on the ranks of its mesh-tensor arguments
    (``remote_autograd_function(MyFunction).apply(x, y)``); ``name``: the new class's
    (``Remote_<name>`` by default). A class made by it is returned as it is."""
    if isinstance(target_class, type) and issubclass(target_class, RemoteAutogradFunction):
        return target_class
    if not (isinstance(target_class, type) and issubclass(target_class, torch.autograd.Function)):
        raise TypeError(
            f"remote_autograd_function() takes a torch.autograd.Function subclass, got "
            f"{target_class!r}"
        )
    target = callable_wire(target_class)

    def forward(ctx: Any, *args: Any) -> Any:
        flat, _ = tree_flatten(args)
        wanted = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        out, attrs, saved, saved_wanted = _FORWARD(target, wanted, *args)
        ctx.save_for_backward(*saved)
        ctx.remote_attrs = attrs
        ctx.saved_wanted = saved_wanted
        return out

    def backward(ctx: Any, *grads: Any) -> Any:
        return _BACKWARD(target, ctx.remote_attrs, ctx.saved_tensors, ctx.saved_wanted, *grads)

    return type(
        name or f"Remote_{target_class.__name__}",
        (RemoteAutogradFunction,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
            "_target": target,
            "__doc__": f"{target_class.__qualname__}, run on the ranks.",
        },
    )


__all__ = ["RemoteAutogradFunction", "remote_autograd_function"]
