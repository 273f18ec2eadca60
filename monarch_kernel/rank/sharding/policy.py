"""``shard_model``: FSDP2 applied to a model by a policy, and the plan it followed.

A policy picks the modules that get their own ``fully_shard`` (their own all-gather and
reduce-scatter): the transformer blocks (children of a ``ModuleList``/``Sequential`` of
one class, or classes the user names), or modules by parameter count, or a list the
user gives; the root is always wrapped last. The mesh defaults to the mesh's own dims:
FULL_SHARD within a host and HSDP across hosts (replicate over ``hosts``, shard over
``gpus``), FSDP over every rank on a mesh of one dim or of one host.

The :class:`ShardPlan` says what was (or would be, with ``apply=False``) done: the
wrapped modules, the parameter bytes per rank before and after, and the communication one
training step implies (the all-gathers of forward and backward, the reduce-scatter, and
HSDP's all-reduce across replicas). Its ``str``/``repr``/``_repr_html_`` is that table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from monarch_kernel.rank.sharding.fingerprint import describe_mesh


class Strategy(str, Enum):
    """How the parameters are spread over the mesh."""

    #: FULL_SHARD over one mesh dim: every rank holds 1/N of each parameter.
    FSDP = "FSDP"
    #: Sharded within the shard dim, replicated across the replicate dim.
    HSDP = "HSDP"


class Policy(str, Enum):
    """How the modules that get their own ``fully_shard`` are chosen."""

    #: ``blocks`` when the model has repeated blocks, else ``size``.
    AUTO = "auto"
    #: Each repeated block (transformer layer): children of a ModuleList/Sequential of
    #: the same class, or modules of the classes named in ``block_classes``.
    BLOCKS = "blocks"
    #: Bottom-up, each module whose not-yet-wrapped parameters reach ``min_params``.
    SIZE = "size"
    #: The modules the caller listed.
    MODULES = "modules"


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` call: a module and the parameters its group holds (those not
    in a unit inside it)."""

    name: str
    cls: str
    params: int
    #: The group's parameters whole, in their storage dtype.
    bytes_whole: int
    #: What one rank holds of them after sharding (dim 0, padded as FSDP2 pads).
    bytes_per_rank: int
    #: The unsharded parameters one all-gather produces (in the compute dtype).
    gather_bytes: int
    #: The gradients one reduce-scatter takes (in the reduce dtype).
    reduce_bytes: int
    #: Freed after forward, so gathered again for backward.
    reshard_after_forward: bool


@dataclass(frozen=True)
class Communication:
    """The collectives one training step (forward + backward) implies, bytes per rank."""

    all_gather_forward: int
    all_gather_backward: int
    reduce_scatter: int
    #: HSDP's all-reduce of the reduced shards across the replicas (0 without replicas).
    all_reduce_replicas: int

    @property
    def all_gather(self) -> int:
        """Forward and backward together."""
        return self.all_gather_forward + self.all_gather_backward


@dataclass(frozen=True)
class ShardPlan:
    """What :func:`shard_model` did (or, with ``apply=False``, would do).

    ``str(plan)``, ``repr(plan)`` and the notebook's HTML show the table: strategy and
    mesh, the wrapped modules with their parameters and bytes per rank, the totals before
    and after, and the communication per step. ``plan.apply()`` applies a dry-run plan.
    """

    strategy: Strategy
    #: ``(hosts=2, gpus=2)``: the mesh the parameters are sharded on.
    mesh: str
    shard_dim: str
    shard_size: int
    replicate_dim: str | None
    replicas: int
    policy: Policy
    #: Why these modules: ``4 × Block in 'blocks'``.
    chosen: str
    units: tuple[Unit, ...]
    params: int
    bytes_before: int
    bytes_after: int
    communication: Communication
    mixed_precision: str
    applied: bool
    #: What the policy left alone and why (shared parameters, ...).
    notes: tuple[str, ...] = ()
    _model: Any = field(default=None, repr=False, compare=False)
    _modules: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    _kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Pickled (``%pull``, a cell's value) without the model and the mesh: only the
        # plan's data travels; a plan unpickled elsewhere cannot ``apply()``.
        public = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for private in ("_model", "_modules", "_kwargs"):
            public.pop(private)
        return (_rebuild, (public,))

    @property
    def wrapped(self) -> tuple[str, ...]:
        """Qualified names of the wrapped modules, the root (``""``) last."""
        return tuple(u.name for u in self.units)

    def apply(self) -> ShardPlan:
        """Apply this plan (made with ``apply=False``) to its model; returns the plan
        marked applied."""
        if self.applied:
            return self
        if self._model is None:
            raise RuntimeError("this plan was unpickled: apply it on the ranks where it was made")
        _apply(self._model, self._modules, self._kwargs)
        return replace(self, applied=True)

    # -- views --------------------------------------------------------------------------

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for u in self.units:
            rows.append(
                (
                    u.name or "(root)",
                    u.cls,
                    _count(u.params),
                    _bytes(u.bytes_whole),
                    _bytes(u.bytes_per_rank),
                )
            )
        return rows

    def _head(self) -> str:
        if self.strategy is Strategy.HSDP:
            how = (
                f"HSDP on mesh {self.mesh}: replicate over {self.replicate_dim!r} "
                f"({self.replicas}), shard over {self.shard_dim!r} ({self.shard_size})"
            )
        else:
            how = (
                f"FSDP (full shard) on mesh {self.mesh}: shard over {self.shard_dim!r} "
                f"({self.shard_size})"
            )
        state = "" if self.applied else " [dry run: nothing applied]"
        return f"shard_model: {how}; policy {self.policy.value!r}: {self.chosen}{state}"

    def _footer(self) -> list[str]:
        c = self.communication
        lines = [
            f"parameters: {_count(self.params)}, {_bytes(self.bytes_before)} per rank before, "
            f"{_bytes(self.bytes_after)} per rank after "
            f"(reshard after forward: {self._reshard_word()}; mixed precision: "
            f"{self.mixed_precision})",
            f"communication per training step, per rank: all-gather "
            f"{_bytes(c.all_gather)} (forward {_bytes(c.all_gather_forward)} + backward "
            f"{_bytes(c.all_gather_backward)}), reduce-scatter {_bytes(c.reduce_scatter)}"
            + (
                f", all-reduce across replicas ({self.replicate_dim}) "
                f"{_bytes(c.all_reduce_replicas)}"
                if self.strategy is Strategy.HSDP
                else ""
            ),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return lines

    def _reshard_word(self) -> str:
        inner = [u for u in self.units if u.name]
        if not inner:
            return "no (the root only)"
        return "yes" if all(u.reshard_after_forward for u in inner) else "no"

    def __str__(self) -> str:
        header = ("wrapped module", "class", "params", "bytes (whole)", "bytes / rank")
        rows = [header, *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [self._head()]
        for i, row in enumerate(rows):
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:])]
            lines.append("  " + "  ".join(cells).rstrip())
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        return "\n".join(lines + self._footer())

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(
            f"<th>{esc(h)}</th>"
            for h in ("wrapped module", "class", "params", "bytes (whole)", "bytes / rank")
        )
        body = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in self._rows()
        )
        foot = "".join(f"<div>{esc(line)}</div>" for line in self._footer())
        return (
            f"<div><b>{esc(self._head())}</b><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>{foot}</div>"
        )


def _rebuild(values: dict[str, Any]) -> ShardPlan:
    return ShardPlan(**values)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -- choosing the modules ----------------------------------------------------------------


def find_blocks(model: Any, block_classes: Iterable[Any] = ()) -> tuple[list[str], str]:
    """Qualified names of the model's repeated blocks and how they were found.

    With ``block_classes`` (classes or class names): every outermost module of one of
    them. Without: the children of a ``ModuleList``/``Sequential`` that share a class
    (two or more), in the container holding the most parameters."""
    import torch

    wanted = {c if isinstance(c, str) else c.__name__ for c in block_classes}
    if wanted:
        names: list[str] = []
        for name, module in model.named_modules():
            if not name or type(module).__name__ not in wanted:
                continue
            if any(name.startswith(n + ".") for n in names):
                continue
            names.append(name)
        return names, f"{len(names)} module(s) of class {', '.join(sorted(wanted))}"
    best: tuple[int, list[str], str] = (0, [], "")
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, Any]]] = {}
        for child_name, child in module.named_children():
            by_class.setdefault(type(child), []).append((child_name, child))
        for cls, children in by_class.items():
            size = sum(p.numel() for _, c in children for p in c.parameters())
            if len(children) < 2 or size == 0 or size <= best[0]:
                continue
            qualified = [f"{name}.{c}" if name else c for c, _ in children]
            best = (size, qualified, f"{len(children)} × {cls.__name__} in {name or '(root)'!r}")
    return best[1], best[2]


def by_size(model: Any, min_params: int) -> list[str]:
    """Bottom-up: each module (not the root) whose parameters not yet in a chosen module
    reach ``min_params``."""
    chosen: list[str] = []

    def visit(name: str, module: Any) -> int:
        left = int(sum(p.numel() for p in module.parameters(recurse=False)))
        for child_name, child in module.named_children():
            left += visit(f"{name}.{child_name}" if name else child_name, child)
        if name and left >= min_params:
            chosen.append(name)
            return 0
        return left

    visit("", model)
    return chosen


def _shared_outside(model: Any, names: Sequence[str]) -> dict[str, str]:
    """Chosen modules holding a parameter that a module outside them also holds (tied
    weights): FSDP2 refuses to put a shared parameter in two groups. name -> the other."""
    owners: dict[int, list[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    out: dict[str, str] = {}
    for name in names:
        prefix = name + "."
        for paths in owners.values():
            inside = [p for p in paths if p.startswith(prefix)]
            outside = [p for p in paths if not p.startswith(prefix)]
            if inside and outside:
                out[name] = f"{inside[0]} is tied to {outside[0]}"
                break
    return out


# -- the mesh ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mesh:
    mesh: Any
    strategy: Strategy
    shard_dim: str
    shard_size: int
    replicate_dim: str | None
    replicas: int


def _choose_mesh(mesh: Any, strategy: str) -> _Mesh:
    from monarch_kernel.rank.sharding.mesh import DeviceMeshError, device_mesh

    dm = device_mesh() if mesh is None else mesh
    names = tuple(dm.mesh_dim_names or (f"dim{i}" for i in range(dm.ndim)))
    sizes = tuple(int(s) for s in dm.mesh.shape)
    if strategy not in ("auto", "fsdp", "hsdp"):
        raise ValueError(f"shard_model(strategy=...): 'auto', 'fsdp' or 'hsdp', not {strategy!r}")
    if dm.ndim == 1:
        if strategy == "hsdp":
            raise DeviceMeshError(
                f"shard_model(strategy='hsdp') needs a mesh of two dims (replicate, shard); "
                f"{describe_mesh(dm)} has one"
            )
        return _Mesh(dm, Strategy.FSDP, names[0], sizes[0], None, 1)
    if dm.ndim != 2:
        raise DeviceMeshError(
            f"shard_model(): the mesh {describe_mesh(dm)} has {dm.ndim} dims; pass "
            "mesh= of one dim (FSDP) or two (HSDP: replicate, shard)"
        )
    if strategy == "fsdp" or (strategy == "auto" and mesh is None and sizes[0] == 1):
        if sizes[0] == 1:  # one host: FSDP within it
            return _Mesh(dm[names[1]], Strategy.FSDP, names[1], sizes[1], None, 1)
        flat = dm._flatten("_".join(names))  # FSDP over every rank
        return _Mesh(flat, Strategy.FSDP, "_".join(names), sizes[0] * sizes[1], None, 1)
    return _Mesh(dm, Strategy.HSDP, names[1], sizes[1], names[0], sizes[0])


# -- mixed precision ---------------------------------------------------------------------


def _mp_policy(mixed_precision: Any) -> tuple[Any, str]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy(), "none"
    if isinstance(mixed_precision, str):
        dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16}
        if mixed_precision not in dtypes:
            raise ValueError(
                f"shard_model(mixed_precision=...): 'bf16', 'fp16', a MixedPrecisionPolicy "
                f"or None, not {mixed_precision!r}"
            )
        mixed_precision = MixedPrecisionPolicy(
            param_dtype=dtypes[mixed_precision], reduce_dtype=torch.float32
        )

    def name(dtype: Any) -> str:
        return str(dtype).removeprefix("torch.") if dtype is not None else "as stored"

    return mixed_precision, (
        f"params {name(mixed_precision.param_dtype)}, reduce {name(mixed_precision.reduce_dtype)}"
    )


# -- the plan ----------------------------------------------------------------------------


def _unit(
    name: str, module: Any, skip: set[int], shard: int, mp: Any, reshard: bool
) -> tuple[Unit, set[int]]:
    """The unit of ``module``: its parameters not in ``skip`` (those of units inside it)."""
    params = [p for p in module.parameters() if id(p) not in skip]
    whole = per_rank = gather = reduce = count = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        rest = p.numel() // rows if rows else 0
        padded_rows = math.ceil(rows / shard) * shard
        elem = p.element_size()
        compute = _itemsize(mp.param_dtype) or elem
        reduce_elem = _itemsize(mp.reduce_dtype) or compute
        count += p.numel()
        whole += p.numel() * elem
        per_rank += padded_rows // shard * rest * elem
        gather += padded_rows * rest * compute
        reduce += padded_rows * rest * reduce_elem
    cls = type(module).__name__
    unit = Unit(name, cls, count, whole, per_rank, gather, reduce, reshard)
    return unit, {id(p) for p in params}


def _itemsize(dtype: Any) -> int:
    if dtype is None:
        return 0
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


def plan(
    model: Any,
    policy: str | Policy = Policy.AUTO,
    *,
    mesh: Any = None,
    strategy: str = "auto",
    modules: Sequence[Any] | None = None,
    block_classes: Iterable[Any] = (),
    min_params: int = 1_000_000,
    mixed_precision: Any = None,
    reshard_after_forward: bool = True,
) -> ShardPlan:
    """The plan :func:`shard_model` would follow (nothing applied)."""
    chosen_policy = Policy.MODULES if modules is not None else Policy(policy)
    notes: list[str] = []
    named = dict(model.named_modules())
    if modules is not None:
        by_id = {id(m): n for n, m in named.items()}
        names = []
        for m in modules:
            name = m if isinstance(m, str) else by_id.get(id(m))
            if name is None or name not in named:
                raise ValueError(f"shard_model(modules=...): {m!r} is not a module of the model")
            if name:
                names.append(name)
        why = f"{len(names)} module(s) given"
    else:
        names, why = [], ""
        if chosen_policy in (Policy.AUTO, Policy.BLOCKS):
            names, why = find_blocks(model, block_classes)
            if chosen_policy is Policy.AUTO:
                chosen_policy = Policy.BLOCKS if names else Policy.SIZE
            elif not names:
                why = "no repeated blocks found: the root only"
        if chosen_policy is Policy.SIZE:
            names = by_size(model, min_params)
            why = f"{len(names)} module(s) of at least {_count(min_params)} parameters"
        tied = _shared_outside(model, names)
        for name, reason in tied.items():
            notes.append(f"{name!r} left in its parent's group: {reason}")
        names = [n for n in names if n not in tied]
    if not names:
        why = (why + "; " if why else "") + "one group for the whole model"
    chosen_mesh = _choose_mesh(mesh, strategy)
    mp, mp_text = _mp_policy(mixed_precision)
    # Inner units first (deepest first), so that each holds only its own parameters.
    order = sorted(names, key=lambda n: -n.count("."))
    units: list[Unit] = []
    taken: set[int] = set()
    for name in order:
        unit, ids = _unit(
            name, named[name], taken, chosen_mesh.shard_size, mp, reshard_after_forward
        )
        units.append(unit)
        taken |= ids
    # The root: FSDP keeps its parameters gathered after forward (they are needed first
    # in backward) unless the caller asked otherwise.
    root, _ = _unit("", model, taken, chosen_mesh.shard_size, mp, reshard=False)
    units.sort(key=lambda u: list(named).index(u.name))
    units.append(root)
    shard = chosen_mesh.shard_size
    gather_fwd = sum(u.gather_bytes for u in units) if shard > 1 else 0
    gather_bwd = sum(u.gather_bytes for u in units if u.reshard_after_forward) if shard > 1 else 0
    reduce = sum(u.reduce_bytes for u in units)
    replicas = (
        sum(u.reduce_bytes // shard for u in units) if chosen_mesh.strategy is Strategy.HSDP else 0
    )
    kwargs = {
        "mesh": chosen_mesh.mesh,
        "mp_policy": mp,
        "reshard_after_forward": reshard_after_forward,
    }
    return ShardPlan(
        strategy=chosen_mesh.strategy,
        mesh=describe_mesh(chosen_mesh.mesh),
        shard_dim=chosen_mesh.shard_dim,
        shard_size=shard,
        replicate_dim=chosen_mesh.replicate_dim,
        replicas=chosen_mesh.replicas,
        policy=chosen_policy,
        chosen=why,
        units=tuple(units),
        params=sum(u.params for u in units),
        bytes_before=sum(u.bytes_whole for u in units),
        bytes_after=sum(u.bytes_per_rank for u in units),
        communication=Communication(gather_fwd, gather_bwd, reduce if shard > 1 else 0, replicas),
        mixed_precision=mp_text,
        applied=False,
        notes=tuple(notes),
        _model=model,
        _modules=tuple(named[n] for n in order),
        _kwargs=kwargs,
    )


def _apply(model: Any, modules: Sequence[Any], kwargs: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        fully_shard(module, **kwargs)
    root = dict(kwargs)
    if root["reshard_after_forward"] is True:
        root["reshard_after_forward"] = None  # FSDP's own choice for a root: keep gathered
    fully_shard(model, **root)


def shard_model(
    model: Any,
    policy: str | Policy = Policy.AUTO,
    *,
    mesh: Any = None,
    strategy: str = "auto",
    modules: Sequence[Any] | None = None,
    block_classes: Iterable[Any] = (),
    min_params: int = 1_000_000,
    mixed_precision: Any = None,
    reshard_after_forward: bool = True,
    apply: bool = True,
    show: bool | str = True,
) -> ShardPlan:
    """Apply FSDP2 (``fully_shard``) to ``model`` by a policy; print and return the plan.

    * ``policy``: ``"auto"`` (repeated blocks if the model has them, else by size),
      ``"blocks"`` (each child of a ``ModuleList``/``Sequential`` of one class, e.g. the
      transformer layers; or each module of ``block_classes``), ``"size"`` (bottom-up,
      modules of at least ``min_params`` parameters). ``modules``: the modules (or their
      qualified names) to wrap, instead of a policy. The root is always wrapped, last.
    * ``mesh``: a ``DeviceMesh``; by default the mesh's own (``device_mesh()``): on
      ``(hosts, gpus)`` HSDP, replicated over ``hosts`` and sharded over ``gpus``, FSDP
      within the one host of a one-host mesh, FSDP over a mesh of one dim.
      ``strategy="fsdp"`` shards over every rank of a two-dim mesh instead.
    * ``mixed_precision``: ``"bf16"``, ``"fp16"`` (reductions in float32) or a
      ``MixedPrecisionPolicy``; ``reshard_after_forward``: free the gathered parameters
      after forward (gather again in backward) or keep them.
    * ``apply=False``: only plan (``plan.apply()`` applies it later). ``show``: print
      the plan on the mesh's first rank (the plan is the same on every rank);
      ``show="all"`` on every rank, ``show=False`` nowhere.

    Call it on every rank, with the same arguments (in a ``%%remote`` cell). Returns a
    :class:`ShardPlan`: the wrapped modules, parameter bytes per rank before and after,
    and the communication each training step implies.
    """
    made = plan(
        model,
        policy,
        mesh=mesh,
        strategy=strategy,
        modules=modules,
        block_classes=block_classes,
        min_params=min_params,
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
    )
    if apply:
        made = made.apply()
    if show and (show == "all" or _first_of_mesh(made)):
        print(made, flush=True)
    return made


def _first_of_mesh(made: ShardPlan) -> bool:
    """Whether this rank is the first of the plan's mesh: the plan is the same on every
    rank (the automatic check compares), so one rank shows it."""
    import torch.distributed as dist

    mesh = made._kwargs.get("mesh")
    if mesh is None or not dist.is_initialized():
        return True
    return int(mesh.mesh.flatten()[0]) == dist.get_rank()
