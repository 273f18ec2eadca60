"""``grad_generator`` and ``grad_function`` (Monarch's ``monarch.gradient_generator``).

Autograd runs on the controller over mesh tensors; each backward op goes to the ranks
of its inputs' mesh, on their stream (the forward op's), whatever mesh or stream is
active while the gradients are taken.

``grad_generator`` runs the backward pass incrementally, as Monarch's does: torch's
autograd engine runs on a thread of the generator's own (the *backward thread*), and a
hook on each of ``with_respect_to`` pauses it once the gradient the caller asked for is
known. The caller's thread and the backward thread hand control back and forth through
a :class:`_Baton`, strictly: one of them issues ops at a time (the activation stacks,
the client's buffer and the fake mode are used by one thread at a time), so the ranks
run the ops the caller issues between two ``next()`` after the backward ops the first
``next()`` needed and before those the second one needs. The last gradient comes once
the backward pass ended (nothing of it is left to run then), so an exhausted
generator holds no thread. A gradient that later backward ops read (that of a non-leaf
tensor) is the tensor they read: what the caller writes in it, they see.

A generator dropped half-way (or closed: ``close()``) stops its backward thread: paused in a
hook, it raises :class:`~.state.Cancelled` there; running (the stop button pressed
during ``next()``), its next op or gradient raises it, and that ``next()`` waits for it
before raising ``KeyboardInterrupt``. What it did not issue is never issued, and
nothing of the backward pass is kept past the thread's end.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.utils._python_dispatch import _disable_current_modes

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.client import held_sigint, user_frames
from monarch_kernel.tensor_engine.tensor import ActiveMesh, inputs_stream

#: Seconds the notebook's thread waits for the backward thread at a time: a SIGINT does
#: not wake a blocked lock wait in every process (a pytest-xdist worker's main thread
#: was seen to take it only when the wait ended), so the wait is sliced.
_SLICE = 0.05

#: Names the backward threads (``grad_generator-<n>``).
_thread_numbers = itertools.count(1)

#: The backward threads running, and their batons (stopped at exit: a thread left
#: inside torch's engine when the interpreter ends aborts the process).
_running: dict[threading.Thread, _Baton] = {}


class _Turn(enum.Enum):
    """Which thread may issue ops now."""

    CALLER = "caller"
    BACKWARD = "backward"


class _Baton:
    """What the caller's thread and the backward thread share: whose turn it is, the
    gradients computed and not handed out yet, and how the backward pass ended. Holds
    nothing of the caller's generator (a dropped generator is collected, and stops the
    thread)."""

    def __init__(self, pending: set[int]) -> None:
        self.cond = threading.Condition()
        #: the indices whose gradient the backward pass has not computed yet (those
        #: known to be None left out): once none is left, it runs to its end
        self.pending = pending
        self.turn = _Turn.CALLER
        #: the index of ``with_respect_to`` the caller waits for
        self.wanted = -1
        #: index -> its gradient, computed and not handed out yet
        self.grads: dict[int, Any] = {}
        #: the backward pass ended (its thread is ending)
        self.done = False
        #: what the backward pass raised, for the caller's ``next()``
        self.error: BaseException | None = None
        #: set to stop the backward pass (a dropped generator, the stop button)
        self.cancel = threading.Event()
        #: where the caller asked for the gradients (see ``state.ThisThread.frames``)
        self.frames: tuple[Any, ...] = ()

    # -- the backward thread's side (called holding nothing) -----------------------------
    def computed(self, indices: list[int], grad: Any) -> None:
        """A hook: the gradient of ``with_respect_to[i]`` for each of ``indices``. When
        it is the one the caller waits for, hand control back until the next ``next()``
        that needs more of the backward pass."""
        with self.cond:
            if self.cancel.is_set():
                raise state.Cancelled("grad_generator dropped")
            for i in indices:
                self.grads[i] = grad
                self.pending.discard(i)
            if self.wanted not in self.grads or not self.pending:
                return  # not the one asked for; or the last: the caller waits for the end
            self.turn = _Turn.CALLER
            self.cond.notify_all()
            while self.turn is _Turn.CALLER and not self.cancel.is_set():
                self.cond.wait()
            if self.cancel.is_set():
                raise state.Cancelled("grad_generator dropped")
            state.this_thread.frames = self.frames

    def finished(self, grads: Sequence[Any], error: BaseException | None) -> None:
        """The backward pass ended: what it computed (those not handed out yet are
        kept), or the error it raised."""
        with self.cond:
            for i, g in enumerate(grads):
                if i >= self.wanted:
                    self.grads.setdefault(i, g)
            if not self.cancel.is_set():
                self.error = error
            self.done = True
            self.turn = _Turn.CALLER
            self.cond.notify_all()

    # -- the caller's side ---------------------------------------------------------------
    def wait_for_turn(self) -> None:
        """Holding ``cond``: wait while the backward thread issues ops (in short slices:
        where a blocked wait is not woken by a signal, the stop button's
        KeyboardInterrupt still lands within one)."""
        while self.turn is _Turn.BACKWARD:
            self.cond.wait(_SLICE)

    def interrupted(self) -> None:
        """Holding ``cond``, the stop button pressed during ``next()``: stop the backward
        pass and wait for its thread to stop issuing ops (at its next op or gradient; a
        second press stops waiting)."""
        self.cancel.set()
        self.cond.notify_all()  # (it may be pausing in a hook just now)
        while not self.done:
            self.cond.wait(_SLICE)

    def stop(self) -> None:
        """Stop the backward pass (a dropped generator): its thread raises ``Cancelled``
        where it is paused, or at its next op."""
        self.cancel.set()
        with self.cond:
            self.cond.notify_all()


class _Generator:
    """The iterator :func:`grad_generator` returns: the gradient of the roots with
    respect to each of ``with_respect_to``, in order (None for one the roots do not
    depend on). Each ``next()`` runs the backward pass as far as that gradient needs
    (on the backward thread; see the module docstring) and returns it."""

    def __init__(
        self,
        roots: list[Any],
        with_respect_to: list[Any],
        grad_roots: list[Any],
    ):
        self._count = len(with_respect_to)
        self._position = 0
        #: indices whose gradient is None for sure (not reachable from the roots)
        self._unused = _unreachable(roots, with_respect_to)
        self._baton = _Baton(set(range(self._count)) - self._unused)
        self._thread: threading.Thread | None = None
        self._args: tuple[list[Any], list[Any], list[Any]] | None = (
            roots,
            with_respect_to,
            grad_roots,
        )

    def __iter__(self) -> _Generator:
        return self

    def __next__(self) -> Any:
        try:
            return self._next()
        except KeyboardInterrupt:
            # Invariant: a next() the stop button ended leaves no backward pass issuing
            # ops, wherever in it the KeyboardInterrupt landed.
            self._position = self._count
            with self._baton.cond:
                if not self._baton.done:
                    self._baton.interrupted()
            raise

    def _next(self) -> Any:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("next() on a grad_generator inside its own backward pass")
        i = self._position
        if i >= self._count:
            self._finish()
            raise StopIteration
        self._position = i + 1
        if i in self._unused:
            return None
        baton = self._baton
        with baton.cond:
            if i not in baton.grads and not baton.done:
                baton.wanted = i
                baton.frames = user_frames()
                baton.turn = _Turn.BACKWARD
                try:
                    if self._thread is None:
                        with held_sigint():  # started whole: then it is waited for
                            self._start()
                    else:
                        baton.cond.notify_all()
                    baton.wait_for_turn()
                except KeyboardInterrupt:
                    self._position = self._count  # stopped: ends here
                    baton.interrupted()
                    raise
            error, baton.error = baton.error, None
            grad = baton.grads.pop(i, None)
            done = baton.done
        if done:
            self._join()
        if error is not None:
            self._position = self._count
            raise error
        return grad

    def _join(self) -> None:
        """The backward pass ended: its thread is ending (nothing left to do)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        assert self._args is not None
        args, self._args = self._args, None
        self._thread = threading.Thread(
            target=_backward,
            args=(self._baton, *args),
            name=f"grad_generator-{next(_thread_numbers)}",
            daemon=True,
        )
        _running[self._thread] = self._baton
        self._thread.start()

    def _finish(self) -> None:
        """Every gradient was handed out: let the backward pass end (what is left of it
        issues its ops now)."""
        baton, thread = self._baton, self._thread
        if thread is None:
            return
        with baton.cond:
            if not baton.done:
                baton.wanted = self._count
                baton.frames = user_frames()
                baton.turn = _Turn.BACKWARD
                baton.cond.notify_all()
                try:
                    baton.wait_for_turn()
                except KeyboardInterrupt:
                    baton.interrupted()
                    raise
            error, baton.error = baton.error, None
        self._join()
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the backward pass now (what it did not issue is never issued) and wait
        for its thread to end."""
        self._args = None
        thread = self._thread
        if thread is not None:
            self._baton.stop()
            thread.join()
            self._thread = None
        self._position = self._count

    def __del__(self) -> None:
        # Not waiting here (a finalizer may run anywhere): the thread stops by itself.
        # It issues no op once told to stop.
        baton = getattr(self, "_baton", None)
        if baton is not None and getattr(self, "_thread", None) is not None:
            baton.stop()


def _backward(baton: _Baton, roots: list[Any], wrt: list[Any], grad_roots: list[Any]) -> None:
    """The backward thread: torch's autograd engine over the roots, paused by hooks."""
    here = state.this_thread
    here.cancel = baton.cancel
    here.frames = baton.frames
    removers: list[Callable[[], None]] = []
    grads: Sequence[Any] = ()
    error: BaseException | None = None
    try:
        removers = _hook(wrt, baton)
        given = list(grad_roots) + [None] * (len(roots) - len(grad_roots))
        # Ops without mesh-tensor inputs (a backward function's factories, autograd's
        # zeros) are made on the active mesh, as on the caller's thread: torch's mode
        # stack is per thread (and the engine runs every node under the one it had here).
        with inputs_stream(), ActiveMesh():
            grads = torch.autograd.grad(
                roots,
                wrt,
                grad_outputs=given if any(g is not None for g in given) else None,
                allow_unused=True,
            )
    except state.Cancelled:
        pass
    except BaseException as exc:  # the caller's next() raises it
        error = exc
    finally:
        for remove in removers:
            remove()
        del roots, wrt, grad_roots, removers
        _running.pop(threading.current_thread(), None)
        baton.finished(grads, error)


@atexit.register
def _stop_all() -> None:
    """At exit: stop the backward passes still running (generators kept half-way)."""
    for thread, baton in list(_running.items()):
        baton.stop()
        thread.join(timeout=10)


def _hook(wrt: list[Any], baton: _Baton) -> list[Callable[[], None]]:
    """Hooks that tell ``baton`` of each gradient of ``wrt`` as soon as the engine has it
    (whole: every contribution summed); what removes them. A tensor's hook is torch's
    tensor hook; a ``GradientEdge``'s a tensor pre-hook on its node for its input."""
    by_key: dict[Any, list[int]] = {}
    targets: dict[Any, Any] = {}
    for i, w in enumerate(wrt):
        if isinstance(w, GradientEdge):
            var = getattr(w.node, "variable", None)  # a leaf's AccumulateGrad
            key: Any = (
                ("tensor", id(var))
                if isinstance(var, torch.Tensor)
                else ("edge", id(w.node), w.output_nr)
            )
            target: Any = var if isinstance(var, torch.Tensor) else w
        elif isinstance(w, torch.Tensor) and w.requires_grad:
            key, target = ("tensor", id(w)), w
        else:
            continue  # autograd.grad says what is wrong with it
        by_key.setdefault(key, []).append(i)
        targets[key] = target
    removers: list[Callable[[], None]] = []
    for key, indices in by_key.items():
        hook = partial(_on_grad, baton, indices)
        target = targets[key]
        if isinstance(target, torch.Tensor):
            removers.append(target.register_hook(hook).remove)
        else:
            removers.append(_edge_hook(target, hook))
    return removers


def _on_grad(baton: _Baton, indices: list[int], grad: Any) -> None:
    baton.computed(indices, grad)


def _edge_hook(edge: GradientEdge, hook: Callable[[Any], None]) -> Callable[[], None]:
    """A hook on the gradient flowing into ``edge`` (a node of the graph and one of its
    inputs). Torch registers a tensor's hook on its node with the tensor's hook dict and
    output number; an edge has no tensor, so a stand-in with that output number carries
    the dict. What it returns empties the dict (the node, freed with the graph, keeps an
    empty one)."""
    with torch.enable_grad(), _disable_current_modes():
        stand_in = torch.zeros(edge.output_nr + 1, requires_grad=True).unbind()[edge.output_nr]
    hooks: dict[int, Callable[[torch.Tensor], torch.Tensor | None]] = {0: hook}
    stand_in._backward_hooks = hooks
    edge.node._register_hook_dict(stand_in)
    return hooks.clear


def _unreachable(roots: list[Any], wrt: list[Any]) -> frozenset[int]:
    """The indices of ``wrt`` no path of the graph leads to from ``roots``: their
    gradient is None without running anything."""
    nodes: set[Any] = set()
    leaves: set[int] = set()
    todo: list[Any] = []
    for r in roots:
        if isinstance(r, GradientEdge):
            todo.append(r.node)
        elif isinstance(r, torch.Tensor):
            if r.grad_fn is not None:
                todo.append(r.grad_fn)
            elif r.requires_grad:
                leaves.add(id(r))
    while todo:
        node = todo.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.add(id(var))
        todo.extend(n for n, _ in node.next_functions)
    unused = set()
    for i, w in enumerate(wrt):
        if isinstance(w, GradientEdge):
            reached = w.node in nodes
        elif not isinstance(w, torch.Tensor) or not w.requires_grad:
            reached = True  # autograd.grad says what is wrong with it
        elif w.grad_fn is not None:
            reached = w.grad_fn in nodes
        else:
            reached = id(w) in leaves
        if not reached:
            unused.add(i)
    return frozenset(unused)


def grad_generator(
    roots: torch.Tensor | Sequence[torch.Tensor | GradientEdge] = (),
    with_respect_to: Sequence[torch.Tensor | GradientEdge] = (),
    grad_roots: Sequence[torch.Tensor | None] = (),
) -> Iterator[Any]:
    """An iterator of the gradients of ``roots`` (a tensor or several; ``grad_roots``:
    their incoming gradients, ones by default) with respect to each of
    ``with_respect_to`` (tensors or ``GradientEdge``s), in that order, None for one the
    roots do not depend on. Each ``next()`` issues the backward ops that gradient needs
    and no more, so ops issued between two ``next()`` (a reduction of the last gradient)
    run on the ranks before the rest of the backward pass. Each backward op runs on its
    forward op's mesh and stream. An error of the backward pass raises at the ``next()``
    that ran it; a generator dropped (or closed: ``close()``) before its end stops there."""
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
