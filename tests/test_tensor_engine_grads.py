# mypy: disable-error-code="attr-defined,union-attr"
# (torch.ones() and the rest return mesh tensors under activate(): a torch.Tensor
# subclass with Monarch's reduce, to_mesh, slice_mesh, stream; torch's stubs say Tensor)
"""``grad_generator`` runs the backward pass incrementally (Monarch's generator): each
``next()`` issues the backward ops its gradient needs, so the caller's ops between two
``next()`` run on the ranks between backward ops. On a real 2x2 mesh (``host`` x
``gpus``) shared by the module, its values checked against local autograd.
"""

from __future__ import annotations

import gc
import signal
import threading
import weakref

import pytest
import torch
from helpers import wait_until
from torch.autograd.graph import get_gradient_edge

from monarch_kernel import Stream, grad_function, grad_generator, inspect, remote
from monarch_kernel.mesh_controller import spawn_tensor_engine
from monarch_kernel.tensor_engine import state


@pytest.fixture(scope="module")
def pm():
    """A 2x2 mesh (``host`` x ``gpus``) shared by the module; checked for orphans after."""
    from conftest import local_mesh

    yield from local_mesh({"host": 2, "gpus": 2})


def _backward_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grad_generator-")]


def _no_backward_thread_left() -> None:
    for t in _backward_threads():
        t.join(timeout=60)
    assert not _backward_threads()


def _weights(pm):
    """Three layers' weights (leaves) and an input, different on each rank."""
    scale = pm.rank("gpus").float() + 1
    x = torch.linspace(-1.0, 1.0, 6).reshape(2, 3) * scale
    ws = [
        (torch.linspace(-0.5, 0.7, n * m).reshape(n, m) * scale).requires_grad_(True)
        for n, m in ((3, 4), (4, 4), (4, 2))
    ]
    return x, ws


def _forward(x, ws):
    h1 = (x @ ws[0]).relu()
    h2 = (h1 @ ws[1]).tanh()
    return (h2 @ ws[2]).sum(), h1, h2


def _local(x, ws, **shard):
    """The input and weights at ``shard``, local (the weights leaves that require grad)."""
    values = inspect([x, *(w.detach() for w in ws)], **shard)
    return values[0], [v.clone().requires_grad_(True) for v in values[1:]]


# -- values --------------------------------------------------------------------------------


def test_gradients_in_order_equal_local_autograd(pm):
    """Tensors, an unused tensor (None), a duplicate, a non-leaf, GradientEdges of a
    leaf and of a non-leaf, and ``grad_roots``: as ``torch.autograd.grad`` locally."""
    with pm.activate():
        x, ws = _weights(pm)
        unused = torch.ones(3, requires_grad=True)
        loss, h1, h2 = _forward(x, ws)
        two = torch.full((), 2.0)
        wrt = [ws[2], unused, h2, get_gradient_edge(ws[1]), ws[2], get_gradient_edge(h1), ws[0]]
        grads = list(grad_generator(loss, wrt, [two]))
        assert grads[1] is None and all(g is not None for i, g in enumerate(grads) if i != 1)
        got = inspect([g for g in grads if g is not None], host=1, gpus=1)
        lx, lws = _local(x, ws, host=1, gpus=1)
    lloss, lh1, lh2 = _forward(lx, lws)
    want = torch.autograd.grad(lloss, [lws[2], lh2, lws[1], lws[2], lh1, lws[0]], torch.tensor(2.0))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)
    _no_backward_thread_left()


def _ops_done(t):
    """How many ops this rank ran before this one (a rank-side record of their order)."""
    from monarch_kernel.rank.tensors.worker import current

    worker = current()
    assert worker is not None
    return torch.tensor(worker.ops_done)


def test_callers_ops_between_next_calls_run_between_backward_ops(pm):
    """Between two ``next()`` the caller issues an op (a snapshot of how many ops the
    rank ran): the rank runs it after the backward ops issued for the gradients handed
    out so far and before those of the next ones."""
    snapshot = remote(_ops_done, propagate=lambda t: torch.zeros((), dtype=torch.int64))
    client = spawn_tensor_engine(pm).client
    other = Stream("other")
    with pm.activate():
        x, ws = _weights(pm)
        loss, _, _ = _forward(x, ws)
        order = list(reversed(ws))
        gen = grad_generator(loss, order)
        issued, snaps = [], []
        for w, g in zip(order, gen):
            assert g.shape == w.shape
            issued.append(client.issued_to(0))  # global rank 0: host=0, gpus=0
            snaps.append(snapshot(g))
            with other.activate(), pytest.raises(TypeError, match="WRONG_STREAM"):
                torch.mul(g, 2)  # the caller's ops follow the active stream
        assert next(gen, None) is None
        ran = inspect(snaps, host=0, gpus=0)
    # the rank ran exactly the ops issued before each snapshot, in that order ...
    assert [int(v) for v in ran] == issued
    # ... and backward ops came between them: each gradient was computed after the
    # caller's op that followed the previous one
    assert all(b - a > 1 for a, b in zip(issued, issued[1:]))
    _no_backward_thread_left()


def test_a_dropped_generator_stops_its_thread_and_frees_the_backward(pm):
    client = spawn_tensor_engine(pm).client
    with pm.activate():
        x, ws = _weights(pm)
        loss, h1, h2 = _forward(x, ws)
        saved = weakref.ref(h1)  # saved by the graph for the backward
        gen = grad_generator(loss, [ws[2], ws[0]])
        first = next(gen)
        assert len(_backward_threads()) == 1
        before = client.ops_issued
        del gen  # paused after the first gradient: the rest is never issued
        _no_backward_thread_left()
        assert client.ops_issued == before
        del loss, h1, h2

        def freed() -> bool:
            # the graph's last holder, torch's queue of the thread's ready nodes, goes
            # when the thread's native part ends (just after join() returns)
            gc.collect()
            return saved() is None

        wait_until(freed, timeout=60, what="the backward's graph to be freed")
        # the gradient handed out is whole, and the mesh goes on
        lx, lws = _local(x, ws, host=0, gpus=0)
        got = inspect(first, host=0, gpus=0)
        # close() stops one too, and a fresh generator runs after
        loss, _, _ = _forward(x, ws)
        gen = grad_generator(loss, [ws[2], ws[1], ws[0]])
        next(gen)
        gen.close()
        assert next(gen, None) is None
        _no_backward_thread_left()
        loss, _, _ = _forward(x, ws)
        again = inspect(list(grad_generator(loss, [ws[2]])), host=0, gpus=0)
    (want,) = torch.autograd.grad(_forward(lx, lws)[0], [lws[2]])
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(again[0], want, atol=1e-6)
    _no_backward_thread_left()


# -- errors and the stop button --------------------------------------------------------------


@grad_function
def _badly_shaped_backward(x):
    def backward(g):
        return g.reshape(5, 5)  # a bad op: raises on the controller (its shape)

    return x.clone(), backward


def test_an_error_in_the_backward_raises_at_the_next_that_ran_it(pm):
    with pm.activate():
        a = torch.ones(3, requires_grad=True)
        b = torch.ones(3, requires_grad=True)
        loss = (_badly_shaped_backward(a * 2) + b).sum()
        gen = grad_generator(loss, [b, a])
        assert inspect(next(gen), host=0, gpus=0).tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(RuntimeError, match=r"shape '\[5, 5\]' is invalid"):
            next(gen)
        assert next(gen, None) is None  # ended
        _no_backward_thread_left()
        assert inspect(b * 2, host=0, gpus=0).tolist() == [2.0, 2.0, 2.0]


def _fails_on_the_ranks(g):
    raise ValueError("the backward's remote function failed")


@grad_function
def _backward_failing_on_the_ranks(x):
    def backward(g):
        return remote(_fails_on_the_ranks, propagate=lambda g: g)(g)

    return x.clone(), backward


def test_a_backward_ops_failure_on_the_ranks_names_the_line_that_called_next(pm):
    from monarch_kernel.mesh_controller import RemoteException

    with pm.activate():
        a = torch.ones(3, requires_grad=True)
        loss = _backward_failing_on_the_ranks(a * 2).sum()
        gen = grad_generator(loss, [a])
        grad = next(gen)  # the line the error must name
        line = _line_of("grad = next(gen)  # the line the error must name")
        with pytest.raises(RemoteException) as failed:
            inspect(grad, host=0, gpus=0)
    text = str(failed.value)
    assert "the backward's remote function failed" in text, text
    assert f'{__file__}", line {line}' in text, text
    assert "threading.py" not in text, text
    _no_backward_thread_left()


def _line_of(source: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if source in text and "_line_of" not in text)


@grad_function
def _stop_button_in_backward(x):
    def backward(g):
        # the stop button while the notebook waits in next()
        main = threading.main_thread().ident
        assert main is not None
        signal.pthread_kill(main, signal.SIGINT)
        cancel = state.this_thread.cancel
        assert cancel is not None and cancel.wait(60), "next() did not stop the backward"
        return g * 2  # the backward's next op stops it

    return x.clone(), backward


def test_the_stop_button_in_next_stops_the_backward_and_the_mesh_goes_on(pm):
    client = spawn_tensor_engine(pm).client
    with pm.activate():
        a = torch.ones(3, requires_grad=True)
        b = torch.ones(3, requires_grad=True)
        loss = (_stop_button_in_backward(a * 2) + b).sum()
        gen = grad_generator(loss, [b, a])
        next(gen)
        before = client.ops_issued
        with pytest.raises(KeyboardInterrupt):
            next(gen)
        _no_backward_thread_left()
        assert client.ops_issued == before  # `g * 2` was never issued
        assert next(gen, None) is None
        again = grad_generator((a * 3).sum(), [a])
        assert inspect(next(again), host=1, gpus=0).tolist() == [3.0, 3.0, 3.0]
    _no_backward_thread_left()


@grad_function
def _two_outputs_and_a_factory_in_backward(x):
    def backward(g_first, g_second):
        # g_second: autograd's zeros (its output is unused); torch.full: a factory
        return g_first + g_second + torch.full((3,), 10.0)

    return (x * 2, x * 3), backward


def test_factories_in_the_backward_land_on_the_active_mesh(pm):
    with pm.activate():
        a = torch.ones(3, requires_grad=True)
        first, _ = _two_outputs_and_a_factory_in_backward(a)
        (g,) = grad_generator(first.sum(), [a])
        assert inspect(g, host=1, gpus=1).tolist() == [11.0, 11.0, 11.0]
    _no_backward_thread_left()
