"""What the sdist and the wheels hold (scripts/check_packaging.sh runs this).

    python scripts/check_dists.py --sdist dist/jupyter_evalsched-0.1.0.tar.gz WHEEL [WHEEL ...]

The sdist: the sources, LICENSE and the built Lab extension (so that a wheel built from it needs
no node), no node_modules. Each wheel: the Python package, the prebuilt Lab extension under
share/jupyter/labextensions/jupyter-evalsched (its package.json at the package's version, the
production build), install.json beside it, the jupyter-config file that enables the server
extension, the metadata (name jupyter-evalsched, the license, the extras, no torch outside the
`models` extra). Several wheels: the same files with the same contents (RECORD aside).
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

DIST = "jupyter-evalsched"
LABEXT = "share/jupyter/labextensions/jupyter-evalsched"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/jupyter_evalsched.json"


class Failures(list[str]):
    def check(self, ok: object, message: str) -> None:
        if not ok:
            self.append(message)


def _version_of(source: str) -> str:
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', source, re.M)
    if not match:
        raise SystemExit("no __version__ in _version.py")
    return match.group(1)


def check_sdist(path: Path, failures: Failures) -> str:
    with tarfile.open(path) as tar:
        names = tar.getnames()
        root = names[0].split("/")[0]
        rel = {n[len(root) + 1 :] for n in names if n.startswith(root + "/")}
        member = tar.extractfile(f"{root}/jupyter_evalsched/_version.py")
        assert member is not None
        version = _version_of(member.read().decode())
        built = tar.extractfile(f"{root}/jupyter_evalsched/labextension/package.json")
        built_pkg = json.loads(built.read()) if built else {}
    failures.check(root == f"jupyter_evalsched-{version}", f"sdist: top folder {root!r}")
    for needed in (
        "pyproject.toml",
        "LICENSE",
        "README.md",
        "install.json",
        "jupyter-config/jupyter_server_config.d/jupyter_evalsched.json",
        "labextension/package.json",
        "labextension/yarn.lock",
        "jupyter_evalsched/__init__.py",
        "jupyter_evalsched/labextension/package.json",
        "jupyter_evalsched/labextension/static/style.js",
    ):
        failures.check(needed in rel, f"sdist: {needed} missing")
    for banned in ("node_modules/", "labextension/lib/", ".venv/", "test-artifacts/", "docs/_build/"):
        failures.check(not any(banned in f"/{n}" or n.startswith(banned) for n in rel), f"sdist: holds {banned}")
    failures.check(built_pkg.get("version") == version, f"sdist: built extension at {built_pkg.get('version')}")
    print(f"sdist {path.name}: {len(rel)} files, built Lab extension {built_pkg.get('version')}")
    return version


def check_wheel(path: Path, version: str | None, failures: Failures) -> tuple[str, dict[str, str]]:
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        contents = {n: hashlib.sha256(whl.read(n)).hexdigest() for n in names if not n.endswith("/RECORD")}
        wheel_version = _version_of(whl.read("jupyter_evalsched/_version.py").decode())
        dist_info = f"jupyter_evalsched-{wheel_version}.dist-info"
        data = f"jupyter_evalsched-{wheel_version}.data/data"
        meta = Parser().parsestr(whl.read(f"{dist_info}/METADATA").decode())
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
        built_pkg = json.loads(whl.read(f"{data}/{LABEXT}/package.json"))
        install = json.loads(whl.read(f"{data}/{LABEXT}/install.json"))
        server_config = json.loads(whl.read(f"{data}/{SERVER_CONFIG}"))
    tag = f"wheel {path.name}"
    if version is not None:
        failures.check(wheel_version == version, f"{tag}: version {wheel_version}, the sdist's is {version}")
    failures.check(path.name == f"jupyter_evalsched-{wheel_version}-py3-none-any.whl", f"{tag}: file name")
    failures.check(meta["Name"] == DIST, f"{tag}: Name {meta['Name']!r}")
    failures.check(meta["Version"] == wheel_version, f"{tag}: Version {meta['Version']!r}")
    failures.check(meta.get("License-Expression") == "BSD-3-Clause", f"{tag}: License-Expression")
    failures.check(f"{dist_info}/licenses/LICENSE" in names, f"{tag}: LICENSE missing")
    extras = set(meta.get_all("Provides-Extra") or [])
    failures.check({"models", "docs", "test"} <= extras, f"{tag}: extras {sorted(extras)}")
    requires = meta.get_all("Requires-Dist") or []
    torch = [r for r in requires if re.match(r"torch\b", r)]
    failures.check(
        torch and all("extra == 'models'" in r or 'extra == "models"' in r for r in torch), f"{tag}: torch {torch}"
    )
    failures.check("jupyter-evalsched = jupyter_evalsched.cli:main" in entry_points, f"{tag}: console script")
    for needed in (
        "jupyter_evalsched/__init__.py",
        "jupyter_evalsched/runner/__main__.py",
        "jupyter_evalsched/examples/basic.py",
        f"{data}/{LABEXT}/static/style.js",
        f"{data}/{LABEXT}/schemas/jupyter-evalsched/plugin.json",
        f"{data}/{LABEXT}/schemas/jupyter-evalsched/package.json.orig",
    ):
        failures.check(needed in names, f"{tag}: {needed} missing")
    failures.check(
        any(re.fullmatch(rf"{re.escape(data)}/{LABEXT}/static/remoteEntry\.[0-9a-f]+\.js", n) for n in names),
        f"{tag}: no remoteEntry.*.js",
    )
    for banned in ("jupyter_evalsched/labextension/", "tests/", "bench/", "labextension/", "node_modules/"):
        failures.check(not any(n.startswith(banned) for n in names), f"{tag}: holds {banned}")
    failures.check(not any(n.endswith("build_log.json") for n in names), f"{tag}: a development build (build_log.json)")
    failures.check(built_pkg.get("name") == "jupyter-evalsched", f"{tag}: Lab extension named {built_pkg.get('name')}")
    failures.check(built_pkg.get("version") == wheel_version, f"{tag}: Lab extension at {built_pkg.get('version')}")
    failures.check("_build" in built_pkg.get("jupyterlab", {}), f"{tag}: the Lab extension is not built")
    failures.check(install.get("packageManager") == "python", f"{tag}: install.json {install}")
    failures.check(
        server_config == {"ServerApp": {"jpserver_extensions": {"jupyter_evalsched": True}}},
        f"{tag}: server config {server_config}",
    )
    labext_files = sum(1 for n in names if n.startswith(f"{data}/{LABEXT}/"))
    print(f"{tag}: {len(names)} files, Lab extension {built_pkg.get('version')} ({labext_files} files)")
    return wheel_version, contents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path)
    parser.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failures = Failures()
    version = check_sdist(args.sdist, failures) if args.sdist else None
    first: dict[str, str] | None = None
    for wheel in args.wheels:
        version, contents = check_wheel(wheel, version, failures)
        if first is None:
            first = contents
        elif contents != first:
            differ = sorted(n for n in set(first) | set(contents) if first.get(n) != contents.get(n))
            failures.append(f"wheel {wheel.name} differs from {args.wheels[0].name} in: {differ[:20]}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
