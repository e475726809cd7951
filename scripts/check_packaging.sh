#!/usr/bin/env bash
# The distributions, as a user gets them (CI runs this after the test suites):
#
#  1. a clean copy of the working tree (tracked files and untracked ones git does not ignore: no
#     node_modules, no development build of the Lab extension), so that what is built is the
#     production build of the sources, never what an editable install left in the tree;
#  2. `python -m build` there: the sdist (hatch-jupyter-builder runs `jlpm build:prod`, and the
#     built extension travels in the sdist as an artifact), then a wheel from that sdist;
#  3. a second wheel from the sdist with node unreachable (skip-if-exists: no npm build);
#  4. both wheels checked: the prebuilt Lab extension, install.json, the jupyter-config file, the
#     metadata (name, version, license), the same files in both (scripts/check_dists.py);
#  5. the wheel installed into a clean venv (no node, no torch, no repository on sys.path) with
#     JupyterLab, `jupyter server extension list` and `jupyter labextension list` saying enabled
#     and OK, and a smoke test against that install (scripts/smoke_install.py): a `jupyter lab` of
#     the clean venv answers GET /evalsched/queue, runs a no-op run submitted over REST, and its
#     panel renders in Chromium (driven by this repository's .venv, which has playwright).
#
# Needs: .venv from scripts/setup.sh (build, playwright), node and the jlpm cache that set-up
# filled, /usr/bin/chromium, PyPI. Environment: EVALSCHED_PACKAGING_DIR (default: a new temporary
# directory, removed at the end unless KEEP=1), PYTHON (the interpreter of the clean venv, default
# python3).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VPY=$REPO/.venv/bin/python
start=$(date +%s)
step() { echo "== packaging: $1 at $(( $(date +%s) - start )) s"; }

WORK=${EVALSCHED_PACKAGING_DIR:-$(mktemp -d /tmp/evalsched-packaging.XXXXXX)}
mkdir -p "$WORK"
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT
SRC=$WORK/src
DIST=$WORK/dist
DIST_NONODE=$WORK/dist-nonode
rm -rf "$SRC" "$DIST" "$DIST_NONODE" "$WORK/venv" "$WORK/nonode" "$WORK/smoke" "$WORK/home"
mkdir -p "$SRC" "$DIST" "$DIST_NONODE"

# PATH without node: stubs first that record any call and fail, the repository's .venv (whose
# jlpm would find node) left out. A build's isolated environment puts its own scripts first (its
# jlpm among them); that jlpm finds the stub node.
NONODE=$WORK/nonode
mkdir -p "$NONODE"
for tool in node nodejs npm npx yarn jlpm corepack; do
  printf '#!/bin/sh\necho "%s was called: $0 $*" >>"%s/called"\necho "no node here: %s" >&2\nexit 127\n' \
    "$tool" "$NONODE" "$tool" >"$NONODE/$tool"
  chmod +x "$NONODE/$tool"
done
NONODE_PATH=$NONODE
IFS=: read -r -a path_parts <<<"$PATH"
for part in "${path_parts[@]}"; do
  if [ -n "$part" ] && [ "$(readlink -f "$part")" != "$(readlink -f "$REPO/.venv/bin")" ]; then
    NONODE_PATH=$NONODE_PATH:$part
  fi
done

# 1. The clean copy (a file git tracks but the work tree lost is skipped).
git ls-files -z --cached --others --exclude-standard \
  | "$VPY" -c 'import os, sys; sys.stdout.buffer.write(b"".join(p + b"\0" for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.lexists(p)))' \
  | tar --null -T - -cf - | tar -xf - -C "$SRC"
step "clean copy of the tree in $SRC"

# 2. sdist, then a wheel from it (isolated build environments from PyPI; jlpm is the one that
#    JupyterLab, a build requirement, brings; its packages come from the cache set-up filled).
"$VPY" -m build --outdir "$DIST" "$SRC" >"$WORK/build.log" 2>&1 || { tail -n 60 "$WORK/build.log"; exit 1; }
SDIST=$(ls "$DIST"/*.tar.gz)
WHEEL=$(ls "$DIST"/*.whl)
step "built $(basename "$SDIST") and $(basename "$WHEEL")"

# 3. A wheel from the sdist, node unreachable.
rm -f "$NONODE/called"
env PATH="$NONODE_PATH" "$VPY" -m build --wheel --outdir "$DIST_NONODE" "$SDIST" >"$WORK/build-nonode.log" 2>&1 \
  || { tail -n 60 "$WORK/build-nonode.log"; exit 1; }
if [ -e "$NONODE/called" ]; then
  echo "building a wheel from the sdist called node tools:" >&2
  cat "$NONODE/called" >&2
  exit 1
fi
WHEEL_NONODE=$(ls "$DIST_NONODE"/*.whl)
step "built $(basename "$WHEEL_NONODE") from the sdist without node"

# 4. What the distributions hold.
"$VPY" scripts/check_dists.py --sdist "$SDIST" "$WHEEL" "$WHEEL_NONODE"
step "distributions checked"

# 5. A clean venv with the wheel (built without node) and JupyterLab; no node on PATH, no torch.
#    Jupyter's user directories are private to this check, so nothing of this host's enables or
#    links anything.
"${PYTHON:-python3}" -m venv "$WORK/venv"
mkdir -p "$WORK/home"
clean_env=(env -u PYTHONPATH -u VIRTUAL_ENV -u JUPYTER_PATH -u JUPYTER_CONFIG_PATH
  -u EVALSCHED_URL -u EVALSCHED_TOKEN -u EVALSCHED_RUNS_DIR -u EVALSCHED_VIRTUAL_GPUS
  HOME="$WORK/home" JUPYTER_CONFIG_DIR="$WORK/home/config" JUPYTER_DATA_DIR="$WORK/home/data"
  JUPYTER_RUNTIME_DIR="$WORK/home/runtime" JUPYTER_PLATFORM_DIRS=0 PATH="$WORK/venv/bin:$NONODE_PATH")
( cd "$WORK/home" && "${clean_env[@]}" "$WORK/venv/bin/python" -m pip install -q "$WHEEL_NONODE" "jupyterlab>=4.4,<5" ) \
  >"$WORK/install.log" 2>&1 || { tail -n 40 "$WORK/install.log"; exit 1; }
step "installed the wheel and JupyterLab into a clean venv"

cd "$WORK/home"
"${clean_env[@]}" "$WORK/venv/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

import jupyter_evalsched

assert jupyter_evalsched.__file__.startswith(sys.prefix), f"imported from outside the venv: {jupyter_evalsched.__file__}"
assert md.version("jupyter-evalsched") == jupyter_evalsched.__version__, (md.version("jupyter-evalsched"), jupyter_evalsched.__version__)
assert importlib.util.find_spec("torch") is None, "torch is installed: the core install must not need it"
print(f"jupyter-evalsched {jupyter_evalsched.__version__} from {jupyter_evalsched.__file__}; no torch")
EOF
serverext=$("${clean_env[@]}" "$WORK/venv/bin/jupyter" server extension list 2>&1)
echo "$serverext" | grep -E "jupyter_evalsched" || true
grep -Eq "jupyter_evalsched .*enabled" <<<"$serverext" && grep -Eq "jupyter_evalsched .*OK" <<<"$serverext" \
  || { echo "server extension not enabled and OK: $serverext" >&2; exit 1; }
labext=$("${clean_env[@]}" "$WORK/venv/bin/jupyter" labextension list 2>&1)
echo "$labext" | grep -E "jupyter-evalsched" || true
grep -Eq "jupyter-evalsched .*enabled.*OK" <<<"$labext" || { echo "lab extension not enabled and OK: $labext" >&2; exit 1; }
"${clean_env[@]}" "$WORK/venv/bin/jupyter" evalsched --help >/dev/null
step "extensions listed enabled and OK"

# The smoke test: the clean venv's jupyter lab, driven from this repository's .venv (playwright).
cd "$REPO"
"$VPY" scripts/smoke_install.py --venv "$WORK/venv" --workdir "$WORK/smoke" --path "$NONODE_PATH"
# JupyterLab itself looks for node (`jupyter labextension list`, `jupyter lab`'s start) and does
# without; the stubs above answered it "not found". Only the build above had to call none.
if [ -e "$NONODE/called" ]; then
  echo "(JupyterLab looked for node $(wc -l <"$NONODE/called") times, and did without it)"
fi
step "smoke test passed; packaging checked"
