"""One version everywhere, and the packaging metadata (fast: no build).

The Python package (``jupyter_evalsched/_version.py``, which pyproject.toml reads through
``[tool.hatch.version]``), the Lab extension's sources (``labextension/package.json``), the built
extension when there is one (``jupyter_evalsched/labextension/package.json``), the OpenAPI
document and ``GET /evalsched/status`` agree. The distributions themselves are built and checked by
``scripts/check_packaging.sh`` (CI).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

import jupyter_evalsched
from jupyter_evalsched import _version
from jupyter_evalsched.openapi import openapi_document

REPO = Path(__file__).resolve().parents[1]
VERSION = _version.__version__


@pytest.fixture
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_version_is_one_string() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*(\.dev\d+)?", VERSION), VERSION
    assert jupyter_evalsched.__version__ == VERSION


def test_pyproject_reads_the_version_from_the_package(pyproject: dict) -> None:
    project = pyproject["project"]
    assert "version" not in project and "version" in project.get("dynamic", [])
    assert pyproject["tool"]["hatch"]["version"]["path"] == "jupyter_evalsched/_version.py"


def test_distribution_name_and_metadata(pyproject: dict) -> None:
    project = pyproject["project"]
    assert project["name"] == "jupyter-evalsched"
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert "BSD 3-Clause" in (REPO / "LICENSE").read_text()
    extras = project["optional-dependencies"]
    assert {"models", "docs", "test"} <= set(extras)
    # The core install needs no torch; the models extra brings it.
    assert not any(re.match(r"torch\b", dep) for dep in project["dependencies"])
    assert any(re.match(r"torch\b", dep) for dep in extras["models"])
    assert any(re.match(r"transformers\b", dep) for dep in extras["models"])
    assert any(re.match(r"build\b", dep) for dep in extras["test"])


def test_wheel_ships_the_lab_extension_and_the_server_config(pyproject: dict) -> None:
    hatch = pyproject["tool"]["hatch"]["build"]
    shared = hatch["targets"]["wheel"]["shared-data"]
    assert shared["jupyter_evalsched/labextension"] == "share/jupyter/labextensions/jupyter-evalsched"
    assert shared["install.json"] == "share/jupyter/labextensions/jupyter-evalsched/install.json"
    assert shared["jupyter-config/jupyter_server_config.d"] == "etc/jupyter/jupyter_server_config.d"
    assert "jupyter_evalsched/labextension" in hatch["targets"]["sdist"]["artifacts"]
    builder = hatch["hooks"]["jupyter-builder"]
    assert builder["skip-if-exists"] == ["jupyter_evalsched/labextension/static/style.js"]
    config = json.loads((REPO / "jupyter-config/jupyter_server_config.d/jupyter_evalsched.json").read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"jupyter_evalsched": True}}}
    assert jupyter_evalsched._jupyter_labextension_paths() == [{"src": "labextension", "dest": "jupyter-evalsched"}]


def test_lab_extension_sources_have_the_version() -> None:
    package = json.loads((REPO / "labextension/package.json").read_text())
    assert package["name"] == "jupyter-evalsched"
    assert package["version"] == VERSION
    assert package["jupyterlab"]["discovery"]["server"]["base"]["name"] == "jupyter_evalsched"


def test_built_lab_extension_has_the_version() -> None:
    built = REPO / "jupyter_evalsched/labextension/package.json"
    # scripts/setup.sh builds it (the editable install runs jlpm): without it the panel tests fail too.
    assert built.exists(), "the Lab extension is not built: run bash scripts/setup.sh (or jlpm build in labextension/)"
    package = json.loads(built.read_text())
    assert package["name"] == "jupyter-evalsched"
    assert package["version"] == VERSION, "rebuild the Lab extension (jlpm build) after a version change"


def test_openapi_document_has_the_version() -> None:
    assert openapi_document()["info"]["version"] == VERSION


@pytest.fixture
def evalsched_config() -> dict:
    return {"warm_start": False}  # no zygote: this test only reads the status


async def test_status_reports_the_version(api) -> None:
    code, status = await api("GET", "status")
    assert code == 200, status
    assert status["version"] == VERSION
