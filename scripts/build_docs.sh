#!/usr/bin/env bash
# The user guide (docs/, Sphinx + MyST) into docs/_build/html, warnings as errors. The REST API
# and CLI pages are generated from the package at build time (docs/_ext/evalsched_docs.py), and
# the panel's screenshot is docs/_static/panel.png: committed, and written again by the browser tests
# when EVALSCHED_DOC_SCREENSHOTS names docs/_static (CI sets it for its default suite; commit it when
# it changes). Needs the `docs` extra (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
echo "== docs built in $(( $(date +%s) - start )) s: docs/_build/html/index.html"
