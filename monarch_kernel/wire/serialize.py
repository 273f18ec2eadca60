"""Serialization: cloudpickle with pickle protocol 5 and out-of-band buffers.

Numpy arrays and torch tensors travel as raw buffers next to the pickle, never copied
into it. A CUDA tensor is moved to host memory on send and placed on the receiving
rank's current CUDA device on load (or stays on the CPU where there is no CUDA).
Classes and functions defined in ``__main__`` or a notebook cell pickle by value.
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import functools
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import cloudpickle

from monarch_kernel.wire.codec import MAX_BUFFERS
from monarch_kernel.wire.limits import STREAM_ABOVE, max_value, too_large

PROTOCOL = 5
#: Buffers below this size are cheaper inside the pickle than as frames of their own.
OUT_OF_BAND_MIN = 8192
#: Values of these types (and small containers of them) pickle the same with plain
#: ``pickle`` as with cloudpickle, several times faster.
_PLAIN_TYPES = frozenset({int, float, str, bytes, bool, type(None), complex})
_PLAIN_MAX_ITEMS = 16


class SerializationError(TypeError):
    """A value could not be pickled or unpickled; the message says which one and why."""


class ValueTooLargeError(SerializationError):
    """A value is larger than the bound on one value (``limits.max_value``); the message
    names the bound and how to raise it."""


#: What a value is, for error messages: a string, or a function that makes one (so that
#: the hot path does not format strings that only an error needs).
What = str | Callable[[], str]


def _describe(what: What) -> str:
    return what if isinstance(what, str) else what()


_PLAIN_DTYPE_NAMES = frozenset(
    [
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
    ]
)


@functools.cache
def _plain_dtypes() -> dict[Any, str]:
    """Torch dtypes that numpy has too, by their names: such a tensor's bytes are shared
    through ``.numpy()`` and read back with ``torch.frombuffer`` in its own dtype."""
    import torch

    return {getattr(torch, n): n for n in _PLAIN_DTYPE_NAMES}


def _rebuild_tensor(
    data: Any, dtype_name: str, shape: tuple[int, ...], cuda: bool, requires_grad: bool
) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    if len(data) == 0:
        t = torch.empty(shape, dtype=dtype)
    elif dtype_name in _PLAIN_DTYPE_NAMES:  # read as its dtype at once (no uint8 view first)
        t = torch.frombuffer(data, dtype=dtype)
        if len(shape) != 1:
            t = t.reshape(shape)
    else:
        t = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
    if cuda and torch.cuda.is_available():
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    if requires_grad:
        t.requires_grad_(True)
    return t


#: What :func:`tensors_reduced_by` installs: given a tensor, its reduction (a
#: ``(callable, args)`` pair, as ``__reduce__`` returns) or None for the usual one.
TensorHook = Callable[[Any], "tuple[Any, ...] | None"]
_hooks = threading.local()


@contextlib.contextmanager
def tensors_reduced_by(hook: TensorHook) -> Iterator[None]:
    """While the block runs, :func:`dumps` in this thread offers every torch tensor it
    pickles to ``hook`` first (a rank's calls to ranks of its machine send large CUDA
    tensors as data-plane handles: ``rank.dataplane.cuda_args``)."""
    before = getattr(_hooks, "hook", None)
    _hooks.hook = hook
    try:
        yield
    finally:
        _hooks.hook = before


def _reduce_tensor(t: Any) -> Any:
    hook = getattr(_hooks, "hook", None)
    if hook is not None:
        reduced = hook(t)
        if reduced is not None:
            return reduced
    # The hot path runs with the CPU's caches cold: the call's own bytes have just gone
    # through them (a 1 MiB call's Python code runs about three times slower than warm),
    # so every torch call costs several microseconds. The common tensor (plain, CPU,
    # contiguous, no grad, a dtype numpy has) takes four: everything else its numpy
    # array says. Checked before numpy() is tried: a torch error costs ~9 us.
    if t.__class__ is _tensor_type() and not t.requires_grad and t.is_cpu:
        name = _plain_dtypes().get(t.dtype)
        if name is not None:
            try:
                a = t.numpy()  # raises for sparse, nested, conjugate/negative views
            except (RuntimeError, TypeError):
                a = None
            if a is not None and a.flags.c_contiguous:
                buf = pickle.PickleBuffer(a) if a.size else b""
                return _rebuild_tensor, (buf, name, a.shape, False, False)
    return _reduce_any_tensor(t)


@functools.cache
def _tensor_type() -> Any:  # Any: a ``type`` would narrow the tensor to ``object``
    import torch

    return torch.Tensor


def _reduce_any_tensor(t: Any) -> Any:
    """:func:`_reduce_tensor` for the tensors its fast path does not take."""
    import torch

    if t.is_sparse or t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented
    plain = type(t) is torch.Tensor
    if not plain and not isinstance(t, torch.nn.Parameter):
        return NotImplemented  # subclasses (DTensor ...) keep their own reduction
    cuda = t.is_cuda
    grad = t.requires_grad
    data = t.detach() if grad or not plain else t
    if not data.is_cpu:
        data = data.cpu()
    if not data.is_contiguous():
        data = data.contiguous()
    dtype = data.dtype
    if not data.numel():
        buf: pickle.PickleBuffer | bytes = b""
    elif dtype in _plain_dtypes():  # numpy shares the bytes as they are (cheapest)
        buf = pickle.PickleBuffer(data.numpy())
    else:  # bfloat16 ...: numpy has no such dtype, its bytes go as uint8
        buf = pickle.PickleBuffer(data.reshape(-1).view(torch.uint8).numpy())
    args = (buf, str(dtype).removeprefix("torch."), tuple(t.shape), cuda, grad)
    return (_rebuild_tensor if plain else _rebuild_parameter), args


def _rebuild_parameter(*args: Any) -> Any:
    import torch

    t = _rebuild_tensor(*args)
    return torch.nn.Parameter(t, requires_grad=t.requires_grad)


#: The file name cloudpickle (3.1.3 on) gives every code object it pickles by value.
_DYNAMIC_FILE = "<dynamic-code>"


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[types.CodeType, str]]:
    """A function pickled by value keeps the file it was defined in: a rank's traceback,
    ``%mesh stacks`` and a breakpoint in a notebook-defined endpoint find its source
    lines by that name (linecache). cloudpickle 3.1.3 replaced every ``co_filename``
    with ``<dynamic-code>`` (a deterministic payload); the name travels beside the code
    here and is put back on load. Nested code objects (inner functions) come through
    this again, each with its own name."""
    return _code_in_file, (code.replace(co_filename=_DYNAMIC_FILE), code.co_filename)


def _code_in_file(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            try:
                return _reduce_tensor(obj)
            except (RuntimeError, TypeError):  # exotic dtypes or layouts
                return NotImplemented
        if type(obj) is types.CodeType and obj.co_filename != _DYNAMIC_FILE:
            return _reduce_code(obj)
        return super().reducer_override(obj)


class _TensorPickler(pickle.Pickler):
    """Plain pickle with torch tensors reduced by :func:`_reduce_tensor` through the
    dispatch table: for values :func:`classify` finds :attr:`ValueKind.ARRAYS`, it
    writes what :class:`_Pickler` writes, without cloudpickle's Python call per object."""

    dispatch_table = copyreg.dispatch_table.copy()


class ValueKind(enum.IntEnum):
    """How :func:`dumps` pickles a value (ordered: a container is of its items' most
    demanding kind)."""

    PLAIN = 0  #: builtin scalars in small builtin containers: plain ``pickle``
    ARRAYS = 1  #: the same with torch tensors and numpy arrays too: :class:`_TensorPickler`
    OTHER = 2  #: anything else: cloudpickle


_PLAIN, _ARRAYS, _OTHER = ValueKind.PLAIN, ValueKind.ARRAYS, ValueKind.OTHER


def classify(obj: Any, tensor: type | None = None) -> ValueKind:
    """Which pickler ``obj`` (an endpoint's ``(args, kwargs)``, typically) needs, in one
    walk: builtin scalars and, with ``tensor`` (``torch.Tensor``, when torch is
    imported), tensors of exactly that type and numpy arrays of no Python objects, in
    builtin tuples, lists and dicts (plain keys) of at most ``_PLAIN_MAX_ITEMS`` items.
    A sparse or quantized tensor is classified ARRAYS: the fast pickler declines it and
    :func:`dumps` falls back to cloudpickle."""
    t = obj.__class__
    if t in _PLAIN_TYPES:
        return _PLAIN
    if t is tuple or t is list:
        if len(obj) > _PLAIN_MAX_ITEMS:
            return _OTHER
        return _items_kind(obj, tensor)
    if t is dict:
        if len(obj) > _PLAIN_MAX_ITEMS:
            return _OTHER
        for key in obj:
            if classify(key) is not _PLAIN:
                return _OTHER
        return _items_kind(obj.values(), tensor)
    if tensor is None:
        return _OTHER
    if t is tensor:
        return _ARRAYS
    if t.__name__ == "ndarray" and t.__module__ == "numpy":  # numpy's own protocol-5 reduce
        return _OTHER if obj.dtype.hasobject else _ARRAYS
    return _OTHER


def _items_kind(items: Iterable[Any], tensor: type | None) -> ValueKind:
    """The most demanding :func:`classify` kind of ``items`` (OTHER at the first one)."""
    kind = _PLAIN
    for x in items:
        k = classify(x, tensor)
        if k is not _PLAIN:
            if k is _OTHER:
                return _OTHER
            kind = _ARRAYS
    return kind


#: Immutable builtin scalar types (a value of them may be shared between ranks).
_IMMUTABLE_SCALARS = frozenset({int, float, str, bytes, bool, type(None), complex})


def is_immutable(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` is an immutable builtin scalar, or a tuple or frozenset of
    such (nested at most ``depth`` deep): one object of it may stand for several equal
    values (nothing anyone does to it can be seen through another reference)."""
    t = value.__class__
    if t in _IMMUTABLE_SCALARS:
        return True
    if (t is tuple or t is frozenset) and depth > 0:
        return all(is_immutable(x, depth - 1) for x in value)
    return False


def dumps(obj: Any, what: What = "value") -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; returns ``(payload, out_of_band_buffers)``.

    ``what`` names the value in the error message (``"argument 'x' of Counter.incr"``).
    """
    torch = sys.modules.get("torch")
    try:
        kind = classify(obj, torch.Tensor if torch is not None else None)
    except RecursionError:  # absurdly nested: let cloudpickle say what it makes of it
        kind = _OTHER
    if kind is _PLAIN:
        plain = pickle.dumps(obj, PROTOCOL)
        if len(plain) > STREAM_ABOVE:
            _check_size(len(plain), what)
        return plain, []
    buffers: list[pickle.PickleBuffer] = []

    def _keep_out_of_band(buf: pickle.PickleBuffer) -> bool:
        # Small buffers stay in the pickle (returning True means in-band), and so do
        # those beyond the most one message carries (codec.MAX_BUFFERS).
        if buf.raw().nbytes < OUT_OF_BAND_MIN or len(buffers) >= MAX_BUFFERS:
            return True
        buffers.append(buf)
        return False

    f = io.BytesIO()
    if kind is _ARRAYS and torch is not None:
        if torch.Tensor not in _TensorPickler.dispatch_table:
            _TensorPickler.dispatch_table[torch.Tensor] = _reduce_tensor
        try:
            _TensorPickler(f, protocol=PROTOCOL, buffer_callback=_keep_out_of_band).dump(obj)
        except Exception:  # a tensor _reduce_tensor declines (sparse ...): cloudpickle's
            # path below pickles it (or says what fails)
            f = io.BytesIO()
            buffers.clear()
        else:
            return _checked(f.getvalue(), buffers, what)
    try:
        _Pickler(f, protocol=PROTOCOL, buffer_callback=_keep_out_of_band).dump(obj)
    except Exception as exc:
        raise SerializationError(
            f"{_describe(what)} cannot be pickled ({type(obj).__name__}): {exc}. "
            "Send plain data, tensors or picklable objects instead."
        ) from exc
    return _checked(f.getvalue(), buffers, what)


def _checked(
    payload: bytes, buffers: list[pickle.PickleBuffer], what: What
) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """``(payload, buffers)``, or :class:`ValueTooLargeError` above the bound on values."""
    size = len(payload) + sum(memoryview(b).nbytes for b in buffers)
    if size > STREAM_ABOVE:
        _check_size(size, what)
    return payload, buffers


def _check_size(size: int, what: What) -> None:
    limit = max_value()
    if size > limit:
        raise ValueTooLargeError(too_large(_describe(what), size, limit))


def loads(
    payload: bytes | bytearray | memoryview, buffers: Sequence[Any] = (), what: What = "value"
) -> Any:
    """Unpickle a payload with its out-of-band buffers (zero-copy where possible)."""
    try:
        return pickle.loads(payload, buffers=buffers)
    except Exception as exc:
        raise SerializationError(f"{_describe(what)} cannot be unpickled here: {exc!r}") from exc


def find_unpicklable(values: Mapping[str, object], what: str) -> None:
    """Raise SerializationError naming the first entry of ``values`` that cannot be pickled."""
    for name, value in values.items():
        dumps(value, f"{name} of {what}")
