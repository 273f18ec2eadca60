"""The collectives of the re-formable group, as torch calls them (from Python and, for
DDP and ``broadcast_coalesced``, from C++ through torch's trampoline): each names its
worker-side method and which tensors go in and come out, and hands them to ``_run``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from monarch_kernel.rank.pg.work import OpWork, PendingOp
from monarch_kernel.rank.pg.worker import EACH

# torch's stubs miss the options classes torch.distributed has at run time.
_d: Any = dist


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


class CollectiveOps:
    """The ops (a mixin of :class:`~.reformable.ReformableGroup`, before torch's class:
    these override torch's C++ methods)."""

    _rank: int
    _coalescing: list[PendingOp] | None

    def _run(
        self,
        name: str,
        method: str,
        args: list[Any],
        opts: object,
        ins: Sequence[torch.Tensor] = (),
        outs: Sequence[torch.Tensor] = (),
        value: object = None,
    ) -> OpWork:
        raise NotImplementedError

    def allreduce(self, tensors: Any, opts: Any = None) -> OpWork:
        tensors = _as_list(tensors)
        opts = _reduce_opts(opts, _d.AllreduceOptions)
        return self._run("allreduce", "allreduce", [tensors], opts, tensors, tensors, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> OpWork:
        opts = _reduce_opts(opts, _d.AllreduceCoalescedOptions)
        name = "allreduce_coalesced"
        return self._run(name, name, [tensors], opts, tensors, tensors, tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> OpWork:
        tensors = _as_list(tensors)
        if opts is None or isinstance(opts, int):
            root, opts = opts or 0, _d.BroadcastOptions()
            opts.rootRank = root
        root_here = opts.rootRank == self._rank
        ins, outs = (tensors, []) if root_here else ([], tensors)
        return self._run("broadcast", "broadcast", [tensors], opts, ins, outs, tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: Any, opts: Any = None) -> OpWork:
        inputs = _as_list(inputs)
        opts = opts or _d.AllgatherOptions()
        args = [outputs, inputs]
        return self._run("allgather", "allgather", args, opts, inputs, _flat(outputs), outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> OpWork:
        opts = opts or _d.AllgatherOptions()
        name = "allgather_coalesced"
        return self._run(name, name, [outputs, inputs], opts, inputs, _flat(outputs), outputs)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> OpWork:
        opts = opts or _d.AllgatherOptions()
        args = [output, input]
        return self._run(
            "all_gather_into_tensor", "_allgather_base", args, opts, [input], [output], [output]
        )

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> OpWork:
        opts = opts or _d.AllgatherOptions()
        method = EACH + "_allgather_base"
        return self._run(
            "all_gather_into_tensor (coalesced)",
            method,
            [outputs, inputs],
            opts,
            inputs,
            outputs,
            outputs,
        )

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, outputs: Any, inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> OpWork:
        outputs = _as_list(outputs)
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        args = [outputs, inputs]
        return self._run(
            "reduce_scatter", "reduce_scatter", args, opts, _flat(inputs), outputs, outputs
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> OpWork:
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        args = [output, input]
        return self._run(
            "reduce_scatter_tensor", "_reduce_scatter_base", args, opts, [input], [output], [output]
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> OpWork:
        opts = _reduce_opts(opts, _d.ReduceScatterOptions)
        method = EACH + "_reduce_scatter_base"
        return self._run(
            "reduce_scatter_tensor (coalesced)",
            method,
            [outputs, inputs],
            opts,
            inputs,
            outputs,
            outputs,
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> OpWork:
        opts = opts or _d.AllToAllOptions()
        args = [output, input, list(output_split_sizes), list(input_split_sizes)]
        return self._run(
            "all_to_all_single", "alltoall_base", args, opts, [input], [output], [output]
        )

    alltoall_base = all_to_all_single

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> OpWork:
        opts = opts or _d.AllToAllOptions()
        return self._run(
            "all_to_all", "alltoall", [outputs, inputs], opts, inputs, outputs, outputs
        )

    def barrier(self, opts: Any = None) -> OpWork:
        return self._run("barrier", "barrier", [], opts or _d.BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> OpWork:
        return self._run("send", "send", [tensors, dst, tag], None, tensors, [], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> OpWork:
        return self._run("recv", "recv", [tensors, src, tag], None, [], tensors, tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> OpWork:
        tensors = _as_list(tensors)
        opts = _reduce_opts(opts, _d.ReduceOptions)
        outs = tensors if opts.rootRank == self._rank else []
        return self._run("reduce", "reduce", [tensors], opts, tensors, outs, tensors)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> OpWork:
        opts = opts or _d.GatherOptions()
        return self._run(
            "gather", "gather", [outputs, inputs], opts, inputs, _flat(outputs), outputs
        )

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> OpWork:
        opts = opts or _d.ScatterOptions()
        return self._run(
            "scatter", "scatter", [outputs, inputs], opts, _flat(inputs), outputs, outputs
        )

    # -- coalescing (``dist._coalescing_manager`` with a device) ---------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> OpWork:
        ops, self._coalescing = self._coalescing or [], None
        op = PendingOp("coalesced ops", None, [], None)
        if not ops:
            op.finish(None)
            return OpWork(op)
        futures = torch.futures.collect_all([o.future for o in ops])

        def settle(_: Any) -> None:
            errors = [o.error for o in ops if o.error is not None]
            op.finish(errors[0] if errors else None)

        futures.add_done_callback(settle)
        return OpWork(op)

    # -- what it does not do ---------------------------------------------------------------
    def _unsupported(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"{what} is not supported by the mesh's re-formable gloo process group; "
                "initialise with MONARCH_KERNEL_REFORMABLE_PG=0 for plain gloo"
            )

        return refuse

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("monitored_barrier")()

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv from any source")()

    def split_group(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("split_group")()


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_opts(opts: Any, cls: Callable[[], Any]) -> Any:
    """An options object from None, a ReduceOp, or an options object."""
    if opts is None or not hasattr(opts, "timeout"):
        made = cls()
        if opts is not None:
            made.reduceOp = opts if isinstance(opts, _d.ReduceOp) else _d.ReduceOp(opts)
        return made
    return opts
