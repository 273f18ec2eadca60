"""Packaging as users install kernels: ``python -m build`` gives an sdist and a wheel that
carry the built JupyterLab extension; a wheel built from the sdist is the same wheel; the
wheel installs into a fresh venv (torch from the machine's local CPU wheel, through
``constraints.txt``); ``python -m monarch_kernel install --user`` and ``--sys-prefix``
register the kernel; and a 2-rank notebook runs through that venv's ``jupyter execute``.

Everything the venv's programs write goes under temporary directories (``HOME`` included:
the real user's ``~/.local`` is never touched). Each phase's time, the artifacts' sizes and
what they hold are written to ``test-artifacts/packaging.md``."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
import tomllib
from conftest import ARTIFACTS, ROOT
from helpers import WaitTimeout, wait_until

PACKAGE = "monarch_kernel"
KERNEL_NAME = "monarch"
LABEXTENSION = "monarch-kernel-labextension"
#: Where a wheel's shared data puts the prebuilt extension (and JupyterLab looks for it).
SHARED_LABEXTENSION = f"share/jupyter/labextensions/{LABEXTENSION}"
#: The built extension in the checkout (git-ignored; ``make setup`` builds it).
BUILT_LABEXTENSION = ROOT / PACKAGE / "labextension"
#: Seconds one command of the user's path may take (a cold install of torch and
#: JupyterLab on a loaded 2-core machine is the slowest: about 30-60 s).
COMMAND_TIMEOUT = 300

#: The module's fixtures run in whichever test comes first: a build, a venv and an install.
pytestmark = pytest.mark.timeout(2 * COMMAND_TIMEOUT)


def checkout_version() -> str:
    """``__version__`` as ``monarch_kernel/__init__.py`` spells it (read, not imported)."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError("monarch_kernel/__init__.py sets no __version__")


@pytest.mark.unit
def test_the_version_lives_in_one_place():
    """pyproject.toml reads the version from ``__version__``; the lab extension's
    package.json and the changelog name the same one."""
    import monarch_kernel

    version = checkout_version()
    assert monarch_kernel.__version__ == version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml spells the version itself"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == f"{PACKAGE}/__init__.py"
    npm = json.loads((ROOT / "labextension" / "package.json").read_text())
    assert npm["version"] == version, "labextension/package.json and __version__ differ"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## .*\b{re.escape(version)}\b", changelog, re.MULTILINE), (
        f"CHANGELOG.md has no section for {version}"
    )


# --- the user's path: build, install, register, run -------------------------------------


@dataclass
class Report:
    """What the module measured: each phase's seconds and the artifacts' inventories,
    written to test-artifacts/packaging.md when the module ends."""

    seconds: dict[str, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - began

    def write(self, path: Path) -> None:
        path.parent.mkdir(exist_ok=True)
        timing = [f"| {name} | {s:.1f} s |" for name, s in self.seconds.items()]
        path.write_text(
            "\n".join(["# Packaging", "", "| phase | time |", "|---|---|", *timing, ""])
            + "\n".join(["", *self.lines, ""])
        )


@dataclass(frozen=True)
class Built:
    """The artifacts ``python -m build`` made of the checkout, and the wheel it made of
    that sdist."""

    wheel: Path
    sdist: Path
    wheel_from_sdist: Path


@dataclass(frozen=True)
class Venv:
    """A fresh virtual environment with the wheel installed; its commands run with a
    ``HOME`` of their own and without this process's Python and Jupyter settings."""

    root: Path
    home: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "JUPYTER_", "XDG_", "VIRTUAL_ENV", "CONDA_"))
        }
        env.update(
            HOME=str(self.home),
            VIRTUAL_ENV=str(self.root),
            PATH=f"{self.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        env.update(extra)
        return env

    def run(self, *argv: str, cwd: Path | None = None, **extra_env: str) -> str:
        """Run one of the venv's programs (``bin/NAME``); its output, stdout then stderr."""
        program = str(self.root / "bin" / argv[0])
        return run([program, *argv[1:]], env=self.env(**extra_env), cwd=cwd or self.home)


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run ``argv`` to its end; fail the test with its output if it fails."""
    p = subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{out[-4000:]}"
    return out


def inventory(names: list[str]) -> Counter[str]:
    """File counts by folder: the package's sub-packages one by one, a wheel's shared data
    down to the extension's folder, every other folder as a whole."""
    counts: Counter[str] = Counter()
    for name in names:
        parts = name.split("/")
        if len(parts) == 1:
            key = "(top-level files)"
        elif ".data" in parts[0]:
            key = "/".join(parts[:6]) + "/"
        elif parts[0] == PACKAGE:
            key = f"{PACKAGE}/{parts[1]}/" if len(parts) > 2 else f"{PACKAGE}/*.py"
        else:
            key = parts[0] + "/"
        counts[key] += 1
    return counts


def wheel_files(path: Path) -> dict[str, tuple[int, int]]:
    """A wheel's files: name -> (CRC-32, size)."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: (i.CRC, i.file_size) for i in z.infolist() if not i.is_dir()}


def sdist_files(path: Path) -> list[str]:
    """An sdist's files, without its ``NAME-VERSION/`` top folder."""
    with tarfile.open(path) as t:
        return [m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()]


def describe(what: str, path: Path, names: list[str]) -> list[str]:
    rows = [f"| `{k}` | {n} |" for k, n in sorted(inventory(names).items())]
    size = path.stat().st_size
    return [
        f"## {what}: `{path.name}`, {size / 1024:.0f} KiB, {len(names)} files",
        "",
        "| folder | files |",
        "|---|---|",
        *rows,
        "",
    ]


@pytest.fixture(scope="module")
def report() -> Iterator[Report]:
    r = Report()
    yield r
    r.write(ARTIFACTS / "packaging.md")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, report: Report) -> Built:
    """``python -m build --sdist --wheel`` of the checkout (build dependencies from the
    registries, in an isolated environment), then ``python -m build --wheel`` of the
    unpacked sdist."""
    assert (BUILT_LABEXTENSION / "package.json").exists(), (
        "the lab extension is not built: `make labextension` (the build would need node)"
    )
    out = tmp_path_factory.mktemp("dist")
    with report.phase("python -m build --sdist --wheel (checkout)"):
        run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)])
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdist) as t:
        t.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    again = tmp_path_factory.mktemp("dist-from-sdist")
    with report.phase("python -m build --wheel (unpacked sdist)"):
        run([sys.executable, "-m", "build", "--wheel", "--outdir", str(again), str(source)])
    (wheel_from_sdist,) = again.glob("*.whl")
    report.lines += describe("wheel", wheel, list(wheel_files(wheel)))
    report.lines += describe("sdist", sdist, sdist_files(sdist))
    return Built(wheel, sdist, wheel_from_sdist)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, built: Built, report: Report) -> Iterator[Venv]:
    """A fresh venv (no system site-packages) with the wheel built from the sdist
    installed as a user would: ``pip install monarch_kernel-....whl``, its dependencies
    from the registries and torch from the local CPU wheel (``constraints.txt``, as
    ``make setup`` does). ``--no-compile``: pip's byte-compiling of the ~9,000 modules
    took more than half of the install here (66 s with it, 28 s without, on 2 cores);
    Python compiles a module when it is first imported."""
    base = tmp_path_factory.mktemp("user")
    home = base / "home"
    home.mkdir()
    v = Venv(base / "venv", home)
    with report.phase("python -m venv"):
        run([sys.executable, "-m", "venv", str(v.root)])
    pip_env = v.env(PIP_CONSTRAINT=str(ROOT / "constraints.txt"))
    pip_env["HOME"] = os.environ.get("HOME", str(home))  # pip's own cache stays the user's
    with report.phase("pip install the wheel (fresh venv)"):
        run(
            [v.python, "-m", "pip", "install", "--no-compile", str(built.wheel_from_sdist)],
            env=pip_env,
            cwd=home,
        )
    yield v
    shutil.rmtree(base, ignore_errors=True)  # a gigabyte (pytest keeps its last 3 runs)


@dataclass(frozen=True)
class Registered:
    """``jupyter kernelspec list --json`` before and after each install, and
    ``jupyter labextension list`` after the wheel's install and after ``--sys-prefix``."""

    before: dict
    after_user: dict
    after_sys_prefix: dict
    extensions_from_wheel: str
    extensions_after_install: str


def kernelspecs(v: Venv) -> dict:
    """``jupyter kernelspec list --json``'s kernels: name -> resource_dir and spec."""
    specs: dict = _json_of(v.run("jupyter", "kernelspec", "list", "--json"))["kernelspecs"]
    return specs


def _json_of(out: str) -> dict:
    """The JSON object in a command's output (stdout comes first, stderr's notes after)."""
    start = out.index("{")
    obj, _ = json.JSONDecoder().raw_decode(out[start:])
    assert isinstance(obj, dict)
    return obj


def labextensions(v: Venv) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", v.run("jupyter", "labextension", "list"))


@pytest.fixture(scope="module")
def registered(venv: Venv, report: Report) -> Registered:
    """``python -m monarch_kernel install --user``, then ``--sys-prefix``, in the venv."""
    from_wheel = labextensions(venv)
    before = kernelspecs(venv)
    with report.phase("python -m monarch_kernel install --user"):
        venv.run("python", "-m", PACKAGE, "install", "--user")
    after_user = kernelspecs(venv)
    with report.phase("python -m monarch_kernel install --sys-prefix"):
        venv.run("python", "-m", PACKAGE, "install", "--sys-prefix")
    after_sys_prefix = kernelspecs(venv)
    return Registered(before, after_user, after_sys_prefix, from_wheel, labextensions(venv))


def tracked_package_files() -> list[str]:
    """The package's files that git tracks and the checkout has (not what git ignores:
    ``__pycache__``, the built extension); outside a git checkout, every file under the
    package but those."""
    try:
        out = subprocess.run(
            ["git", "ls-files", PACKAGE], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    if out:
        return [f for f in out if (ROOT / f).is_file()]
    return [
        str(p.relative_to(ROOT))
        for p in (ROOT / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and BUILT_LABEXTENSION not in p.parents
    ]


#: What never goes into the sdist: build outputs, node's packages, the tests' artifacts.
NOT_IN_SDIST = (
    "labextension/node_modules/",
    "labextension/lib/",
    ".venv/",
    "dist/",
    "docs/_build/",
    "test-artifacts/",
)


def built_labextension_files() -> list[str]:
    return sorted(
        str(p.relative_to(BUILT_LABEXTENSION)) for p in BUILT_LABEXTENSION.rglob("*") if p.is_file()
    )


@pytest.mark.local
@pytest.mark.package
def test_the_wheel_carries_the_package_and_the_built_lab_extension(built: Built):
    version = checkout_version()
    assert built.wheel.name == f"{PACKAGE}-{version}-py3-none-any.whl"
    files = wheel_files(built.wheel)
    missing = [f for f in tracked_package_files() if f not in files]
    assert not missing, f"package files the wheel lacks: {missing}"
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    # the widgets' front end (anywidget modules and the vendored uPlot with its licence)
    static = [f for f in files if f.startswith(f"{PACKAGE}/widgets/static/")]
    assert f"{PACKAGE}/widgets/static/uplot/LICENSE" in static and len(static) >= 4
    # the kernelspec's command and what `python -m monarch_kernel install` runs
    for module in ("__main__.py", "kernel/__main__.py", "kernel/install.py"):
        assert f"{PACKAGE}/{module}" in files
    # the licence (BSD-3-Clause) travels with the wheel
    assert f"{PACKAGE}-{version}.dist-info/licenses/LICENSE" in files
    # the extension twice: where JupyterLab finds it, and in the package for --prefix
    data = f"{PACKAGE}-{version}.data/data/{SHARED_LABEXTENSION}"
    ext = built_labextension_files()
    assert "package.json" in ext and "static/style.js" in ext
    for name in ext:
        assert files[f"{data}/{name}"] == files[f"{PACKAGE}/labextension/{name}"], name
    with zipfile.ZipFile(built.wheel) as z:
        npm = json.loads(z.read(f"{data}/package.json"))
        metadata = z.read(f"{PACKAGE}-{version}.dist-info/METADATA").decode()
    assert npm["name"] == LABEXTENSION and npm["version"] == version
    assert f"\nVersion: {version}\n" in metadata
    assert re.search(r"^Requires-Dist: torch", metadata, re.MULTILINE)


@pytest.mark.local
@pytest.mark.package
def test_the_sdist_builds_the_same_wheel(built: Built):
    """The sdist carries what a wheel needs (the built extension too: no node), and the
    wheel built from it holds the same files, byte for byte."""
    files = set(sdist_files(built.sdist))
    needed = {
        "pyproject.toml",
        "PKG-INFO",
        "README.md",
        "CHANGELOG.md",
        "constraints.txt",
        "LICENSE",
    }
    needed |= {f"{PACKAGE}/labextension/{name}" for name in built_labextension_files()}
    needed |= {"labextension/package.json", "labextension/yarn.lock"}
    assert needed <= files, f"the sdist lacks {sorted(needed - files)}"
    assert not [f for f in files if f.startswith(NOT_IN_SDIST) or "__pycache__" in f]
    assert wheel_files(built.wheel_from_sdist) == wheel_files(built.wheel)


@pytest.mark.local
@pytest.mark.package
def test_install_registers_the_kernel_and_the_lab_extension(venv: Venv, registered: Registered):
    version = checkout_version()
    where = venv.run("python", "-c", "import monarch_kernel as m; print(m.__version__, m.__file__)")
    got_version, path = where.split()
    assert got_version == version
    assert Path(path).is_relative_to(venv.root) and "site-packages" in Path(path).parts

    user_dir = venv.home / ".local" / "share" / "jupyter" / "kernels" / KERNEL_NAME
    env_dir = venv.root / "share" / "jupyter" / "kernels" / KERNEL_NAME
    owned = (venv.root, venv.home)
    mine = registered.before.get(KERNEL_NAME, {}).get("resource_dir", "")
    assert not any(Path(mine).is_relative_to(p) for p in owned), "registered before install"
    assert Path(registered.after_user[KERNEL_NAME]["resource_dir"]) == user_dir
    # in a venv, Jupyter prefers the environment's own kernelspecs to the user's
    assert Path(registered.after_sys_prefix[KERNEL_NAME]["resource_dir"]) == env_dir
    for folder in (user_dir, env_dir):
        spec = json.loads((folder / "kernel.json").read_text())
        assert spec["argv"][:3] == [venv.python, "-m", f"{PACKAGE}.kernel"], spec

    for listing in (registered.extensions_from_wheel, registered.extensions_after_install):
        section = listing.split(str(venv.root / "share" / "jupyter" / "labextensions"), 1)
        assert len(section) == 2, listing
        entries = section[1].split("\n/", 1)[0]  # up to the next folder's heading
        assert re.search(
            rf"^\s+{LABEXTENSION} v{re.escape(version)} enabled\s+OK", entries, re.MULTILINE
        ), listing


def notebook_text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


TWO_RANKS = [
    "import monarch_kernel, sys\nprint(monarch_kernel.__version__, sys.prefix)",
    "%mesh pk --gpus 2",
    "%%remote pk\nimport os, sys, monarch_kernel\n"
    "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], sys.prefix,"
    " monarch_kernel.__file__)",
    "%mesh stop pk",
]


@pytest.mark.local
@pytest.mark.package
def test_a_two_rank_notebook_runs_through_the_venvs_jupyter_execute(
    venv: Venv, registered: Registered, place, report: Report
):
    """``jupyter execute`` of the venv runs a notebook on the ``monarch`` kernel: a
    2-rank local mesh, a ``%%remote`` cell on both ranks, a stop. The kernel and the
    ranks run the venv's Python and the installed package; none is left afterwards."""
    folder = venv.home / "work"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in TWO_RANKS]
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "Monarch (Python 3)"}
    nbformat.write(nb, folder / "two_ranks.ipynb")
    with report.phase("jupyter execute (2-rank notebook)"):
        venv.run(
            "jupyter",
            "execute",
            "--timeout=120",
            "--startup_timeout=120",
            "--output=executed",
            "two_ranks.ipynb",
            cwd=folder,
            **place.env,
        )
    done = nbformat.read(folder / "executed.ipynb", as_version=4)
    texts = [notebook_text(c) for c in done.cells]
    errors = [o for c in done.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, texts

    version = checkout_version()
    assert texts[0].split() == [version, str(venv.root)], texts[0]
    assert "mesh 'pk'" in texts[1] and "ready" in texts[1], texts[1]
    package = venv.root / "lib"  # the venv's site-packages, under lib/pythonX.Y/
    ranks = {}
    for line in texts[2].splitlines():
        label, rank_word, rank, of, world, prefix, file = line.split()
        assert (rank_word, of, world, prefix) == ("rank", "of", "2", str(venv.root)), line
        assert Path(file).is_relative_to(package), line
        ranks[rank] = label
    assert ranks == {"0": "[0]", "1": "[1]"}, texts[2]
    assert "stopped" in texts[3], texts[3]
    try:
        wait_until(lambda: not place.processes(), timeout=30, what="the kernel and ranks to end")
    except WaitTimeout:
        left = [" ".join(p.cmdline())[:100] for p in place.processes()]
        raise AssertionError(f"processes left after jupyter execute: {left}") from None
