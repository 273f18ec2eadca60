"""Sphinx configuration of the monarch_kernel documentation (``make docs``)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import monarch_kernel  # noqa: E402

project = "monarch_kernel"
author = "monarch_kernel contributors"
copyright = "monarch_kernel contributors, BSD-3-Clause"
version = release = monarch_kernel.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "mk_docs",
]

# -- sources ---------------------------------------------------------------------------
# docs/notebooks is a symlink to ../notebooks, made here (git-ignored, so that an sdist
# does not carry the notebooks twice): the tutorials are rendered from the repository's
# own files. The quick start needs nothing but a local mesh of 4 CPU ranks
# and runs in about 15 s: it is executed at every build with the monarch kernel (an error
# in a cell not tagged raises-exception fails the build). The others need more (Ray,
# Lightning, minutes of training) and show the outputs stored in them; the test suite
# executes them all (tests/test_notebooks.py).
NOTEBOOKS = HERE / "notebooks"
if not NOTEBOOKS.is_symlink():
    with contextlib.suppress(FileExistsError):  # another build made it meanwhile
        NOTEBOOKS.symlink_to(Path("..") / "notebooks", target_is_directory=True)
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints"]
EXECUTED_NOTEBOOKS = {"01-quickstart.ipynb"}
nb_execution_mode = "force"
nb_execution_excludepatterns = [
    f"notebooks/{p.name}"
    for p in sorted(NOTEBOOKS.glob("*.ipynb"))
    if p.name not in EXECUTED_NOTEBOOKS
]
nb_execution_timeout = 180
nb_execution_raise_on_error = True
nb_merge_streams = True
# Pygments cannot lex everything a notebook holds (IPython's `%magic $var` lines, a
# traceback lexer meeting text that is no traceback): it then highlights less, which is
# no fault of the page.
suppress_warnings = ["misc.highlighting_failure"]
# A dashboard's output is a widget and its static HTML snapshot: the page shows the
# snapshot (no widget state is stored, so the widget view could not render).
nb_mime_priority_overrides = [
    ("html", "application/vnd.jupyter.widget-view+json", None),
    ("html", "application/vnd.jupyter.widget-state+json", None),
]
myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
# Every heading gets an anchor, so `[text](page.md#a-heading)` links are checked.
myst_heading_anchors = 4

# -- cross-references ------------------------------------------------------------------
nitpicky = True
# Names of the standard library and of other projects (signatures hold
# collections.abc types): their inventories are not fetched, the build runs offline.
# monarch_kernel's own names must resolve: docs/_ext/mk_docs.py shows a real internal one
# as code, and anything else fails the build.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(collections\.abc|typing|asyncio|concurrent\.futures|pathlib|enum|torch|numpy|zmq)\..*",
    ),
]

# -- autodoc ---------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autosummary_generate = False

# -- HTML ------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"monarch_kernel {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
