"""Endpoints of an actor mesh and Monarch's adverbs on them (``call``, ``call_one``,
``choose``, ``broadcast``, ``stream``), sent through the mesh's
:class:`~monarch_kernel.calls.requester.Requester` and gathered by
:mod:`monarch_kernel.calls.gather`: the same code in the notebook and in ranks."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from monarch_kernel.calls.errors import CallSite, SupervisionError, call_failed
from monarch_kernel.calls.future import Future, check_port, forward_to_port
from monarch_kernel.calls.gather import Each, Gather, One
from monarch_kernel.calls.requester import CallOptions, Requester
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.shape import Shape
from monarch_kernel.wire import SerializationError, dumps
from monarch_kernel.wire import headers as H
from monarch_kernel.wire.codec import Buffer, Header
from monarch_kernel.wire.serialize import tensors_reduced_by

if TYPE_CHECKING:
    from monarch_kernel.rank.dataplane.cuda_args import Snapshots

#: (mesh name, actor name) -> the error calls to that actor mesh raise: its constructor
#: failed (``ProcMesh.spawn``); cleared when it is spawned again. In this process.
failed_init: dict[tuple[str, str], SupervisionError] = {}

#: The payload of a call without arguments (``dumps(((), {}))``, made once).
_NO_ARGUMENTS: bytes = dumps(((), {}))[0]

#: Packs mesh tensors among a call's arguments (each rank reads its local tensor); only
#: looked up, never imported: mesh tensors exist only once the tensor engine is loaded.
_MESH_TENSOR_ARGS = "monarch_kernel.tensor_engine.actor_args"

#: The adverbs of an endpoint (what a method that is not one is told to become first).
ADVERBS = frozenset({"call", "call_one", "choose", "broadcast", "stream", "rref"})


def mesh_tensor_args(
    requester: Requester, ranks: Sequence[int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a call (or a constructor) sent to ``ranks``, each mesh tensor
    in them replaced by a ref each rank reads as its local tensor, after the tensor
    engine's ops issued before (``tensor_engine.actor_args.local_shards``). Unchanged
    when the tensor engine is not loaded (then there is no mesh tensor)."""
    # (while another thread imports the engine, the module has no ``local_shards`` yet,
    # and there is no mesh tensor)
    pack = getattr(sys.modules.get(_MESH_TENSOR_ARGS), "local_shards", None)
    if pack is None:
        return args, kwargs
    return pack(requester, ranks, args, kwargs)  # type: ignore[no-any-return]


#: ``EndpointRef(propagate=...)`` not given: the endpoint's own (``@endpoint(propagate=)``).
_OWN = object()


@dataclass(frozen=True)
class ActorTarget:
    """Which actors an endpoint reference calls: actor ``name`` (of ``actor_class``) on the
    ranks of ``shape`` of the mesh that ``requester`` reaches."""

    requester: Requester
    name: str
    actor_class: type
    shape: Shape
    ranks: list[int]


class EndpointRef:
    """One endpoint of an actor mesh, with Monarch's adverbs."""

    def __init__(self, target: ActorTarget, method: str, propagate: Any = _OWN):
        self._target = target
        self._method = method
        #: how :meth:`rref` shapes its mesh tensors (``as_endpoint(propagate=...)``);
        #: by default the endpoint's ``@endpoint(propagate=...)``
        self._propagate = propagate
        self._requester = target.requester
        self._ranks = target.ranks
        self._where = f"{target.actor_class.__name__}.{method}"
        what = f"{target.name}.{method}"  # for RequestStarted: built once, not per call
        self._call = CallSite(self._requester.name, target.name, method)
        self._waited = CallOptions(what=what, waited=True)
        self._streamed = CallOptions(what=what)
        # The slice called, when it is not the whole mesh (``context().message_rank``).
        sl = slice_header(target.shape, self._requester.shape)
        self._base = H.Call(actor=target.name, method=method, slice=sl).encode()

    def _header(self) -> Header:
        return dict(self._base)  # a fresh one per call: the requester adds the request id

    def _request(
        self, rank: int, header: Header, payload: bytes, buffers: Sequence[Buffer]
    ) -> Future[Any]:
        requester = self._requester
        one = One(requester.waiter, self._call)
        try:
            requester.request([rank], header, payload, buffers, one, self._waited)
        except SupervisionError as exc:  # refused at once: the rank or the mesh is gone
            raise call_failed(exc, self._call, rank) from None
        return one.future

    def _check_constructed(self) -> None:
        """Raise what calls to this actor mesh raise when its constructor failed."""
        failed = failed_init.get((self._requester.name, self._target.name))
        if failed is not None:
            label = self._call.label
            text = f"Endpoint call {label} failed, {failed}"
            raise SupervisionError(text, failed.failures, failed.exception, label)

    def _payload(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], snapshots: Snapshots | None = None
    ) -> tuple[bytes, Sequence[Buffer]]:
        """The call's pickled arguments. ``snapshots`` (a call that is answered, from a
        rank to ranks of its machine): large CUDA tensors go as handles on copies it
        collects (``rank.dataplane.cuda_args``)."""
        if failed_init:  # (every adverb comes here first)
            self._check_constructed()
        if not args and not kwargs:  # a call without arguments: always the same bytes
            return _NO_ARGUMENTS, ()
        args, kwargs = mesh_tensor_args(self._requester, self._ranks, args, kwargs)
        if snapshots is not None:
            with tensors_reduced_by(snapshots.reduce):
                return self._dump(args, kwargs)
        return self._dump(args, kwargs)

    def _dump(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bytes, Sequence[Buffer]]:
        try:
            return dumps((args, kwargs))
        except SerializationError:
            return dump_call((args, kwargs), args, kwargs, self._where)  # names the culprit

    def _snapshots(self, ranks: Sequence[int]) -> Snapshots | None:
        """A collector for the CUDA arguments of an answered call to ``ranks``, where
        they may go by CUDA IPC (a rank, or the notebook with CUDA in use, calling
        ranks of its machine), else None."""
        requester = self._requester
        if not hasattr(requester, "on_machine"):  # (an actor of this very process)
            return None
        from monarch_kernel.rank.dataplane.cuda_args import OnMachine, Snapshots, may_share

        if not may_share():
            return None
        return Snapshots(cast(OnMachine, requester), ranks)

    def _answered(
        self,
        ranks: Sequence[int],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        send: Callable[[Header, bytes, Sequence[Buffer]], list[Future[Any]]],
    ) -> list[Future[Any]]:
        """Pickle a call to ``ranks`` that is answered and ``send`` it (its futures).
        From a rank to ranks of its machine, large CUDA tensors travel as handles on
        copies both ways: the arguments' copies are dropped once every future is done,
        or at once if the call could not be sent; the results' (``rp``) once read here
        (``rank.dataplane.cuda_results``)."""
        snapshots = self._snapshots(ranks)  # (also without arguments: results may come back)
        header = self._header()
        try:
            payload, buffers = self._payload(args, kwargs, snapshots)
            if snapshots is not None and snapshots.results_by_handle():
                from monarch_kernel.rank.dataplane import cuda_results  # (its reader is set)

                header["rp"] = cuda_results.reader_pid()
            futures = send(header, payload, buffers)
        except BaseException:
            if snapshots is not None:
                snapshots.release()
            raise
        if snapshots is not None:
            snapshots.release_after(futures)
        return futures

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Call every rank; the future gives a ValueMesh (or one grouped ActorError)."""
        shape = self._target.shape
        requester, ranks, options = self._requester, self._ranks, self._waited

        def send(header: Header, payload: bytes, buffers: Sequence[Buffer]) -> list[Future[Any]]:
            try:
                return [
                    gather(requester, ranks, header, payload, buffers, shape, options, self._call)
                ]
            except SupervisionError as exc:  # refused at once: a rank or the mesh is gone
                raise call_failed(exc, self._call, None) from None

        return self._answered(ranks, args, kwargs, send)[0]

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call the single rank of a one-point mesh; the future gives its value."""
        ranks = self._ranks
        if len(ranks) != 1:
            shape = self._target.shape
            raise ValueError(
                f"call_one() needs a mesh of exactly one rank, but {self._where} is on "
                f"{len(ranks)} ranks ({shape.describe()}); slice it first, e.g. "
                f".slice({shape.labels[-1]}=0), or use call()"
            )
        return self._answered_by(ranks[0], args, kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call one rank: the least busy live one (in the notebook), any one (in a rank)."""
        return self._answered_by(self._requester.choose(self._ranks), args, kwargs)

    def _answered_by(self, rank: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        """The future of a call to ``rank`` alone."""

        def send(header: Header, payload: bytes, buffers: Sequence[Buffer]) -> list[Future[Any]]:
            return [self._request(rank, header, payload, buffers)]

        return self._answered([rank], args, kwargs, send)[0]

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Fire and forget on every rank; exceptions go to the mesh's supervision."""
        payload, buffers = self._payload(args, kwargs)
        try:
            self._requester.send(self._ranks, self._header(), payload, buffers)
        except SupervisionError as exc:  # refused at once: a rank or the mesh is gone
            raise call_failed(exc, self._call, None) from None

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Call every rank; yield one future per rank in the order they answer."""
        ranks = self._ranks
        each = Each(ranks, self._requester.waiter, self._call)

        def send(header: Header, payload: bytes, buffers: Sequence[Buffer]) -> list[Future[Any]]:
            try:
                self._requester.request(ranks, header, payload, buffers, each, self._streamed)
            except SupervisionError as exc:  # refused at once: a rank or the mesh is gone
                raise call_failed(exc, self._call, None) from None
            return each.futures()

        self._answered(ranks, args, kwargs, send)
        return each.in_order_of_answers()

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Monarch's ``rref``: call the endpoint on every actor of the mesh as an op of
        the tensor engine (in order with the ops issued before and after it, on the
        ranks of its mesh-tensor arguments, else of the active mesh: they must be the
        actor mesh's) and keep what it returns on the ranks, as mesh tensors shaped by
        the endpoint's ``propagate`` (``@endpoint(propagate=...)``, or
        ``as_endpoint(mesh.method, propagate=...)``): a function of the endpoint's
        arguments run on fake tensors here, or ``"inspect"`` (no tensors back: None).
        A failure on a rank poisons the returned tensors, as a failed op does."""
        if failed_init:
            self._check_constructed()
        propagate = self._propagate
        if propagate is _OWN:
            fn = getattr(self._target.actor_class, self._method, None)
            propagate = getattr(fn, "_propagator", None)
        from monarch_kernel.tensor_engine.endpoint_rref import endpoint_rref

        target = self._target
        sl = slice_header(target.shape, self._requester.shape)
        return endpoint_rref(
            self._requester, self._ranks, target.name, self._method, self._where, sl,
            propagate, args, kwargs,
        )  # fmt: skip

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through an adverb: {self._method}.call(...), .call_one(...), "
            ".broadcast(...), .choose(...), .stream(...) or .rref(...)"
        )

    def __repr__(self) -> str:
        return f"<endpoint {self._where} of actor mesh {self._target.name!r}>"


class NotAnEndpoint:
    """A method of an actor mesh's class that is not an ``@endpoint`` (Monarch's
    ``NotAnEndpoint``): calling it, or an adverb of it, raises and says how to make it
    one; ``as_endpoint(mesh.method)`` calls it as an endpoint."""

    def __init__(self, target: ActorTarget, method: str):
        self._target = target
        self._method = method
        self._where = f"{target.actor_class.__name__}.{method}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Actor {self._where} is not annotated as an endpoint. To call it as one, "
            "add a @endpoint decorator to it, or directly wrap it in one "
            "as_endpoint(obj.method).call(...)"
        )

    def __getattr__(self, attr: str) -> Any:
        if attr in ADVERBS:
            raise AttributeError(
                f"{self._where} is not an endpoint: mark it with @endpoint, or call it "
                f"through as_endpoint(mesh.{self._method}).{attr}(...)"
            )
        raise AttributeError(attr)

    def __repr__(self) -> str:
        return f"<method {self._where} of actor mesh {self._target.name!r} (not an endpoint)>"


def as_endpoint(
    not_an_endpoint: Any, *, propagate: Any = None, explicit_response_port: bool = False
) -> EndpointRef:
    """Monarch's ``as_endpoint``: a method of a spawned actor mesh that is not an
    ``@endpoint`` (``mesh.method``), as an endpoint with every adverb;
    ``propagate`` as ``@endpoint``'s (what :meth:`EndpointRef.rref` returns)."""
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        what = (
            "an endpoint already (give its propagate to @endpoint(propagate=...))"
            if isinstance(not_an_endpoint, EndpointRef)
            else repr(not_an_endpoint)
        )
        raise ValueError(
            f"as_endpoint() expects a method of a spawned actor mesh that is not an "
            f"@endpoint (actors.method), got {what}"
        )
    if explicit_response_port:
        raise ValueError(
            f"as_endpoint({not_an_endpoint._where}, explicit_response_port=True) is not "
            "supported: mark the method @endpoint(explicit_response_port=True) instead"
        )
    return EndpointRef(not_an_endpoint._target, not_an_endpoint._method, propagate)


def send(
    endpoint: EndpointRef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    port: Any = None,
    selection: str = "all",
) -> None:
    """Monarch's ``send``: call ``endpoint`` without waiting, on every actor of its mesh
    (``selection="all"``) or on one, load-balanced (``"choose"``). Each actor's answer
    goes to ``port`` (a :class:`~.channels.Port`: its receiver's
    ``recv()`` gives the values, and raises an endpoint's exception); without a port
    answers are dropped and exceptions go to supervision, as under ``broadcast``."""
    if selection not in ("all", "choose"):
        raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")
    if not isinstance(endpoint, EndpointRef):
        remote_send = getattr(endpoint, "_send", None)  # a tensor-engine remote function
        if remote_send is None:
            raise TypeError(f"send() needs an endpoint of an actor mesh, got {endpoint!r}")
        remote_send(tuple(args), dict(kwargs or {}), port, selection)
        return
    args = tuple(args)
    kwargs = dict(kwargs or {})
    if port is None:
        if selection == "all":
            endpoint.broadcast(*args, **kwargs)
            return
        ref = endpoint
        rank = ref._requester.choose(ref._ranks)
        payload, buffers = ref._payload(args, kwargs)
        ref._requester.send([rank], ref._header(), payload, buffers)
        return
    check_port(port)
    futures = [endpoint.choose(*args, **kwargs)] if selection == "choose" else None
    if futures is None:
        futures = list(endpoint.stream(*args, **kwargs))
    forward_to_port(futures, port)


def slice_header(shape: Shape, whole: Shape | None) -> list[Any] | None:
    """Header value ``sl`` of calls to ``shape`` (None when it is the ``whole`` mesh)."""
    if whole is not None and shape == whole:
        return None
    return [list(shape.labels), list(shape.sizes), list(shape.strides), shape.offset]


def dump_call(
    obj: object, args: tuple[Any, ...], kwargs: dict[str, Any], what: str
) -> tuple[bytes, list[Any]]:
    """Pickle a call's arguments; an error names the argument that does not pickle."""
    try:
        return dumps(obj, what)
    except SerializationError:
        pass
    for i, a in enumerate(args):
        dumps(a, f"argument {i} of {what}")
    for k, v in kwargs.items():
        dumps(v, f"argument {k!r} of {what}")
    return dumps(obj, what)  # the class itself (raises with its own message)


def gather(
    requester: Requester,
    ranks: list[int],
    header: Header,
    payload: bytes,
    buffers: Sequence[Buffer],
    shape: Shape | None,
    options: CallOptions,
    call: CallSite | None = None,
) -> Future[ValueMesh[Any]]:
    """Send a request to ``ranks``; the future gives a ValueMesh (or a grouped error;
    ``call``: the endpoint call it is, see :class:`CallSite`)."""
    g = Gather(ranks, shape, requester.waiter, call=call)
    requester.request(ranks, header, payload, buffers, g, options)
    return g.hand_out()


__all__ = [
    "ActorTarget",
    "EndpointRef",
    "NotAnEndpoint",
    "as_endpoint",
    "dump_call",
    "gather",
    "mesh_tensor_args",
    "send",
    "slice_header",
]
