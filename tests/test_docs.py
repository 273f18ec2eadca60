"""The documentation site (``make docs``) and the README, built and checked as a user reads them.

One real Sphinx build of ``docs/`` (``-W -n``: warnings and unresolved cross-references
fail it) into a temporary directory, then what the build must hold: an entry for every
public name, a page for every notebook and every generated benchmark file, every option
of the magics' parsers on the magics page, and no internal link or anchor that leads
nowhere. A small second project checks that the build does fail for a misspelt
reference and for a public name without a docstring. The README is checked for its
length, its links and its benchmark table against ``bench/results/latest.md``.
"""

from __future__ import annotations

import html
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psutil
import pytest
from helpers import wait_until
from kernel_client import ensure_kernelspec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LATEST = ROOT / "bench" / "results" / "latest.md"

#: The modules of the API reference (docs/_ext/mk_docs.py documents the same).
API_MODULES = (
    "monarch_kernel",
    "monarch_kernel.actor",
    "monarch_kernel.training",
    "monarch_kernel.job",
    "monarch_kernel.spmd",
    "monarch_kernel.rdma",
    "monarch_kernel.config",
)

#: A cold build takes about 25 s on an idle 2-core machine (15 s of it the quick-start
#: notebook, executed); the bound is for a loaded one.
BUILD_TIMEOUT = 600
#: The environment variable that marks the processes of one docs build.
BUILD_MARK = "MONARCH_KERNEL_DOCS_BUILD"


def sphinx_build(src: Path, out: Path, token: str = "") -> subprocess.CompletedProcess[str]:
    """``make docs``'s command line, into ``out`` (its doctrees beside it); ``token``
    marks the environment of every process the build starts (the executed notebook's
    kernel, host agent and ranks)."""
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "html"]
    cmd += ["-d", str(out.parent / "doctrees"), str(src), str(out)]
    env = {**os.environ, BUILD_MARK: token}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT, env=env, check=False
    )


def started_by_build(token: str) -> list[psutil.Process]:
    """The live processes whose environment carries the build's ``token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(BUILD_MARK) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs built from scratch, as on a fresh clone; the notebook it executes
    leaves no kernel, host agent or rank behind."""
    ensure_kernelspec()  # the executed notebook runs on the monarch kernel
    out = tmp_path_factory.mktemp("docs") / "html"
    token = uuid.uuid4().hex
    done = sphinx_build(DOCS, out, token)
    assert done.returncode == 0, f"sphinx-build failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING:" not in done.stderr, done.stderr
    wait_until(
        lambda: not started_by_build(token),
        timeout=30,
        what="the docs build's kernel and ranks to exit",
        detail=lambda: [" ".join(p.cmdline())[:80] for p in started_by_build(token)],
    )
    return out


def public_names(module_name: str) -> list[str]:
    """``__all__``, else what the module defines without a leading underscore."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == module_name
    ]


def inventory(site: Path) -> set[str]:
    """The Python objects the site documents (its ``objects.inv``)."""
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inv = InventoryFile.load(f, "", lambda base, uri: uri)
    return {name for kind, entries in inv.items() if kind.startswith("py:") for name in entries}


class Links(HTMLParser):
    """Every ``href``/``src`` of a page and every ``id`` it defines."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if value is None:
                continue
            if key == "id":
                self.ids.add(value)
            elif key in ("href", "src") and tag != "script":
                self.links.append(value)


def parse(page: Path) -> Links:
    parser = Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def test_every_public_name_has_an_entry(site):
    documented = inventory(site)
    expected = [f"{m}.{n}" for m in API_MODULES for n in public_names(m)]
    assert len(expected) > 60
    missing = [name for name in expected if name not in documented]
    assert not missing, f"public names without an API entry: {missing}"
    for module in API_MODULES:
        assert (site / "api" / f"{module}.html").exists()


def test_every_notebook_is_a_page_with_its_cells_and_stored_outputs(site):
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for nb_path in notebooks:
        page = site / "notebooks" / f"{nb_path.stem}.html"
        assert page.exists(), f"no page for {nb_path.name}"
        text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))
        nb = json.loads(nb_path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
        with_outputs = [c for c in code if c.get("outputs")]
        # the pages show what the cells printed: `make notebooks` stores it in the notebook
        assert len(with_outputs) >= len(code) * 0.75, (
            f"{nb_path.name}: {len(code) - len(with_outputs)} of {len(code)} code cells have "
            "no stored outputs (run `make notebooks` and commit the notebooks)"
        )
        for cell in nb["cells"]:
            source = "".join(cell["source"]).strip()
            if cell["cell_type"] != "code" or not source:
                continue
            first = source.splitlines()[0].strip()
            assert first.split()[0] in text, f"{nb_path.name}: cell {first!r} missing"
            for output in cell.get("outputs", []):  # stored outputs are shown
                shown = "".join(output.get("text", "")).strip()
                if shown:
                    line = shown.splitlines()[0].strip()
                    assert line.split()[0] in text, f"{nb_path.name}: output {line!r} missing"


def test_quickstart_page_shows_the_outputs_of_its_execution(site):
    """The quick start is executed at build time: its page holds what the mesh answered."""
    text = html.unescape((site / "notebooks" / "01-quickstart.html").read_text(encoding="utf-8"))
    assert re.search(r"mesh 'trainers': gpus=4 \(local\) ready in [0-9.]+s", text)
    assert "[0-3] hello from every rank" in text
    assert "pushed to trainers (4 ranks): scale=10" in text
    assert "ValueError in the cell on ranks 1, 3 of 4" in text
    assert "rank 3 · idle" in text  # the dashboard's static snapshot
    assert "mesh 'trainers' stopped" in text


def test_magics_reference_lists_every_option_of_the_parsers(site):
    from monarch_kernel.kernel.args import mesh_parser, remote_parser

    text = (site / "reference" / "magics.html").read_text(encoding="utf-8")
    for parser in (mesh_parser(), remote_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, f"{parser.prog} {flag} is not on the magics page"
    for magic in ("%mesh stacks", "%mesh shrink", "--drop-ranks", "%debug_remote", "%torchrun"):
        assert magic in text


def test_every_benchmark_result_file_has_a_page(site):
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert any(p.name == "latest.md" for p in results)
    for path in results:
        page = site / "benchmarks" / "results" / f"{path.stem}.html"
        assert page.exists(), f"no page for bench/results/{path.name}"
        first_row = next(line for line in path.read_text().splitlines() if line.startswith("|"))
        first_cell = first_row.strip("|").split("|")[0].strip().strip("`")
        assert first_cell in page.read_text(encoding="utf-8")


def test_internal_links_and_anchors_resolve(site):
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)  # theme's
    ids = {page: parse(page) for page in pages}
    broken = []
    checked = 0
    for page, found in ids.items():
        for link in found.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("//", "mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {link}")
            elif parts.fragment and target.suffix == ".html":
                anchors = ids[target].ids if target in ids else parse(target).ids
                if unquote(parts.fragment) not in anchors:
                    broken.append(f"{page.relative_to(site)} -> {link} (no such anchor)")
    assert checked > 1000
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_user_guide_has_a_page_per_capability(site):
    for page in (
        "getting-started", "guide/meshes", "guide/remote", "guide/push-pull", "guide/actors",
        "guide/pytorch", "guide/failures", "guide/training", "guide/elastic", "guide/detach",
        "guide/debugging", "guide/hang-doctor", "guide/engines", "guide/lightning",
        "guide/security", "coming-from/monarch", "coming-from/ray", "coming-from/ipyparallel",
        "coming-from/dask", "benchmarks/index", "architecture", "changelog",
    ):  # fmt: skip
        assert (site / f"{page}.html").exists(), page
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "dashboard.png" in home and (site / "_images" / "dashboard.png").exists()


def test_build_fails_on_a_broken_reference_and_a_missing_docstring(tmp_path):
    """The checks are real: a misspelt name and an undocumented public name fail the
    build, while a real internal module (shown without a link) does not."""
    pkg = tmp_path / "mk_fake_pkg.py"
    pkg.write_text(
        '"""A module."""\n__all__ = ["documented", "bare"]\n'
        'def documented():\n    """Has one."""\n'
        "def bare():\n    pass\n"
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(DOCS / "_ext")!r}, {str(tmp_path)!r}]
        extensions = ["myst_parser", "mk_docs"]
        mk_docs_generate = False
        mk_docs_api_modules = ["mk_fake_pkg"]
        nitpicky = True
        """)
    )
    (src / "index.md").write_text(
        "# Index\n\n{py:mod}`monarch_kernel.wire.limits`\n"
        "{py:class}`monarch_kernel.wire.reports.FailureReport`\n"
        "{py:class}`monarch_kernel.actor.NoSuchThing`\n"
    )
    done = sphinx_build(src, tmp_path / "out" / "html")
    assert done.returncode != 0
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert any("monarch_kernel.actor.NoSuchThing" in w for w in warnings), done.stderr
    assert any("public name mk_fake_pkg.bare has no docstring" in w for w in warnings)
    assert len(warnings) == 2, done.stderr


# -- the README ----------------------------------------------------------------------


def readme_links() -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", README.read_text())


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150


def test_readme_links_lead_to_files_and_built_pages(site):
    links = [link for link in readme_links() if not urlsplit(link).scheme]
    assert len(links) > 20
    for link in links:
        path = ROOT / urlsplit(link).path
        assert path.exists(), f"README links to {link}, which does not exist"
        if path.suffix == ".md" and path.is_relative_to(DOCS):
            page = site / path.relative_to(DOCS).with_suffix(".html")
            assert page.exists(), f"README links to {link}, which is no page of the site"


def _table(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table whose first column is ``first_header``: header, rows."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\|\s*{first_header}\s*\|", line))
    return _table_at(lines, start)


def _training_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The workload table (its header names ``torchrun (floor)``): header, rows."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "| torchrun (floor) |" in line)
    return _table_at(lines, start)


def _table_at(lines: list[str], start: int) -> tuple[list[str], list[list[str]]]:
    """The markdown table whose header is ``lines[start]``: header, rows."""
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header = [cell.strip() for cell in lines[start].strip().strip("|").split("|")]
    return header, rows


def test_readme_training_ratios_are_the_generated_ones():
    header, rows = _training_table(README.read_text())
    latest_header, latest_rows = _training_table(LATEST.read_text())
    assert header[1:] == latest_header[1:], "README's systems differ from latest.md's"
    by_label = {row[0]: row for row in latest_rows}
    assert len(rows) >= 2
    for row in rows:
        assert row[0] in by_label, f"README row {row[0]!r} is not a row of latest.md's workload"
        assert row == by_label[row[0]], f"{row[0]}: {row} != {by_label[row[0]]}"


def test_readme_benchmark_ratios_are_the_generated_ones():
    header, rows = _table(README.read_text(), "benchmark")
    latest_header, latest_rows = _table(LATEST.read_text(), "benchmark")
    by_label = {row[0]: row for row in latest_rows}
    assert len(rows) >= 4
    for row in rows:
        assert row[0] in by_label, f"README row {row[0]!r} is not a row of latest.md"
        for column, value in zip(header[1:], row[1:]):
            peer = column.split("÷")[1].strip()
            source = next(i for i, h in enumerate(latest_header) if h.startswith(f"ours ÷ {peer}"))
            assert value == by_label[row[0]][source], f"{row[0]} {column}: {value}"
