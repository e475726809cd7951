"""docs/reference.md keeps up with the code: every REST route, state, reason code, record and spec
field, setting and environment variable the package has is written up there; and the repository
stands alone (no tracked file cites a design document that is not in it)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from jupyter_evalsched import contract
from jupyter_evalsched.app import EvalSchedApp
from jupyter_evalsched.openapi import openapi_document
from jupyter_evalsched.scheduler.config import SchedulerConfig
from jupyter_evalsched.schemas import EvalSpec, LeaseRecord, ModelInfo, RunRecord, Scheduling

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
PACKAGE = ROOT / "jupyter_evalsched"
METHODS = ("get", "post", "put", "patch", "delete")


def server_settings() -> set[str]:
    """Every ``c.EvalSchedApp.*`` setting: the app's own and the scheduler's, which it inherits
    (declared once, on ``SchedulerConfig``)."""
    own = set(EvalSchedApp.class_own_traits(config=True))
    return own | set(SchedulerConfig.class_own_traits(config=True))


def reference() -> str:
    return REFERENCE.read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text of the ``## title`` section of the reference, up to the next ``## `` heading."""
    text = reference()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/reference.md has no '## {title}' section"
    return match.group(1)


def missing_names(names, text: str) -> list[str]:
    """The names that do not appear in ``text`` as inline code (`name`, or `name:...` for codes)."""
    return sorted(n for n in set(names) if not re.search(rf"`{re.escape(n)}(`|:)", text))


def test_every_route_of_the_openapi_document_is_in_the_reference():
    text = reference()
    document = openapi_document()
    routes = [
        f"{method.upper()} /evalsched{path}"
        for path, item in document["paths"].items()
        for method in METHODS
        if method in item
    ]
    assert len(routes) >= 25  # the document was read, not an empty one
    missing = [route for route in routes if f"`{route}`" not in text]
    assert not missing, f"routes missing from docs/reference.md: {missing}"


def contract_reason_codes() -> dict[str, str]:
    """Every string constant of contract.py's "reason codes" part (name -> code), read from the
    source so that a code added there is checked without touching this test."""
    source = Path(contract.__file__).read_text(encoding="utf-8")
    start = source.index("# ----")
    start = source.index("reason codes", start)
    end = source.index("# ----", start)
    codes = {}
    for node in ast.parse(source[start:end].split("\n", 1)[1]).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    codes[target.id] = node.value.value
    return codes


def test_every_state_and_reason_code_is_in_the_reference():
    codes = contract_reason_codes()
    # The part was found and read: the pinned codes and the later ones are all there.
    assert {"WAITING_VRAM", "RESERVED_FOR", "SERVER_RESTART", "PREEMPTED_BY", "TTL_EXPIRED"} <= set(codes)
    assert set(contract.RETRYABLE_CODES) <= set(codes.values())
    states = section("States and reasons")
    missing = missing_names([*contract.STATES, *contract.LEASE_STATES, *codes.values()], states)
    assert not missing, f"states or reason codes missing from docs/reference.md, 'States and reasons': {missing}"


@pytest.mark.parametrize(
    ("model", "title"),
    [
        (RunRecord, "Run record"),
        (LeaseRecord, "Lease record"),
        (ModelInfo, "Models view"),
        (EvalSpec, "Eval spec"),
        (Scheduling, "Eval spec"),
    ],
)
def test_every_field_of_the_records_and_the_spec_is_in_the_reference(model, title):
    fields = list(model.model_fields)
    assert fields
    missing = missing_names(fields, section(title))
    assert not missing, f"fields of {model.__name__} missing from docs/reference.md, '{title}': {missing}"


def table_names(text: str) -> set[str]:
    """The inline-code names in the first column of the markdown tables of ``text``."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize(
    ("models", "title"),
    [
        ((RunRecord,), "Run record"),
        ((LeaseRecord,), "Lease record"),
        ((EvalSpec, Scheduling), "Eval spec"),
        ((ModelInfo,), "Models view"),
    ],
)
def test_the_reference_documents_no_field_the_models_lack(models, title):
    documented = table_names(section(title))
    assert len(documented) >= 10
    known = set().union(*(m.model_fields for m in models))
    extra = sorted(documented - known)
    assert not extra, f"docs/reference.md, '{title}', documents fields the models do not have: {extra}"


def test_the_reference_documents_no_setting_the_server_lacks():
    documented = table_names(section("Configuration"))
    traits = set(server_settings())
    variables = {n for n in documented if n.startswith("EVALSCHED_")}
    source = "".join(path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py"))
    extra = sorted(n for n in documented - traits - variables)
    assert not extra, f"docs/reference.md documents settings EvalSchedApp does not have: {extra}"
    unknown = sorted(n for n in variables if n not in source)
    assert not unknown, f"docs/reference.md documents variables the package never names: {unknown}"


def test_every_setting_is_in_the_reference():
    traits = sorted(server_settings())
    assert {"runs_dir", "virtual_gpus", "enforce_vram", "warm_start", "models"} <= set(traits)
    missing = missing_names(traits, section("Configuration"))
    assert not missing, f"c.EvalSchedApp settings missing from docs/reference.md, 'Configuration': {missing}"


def test_every_environment_variable_of_the_package_is_in_the_reference():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"\bEVALSCHED_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    assert {"EVALSCHED_RUNS_DIR", "EVALSCHED_VIRTUAL_GPUS", "EVALSCHED_URL", "EVALSCHED_TOKEN"} <= names
    missing = missing_names(names, section("Configuration"))
    assert not missing, f"environment variables missing from docs/reference.md, 'Configuration': {missing}"


def test_the_reference_is_in_the_guide():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    toctrees = re.findall(r"```\{toctree\}(.*?)```", index, re.S)
    assert any(re.search(r"^reference$", tree, re.M) for tree in toctrees)


def test_no_tracked_file_cites_a_document_that_is_not_in_the_repository():
    """The repository stands alone: the contract is docs/reference.md, not a design file kept
    elsewhere. CHANGELOG.md is history and may name what was."""
    absent = ["DESIGN" + ".md", "../" + "shared"]  # spelled apart, so that this file does not match
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    )
    assert "docs/reference.md" in files
    offenders = []
    for name in files:
        path = ROOT / name
        if not name or name == "CHANGELOG.md" or not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            offenders += [f"{name}:{number}: {word}" for word in absent if word in line]
    assert not offenders, "tracked files cite documents the repository does not have:\n" + "\n".join(offenders)
