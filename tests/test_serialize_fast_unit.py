"""Endpoint arguments made of plain values, tensors and numpy arrays pickle through the
fast path (plain pickle, tensors reduced through its dispatch table) and come back
exactly as they went; anything else still goes through cloudpickle."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from monarch_kernel.wire import serialize as S

pytestmark = pytest.mark.unit


def _round_trip(value):
    payload, buffers = S.dumps(value)
    # as a receiver sees them: raw byte views of the frames, not the sender's objects
    return S.loads(payload, [memoryview(b.raw()) for b in buffers]), payload, buffers


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,  # no numpy dtype: its bytes go as uint8
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5000,), (40, 50), (2, 3, 1000), (), (0,), (0, 3)])
def test_tensors_of_every_dtype_and_shape_come_back_equal(dtype, shape):
    t = (torch.arange(int(np.prod(shape)) or 0) % 7).reshape(shape).to(dtype)
    args = ((t, 3, "x"), {"scale": 1.5, "other": t})
    assert S.classify(args, torch.Tensor) is S.ValueKind.ARRAYS
    back, _, _ = _round_trip(args)
    _same(args, back)


def test_a_large_tensor_travels_out_of_band_not_in_the_pickle():
    t = torch.ones(1 << 18)  # 1 MiB
    back, payload, buffers = _round_trip(((t,), {}))
    assert len(buffers) == 1 and buffers[0].raw().nbytes == 1 << 20
    assert len(payload) < 1024
    _same(t, back[0][0])


def test_non_contiguous_and_grad_tensors_keep_values_and_flags():
    base = torch.arange(120.0).reshape(10, 12)
    strided = base.t()[::2]  # not contiguous
    grad = torch.ones(3000, requires_grad=True)
    args: tuple[tuple[torch.Tensor, ...], dict[str, object]] = ((strided, grad), {})
    assert S.classify(args, torch.Tensor) is S.ValueKind.ARRAYS
    back, _, _ = _round_trip(args)
    _same(strided.contiguous(), back[0][0])
    assert back[0][1].requires_grad and torch.equal(back[0][1].detach(), grad.detach())


def test_numpy_arrays_travel_beside_tensors():
    arrays = (np.arange(20000, dtype=np.int32), np.ones((3, 4)), torch.ones(10))
    args: tuple[tuple[object, ...], dict[str, object]] = (arrays, {})
    assert S.classify(args, torch.Tensor) is S.ValueKind.ARRAYS
    back, _, buffers = _round_trip(args)
    _same(args, back)
    assert len(buffers) == 1  # the 80 kB array; the small ones stay in the pickle


@pytest.mark.parametrize(
    "value",
    [
        ((torch.ones(50).to_sparse(),), {}),  # not strided: declined by the fast pickler
        ((torch.nn.Parameter(torch.ones(5000)),), {}),  # a tensor subclass
        ((np.array([object(), 1], dtype=object),), {}),  # Python objects inside
        ((lambda x: x + 1,), {}),  # by value: cloudpickle only
        (tuple(torch.ones(2) for _ in range(S._PLAIN_MAX_ITEMS + 1)), {}),  # a long tuple
    ],
    ids=["sparse", "parameter", "object-array", "lambda", "long-tuple"],
)
def test_anything_else_goes_through_cloudpickle_and_still_round_trips(value):
    first = value[0][0]
    # a sparse tensor is of the plain type: the fast pickler declines it inside dumps
    sparse = isinstance(first, torch.Tensor) and first.is_sparse
    assert (S.classify(value, torch.Tensor) is S.ValueKind.ARRAYS) is sparse
    back, _, _ = _round_trip(value)
    again = back[0][0]
    if callable(first):
        assert again(1) == 2
    elif sparse:
        assert torch.equal(first.to_dense(), again.to_dense())
    elif isinstance(first, np.ndarray):
        assert again[1] == 1
    else:
        _same(first, again)


def test_the_fast_path_writes_what_the_general_path_reads():
    """The rank side is unchanged: a plain ``pickle.loads`` with the buffers reads it,
    and the bytes of a tensor are the tensor's own bytes, in order."""
    t = torch.arange(2000, dtype=torch.int64).reshape(20, 100)
    payload, buffers = S.dumps(((t,), {}))
    assert bytes(buffers[0].raw()) == t.numpy().tobytes()
    back = pickle.loads(payload, buffers=[memoryview(b.raw()) for b in buffers])
    assert torch.equal(back[0][0], t)


@pytest.mark.parametrize(
    "value, kind",
    [
        (((), {}), S.ValueKind.PLAIN),
        (((1, "a", None), {"k": (2.5, b"x")}), S.ValueKind.PLAIN),
        (((torch.ones(2), 1), {}), S.ValueKind.ARRAYS),
        (((), {"a": [np.ones(3)]}), S.ValueKind.ARRAYS),
        (((), {(1, 2): torch.ones(1)}), S.ValueKind.ARRAYS),  # a tuple key of scalars
        (((), {torch.ones(1): 1}), S.ValueKind.OTHER),  # a tensor key
        (((1, object()), {}), S.ValueKind.OTHER),
        (((torch.ones(1), object()), {}), S.ValueKind.OTHER),  # other after a tensor
        ((tuple(range(S._PLAIN_MAX_ITEMS + 1)), {}), S.ValueKind.OTHER),
    ],
)
def test_one_walk_classifies_plain_arrays_and_other(value, kind) -> None:
    assert S.classify(value, torch.Tensor) is kind


def test_without_torch_arrays_are_other_and_plain_stays_plain() -> None:
    assert S.classify(((1,), {}), None) is S.ValueKind.PLAIN
    assert S.classify(((np.ones(3),), {}), None) is S.ValueKind.OTHER


def _quick_and_general(t: torch.Tensor) -> tuple[object, object]:
    """What ``_reduce_tensor`` (quick path first) and ``_reduce_any_tensor`` make of
    ``t``, with the buffers as bytes (the frames' contents)."""

    def plain(reduced: tuple[object, tuple[object, ...]]) -> object:
        fn, args = reduced
        buf, *rest = args
        data = bytes(buf.raw()) if isinstance(buf, pickle.PickleBuffer) else buf
        return fn, data, *rest

    return plain(S._reduce_tensor(t)), plain(S._reduce_any_tensor(t))


@pytest.mark.parametrize(
    "t",
    [
        torch.ones(3000),
        torch.arange(24, dtype=torch.int16).reshape(2, 3, 4),
        torch.tensor(7),  # 0-dim
        torch.ones(0, 3),  # empty
        torch.ones(3, dtype=torch.bool),
        torch.arange(10)[3:6],  # a view at an offset into its storage
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.ones(1).expand(5),  # stride 0
        torch.ones(4, dtype=torch.bfloat16),  # no numpy dtype
        torch.ones(4, dtype=torch.uint16),  # numpy has it, the wire sends it as bytes
        torch.ones(4, requires_grad=True),
    ],
    ids=lambda t: f"{t.dtype}{tuple(t.shape)}",
)
def test_the_quick_tensor_reduction_makes_what_the_general_one_makes(t) -> None:
    quick, general = _quick_and_general(t)
    assert quick == general
    back, _, _ = _round_trip(((t,), {}))
    got = back[0][0]
    assert got.dtype == t.dtype and got.shape == t.shape
    assert got.requires_grad == t.requires_grad
    assert torch.equal(got.detach().resolve_conj(), t.detach().resolve_conj())


def test_a_tensor_both_reductions_refuse_still_round_trips() -> None:
    """numpy() refuses a conjugate view: both reductions raise, dumps falls back to
    cloudpickle (torch's own reduction), and the value arrives resolved."""
    t = torch.arange(4.0).to(torch.complex64).mul(1j).conj()
    with pytest.raises(RuntimeError):
        S._reduce_tensor(t)
    with pytest.raises(RuntimeError):
        S._reduce_any_tensor(t)
    back, _, _ = _round_trip(((t,), {}))
    assert torch.equal(back[0][0].resolve_conj(), t.resolve_conj())


def _as_negated(t):
    """A hook that sends 1-D tensors of 4 values or more as their negation (made from a
    list: a tensor in the reduction would come to the hook again), others as usual."""
    return (torch.tensor, ([-x for x in t.tolist()],)) if t.numel() >= 4 else None


def test_a_tensor_hook_reduces_the_tensors_it_takes_at_any_depth_in_both_picklers() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    for value in ({"a": [torch.arange(4.0)], "b": torch.ones(2)}, ({"p": param}, object)):
        with S.tensors_reduced_by(_as_negated):
            back, _, _ = _round_trip(value)
        if isinstance(back, dict):  # the fast pickler
            assert torch.equal(back["a"][0], -torch.arange(4.0))
            assert torch.equal(back["b"], torch.ones(2))  # declined: as usual
        else:  # cloudpickle (an object in it): the Parameter too
            assert torch.equal(back[0]["p"], -torch.ones(4))
    # the hook is gone after the block, and never seen by another thread
    assert torch.equal(_round_trip(torch.arange(4.0))[0], torch.arange(4.0))
    import threading

    seen = []
    with S.tensors_reduced_by(_as_negated):
        thread = threading.Thread(target=lambda: seen.append(_round_trip(torch.ones(4))[0]))
        thread.start()
        thread.join()
    assert torch.equal(seen[0], torch.ones(4))


def test_tensor_hooks_nest_and_the_outer_one_comes_back() -> None:
    with S.tensors_reduced_by(_as_negated):
        with S.tensors_reduced_by(lambda t: None):
            assert torch.equal(_round_trip(torch.ones(4))[0], torch.ones(4))
        assert torch.equal(_round_trip(torch.ones(4))[0], -torch.ones(4))
