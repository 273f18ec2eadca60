"""Opaque objects (Monarch's ``OpaqueRef``, ``OpaqueObject``, ``opaque_method`` and
``OpaqueModule``): Python objects that live on the ranks, named from the notebook.

An :class:`OpaqueRef` holds a *key*: a 0-d ``int64`` tensor. On a rank the key is a
local tensor and the object sits in a table weakly keyed by it; on the controller the
key is a mesh tensor (an ``OpaqueRef`` is a pytree node, so a remote function's
propagator that returns one makes its key a mesh tensor, and passing one to a remote
function passes its key's ref). The object lives as long as the key's mesh tensor:
when the notebook lets go of the ``OpaqueRef``, the key's ref is dropped on the ranks
before the next op runs and the object goes with it.

:class:`OpaqueObject` builds an object on every rank (``Foo("pkg.mod.Class", *args)``)
and calls its methods as remote functions (``@opaque_method``: the decorated body is
the propagator, run here on fakes). :class:`OpaqueModule` wraps an ``nn.Module`` built
on the ranks: its parameters as mesh tensors, its forward with a given propagator, and
gradients through it for the controller's autograd (the ranks keep the forward's graph
until the backward).

The functions named by path below (``_construct_object`` ...) run on the ranks.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import register_pytree_node, tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from monarch_kernel.tensor_engine.remote_functions import Remote, call_on_shard_and_fetch, remote
from monarch_kernel.tensor_engine.tensor import Tensor
from monarch_kernel.wire.tensor_ops import RemoteFunction, TensorPattern, shard_lookup

#: key tensor -> the object it names (in this process: a rank's objects; on the
#: controller, those made by propagators on fakes)
_key_table: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_key_counter: Iterator[int] = itertools.count(1)


def _propagating() -> bool:
    """Whether torch runs on fake tensors now (a propagator on the controller)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def _on_rank() -> bool:
    """Whether this process runs the tensor engine's ops (a rank, in a remote function:
    its tensor worker installed the lookup of local tensors)."""
    return bool(shard_lookup)


class OpaqueRef:
    """A reference to an object that only the ranks hold (Monarch's ``OpaqueRef``).

    Made in a remote function (``OpaqueRef(model)`` on the rank) or by its propagator
    (``propagate=lambda: OpaqueRef(None)`` here), and passed to other remote functions,
    which read the rank's object as ``ref.value``. The controller cannot read or set
    it: ``RuntimeError``."""

    _key: Any

    def __init__(self, value: Any = None) -> None:
        if not (_on_rank() or _propagating()):
            raise RuntimeError(
                "Client is attempting to create an OpaqueRef. This can only be done in a "
                "remote function (on the ranks) or its propagator"
            )
        self._key = torch.tensor(next(_key_counter), dtype=torch.int64)
        _key_table[self._key] = value

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # every subclass is a pytree node too (its key is a tensor to find)
        super().__init_subclass__(**kwargs)
        register_pytree_node(cls, _flatten, _unflatten)

    @classmethod
    def _create(cls, key: Any) -> OpaqueRef:
        ref = cls.__new__(cls)
        ref._key = key
        return ref

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # a subclass travels as a plain OpaqueRef (the ranks need not know it)
        return OpaqueRef._create, (self._key,)

    def __repr__(self) -> str:
        return f"OpaqueRef({self._key!r})"

    @property
    def value(self) -> Any:
        """The object on this rank (in a remote function)."""
        self._check("access")
        return _key_table[self._key]

    @value.setter
    def value(self, v: Any) -> None:
        self._check("set")
        _key_table[self._key] = v

    def _check(self, what: str) -> None:
        if isinstance(self._key, Tensor):  # a mesh tensor: this is the controller
            raise RuntimeError(
                f"Client is attempting to {what} an OpaqueRef. This can only be done in a "
                "remote function (on the ranks)"
            )


def _flatten(ref: OpaqueRef) -> tuple[list[Any], Any]:
    return [ref._key], type(ref)


def _unflatten(children: Any, cls: Any) -> OpaqueRef:
    return cls._create(list(children)[0])  # type: ignore[no-any-return]


register_pytree_node(OpaqueRef, _flatten, _unflatten)


# -- objects on the ranks ---------------------------------------------------------------


def resolve_callable(constructor: RemoteFunction) -> Callable[..., Any]:
    """(On a rank.) The function or class ``constructor`` names (see
    :func:`callable_wire`): an :class:`OpaqueObject`'s constructor, an autograd
    function's class."""
    if constructor.path is not None:
        module, _, attr = constructor.path.rpartition(".")
        found: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        return found
    import cloudpickle

    assert constructor.pickled is not None
    made: Callable[..., Any] = cloudpickle.loads(constructor.pickled)
    return made


def _fresh_opaque_ref(*args: Any, **kwargs: Any) -> OpaqueRef:
    """(A propagator.) A new ref, as a remote function that makes one returns."""
    return OpaqueRef(None)


@remote(propagate=_fresh_opaque_ref)
def _construct_object(constructor: RemoteFunction, *args: Any, **kwargs: Any) -> OpaqueRef:
    return OpaqueRef(resolve_callable(constructor)(*args, **kwargs))


def _invoke_method(obj: OpaqueRef, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """(On a rank.) ``obj.value.method_name(*args, **kwargs)``."""
    return getattr(obj.value, method_name)(*args, **kwargs)


_INVOKE = f"{__name__}._invoke_method"


def callable_wire(constructor: Any) -> RemoteFunction:
    """How a function or class for the ranks travels (an :class:`OpaqueObject`'s
    constructor): an import path as given, by path when the ranks can import it, else
    by value (defined in a notebook)."""
    if isinstance(constructor, str):
        if "." not in constructor:
            raise ValueError(
                f"expected a function or class, or its import path ('pkg.module.Class'), "
                f"got {constructor!r}"
            )
        return RemoteFunction(path=constructor)
    if not callable(constructor):
        raise TypeError(f"expected a function, a class or an import path, got {constructor!r}")
    module = getattr(constructor, "__module__", None)
    name = getattr(constructor, "__qualname__", "")
    if module and module != "__main__" and "<" not in name and "." not in name:
        return RemoteFunction(path=f"{module}.{name}")
    return Remote(constructor)._function()


def opaque_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare a method of the rank's object on an :class:`OpaqueObject` subclass: the
    decorated body is its propagator (run here on fakes, ``self`` an ``OpaqueRef``);
    calling it calls the rank's object's method of the same name, on every rank."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: OpaqueObject, *args: Any, **kwargs: Any) -> Any:
        return self.call_method(name, fn, *args, **kwargs)

    return call


class OpaqueObject(OpaqueRef):
    """An object built on every rank (Monarch's ``OpaqueObject``)::

        class Counter(OpaqueObject):
            @opaque_method
            def add(self, x):  # what it returns, on fakes
                return x + x

        c = Counter("pkg.mod.WorkerCounter", 4.0)   # or an OpaqueRef of one
        y = c.add(torch.ones(3))                     # a mesh tensor

    ``constructor``: a class or function (or its import path) the ranks call with the
    arguments (mesh tensors read as each rank's local tensors), or an ``OpaqueRef``
    to wrap."""

    def __init__(self, constructor: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(constructor, OpaqueRef):
            self._key = constructor._key
        else:
            made = _construct_object(callable_wire(constructor), *args, **kwargs)
            self._key = made._key

    def call_method(
        self, method_name: str, propagation: Callable[..., Any] | str, *args: Any, **kwargs: Any
    ) -> Any:
        """Call ``method_name`` of the rank's object on every rank; ``propagation``
        says what it returns (a function of ``(self, *args, **kwargs)`` run on fakes,
        or ``"inspect"``: nothing)."""
        if callable(propagation):
            shapes = propagation

            def propagate(obj: Any, _name: str, *a: Any, **k: Any) -> Any:
                return shapes(obj, *a, **k)

            return remote(_INVOKE, propagate=propagate)(self, method_name, *args, **kwargs)
        return remote(_INVOKE, propagate=propagation)(self, method_name, *args, **kwargs)

    def call_method_on_shard_and_fetch(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on one rank (``shard=`` coordinates; none: the first)
        and return a future of its value."""
        return call_on_shard_and_fetch(remote(_INVOKE), self, method_name, *args, **kwargs)


# -- modules on the ranks ------------------------------------------------------------------


@dataclass(frozen=True)
class _Like:
    """A tensor's shape and dtype (the gradient a rank sends for an input)."""

    size: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> _Like:
        return _Like(tuple(t.shape), t.dtype)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.size, dtype=self.dtype)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=self.dtype)


def _parameter_patterns(module: OpaqueRef) -> list[TensorPattern]:
    """(On a rank.) The shapes of the module's parameters."""
    return [
        TensorPattern(tuple(p.shape), tuple(p.stride()), str(p.dtype).removeprefix("torch."))
        for p in module.value.parameters()
    ]


def _parameters(module: OpaqueRef) -> list[torch.Tensor]:
    """(On a rank.) The module's parameters, detached: ops on them here record no
    graph (the controller runs autograd); they share the parameters' storage."""
    return [p.detach() for p in module.value.parameters()]


def _forward(requires_grad: list[bool], module: OpaqueRef, args: Any, kwargs: Any) -> Any:
    """(On a rank.) The module's forward, recording its graph: returns a ref of the
    backward closure (kept here until the controller's backward) and the outputs,
    detached. ``requires_grad``: per input tensor (``args``, ``kwargs``, then the
    parameters), whether the controller wants its gradient."""
    parameters = list(module.value.parameters())
    flat, spec = tree_flatten((args, kwargs, parameters))
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    inputs = [flat[i] for i in tensors]
    n_given = len(inputs) - len(parameters)
    for j in range(n_given):  # the inputs are local tensors without a graph: leaves here
        if requires_grad[j]:
            inputs[j] = inputs[j].detach().requires_grad_(True)
    for j, i in enumerate(tensors):
        flat[i] = inputs[j]
    likes = [_Like.of(t) for t in inputs]
    edges = [
        torch.autograd.graph.get_gradient_edge(t)
        for t, wanted in zip(inputs, requires_grad)
        if wanted
    ]
    args, kwargs, _ = tree_unflatten(flat, spec)
    with torch.enable_grad():
        result = module.value(*args, **kwargs)
    out_flat, out_spec = tree_flatten(result)
    outputs = [x for x in out_flat if isinstance(x, torch.Tensor)]
    # the controller sends a gradient per tensor output; those with a graph here count
    with_grad = [k for k, x in enumerate(outputs) if x.requires_grad]
    out_edges = [torch.autograd.graph.get_gradient_edge(outputs[k]) for k in with_grad]

    def backward(grad_outputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        # holds the graph's edges only, not the inputs and outputs themselves
        found: tuple[torch.Tensor | None, ...] = (None,) * len(edges)
        if out_edges and edges:
            with torch.no_grad():
                found = torch.autograd.grad(
                    outputs=out_edges,
                    inputs=edges,
                    grad_outputs=[grad_outputs[k] for k in with_grad],
                    allow_unused=True,
                )
        grads = iter(found)
        out: list[torch.Tensor | None] = []
        for like, wanted in zip(likes, requires_grad):
            g = next(grads) if wanted else None
            if wanted and g is None:  # unused: the controller expects a tensor
                g = like.zeros()
            out.append(g)
        return out

    detached = [
        x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in out_flat
    ]
    return OpaqueRef(backward), tree_unflatten(detached, out_spec)


def _backward(closure: OpaqueRef, grad_outputs: list[torch.Tensor]) -> Any:
    """(On a rank.) The gradients of the forward's inputs (see :func:`_forward`)."""
    return closure.value(grad_outputs)


class OpaqueModule:
    """An ``nn.Module`` built on every rank (Monarch's ``OpaqueModule``)::

        linear = OpaqueModule("torch.nn.Linear", 3, 3)
        y = linear(x, propagator=lambda self, x: x.clone())   # differentiable
        y.sum().backward()                                    # grads of x and parameters

    ``parameters()`` are its parameters as mesh tensors (sharing the ranks' storage:
    writing them changes the module); ``module(*args, propagator=...)`` runs its
    forward (``propagator(self, *args, **kwargs)``: what it returns, on fakes), and
    gradients flow through it to the inputs and parameters that require them, the
    ranks keeping the forward's graph until the backward. ``call_method(name,
    propagation, *args)`` calls any method of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._object = OpaqueObject(*args, **kwargs)
        self._parameters: list[torch.Tensor] | None = None

    def parameters(self) -> list[torch.Tensor]:
        """The module's parameters (mesh tensors that require grad; asked once)."""
        if self._parameters is None:
            patterns = call_on_shard_and_fetch(
                remote(f"{__name__}._parameter_patterns"), self._object
            ).result()

            def shapes(_module: Any) -> list[torch.Tensor]:
                return [
                    torch.empty_strided(p.size, p.stride, dtype=getattr(torch, p.dtype))
                    for p in patterns
                ]

            got = remote(f"{__name__}._parameters", propagate=shapes)(self._object)
            self._parameters = [p.requires_grad_(True) for p in got]
        return self._parameters

    def call_method(self, method_name: str, propagation: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` of the module on every rank (no gradients through it)."""
        return self._object.call_method(method_name, propagation, *args, **kwargs)

    def __call__(self, *args: Any, propagator: Callable[..., Any], **kwargs: Any) -> Any:
        """The module's forward on every rank; ``propagator(self, *args, **kwargs)``
        says what it returns (on fakes). Differentiable when an input or a parameter
        requires grad."""
        parameters = self.parameters()
        flat, spec = tree_flatten((args, kwargs, parameters))
        tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        inputs = [flat[i] for i in tensors]
        requires_grad = [bool(t.requires_grad) for t in inputs]
        if not any(requires_grad):
            return self._object.call_method("__call__", propagator, *args, **kwargs)
        likes = [_Like.of(t) for t in inputs]
        obj = self._object
        state: dict[str, Any] = {}

        class _Through(torch.autograd.Function):
            """The rank's forward and backward, as one node of the controller's graph."""

            @staticmethod
            def forward(ctx: Any, *given: Any) -> Any:
                for j, i in enumerate(tensors):
                    flat[i] = given[j]
                fargs, fkwargs, _ = tree_unflatten(flat, spec)

                def shapes(_rg: Any, module: Any, a: Any, k: Any) -> Any:
                    return _fresh_opaque_ref(), propagator(module, *a, **k)

                closure, result = remote(f"{__name__}._forward", propagate=shapes)(
                    requires_grad, obj, fargs, fkwargs
                )
                state["closure"] = closure
                outs, state["spec"] = tree_flatten(result)
                state["tensors"] = [isinstance(o, torch.Tensor) for o in outs]
                return tuple(outs)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                def shapes(_closure: Any, _grads: Any) -> Any:
                    return [like.empty() if rg else None for like, rg in zip(likes, requires_grad)]

                # the ranks' graph goes after this backward (the ref is dropped)
                closure = state.pop("closure", None)
                if closure is None:
                    raise RuntimeError(
                        "the gradients through an OpaqueModule call are taken once: its "
                        "ranks freed the forward's graph after the first backward"
                    )
                back = remote(f"{__name__}._backward", propagate=shapes)
                # one gradient per tensor output (autograd gives None for the others)
                given = [g for g, is_tensor in zip(grads, state["tensors"]) if is_tensor]
                return tuple(back(closure, given))

        outs = _Through.apply(*inputs)
        return tree_unflatten(list(outs), state["spec"])


__all__ = ["OpaqueModule", "OpaqueObject", "OpaqueRef", "opaque_method"]
