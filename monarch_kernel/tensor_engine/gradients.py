"""``grad_generator`` and ``grad_function`` (Monarch's ``monarch.gradient_generator``).

Autograd runs on the controller over mesh tensors; each backward op goes to the ranks
of its inputs' mesh, on their stream (the forward op's), whatever mesh or stream is
active while the gradients are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from monarch_kernel.tensor_engine.tensor import inputs_stream


class _Generator:
    """The iterator :func:`grad_generator` returns: the gradient of the roots with
    respect to each of ``with_respect_to``, in order (None for one the roots do not
    depend on). The backward pass runs at the first ``next()``; its ops stream to the
    ranks as it goes, and each gradient is handed out as soon as it is asked for."""

    def __init__(
        self,
        roots: list[Any],
        with_respect_to: list[Any],
        grad_roots: list[Any],
    ):
        self._roots = roots
        self._wrt = with_respect_to
        self._grad_roots = grad_roots
        self._grads: list[Any] | None = None
        self._next = 0

    def __iter__(self) -> _Generator:
        return self

    def __next__(self) -> Any:
        if self._grads is None:
            self._grads = self._run()
        if self._next >= len(self._grads):
            raise StopIteration
        g = self._grads[self._next]
        self._grads[self._next] = None  # handed out: held by the caller only
        self._next += 1
        return g

    def _run(self) -> list[Any]:
        if not self._wrt:
            return []
        given = list(self._grad_roots)
        given += [None] * (len(self._roots) - len(given))
        with inputs_stream():
            grads = torch.autograd.grad(
                self._roots,
                self._wrt,
                grad_outputs=given if any(g is not None for g in given) else None,
                allow_unused=True,
            )
        return list(grads)


def grad_generator(
    roots: torch.Tensor | Sequence[torch.Tensor | GradientEdge] = (),
    with_respect_to: Sequence[torch.Tensor | GradientEdge] = (),
    grad_roots: Sequence[torch.Tensor | None] = (),
) -> Iterator[Any]:
    """An iterator of the gradients of ``roots`` (a tensor or several; ``grad_roots``:
    their incoming gradients, ones by default) with respect to each of
    ``with_respect_to``, in that order. Each backward op runs on its forward op's mesh
    and stream."""
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    return _Generator(list(roots), list(with_respect_to), list(grad_roots))


class _GradFunction(torch.autograd.Function):
    """Runs ``fn`` forward; its returned continuation is the backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result, backward = fn(*args, **kwargs)
        ctx.backward_continuation = backward
        return result

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        out = ctx.backward_continuation(*grads)
        ctx.backward_continuation = None  # what it holds is freed after one backward
        if isinstance(out, tuple):
            return (None, *out)
        return None, out


def grad_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A differentiable function from ``fn(*args) -> (result, backward)``, where
    ``backward(*grads_of_result)`` returns the gradients of ``args`` (a tuple, or one).
    For moves autograd cannot see through, such as ``to_mesh``."""
    return partial(_GradFunction.apply, fn)
