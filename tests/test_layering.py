"""The layering of docs/architecture.md, checked on the source: a layer imports only
those below it.

``shape``/``wire`` <- ``calls`` <- ``rank``/``host``/``launchers`` <- ``controller`` <-
``actor`` <- ``kernel``/``widgets``. ``rank``/``host`` sit on ``calls``, ``wire`` and
``shape`` only (they never import the controller, the actor API, the kernel or the
widgets); the actor API reads the rank's context (``current_rank()`` in user code on a
rank).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "monarch_kernel"

BASE = {"shape", "wire"}
ALLOWED: dict[str, set[str]] = {
    "shape": BASE,
    "wire": BASE,
    "calls": BASE | {"calls"},
    "rank": BASE | {"calls", "rank"},
    "host": BASE | {"calls", "rank", "host"},
    "launchers": BASE | {"calls", "launchers"},
    "controller": BASE | {"calls", "launchers", "controller"},
    # The tensor engine's controller side sits on the calls (a Requester); the actor API
    # (``ProcMesh.activate``) and Monarch's top-level names sit on it.
    "tensor_engine": BASE | {"calls", "tensor_engine"},
    "mesh_controller": BASE | {"calls", "tensor_engine", "mesh_controller"},
    "builtins": BASE | {"calls", "tensor_engine", "builtins"},
    "actor": BASE
    | {"calls", "launchers", "controller", "rank", "actor", "config", "tensor_engine"},
    "kernel": BASE
    | {
        "calls",
        "launchers",
        "controller",
        "rank",
        "actor",
        "kernel",
        "widgets",
        "config",
        "tensor_engine",
    },
    "widgets": BASE
    | {"calls", "launchers", "controller", "rank", "actor", "widgets", "config", "tensor_engine"},
    # Top-level modules: configuration (imports nothing of the package) and Monarch's
    # modules beside the actor API (spmd, job, rdma: they sit on it).
    "config": BASE | {"config"},
    "spmd": BASE | {"calls", "rank", "actor", "config", "spmd"},
    "job": BASE | {"calls", "launchers", "controller", "rank", "actor", "config", "job"},
    "rdma": BASE | {"calls", "rank", "actor", "config", "rdma"},
    "training": BASE | {"calls", "rank", "training"},
    "sharding": BASE | {"calls", "rank", "sharding"},
}


def _layer(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return None if rel.name in ("__init__.py", "__main__.py") else rel.stem
    return rel.parts[0]


def _imported_layers(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "monarch_kernel" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if _layer(p) is not None)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_only_lower_layers(path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{path}: unknown layer {layer!r}; add it to ALLOWED"
    bad = sorted(
        (line, imported)
        for imported, line in _imported_layers(path)
        if imported not in ALLOWED[layer]
    )
    assert not bad, f"{path.relative_to(PACKAGE)} ({layer}) imports layers above it: {bad}"


def test_every_layer_is_known():
    assert {_layer(p) for p in MODULES} <= set(ALLOWED)


# -- what a rank loads ------------------------------------------------------------------

#: Modules a rank process may load: everything but the controller's side. A rank that
#: runs actors and calls other meshes loads ``monarch_kernel.actor``, never ``controller/``
#: or ``launchers/`` (``actor.hosts``, which starts meshes, is imported on first use only).
RANK_SIDE_LAYERS = {"shape", "wire", "calls", "rank", "host", "config", "spmd", "rdma"}
RANK_SIDE_ACTOR = {
    "__init__",
    "actor",
    "api",
    "channels",
    "endpoints",
    "local_context",
    "mesh_view",
    "meshes",
    "peer",
    "peer.requester",
    "peer.client",
    "peer.inline",
    "peer.reply",
    "peer.resolve",
    "resize",
}
CONTROLLER_ONLY = {"controller", "launchers"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


ALL_MODULES = sorted(PACKAGE.rglob("*.py"))
MODULE_NAMES = {_module_name(p) for p in ALL_MODULES}


def _imports(path: Path, with_type_checking: bool) -> set[tuple[str, int]]:
    """Package modules ``path`` imports anywhere (functions included), as
    ``(module, line)``; ``from pkg import mod`` counts as importing ``pkg.mod``. Imports
    under ``if TYPE_CHECKING:`` count only ``with_type_checking``."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    if not with_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{a.name}"
                if f"{node.module}.{a.name}" in MODULE_NAMES
                else node.module
                for a in node.names
            ]
        else:
            continue
        found |= {(t, node.lineno) for t in targets if t in MODULE_NAMES}
    return found


def _module_level_actor_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of each module of ``actor/`` imported at module level, however
    it is written (``from monarch_kernel.actor.hosts import x``, ``from
    monarch_kernel.actor import hosts``, ``import monarch_kernel.actor.hosts``)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("monarch_kernel.actor."):
                found.append((node.lineno, node.module))
            elif node.module == "monarch_kernel.actor":
                found += [
                    (node.lineno, f"monarch_kernel.actor.{a.name}")
                    for a in node.names
                    if f"monarch_kernel.actor.{a.name}" in MODULE_NAMES
                ]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name)
                for a in node.names
                if a.name.startswith("monarch_kernel.actor.")
            ]
    return found


def test_an_import_of_hosts_is_seen_however_it_is_written():
    for text in (
        "from monarch_kernel.actor.hosts import HostMesh\n",
        "from monarch_kernel.actor import hosts\n",
        "import monarch_kernel.actor.hosts\n",
    ):
        assert _module_level_actor_imports(ast.parse(text)) == [(1, "monarch_kernel.actor.hosts")]


def _in_actor(path: Path) -> str:
    """``path``'s module name inside ``actor/`` (``peer.client``, ``meshes``, ``peer``
    for ``peer/__init__.py``)."""
    return ".".join(path.relative_to(PACKAGE / "actor").with_suffix("").parts).removesuffix(
        ".__init__"
    )


def _rank_side(path: Path) -> bool:
    layer = _layer(path)
    if layer == "actor":
        return _in_actor(path) in RANK_SIDE_ACTOR
    return layer in RANK_SIDE_LAYERS


@pytest.mark.parametrize(
    "path", [p for p in MODULES if _rank_side(p)], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_rank_side_modules_never_import_the_controller(path):
    # Anywhere in the module, even in a function: the controller and the launchers.
    bad = sorted(
        (line, mod)
        for mod, line in _imports(path, with_type_checking=False)
        if mod.split(".")[1] in CONTROLLER_ONLY
    )
    # At import time: the controller's part of the actor API (its functions may import
    # it on their controller-only branches; tests/test_mesh_sides.py checks a rank's
    # sys.modules after it used every adverb).
    tree = ast.parse(path.read_text(), str(path))
    bad += sorted(
        (line, module)
        for line, module in _module_level_actor_imports(tree)
        if module.removeprefix("monarch_kernel.actor.") not in RANK_SIDE_ACTOR
    )
    assert not bad, f"{path.relative_to(PACKAGE)} (loaded by ranks) imports {bad}"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over every
    import in the package: module level, in functions and under TYPE_CHECKING."""
    graph = {
        _module_name(p): sorted({m for m, _ in _imports(p, with_type_checking=True)})
        for p in ALL_MODULES
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_the_package():
    assert _cycles() == []


# -- the order inside the packages ------------------------------------------------------

#: Inside each of these packages, its parts (subpackages and top-level modules) lowest
#: first: a part imports only parts before it in its list (anywhere in a module,
#: functions and ``TYPE_CHECKING`` included). A newcomer reads a package bottom-up in
#: this order; a part that needs one above it gets a hook or a Protocol instead.
PART_ORDER: dict[str, list[str]] = {
    "controller": [
        "__init__",
        "state",  # records, events, phase, requests: what is known of a mesh
        "messaging",  # sockets, sending, receiving, dispatch
        "attach_file",  # the attach file a detachable mesh writes
        "lifecycle",  # start, supervise, fail, restart
        "telemetry",  # per-step telemetry of the ranks, stragglers, profiles
        "training",  # TrainingState recovery from replicas
        "elastic",  # grow and shrink
        "mesh_recovery",
        "mesh",  # MeshRuntime: the façade the layers above hold
        "detach",  # features built on whole meshes: above the façade
    ],
    "rank": [
        "__init__",
        "config",
        "import_hooks",  # patching a library's module once it is imported
        "context",
        "oom",
        "torch_modes",  # an interrupt never leaves torch's modes switched (grad, autocast)
        "errors",
        "link",
        "signals",
        "lane",  # the same-machine lane to the controller (the outbox and inbox use it)
        "outbox",
        "supervise",
        "actor_logs",  # Monarch's [actor=...] prefix on the logging records of actors
        "runners",  # worker threads and the relief thread (rank.lines hands them work)
        "lines",  # which thread runs each actor message, and the actors' lines
        "actors",
        "listener_gate",
        "dataplane",
        "inbox",
        "stdio",
        "debug",
        "cells",
        "replicas",
        "pg",
        "telemetry",  # per-step telemetry and ``%mesh profile`` (hooks the pg)
        "env",
        "world",
        "sharding",  # device_mesh(), FSDP2/HSDP replicas and resets (training uses them)
        "training",
        "tensors",  # the tensor engine's rank side (``tensor_ops`` records)
        "control",
        "device",
        "scripts",
        "runtime",
        "forked",
    ],
    "actor": [
        "actor",
        "log_level",  # ProcMesh.logging_option(level=): a helper actor
        "endpoints",
        "local_context",
        "resize",
        "peer",
        "channels",
        "mesh_view",
        "meshes",
        "client_actor",
        "client_server",
        "client_proc",
        "orphans",  # what a dead rank's actors owned stops (hosts' watch_faults)
        "hosts",
        "api",
        "attach",
        "__init__",
    ],
    "tensor_engine": [
        "errors",
        "state",
        "client",
        "process_groups",
        "streams",
        "tensor",
        "actor_args",
        "mesh",
        "fetch",
        "moves",
        "reductions",
        "remote_functions",
        "endpoint_rref",  # an actor endpoint's rref: a remote function that calls it
        "borrows",
        "gradients",
        "opaque",  # OpaqueRef, OpaqueObject, OpaqueModule: objects kept on the ranks
        "remote_autograd",  # remote_autograd_function: an autograd.Function on the ranks
        "random",
        "__init__",
    ],
    "kernel": [
        "__init__",
        "table",
        "notebook",
        "channel",
        "output_items",
        "output",
        "args",
        "help",
        "targets",
        "lab",
        "install",
        "debug",
        "failure_voice",
        "remote",
        "debug_remote",
        "hints",
        "remote_cell",
        "push_pull",
        "mesh",
        "magics",
        "kernel",
        "__main__",
    ],
}


def _part(module: str) -> tuple[str, str] | None:
    """``(package, part)`` of a dotted module name inside a package of PART_ORDER."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in PART_ORDER:
        return None
    return parts[1], parts[2] if len(parts) > 2 else "__init__"


def test_every_part_has_a_place_in_its_package_order():
    missing = {
        found
        for found in (_part(_module_name(p)) for p in ALL_MODULES)
        if found and found[1] not in PART_ORDER[found[0]]
    }
    assert missing == set(), "add these parts to PART_ORDER"


def _upward_imports(package: str, modules: list[tuple[str, Path]]) -> list[str]:
    """Imports in ``modules`` (``(dotted name, path)``) of a part of ``package`` placed
    above the importing module's own part in ``PART_ORDER``."""
    order = PART_ORDER[package]
    bad = []
    for name, path in modules:
        mine = _part(name)
        if mine is None or mine[0] != package:
            continue
        for imported, line in _imports(path, with_type_checking=True):
            theirs = _part(imported)
            if theirs is None or theirs[0] != package or theirs[1] == mine[1]:
                continue
            if order.index(theirs[1]) > order.index(mine[1]):
                bad.append(f"{name}:{line} imports {imported}")
    return bad


@pytest.mark.parametrize("package", sorted(PART_ORDER))
def test_parts_import_only_the_parts_below_them(package):
    bad = _upward_imports(package, [(_module_name(p), p) for p in ALL_MODULES])
    assert bad == [], "a part imports one above it in PART_ORDER:\n" + "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path):
    # The check fails the old way: a state module importing the façade, or the rank's
    # process group importing its TrainingState, is reported with its line.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "from monarch_kernel.controller.state.records import RankInfo\n"
        "def later():\n"
        "    from monarch_kernel.controller.mesh import MeshRuntime\n"
    )
    assert _upward_imports("controller", [("monarch_kernel.controller.state.probe", probe)]) == [
        "monarch_kernel.controller.state.probe:4 imports monarch_kernel.controller.mesh"
    ]
    probe.write_text("from monarch_kernel.rank.training import state\n")
    assert _upward_imports("rank", [("monarch_kernel.rank.pg.probe", probe)]) == [
        "monarch_kernel.rank.pg.probe:1 imports monarch_kernel.rank.training.state"
    ]
    assert _upward_imports("rank", [("monarch_kernel.rank.training.probe", probe)]) == []


def _faces() -> list[Path]:
    return [p for p in ALL_MODULES if p.name == "__init__.py" and p.parent.parent != PACKAGE.parent]


#: Faces that name a module of their package on purpose, with why.
FACE_SHADOWS_ALLOWED = {
    # ``dashboard(mesh)`` is the public function; __init__ imports the module first, so
    # the name stays bound to the function (a later import finds the module loaded).
    ("widgets", "dashboard"),
}


@pytest.mark.parametrize("init", _faces(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_face_never_hides_a_module_of_its_package(init):
    # `from pkg import mod` must keep giving the module: a name the face binds (a
    # re-export, a function, a class, an assignment) named like a module of the package
    # would be returned instead.
    tree = ast.parse(init.read_text())
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            bound |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    modules = {p.stem for p in init.parent.glob("*.py")} | {
        p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()
    }
    package = init.parent.name
    assert {
        name for name in bound & modules if (package, name) not in FACE_SHADOWS_ALLOWED
    } == set()
