"""Sphinx configuration of the jupyter_evalsched user guide (MyST markdown).

Build: ``bash scripts/build_docs.sh`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``).
Pages written at build time, offline, by ``_ext/evalsched_docs.py``: the REST API (from
``jupyter_evalsched.openapi.openapi_document()``), the CLI (from
``jupyter_evalsched.cli.build_parser()``), and the panel's screenshot when the browser tests made
one (``docs/_static/panel.png``; see ``EVALSCHED_DOC_SCREENSHOTS`` in tests/test_lab_layout.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the package, installed or not
sys.path.insert(0, str(DOCS / "_ext"))

from jupyter_evalsched._version import __version__  # noqa: E402

project = "jupyter_evalsched"
author = "jupyter_evalsched contributors"
copyright = "2026, jupyter_evalsched contributors"
version = release = __version__

extensions = ["myst_parser", "evalsched_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links
# Blocks without a language are shown as they are (no guessing, no lexer warnings).
highlight_language = "none"

html_theme = "pydata_sphinx_theme"
html_title = f"jupyter_evalsched {__version__}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_sidebars = {"**": []}  # the top bar holds the navigation; no empty left column
html_show_sourcelink = False
# No html_static_path: docs/_static holds only the panel's screenshot, which the figure copies.
